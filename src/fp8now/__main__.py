"""`python -m fp8now ...` runs the CLI."""

from .cli import main

raise SystemExit(main())
