#!/usr/bin/env bash
set -euo pipefail
cat > roman.py <<'PYEOF'
"""Roman numerals: conversion functions and a command line interface."""

import re
import sys

_SYMBOLS = [
    (1000, "M"),
    (900, "CM"),
    (500, "D"),
    (400, "CD"),
    (100, "C"),
    (90, "XC"),
    (50, "L"),
    (40, "XL"),
    (10, "X"),
    (9, "IX"),
    (5, "V"),
    (4, "IV"),
    (1, "I"),
]
_CANONICAL = re.compile(r"M{0,3}(CM|CD|D?C{0,3})(XC|XL|L?X{0,3})(IX|IV|V?I{0,3})")


def to_roman(n):
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"expected an int, got {type(n).__name__}")
    if not 1 <= n <= 3999:
        raise ValueError(f"{n} is out of range 1..3999")
    out = []
    for value, symbol in _SYMBOLS:
        count, n = divmod(n, value)
        out.append(symbol * count)
    return "".join(out)


def from_roman(s):
    if not isinstance(s, str):
        raise TypeError(f"expected a str, got {type(s).__name__}")
    if not s or not _CANONICAL.fullmatch(s):
        raise ValueError(f"{s!r} is not a canonical Roman numeral")
    total, i = 0, 0
    for value, symbol in _SYMBOLS:
        while s.startswith(symbol, i):
            total += value
            i += len(symbol)
    return total


def _convert(command, value):
    if command == "from":
        return str(from_roman(value))
    if not re.fullmatch(r"[+-]?\d+", value):
        raise ValueError("not a decimal integer")
    n = int(value)
    if not 1 <= n <= 3999:
        raise ValueError("out of range 1..3999")
    return to_roman(n)


def main(argv):
    if not argv or argv[0] not in ("to", "from"):
        print("usage: python -m roman {to,from} [VALUE...]", file=sys.stderr)
        return 2
    values = argv[1:] or sys.stdin.read().split()
    status = 0
    for value in values:
        try:
            print(_convert(argv[0], value))
        except ValueError as e:
            print(f"error: {value}: {e}", file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
PYEOF
