"""A small calendar / scheduling package (see instruction.md)."""

from scheduler.model import WEEKDAYS, Event, Occurrence, Recurrence

__all__ = ["WEEKDAYS", "Event", "Occurrence", "Recurrence"]
