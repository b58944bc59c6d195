#!/usr/bin/env bash
set -euo pipefail
cat > searching.py <<'EOF'
"""Binary-search helpers over an ascending sorted list."""


def bisect_left(a, x):
    """Leftmost insertion point of x in sorted list a."""
    lo, hi = 0, len(a)
    while lo < hi:
        mid = (lo + hi) // 2
        if a[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo


def bisect_right(a, x):
    """Rightmost insertion point of x in sorted list a."""
    lo, hi = 0, len(a)
    while lo < hi:
        mid = (lo + hi) // 2
        if x < a[mid]:
            hi = mid
        else:
            lo = mid + 1
    return lo


def find(a, x):
    """Index of the first element equal to x, or -1."""
    i = bisect_left(a, x)
    return i if i < len(a) and a[i] == x else -1


def find_last(a, x):
    """Index of the last element equal to x, or -1."""
    i = bisect_right(a, x) - 1
    return i if i >= 0 and a[i] == x else -1


def count(a, x):
    """Number of elements equal to x."""
    return bisect_right(a, x) - bisect_left(a, x)


def find_range(a, x):
    """(start, stop) with a[start:stop] exactly the elements equal to x."""
    return bisect_left(a, x), bisect_right(a, x)
EOF
