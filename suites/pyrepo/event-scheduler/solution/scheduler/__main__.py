"""Command line: python -m scheduler FILE COMMAND ..."""

import argparse
import datetime as dt
import sys

from scheduler.ics import to_ics
from scheduler.io import load_json


def _day(s):
    try:
        return dt.datetime.combine(dt.date.fromisoformat(s), dt.time())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a date YYYY-MM-DD: {s!r}") from None


def _hhmm(s):
    try:
        return dt.time.fromisoformat(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a time HH:MM: {s!r}") from None


def _parser():
    p = argparse.ArgumentParser(prog="scheduler")
    p.add_argument("file")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("agenda", "conflicts", "free"):
        s = sub.add_parser(name)
        s.add_argument("start", type=_day)
        s.add_argument("end", type=_day)
        if name == "free":
            s.add_argument("minutes", type=int)
            s.add_argument("--day-start", type=_hhmm, default=dt.time(9, 0))
            s.add_argument("--day-end", type=_hhmm, default=dt.time(17, 0))
    sub.add_parser("export")
    return p


def main(argv=None):
    args = _parser().parse_args(argv)
    try:
        cal = load_json(args.file)
        if args.cmd == "agenda":
            for o in cal.occurrences(args.start, args.end):
                print(f"{o.start:%Y-%m-%d %H:%M}-{o.end:%H:%M} {o.uid} {o.title}")
        elif args.cmd == "conflicts":
            for a, b in cal.conflicts(args.start, args.end):
                print(f"{a.uid} {a.start:%Y-%m-%dT%H:%M} <-> {b.uid} {b.start:%Y-%m-%dT%H:%M}")
        elif args.cmd == "free":
            slots = cal.free_slots(
                args.start, args.end, dt.timedelta(minutes=args.minutes), args.day_start, args.day_end
            )
            for s, e in slots:
                print(f"{s:%Y-%m-%d %H:%M}-{e:%H:%M}")
        else:
            sys.stdout.write(to_ics(cal))
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
