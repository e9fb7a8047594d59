"""`python -m pagoda.client ...` is the `pagoda` command."""

from pagoda.client.cli import main

raise SystemExit(main())
