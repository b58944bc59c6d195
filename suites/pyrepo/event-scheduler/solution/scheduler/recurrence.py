"""Expanding events into occurrences."""

import datetime as dt

from scheduler.model import Occurrence


def _starts(event, stop):
    """Occurrence starts in order (exceptions included), ending before `stop` or at count/until."""
    r = event.recurrence
    if r is None:
        yield event.start
        return
    until = r.until_datetime()
    n = 0

    def ok(s):
        return s < stop and (until is None or s <= until)

    if r.freq == "daily":
        k = 0
        while True:
            s = event.start + dt.timedelta(days=k * r.interval)
            if not ok(s):
                return
            yield s
            n += 1
            if r.count is not None and n >= r.count:
                return
            k += 1
    days = sorted(r.byweekday or {event.start.weekday()})
    monday = event.start.date() - dt.timedelta(days=event.start.weekday())
    w = 0
    while True:
        week = monday + dt.timedelta(weeks=w * r.interval)
        for d in days:
            s = dt.datetime.combine(week + dt.timedelta(days=d), event.start.time())
            if s < event.start:
                continue
            if not ok(s):
                return
            yield s
            n += 1
            if r.count is not None and n >= r.count:
                return
        w += 1


def occurrences(event, window_start, window_end):
    out = []
    dur = event.duration
    for s in _starts(event, window_end):
        if s >= window_end:
            break
        if s.date() in event.exceptions:
            continue
        if s + dur > window_start:
            out.append(Occurrence(start=s, uid=event.uid, end=s + dur, title=event.title))
    return sorted(out)
