#!/usr/bin/env bash
set -euo pipefail
cat > textkit/paginate.py <<'PYEOF'
"""Pagination helpers (see README.md for the intended behaviour)."""


def _check(total, size):
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be an int >= 1, got {size!r}")
    if not isinstance(total, int) or total < 0:
        raise ValueError(f"total must be an int >= 0, got {total!r}")


def page_count(total, size):
    """Number of pages needed to show `total` items, `size` per page."""
    _check(total, size)
    return (total + size - 1) // size


def paginate(items, size, page):
    """The items on page `page` (1-based) as a new list."""
    pages = page_count(len(items), size)
    if page < 1 or page > pages:
        raise IndexError(f"page {page} out of range 1..{pages}")
    start = (page - 1) * size
    return list(items[start : start + size])


def describe(total, size, page):
    """Caption for a page, e.g. 'Showing 11-20 of 45'."""
    pages = page_count(total, size)
    if total == 0:
        return "No items"
    if page < 1 or page > pages:
        raise IndexError(f"page {page} out of range 1..{pages}")
    start = (page - 1) * size
    end = min(start + size, total)
    return f"Showing {start + 1}-{end} of {total}"
PYEOF
