"""Markdown tables for the experiment scripts (one place for the table layout they print and write).

``markdown_table(header, rows, title=...)`` -> lines; ``pct`` / ``times`` format a cell (None -> "-").
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]], title: str = "") -> list[str]:
    """The lines of a markdown table: an optional ``### title`` and a blank line, the header, its rule, one line
    per row (each cell ``str()``-ed; a row shorter than the header is padded with empty cells)."""
    lines = [f"### {title}", ""] if title else []
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "---|" * len(header))
    for row in rows:
        cells = [str(c) for c in row] + [""] * (len(header) - len(row))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def pct(x: float | None, digits: int = 0) -> str:
    """``0.123`` -> ``12%`` (``digits`` decimals); None -> ``-``."""
    return "-" if x is None else f"{x:.{digits}%}"


def times(x: float | None) -> str:
    """A ratio: ``1.234`` -> ``1.23x``; None -> ``-``."""
    return "-" if x is None else f"{x:.2f}x"
