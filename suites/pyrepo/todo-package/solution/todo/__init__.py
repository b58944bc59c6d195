"""todo: a small to-do list manager (see README.md)."""
