#!/usr/bin/env bash
set -euo pipefail
cat > bizdays.py <<'EOF'
"""Business-day arithmetic."""

import bisect
import calendar as _calendar
import datetime

ONE = datetime.timedelta(days=1)


def _check_date(d, what="date"):
    if not isinstance(d, datetime.date) or isinstance(d, datetime.datetime):
        raise TypeError(f"{what} must be a datetime.date, got {type(d).__name__}")
    return d


class Calendar:
    def __init__(self, weekend=(5, 6), holidays=()):
        wk = set()
        for w in weekend:
            if isinstance(w, bool) or not isinstance(w, int) or not 0 <= w <= 6:
                raise ValueError(f"weekend days must be ints 0..6, got {w!r}")
            wk.add(w)
        if len(wk) == 7:
            raise ValueError("all seven days cannot be weekend days")
        self.weekend = frozenset(wk)
        hs = set()
        for h in holidays:
            if isinstance(h, str):
                try:
                    h = datetime.date.fromisoformat(h)
                except ValueError as e:
                    raise ValueError(f"bad holiday {h!r}: {e}") from None
            hs.add(_check_date(h, "holiday"))
        self.holidays = frozenset(hs)
        self._workdays_per_week = 7 - len(wk)
        # sorted weekday-holidays only (those are the ones that remove a business day)
        self._hol = sorted(h for h in hs if h.weekday() not in wk)

    def is_business_day(self, d):
        _check_date(d)
        return d.weekday() not in self.weekend and d not in self.holidays

    def next_business_day(self, d):
        _check_date(d)
        d += ONE
        while not self.is_business_day(d):
            d += ONE
        return d

    def previous_business_day(self, d):
        _check_date(d)
        d -= ONE
        while not self.is_business_day(d):
            d -= ONE
        return d

    def _count(self, start, end):
        """Business days in [start, end), start <= end."""
        days = (end - start).days
        weeks, rest = divmod(days, 7)
        n = weeks * self._workdays_per_week
        wd = start.weekday()
        for i in range(rest):
            if (wd + i) % 7 not in self.weekend:
                n += 1
        n -= bisect.bisect_left(self._hol, end) - bisect.bisect_left(self._hol, start)
        return n

    def business_days_between(self, start, end):
        _check_date(start, "start")
        _check_date(end, "end")
        if end < start:
            return -self._count(end, start)
        return self._count(start, end)

    def add_business_days(self, start, n):
        _check_date(start, "start")
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"n must be an int, got {type(n).__name__}")
        if n == 0:
            return start if self.is_business_day(start) else self.next_business_day(start)
        step = 1 if n > 0 else -1
        d = start
        left = abs(n)
        # jump whole weeks while far away, then fix up holidays by stepping
        while left > 2 * self._workdays_per_week + 1:
            weeks = (left - self._workdays_per_week) // self._workdays_per_week
            nd = d + datetime.timedelta(days=7 * weeks * step)
            lo, hi = (d + ONE, nd + ONE) if step > 0 else (nd, d)
            got = self._count(lo, hi)
            left -= got
            d = nd
        while left:
            d += ONE * step
            if self.is_business_day(d):
                left -= 1
        return d

    def business_days_in_month(self, year, month):
        if not 1 <= month <= 12:
            raise ValueError(f"month must be 1..12, got {month}")
        days = _calendar.monthrange(year, month)[1]
        out = []
        for i in range(1, days + 1):
            d = datetime.date(year, month, i)
            if self.is_business_day(d):
                out.append(d)
        return out
EOF
