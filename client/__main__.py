"""`python -m client ...` is the `pagoda` command."""

from client.cli import main

raise SystemExit(main())
