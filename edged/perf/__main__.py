"""``python -m edged.perf``: the ``edged perf`` command on its own."""

import sys

from edged.perf.command import main

sys.exit(main())
