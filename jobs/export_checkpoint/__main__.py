from jobs.export_checkpoint.cli import main

raise SystemExit(main())
