from geonear.clients.cli import main

raise SystemExit(main())
