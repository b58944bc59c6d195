"""Loading and atomically saving the JSON file (see README.md)."""
