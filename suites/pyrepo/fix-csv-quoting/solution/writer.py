"""Write rows as CSV text (the format is described in csvlite/FORMAT.md)."""


def _field(value, delimiter):
    text = "" if value is None else str(value)
    if any(c in text for c in (delimiter, '"', "\r", "\n")):
        return '"' + text.replace('"', '""') + '"'
    return text


def format_row(fields, delimiter=","):
    """One row as a line of CSV text, without the line terminator."""
    fields = list(fields)
    if not fields:
        raise ValueError("a row needs at least one field")
    if len(fields) == 1 and _field(fields[0], delimiter) == "":
        return '""'
    return delimiter.join(_field(f, delimiter) for f in fields)


def write_rows(rows, delimiter=","):
    """All rows as CSV text, each row terminated by a newline."""
    return "".join(format_row(row, delimiter) + "\n" for row in rows)
