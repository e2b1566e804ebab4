from services.meter.main import main

raise SystemExit(main())
