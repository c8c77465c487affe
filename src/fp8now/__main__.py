"""`python -m fp8now ...` runs the CLI."""

from .cli.main import main

raise SystemExit(main())
