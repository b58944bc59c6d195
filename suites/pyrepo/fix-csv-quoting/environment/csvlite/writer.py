"""Write rows as CSV text (the format is described in csvlite/FORMAT.md)."""


def _field(value, delimiter):
    text = str(value)
    if "," in text:
        return '"' + text + '"'
    return text


def format_row(fields, delimiter=","):
    """One row as a line of CSV text, without the line terminator."""
    return delimiter.join(_field(f, delimiter) for f in fields)


def write_rows(rows, delimiter=","):
    """All rows as CSV text, each row terminated by a newline."""
    return "".join(format_row(row, delimiter) + "\n" for row in rows)
