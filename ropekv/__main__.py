from ropekv.cli import main

raise SystemExit(main())
