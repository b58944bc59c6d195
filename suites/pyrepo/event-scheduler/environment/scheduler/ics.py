"""iCalendar-like export and import."""


def to_ics(calendar):
    raise NotImplementedError


def from_ics(text):
    raise NotImplementedError
