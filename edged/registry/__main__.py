from edged.registry.cli import main

raise SystemExit(main())
