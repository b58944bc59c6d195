"""Loading a calendar from JSON."""

import datetime as dt
import json

from scheduler.calendar import Calendar
from scheduler.model import Event, Recurrence


def _need(d, key, where):
    if not isinstance(d, dict):
        raise ValueError(f"{where} must be an object, got {type(d).__name__}")
    if key not in d:
        raise ValueError(f"{where} is missing the key {key!r}")
    return d[key]


def _datetime(value, what):
    try:
        return dt.datetime.fromisoformat(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what}: not an ISO datetime: {value!r}") from None


def _date(value, what):
    try:
        return dt.date.fromisoformat(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what}: not an ISO date: {value!r}") from None


def event_from_dict(d):
    uid = _need(d, "uid", "event")
    where = f"event {uid!r}"
    title = _need(d, "title", where)
    start = _datetime(_need(d, "start", where), f"{where} start")
    end = _datetime(_need(d, "end", where), f"{where} end")
    rec = None
    if d.get("recurrence") is not None:
        r = d["recurrence"]
        freq = _need(r, "freq", f"{where} recurrence")
        until = r.get("until")
        if until is not None:
            until = _date(until, f"{where} until") if len(str(until)) == 10 else _datetime(until, f"{where} until")
        byweekday = r.get("byweekday")
        rec = Recurrence(
            freq, r.get("interval", 1), r.get("count"), until, frozenset(byweekday) if byweekday is not None else None
        )
    exceptions = frozenset(_date(x, f"{where} exception") for x in d.get("exceptions", []))
    if not isinstance(title, str):
        raise ValueError(f"{where}: title must be a string")
    return Event(uid, title, start, end, rec, exceptions)


def load_json(path):
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: bad JSON: {e}") from None
    cal = Calendar()
    for item in _need(data, "events", "the top-level object"):
        cal.add(event_from_dict(item))
    return cal
