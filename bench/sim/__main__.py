"""``python -m bench.sim`` (from the repository root): the fleet simulator, see :mod:`bench.sim.command`."""

from bench.sim.command import main

raise SystemExit(main())
