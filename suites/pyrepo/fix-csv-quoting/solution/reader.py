"""Parse CSV text (the format is described in csvlite/FORMAT.md)."""


class CSVError(ValueError):
    """Malformed CSV text."""


def _row_end(text, i):
    """Length of the row end at text[i] (0 when there is none)."""
    if text.startswith("\r\n", i):
        return 2
    return 1 if text.startswith("\n", i) else 0


def _quoted(text, i):
    """Parse a quoted field whose opening quote is at text[i]; return (value, index after closing quote)."""
    buf, i = [], i + 1
    while True:
        j = text.find('"', i)
        if j < 0:
            raise CSVError(f"unterminated quoted field starting at offset {i - 1}")
        buf.append(text[i:j])
        if text.startswith('""', j):
            buf.append('"')
            i = j + 2
        else:
            return "".join(buf), j + 1


def _field(text, i, delimiter):
    """Parse the field starting at text[i]; return (value, index of the delimiter / row end / end of text)."""
    n = len(text)
    if i < n and text[i] == '"':
        value, i = _quoted(text, i)
        if i < n and text[i] != delimiter and not _row_end(text, i):
            raise CSVError(f"unexpected {text[i]!r} after a closing quote at offset {i}")
        return value, i
    j = i
    while j < n and text[j] != delimiter and not _row_end(text, j):
        if text[j] == '"':
            raise CSVError(f'a " inside an unquoted field at offset {j}')
        j += 1
    return text[i:j], j


def parse(text, delimiter=","):
    """Rows of fields (lists of str) from CSV text; blank lines are skipped."""
    rows, i, n = [], 0, len(text)
    while i < n:
        if _row_end(text, i):
            i += _row_end(text, i)
            continue
        row = []
        while True:
            value, i = _field(text, i, delimiter)
            row.append(value)
            if i < n and text[i] == delimiter:
                i += 1
                continue
            break
        rows.append(row)
        if i < n:
            i += _row_end(text, i)
    return rows
