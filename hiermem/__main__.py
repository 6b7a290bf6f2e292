"""``python3 -m hiermem``: the ``hiermem`` command."""

from .cli.main import main

raise SystemExit(main())
