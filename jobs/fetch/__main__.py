from jobs.fetch.cli import main

raise SystemExit(main())
