"""inventory: a small stock-keeping package with a command line interface."""
