"""The Task model (see README.md)."""
