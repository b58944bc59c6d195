"""The command line: python -m todo (see README.md)."""
