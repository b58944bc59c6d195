"""csvlite: a tiny CSV writer and reader (no dependency on the csv module)."""

from csvlite.reader import CSVError, parse
from csvlite.writer import format_row, write_rows

__all__ = ["CSVError", "format_row", "parse", "write_rows"]
