from jobs.filter.cli import main

raise SystemExit(main())
