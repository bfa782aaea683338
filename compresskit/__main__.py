from compresskit.cli import main

raise SystemExit(main())
