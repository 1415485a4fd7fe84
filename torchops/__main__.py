from torchops.cli import main

raise SystemExit(main())
