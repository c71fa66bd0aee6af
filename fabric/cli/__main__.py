from fabric.cli.main import main

raise SystemExit(main())
