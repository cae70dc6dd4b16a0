from ninfer.cli import main

raise SystemExit(main())
