"""iCalendar-like export and import."""

import datetime as dt

from scheduler.model import WEEKDAYS, Event, Recurrence

_FMT = "%Y%m%dT%H%M%S"


def _escape(text):
    return text.replace("\\", "\\\\").replace(";", "\\;").replace(",", "\\,").replace("\n", "\\n")


def _unescape(text):
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text):
            nxt = text[i + 1]
            out.append("\n" if nxt in "nN" else nxt)
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def _rule(ev):
    r = ev.recurrence
    parts = [f"FREQ={r.freq.upper()}", f"INTERVAL={r.interval}"]
    if r.freq == "weekly":
        days = sorted(r.byweekday or {ev.start.weekday()})
        parts.append("BYDAY=" + ",".join(WEEKDAYS[d] for d in days))
    if r.count is not None:
        parts.append(f"COUNT={r.count}")
    if r.until is not None:
        parts.append(f"UNTIL={r.until_datetime().strftime(_FMT)}")
    return ";".join(parts)


def to_ics(calendar):
    lines = ["BEGIN:VCALENDAR", "VERSION:2.0", "PRODID:-//gyre//scheduler//EN"]
    for ev in calendar.events():
        lines += [
            "BEGIN:VEVENT",
            f"UID:{ev.uid}",
            f"SUMMARY:{_escape(ev.title)}",
            f"DTSTART:{ev.start.strftime(_FMT)}",
            f"DTEND:{ev.end.strftime(_FMT)}",
        ]
        if ev.recurrence is not None:
            lines.append(f"RRULE:{_rule(ev)}")
        if ev.exceptions:
            stamps = sorted(dt.datetime.combine(d, ev.start.time()) for d in ev.exceptions)
            lines.append("EXDATE:" + ",".join(s.strftime(_FMT) for s in stamps))
        lines.append("END:VEVENT")
    lines.append("END:VCALENDAR")
    return "\r\n".join(lines) + "\r\n"


def _dt(value, n):
    try:
        return dt.datetime.strptime(value, _FMT)
    except ValueError:
        raise ValueError(f"line {n}: bad datetime {value!r}, expected YYYYMMDDTHHMMSS") from None


def _parse_rule(value, n):
    kw = {}
    try:
        fields = dict(p.split("=", 1) for p in value.split(";"))
        freq = fields.pop("FREQ").lower()
        kw["interval"] = int(fields.pop("INTERVAL", "1"))
        if "COUNT" in fields:
            kw["count"] = int(fields.pop("COUNT"))
        if "UNTIL" in fields:
            kw["until"] = _dt(fields.pop("UNTIL"), n)
        if "BYDAY" in fields:
            kw["byweekday"] = frozenset(WEEKDAYS.index(d) for d in fields.pop("BYDAY").split(","))
        return Recurrence(freq, **kw)
    except (ValueError, KeyError) as e:
        raise ValueError(f"line {n}: bad RRULE {value!r}: {e}") from None


def _make_event(props, n):
    for key in ("UID", "DTSTART", "DTEND"):
        if key not in props:
            raise ValueError(f"line {n}: VEVENT without {key}")
    start = props["DTSTART"]
    try:
        return Event(
            props["UID"],
            props.get("SUMMARY", ""),
            start,
            props["DTEND"],
            recurrence=props.get("RRULE"),
            exceptions=props.get("EXDATE", frozenset()),
        )
    except ValueError as e:
        raise ValueError(f"line {n}: {e}") from None


def from_ics(text):
    from scheduler.calendar import Calendar

    lines = text.replace("\r\n", "\n").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    cal, in_cal, props, done = Calendar(), False, None, False
    n = 0
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise ValueError(f"line {n}: expected NAME:VALUE, got {line!r}")
        if not in_cal:
            if line != "BEGIN:VCALENDAR" or done:
                raise ValueError(f"line {n}: expected BEGIN:VCALENDAR, got {line!r}")
            in_cal = True
        elif line == "BEGIN:VEVENT":
            if props is not None:
                raise ValueError(f"line {n}: nested VEVENT")
            props = {}
        elif line == "END:VEVENT":
            if props is None:
                raise ValueError(f"line {n}: END:VEVENT without BEGIN:VEVENT")
            ev = _make_event(props, n)
            try:
                cal.add(ev)
            except ValueError as e:
                raise ValueError(f"line {n}: {e}") from None
            props = None
        elif line == "END:VCALENDAR":
            if props is not None:
                raise ValueError(f"line {n}: END:VCALENDAR inside a VEVENT")
            in_cal, done = False, True
        elif props is not None:
            if name == "UID":
                props["UID"] = value
            elif name == "SUMMARY":
                props["SUMMARY"] = _unescape(value)
            elif name in ("DTSTART", "DTEND"):
                props[name] = _dt(value, n)
            elif name == "RRULE":
                props["RRULE"] = _parse_rule(value, n)
            elif name == "EXDATE":
                props["EXDATE"] = frozenset(_dt(v, n).date() for v in value.split(","))
    if in_cal or props is not None or not done:
        raise ValueError(f"line {max(n, 1)}: unterminated VCALENDAR or VEVENT block")
    return cal
