#!/usr/bin/env bash
set -euo pipefail
cat > mdtable.py <<'EOF'
"""Markdown tables."""

import re

_SEP = re.compile(r":?-+:?")


def _escape(text):
    text = text.replace("|", "\\|")
    return text.replace("\r\n", "<br>").replace("\n", "<br>").replace("\r", "<br>")


def _cell(value, precision):
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and precision is not None:
        return f"{value:.{precision}f}"
    return str(value)


def _pad(text, w, a):
    gap = w - len(text)
    if a == "r":
        return " " * gap + text
    if a == "c":
        left = gap // 2
        return " " * left + text + " " * (gap - left)
    return text + " " * gap


def _sep(w, a):
    if a == "l":
        return ":" + "-" * (w - 1)
    if a == "r":
        return "-" * (w - 1) + ":"
    if a == "c":
        return ":" + "-" * (w - 2) + ":"
    return "-" * w


def render_table(rows, columns=None, align=None, headers=None, precision=None):
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise TypeError("rows must be a list of dicts")
    if columns is None:
        columns = []
        for r in rows:
            for k in r:
                if k not in columns:
                    columns.append(k)
    columns = list(columns)
    if not columns:
        raise ValueError("no columns to render")
    if align is None:
        align = "-" * len(columns)
    if len(align) != len(columns) or any(a not in "lcr-" for a in align):
        raise ValueError(f"align must have one of 'lcr-' per column ({len(columns)}), got {align!r}")
    headers = headers or {}
    head = [_escape(str(headers.get(k, k))) for k in columns]
    body = [[_escape(_cell(r.get(k), precision)) for k in columns] for r in rows]
    widths = [max([3, len(head[i])] + [len(b[i]) for b in body]) for i in range(len(columns))]

    def line(cells):
        return "| " + " | ".join(cells) + " |"

    out = [line(_pad(h, w, a) for h, w, a in zip(head, widths, align))]
    out.append(line(_sep(w, a) for w, a in zip(widths, align)))
    for b in body:
        out.append(line(_pad(c, w, a) for c, w, a in zip(b, widths, align)))
    return "\n".join(out) + "\n"


def _split(line, lineno):
    if len(line) < 2 or not line.startswith("|") or not line.endswith("|"):
        raise ValueError(f"line {lineno}: a table line must start and end with '|'")
    if line.endswith("\\|") and not line.endswith("\\\\|"):
        raise ValueError(f"line {lineno}: a table line must end with an unescaped '|'")
    parts = re.split(r"(?<!\\)\|", line[1:-1])
    return [p.strip().replace("\\|", "|").replace("<br>", "\n") for p in parts]


def parse_table(text):
    lines = text.split("\n")
    numbered = [(i + 1, ln.strip()) for i, ln in enumerate(lines)]
    while numbered and not numbered[0][1]:
        numbered.pop(0)
    while numbered and not numbered[-1][1]:
        numbered.pop()
    if len(numbered) < 2:
        n = numbered[0][0] if numbered else 1
        raise ValueError(f"line {n}: a table needs a header and a separator line")
    (hn, hl), (sn, sl) = numbered[0], numbered[1]
    header = _split(hl, hn)
    seps = _split(sl, sn)
    if len(seps) != len(header) or not all(_SEP.fullmatch(s) for s in seps):
        raise ValueError(f"line {sn}: bad separator row {sl!r}")
    rows = []
    for n, ln in numbered[2:]:
        cells = _split(ln, n)
        if len(cells) != len(header):
            raise ValueError(f"line {n}: {len(cells)} cells, the header has {len(header)}")
        rows.append(dict(zip(header, cells)))
    return rows
EOF
