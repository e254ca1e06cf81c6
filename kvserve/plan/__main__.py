"""``python -m kvserve.plan``: the plan command on its own, until kvserve/cli.py mounts it."""

from __future__ import annotations

from kvserve.plan.cli import main

raise SystemExit(main())
