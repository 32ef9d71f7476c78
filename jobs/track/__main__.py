from jobs.track.cli import main

raise SystemExit(main())
