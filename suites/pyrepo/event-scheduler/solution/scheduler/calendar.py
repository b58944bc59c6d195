"""The Calendar: a set of events, conflicts and free time."""

import datetime as dt

from scheduler.recurrence import occurrences as _event_occurrences


class Calendar:
    def __init__(self):
        self._events = {}

    def add(self, event):
        if event.uid in self._events:
            raise ValueError(f"an event with uid {event.uid!r} already exists")
        self._events[event.uid] = event

    def remove(self, uid):
        del self._events[uid]

    def get(self, uid):
        return self._events[uid]

    def events(self):
        return list(self._events.values())

    def __len__(self):
        return len(self._events)

    def occurrences(self, window_start, window_end):
        out = []
        for ev in self._events.values():
            out.extend(_event_occurrences(ev, window_start, window_end))
        return sorted(out)

    def conflicts(self, window_start, window_end):
        occ = self.occurrences(window_start, window_end)
        pairs = []
        for i, a in enumerate(occ):
            for b in occ[i + 1 :]:
                if b.start >= a.end:
                    break
                pairs.append((a, b))
        return pairs

    def free_slots(self, window_start, window_end, duration, day_start=dt.time(9, 0), day_end=dt.time(17, 0)):
        if not isinstance(duration, dt.timedelta) or duration <= dt.timedelta(0):
            raise ValueError(f"duration must be a positive timedelta, got {duration!r}")
        if not day_start < day_end:
            raise ValueError(f"day_start {day_start} must be before day_end {day_end}")
        busy = [(o.start, o.end) for o in self.occurrences(window_start, window_end)]
        slots = []
        day = window_start.date()
        while dt.datetime.combine(day, dt.time()) < window_end:
            lo = max(window_start, dt.datetime.combine(day, day_start))
            hi = min(window_end, dt.datetime.combine(day, day_end))
            cur = lo
            for s, e in busy:
                if e <= cur or s >= hi:
                    continue
                if s > cur and s - cur >= duration:
                    slots.append((cur, s))
                cur = max(cur, e)
            if cur < hi and hi - cur >= duration:
                slots.append((cur, hi))
            day += dt.timedelta(days=1)
        return slots

    def find_slot(self, window_start, window_end, duration, day_start=dt.time(9, 0), day_end=dt.time(17, 0)):
        slots = self.free_slots(window_start, window_end, duration, day_start, day_end)
        return slots[0][0] if slots else None
