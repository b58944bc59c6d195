"""python -m intervals COMMAND ARGS..."""

import re
import sys

from intervals import contains, intersect, merge, subtract, total_length

_INTERVAL = re.compile(r"(\d+)-(\d+)")


class _Usage(Exception):
    pass


def _interval(text):
    m = _INTERVAL.fullmatch(text)
    if not m:
        raise _Usage(f"bad interval {text!r}: write START-END, e.g. 1-3")
    start, end = int(m.group(1)), int(m.group(2))
    if start >= end:
        raise _Usage(f"bad interval {text!r}: start must be < end")
    return (start, end)


def _show(intervals):
    return " ".join(f"{s}-{e}" for s, e in intervals) or "empty"


def _two_sets(args):
    if "--" not in args:
        raise _Usage("expected two interval lists separated by --")
    k = args.index("--")
    return [_interval(a) for a in args[:k]], [_interval(a) for a in args[k + 1 :]]


def _run(argv):
    if not argv:
        raise _Usage("missing command (merge, intersect, subtract, contains, length)")
    cmd, args = argv[0], argv[1:]
    if cmd == "merge":
        return _show(merge([_interval(a) for a in args]))
    if cmd == "length":
        return str(total_length([_interval(a) for a in args]))
    if cmd in ("intersect", "subtract"):
        a, b = _two_sets(args)
        return _show((intersect if cmd == "intersect" else subtract)(a, b))
    if cmd == "contains":
        if not args or not re.fullmatch(r"-?\d+", args[0]):
            raise _Usage("contains needs an integer POINT first")
        return "true" if contains([_interval(a) for a in args[1:]], int(args[0])) else "false"
    raise _Usage(f"unknown command {cmd!r}")


def main(argv=None):
    try:
        print(_run(sys.argv[1:] if argv is None else argv))
    except _Usage as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
