"""The data model: events and their recurrence rules (complete; do not change the behaviour)."""

import datetime as dt
from dataclasses import dataclass, field

WEEKDAYS = ("MO", "TU", "WE", "TH", "FR", "SA", "SU")  # index = datetime.weekday()


def _is_int(x):
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class Recurrence:
    """How an event repeats.

    freq: "daily" or "weekly". interval: every `interval` days / weeks (int >= 1).
    count: at most this many occurrences (exceptions included in the count, as in iCalendar).
    until: last allowed occurrence start (a datetime; a date means the end of that day).
    byweekday: weekly only: the weekdays (0 = Monday) it happens on; None = the start's weekday.
    count and until are exclusive.
    """

    freq: str
    interval: int = 1
    count: int | None = None
    until: dt.date | None = None
    byweekday: frozenset | None = None

    def __post_init__(self):
        if self.freq not in ("daily", "weekly"):
            raise ValueError(f"freq must be 'daily' or 'weekly', got {self.freq!r}")
        if not _is_int(self.interval) or self.interval < 1:
            raise ValueError(f"interval must be an int >= 1, got {self.interval!r}")
        if self.count is not None and (not _is_int(self.count) or self.count < 1):
            raise ValueError(f"count must be an int >= 1, got {self.count!r}")
        if self.count is not None and self.until is not None:
            raise ValueError("give count or until, not both")
        if self.until is not None and not isinstance(self.until, dt.date):
            raise ValueError(f"until must be a date or datetime, got {self.until!r}")
        if self.byweekday is not None:
            if self.freq != "weekly":
                raise ValueError("byweekday is only allowed with freq='weekly'")
            days = frozenset(self.byweekday)
            if not days or not all(_is_int(d) and 0 <= d <= 6 for d in days):
                raise ValueError(f"byweekday must be a non-empty set of ints 0..6, got {self.byweekday!r}")
            object.__setattr__(self, "byweekday", days)

    def until_datetime(self):
        """`until` as a datetime (a plain date means 23:59:59 of that day), or None."""
        if self.until is None or isinstance(self.until, dt.datetime):
            return self.until
        return dt.datetime.combine(self.until, dt.time(23, 59, 59))


@dataclass
class Event:
    """A (possibly recurring) event. start/end are naive datetimes, end > start.

    exceptions: dates of occurrences (by their start date) that are cancelled.
    """

    uid: str
    title: str
    start: dt.datetime
    end: dt.datetime
    recurrence: Recurrence | None = None
    exceptions: frozenset = field(default_factory=frozenset)

    def __post_init__(self):
        if not isinstance(self.uid, str) or not self.uid:
            raise ValueError(f"uid must be a non-empty string, got {self.uid!r}")
        for name in ("start", "end"):
            if not isinstance(getattr(self, name), dt.datetime):
                raise ValueError(f"{name} must be a datetime, got {getattr(self, name)!r}")
        if self.end <= self.start:
            raise ValueError(f"event {self.uid!r}: end {self.end} is not after start {self.start}")
        exc = frozenset(self.exceptions)
        if not all(isinstance(d, dt.date) and not isinstance(d, dt.datetime) for d in exc):
            raise ValueError(f"event {self.uid!r}: exceptions must be dates")
        self.exceptions = exc

    @property
    def duration(self):
        return self.end - self.start


@dataclass(frozen=True, order=True)
class Occurrence:
    """One concrete occurrence of an event. Ordered by (start, uid)."""

    start: dt.datetime
    uid: str
    end: dt.datetime = field(compare=False)
    title: str = field(compare=False)
