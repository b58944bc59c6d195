"""Parse CSV text (the format is described in csvlite/FORMAT.md)."""


class CSVError(ValueError):
    """Malformed CSV text."""


def _parse_line(line, delimiter):
    fields, buf, quoted, i = [], [], False, 0
    while i < len(line):
        c = line[i]
        if quoted:
            if c == '"':
                if i + 1 < len(line) and line[i + 1] == '"':
                    buf.append('"')
                    i += 2
                    continue
                quoted = False
            else:
                buf.append(c)
        elif c == '"':
            quoted = True
        elif c == delimiter:
            fields.append("".join(buf))
            buf = []
        else:
            buf.append(c)
        i += 1
    if quoted:
        raise CSVError(f"unterminated quoted field in {line!r}")
    fields.append("".join(buf))
    return fields


def parse(text, delimiter=","):
    """Rows of fields (lists of str) from CSV text; blank lines are skipped."""
    rows = []
    for line in text.splitlines():
        if not line:
            continue
        rows.append(_parse_line(line, delimiter))
    return rows
