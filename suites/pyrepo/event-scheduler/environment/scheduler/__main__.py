"""Command line: python -m scheduler FILE COMMAND ..."""

raise SystemExit("not implemented yet")
