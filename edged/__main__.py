from edged.cli import main

raise SystemExit(main())
