from kvtierd.ops.cli import main

raise SystemExit(main())
