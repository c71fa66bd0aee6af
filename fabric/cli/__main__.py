from adapter_fabric.cli.main import main

raise SystemExit(main())
