"""A small calendar / scheduling package."""

from scheduler.calendar import Calendar
from scheduler.ics import from_ics, to_ics
from scheduler.io import event_from_dict, load_json
from scheduler.model import WEEKDAYS, Event, Occurrence, Recurrence
from scheduler.recurrence import occurrences

__all__ = [
    "WEEKDAYS",
    "Calendar",
    "Event",
    "Occurrence",
    "Recurrence",
    "event_from_dict",
    "from_ics",
    "load_json",
    "occurrences",
    "to_ics",
]
