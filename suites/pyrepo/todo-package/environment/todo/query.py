"""Selecting and ordering tasks (see README.md)."""
