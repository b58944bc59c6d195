import datetime as dt
import json
import os
import subprocess
import sys

import pytest
from scheduler import (
    Calendar,
    Event,
    Occurrence,
    Recurrence,
    event_from_dict,
    from_ics,
    load_json,
    occurrences,
    to_ics,
)

D = dt.datetime
T = dt.time
MIN = dt.timedelta(minutes=1)
# 2024-01-01 is a Monday


def starts(occs):
    return [o.start for o in occs]


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "scheduler", *map(str, args)],
        cwd=os.getcwd(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_single_event_overlap_window():
    ev = Event("a", "Talk", D(2024, 1, 1, 10), D(2024, 1, 1, 11))
    assert occurrences(ev, D(2024, 1, 1), D(2024, 1, 2)) == [
        Occurrence(start=D(2024, 1, 1, 10), uid="a", end=D(2024, 1, 1, 11), title="Talk")
    ]
    assert occurrences(ev, D(2024, 1, 1, 10, 30), D(2024, 1, 1, 10, 31)) != []
    assert occurrences(ev, D(2024, 1, 1, 11), D(2024, 1, 2)) == []
    assert occurrences(ev, D(2024, 1, 1, 9), D(2024, 1, 1, 10)) == []


def test_daily_interval_count_and_exceptions():
    ev = Event(
        "d",
        "Pill",
        D(2024, 1, 1, 8),
        D(2024, 1, 1, 8, 5),
        Recurrence("daily", interval=2, count=5),
        exceptions={dt.date(2024, 1, 5)},
    )
    got = occurrences(ev, D(2023, 12, 1), D(2024, 3, 1))
    assert starts(got) == [D(2024, 1, 1, 8), D(2024, 1, 3, 8), D(2024, 1, 7, 8), D(2024, 1, 9, 8)]
    assert all(o.end - o.start == dt.timedelta(minutes=5) and o.title == "Pill" for o in got)


def test_daily_until_date_inclusive_and_open_ended():
    ev = Event("d", "x", D(2024, 1, 1, 23), D(2024, 1, 2, 1), Recurrence("daily", until=dt.date(2024, 1, 3)))
    assert starts(occurrences(ev, D(2024, 1, 1), D(2024, 2, 1))) == [
        D(2024, 1, 1, 23),
        D(2024, 1, 2, 23),
        D(2024, 1, 3, 23),
    ]
    forever = Event("f", "x", D(2000, 1, 1, 12), D(2000, 1, 1, 13), Recurrence("daily"))
    got = occurrences(forever, D(2024, 1, 1, 12, 30), D(2024, 1, 3))
    assert starts(got) == [D(2024, 1, 1, 12), D(2024, 1, 2, 12)]  # the first one overlaps the window start


def test_weekly_byweekday_interval():
    ev = Event(
        "w",
        "Gym",
        D(2024, 1, 3, 18),
        D(2024, 1, 3, 19),  # a Wednesday
        Recurrence("weekly", interval=2, byweekday={0, 2, 4}, count=6),
    )
    got = occurrences(ev, D(2024, 1, 1), D(2024, 3, 1))
    # Monday Jan 1 is before the start: skipped, not counted
    assert starts(got) == [
        D(2024, 1, 3, 18),
        D(2024, 1, 5, 18),
        D(2024, 1, 15, 18),
        D(2024, 1, 17, 18),
        D(2024, 1, 19, 18),
        D(2024, 1, 29, 18),
    ]


def test_weekly_default_weekday_until_datetime_and_exception_counts():
    ev = Event(
        "w",
        "1:1",
        D(2024, 1, 2, 9),
        D(2024, 1, 2, 9, 30),
        Recurrence("weekly", until=D(2024, 1, 23, 9)),
        exceptions={dt.date(2024, 1, 9)},
    )
    assert starts(occurrences(ev, D(2024, 1, 1), D(2024, 12, 1))) == [
        D(2024, 1, 2, 9),
        D(2024, 1, 16, 9),
        D(2024, 1, 23, 9),
    ]
    ev2 = Event(
        "c", "x", D(2024, 1, 2, 9), D(2024, 1, 2, 10), Recurrence("weekly", count=3), exceptions={dt.date(2024, 1, 9)}
    )
    assert starts(occurrences(ev2, D(2024, 1, 1), D(2024, 12, 1))) == [D(2024, 1, 2, 9), D(2024, 1, 16, 9)]


def _cal(*events):
    cal = Calendar()
    for e in events:
        cal.add(e)
    return cal


def test_calendar_crud():
    a = Event("a", "A", D(2024, 1, 1, 9), D(2024, 1, 1, 10))
    b = Event("b", "B", D(2024, 1, 1, 9), D(2024, 1, 1, 10))
    cal = _cal(b, a)
    assert cal.events() == [b, a] and len(cal) == 2 and cal.get("a") is a
    with pytest.raises(ValueError):
        cal.add(Event("a", "again", D(2024, 1, 1, 9), D(2024, 1, 1, 10)))
    cal.remove("b")
    with pytest.raises(KeyError):
        cal.remove("b")
    with pytest.raises(KeyError):
        cal.get("zz")
    assert cal.events() == [a]


def test_calendar_occurrences_sorted_by_start_then_uid():
    cal = _cal(
        Event("z", "Z", D(2024, 1, 1, 9), D(2024, 1, 1, 9, 30), Recurrence("daily", count=2)),
        Event("a", "A", D(2024, 1, 2, 9), D(2024, 1, 2, 10)),
        Event("m", "M", D(2024, 1, 1, 8), D(2024, 1, 1, 8, 30)),
    )
    got = cal.occurrences(D(2024, 1, 1), D(2024, 1, 3))
    assert [(o.uid, o.start) for o in got] == [
        ("m", D(2024, 1, 1, 8)),
        ("z", D(2024, 1, 1, 9)),
        ("a", D(2024, 1, 2, 9)),
        ("z", D(2024, 1, 2, 9)),
    ]


def test_conflicts():
    cal = _cal(
        Event("standup", "S", D(2024, 1, 1, 9), D(2024, 1, 1, 9, 15), Recurrence("daily", count=3)),
        Event("review", "R", D(2024, 1, 2, 9, 10), D(2024, 1, 2, 10)),
        Event("lunch", "L", D(2024, 1, 2, 9, 30), D(2024, 1, 2, 9, 45)),
        Event("touch", "T", D(2024, 1, 3, 9, 15), D(2024, 1, 3, 9, 30)),
    )
    got = [(a.uid, a.start, b.uid, b.start) for a, b in cal.conflicts(D(2024, 1, 1), D(2024, 1, 4))]
    assert got == [
        ("standup", D(2024, 1, 2, 9), "review", D(2024, 1, 2, 9, 10)),
        ("review", D(2024, 1, 2, 9, 10), "lunch", D(2024, 1, 2, 9, 30)),
    ]
    assert cal.conflicts(D(2024, 1, 3), D(2024, 1, 4)) == []


def test_conflicts_long_event_overlaps_many():
    cal = _cal(
        Event("offsite", "O", D(2024, 1, 1, 8), D(2024, 1, 1, 18)),
        Event("a", "A", D(2024, 1, 1, 9), D(2024, 1, 1, 10)),
        Event("b", "B", D(2024, 1, 1, 9, 30), D(2024, 1, 1, 11)),
        Event("c", "C", D(2024, 1, 1, 12), D(2024, 1, 1, 13)),
    )
    got = [(a.uid, b.uid) for a, b in cal.conflicts(D(2024, 1, 1), D(2024, 1, 2))]
    assert got == [("offsite", "a"), ("offsite", "b"), ("offsite", "c"), ("a", "b")]


def test_free_slots():
    cal = _cal(
        Event("s", "S", D(2024, 1, 1, 9), D(2024, 1, 1, 9, 30), Recurrence("daily", count=2)),
        Event("m", "M", D(2024, 1, 1, 11), D(2024, 1, 1, 12)),
        Event("m2", "M2", D(2024, 1, 1, 11, 30), D(2024, 1, 1, 13)),
        Event("late", "L", D(2024, 1, 2, 16, 45), D(2024, 1, 2, 18)),
    )
    got = cal.free_slots(D(2024, 1, 1), D(2024, 1, 3), dt.timedelta(minutes=30))
    assert got == [
        (D(2024, 1, 1, 9, 30), D(2024, 1, 1, 11)),
        (D(2024, 1, 1, 13), D(2024, 1, 1, 17)),
        (D(2024, 1, 2, 9, 30), D(2024, 1, 2, 16, 45)),
    ]
    assert cal.find_slot(D(2024, 1, 1), D(2024, 1, 3), dt.timedelta(hours=5)) == D(2024, 1, 2, 9, 30)
    assert cal.find_slot(D(2024, 1, 1), D(2024, 1, 3), dt.timedelta(hours=8)) is None


def test_free_slots_clipping_custom_hours_and_errors():
    cal = _cal(Event("x", "X", D(2024, 1, 1, 10), D(2024, 1, 1, 10, 20)))
    got = cal.free_slots(D(2024, 1, 1, 9, 50), D(2024, 1, 1, 11), 10 * MIN, day_start=T(8), day_end=T(10, 40))
    assert got == [(D(2024, 1, 1, 9, 50), D(2024, 1, 1, 10)), (D(2024, 1, 1, 10, 20), D(2024, 1, 1, 10, 40))]
    assert cal.free_slots(D(2024, 1, 1, 9, 50), D(2024, 1, 1, 11), 11 * MIN, day_end=T(10, 40)) == [
        (D(2024, 1, 1, 10, 20), D(2024, 1, 1, 10, 40))
    ]
    with pytest.raises(ValueError):
        cal.free_slots(D(2024, 1, 1), D(2024, 1, 2), dt.timedelta(0))
    with pytest.raises(ValueError):
        cal.free_slots(D(2024, 1, 1), D(2024, 1, 2), MIN, day_start=T(17), day_end=T(9))


def _ics_cal():
    return _cal(
        Event(
            "w1",
            "Team; sync, weekly\\ok",
            D(2024, 1, 3, 9, 30),
            D(2024, 1, 3, 10),
            Recurrence("weekly", byweekday={4, 0}, count=4),
            exceptions={dt.date(2024, 1, 8), dt.date(2024, 1, 5)},
        ),
        Event(
            "d1",
            "Line1\nLine2",
            D(2024, 1, 1, 7),
            D(2024, 1, 1, 7, 15),
            Recurrence("daily", interval=3, until=dt.date(2024, 2, 1)),
        ),
        Event("one", "Once", D(2024, 5, 6, 14), D(2024, 5, 6, 15)),
        Event("w2", "Tue", D(2024, 1, 2, 8), D(2024, 1, 2, 9), Recurrence("weekly", interval=2)),
    )


EXPECTED_ICS = "\r\n".join(
    [
        "BEGIN:VCALENDAR",
        "VERSION:2.0",
        "PRODID:-//gyre//scheduler//EN",
        "BEGIN:VEVENT",
        "UID:w1",
        "SUMMARY:Team\\; sync\\, weekly\\\\ok",
        "DTSTART:20240103T093000",
        "DTEND:20240103T100000",
        "RRULE:FREQ=WEEKLY;INTERVAL=1;BYDAY=MO,FR;COUNT=4",
        "EXDATE:20240105T093000,20240108T093000",
        "END:VEVENT",
        "BEGIN:VEVENT",
        "UID:d1",
        "SUMMARY:Line1\\nLine2",
        "DTSTART:20240101T070000",
        "DTEND:20240101T071500",
        "RRULE:FREQ=DAILY;INTERVAL=3;UNTIL=20240201T235959",
        "END:VEVENT",
        "BEGIN:VEVENT",
        "UID:one",
        "SUMMARY:Once",
        "DTSTART:20240506T140000",
        "DTEND:20240506T150000",
        "END:VEVENT",
        "BEGIN:VEVENT",
        "UID:w2",
        "SUMMARY:Tue",
        "DTSTART:20240102T080000",
        "DTEND:20240102T090000",
        "RRULE:FREQ=WEEKLY;INTERVAL=2;BYDAY=TU",
        "END:VEVENT",
        "END:VCALENDAR",
        "",
    ]
)


def test_to_ics_exact():
    assert to_ics(_ics_cal()) == EXPECTED_ICS


def test_from_ics_roundtrip_and_semantics():
    cal = from_ics(EXPECTED_ICS)
    assert to_ics(cal) == EXPECTED_ICS
    assert [e.uid for e in cal.events()] == ["w1", "d1", "one", "w2"]
    assert cal.get("w1").title == "Team; sync, weekly\\ok"
    assert cal.get("d1").title == "Line1\nLine2"
    assert cal.get("w1").exceptions == {dt.date(2024, 1, 5), dt.date(2024, 1, 8)}
    lf = EXPECTED_ICS.replace("\r\n", "\n").replace("VERSION:2.0\n", "VERSION:2.0\nX-FOO:bar\n\n")
    a = from_ics(lf).occurrences(D(2024, 1, 1), D(2024, 2, 1))
    b = _ics_cal().occurrences(D(2024, 1, 1), D(2024, 2, 1))
    assert a == b and len(a) > 10


def test_from_ics_errors_with_line_numbers():
    bad_dt = EXPECTED_ICS.replace("DTSTART:20240506T140000", "DTSTART:2024-05-06")
    with pytest.raises(ValueError, match="line 22"):
        from_ics(bad_dt)
    no_uid = EXPECTED_ICS.replace("UID:one\r\n", "")
    with pytest.raises(ValueError, match="line 23"):
        from_ics(no_uid)
    with pytest.raises(ValueError, match="line 1"):
        from_ics("BEGIN:VEVENT\r\n")
    truncated = "\r\n".join(EXPECTED_ICS.split("\r\n")[:8])
    with pytest.raises(ValueError, match="line 8"):
        from_ics(truncated)
    with pytest.raises(ValueError, match="line 9"):
        from_ics(EXPECTED_ICS.replace("FREQ=WEEKLY;INTERVAL=1", "FREQ=HOURLY;INTERVAL=1"))


SAMPLE = {
    "events": [
        {
            "uid": "standup",
            "title": "Standup",
            "start": "2024-01-01T09:00",
            "end": "2024-01-01T09:15",
            "recurrence": {"freq": "weekly", "byweekday": [0, 2, 4], "count": 10},
            "exceptions": ["2024-01-03"],
        },
        {"uid": "review", "title": "Design review", "start": "2024-01-05T09:00", "end": "2024-01-05T10:30"},
        {
            "uid": "focus",
            "title": "Focus",
            "start": "2024-01-01T13:00",
            "end": "2024-01-01T15:00",
            "recurrence": {"freq": "daily", "interval": 2, "until": "2024-01-05"},
        },
    ]
}


def _write(tmp_path, data):
    p = tmp_path / "cal.json"
    p.write_text(json.dumps(data), encoding="utf-8")
    return p


def test_load_json_and_event_from_dict(tmp_path):
    cal = load_json(_write(tmp_path, SAMPLE))
    assert [e.uid for e in cal.events()] == ["standup", "review", "focus"]
    su = cal.get("standup")
    assert su.recurrence == Recurrence("weekly", count=10, byweekday=frozenset({0, 2, 4}))
    assert su.exceptions == {dt.date(2024, 1, 3)}
    assert cal.get("focus").recurrence.until == dt.date(2024, 1, 5)
    with pytest.raises(ValueError, match="start"):
        event_from_dict({"uid": "x", "title": "t", "end": "2024-01-01T10:00"})
    with pytest.raises(ValueError):
        event_from_dict({"uid": "x", "title": "t", "start": "tomorrow", "end": "2024-01-01T10:00"})
    bad = tmp_path / "bad.json"
    bad.write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError):
        load_json(bad)


def test_cli_agenda_and_conflicts(tmp_path):
    p = _write(tmp_path, SAMPLE)
    r = run_cli(p, "agenda", "2024-01-01", "2024-01-06")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "2024-01-01 09:00-09:15 standup Standup",
        "2024-01-01 13:00-15:00 focus Focus",
        "2024-01-03 13:00-15:00 focus Focus",
        "2024-01-05 09:00-10:30 review Design review",
        "2024-01-05 09:00-09:15 standup Standup",
        "2024-01-05 13:00-15:00 focus Focus",
    ]
    r = run_cli(p, "conflicts", "2024-01-01", "2024-01-08")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "review 2024-01-05T09:00 <-> standup 2024-01-05T09:00\n"


def test_cli_free_and_export(tmp_path):
    p = _write(tmp_path, SAMPLE)
    r = run_cli(p, "free", "2024-01-05", "2024-01-06", "60", "--day-start", "08:00", "--day-end", "16:00")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["2024-01-05 08:00-09:00", "2024-01-05 10:30-13:00", "2024-01-05 15:00-16:00"]
    r = subprocess.run(
        [sys.executable, "-m", "scheduler", str(p), "export"], cwd=os.getcwd(), capture_output=True, timeout=60
    )
    assert r.returncode == 0
    text = r.stdout.decode()
    assert text.startswith("BEGIN:VCALENDAR\r\nVERSION:2.0\r\n") and text.endswith("END:VCALENDAR\r\n")
    assert "RRULE:FREQ=DAILY;INTERVAL=2;UNTIL=20240105T235959\r\n" in text
    assert to_ics(from_ics(text)) == text


def test_cli_errors(tmp_path):
    r = run_cli(tmp_path / "missing.json", "agenda", "2024-01-01", "2024-01-02")
    assert r.returncode == 2 and r.stderr.startswith("error:")
    p = _write(
        tmp_path, {"events": [{"uid": "x", "title": "t", "start": "2024-01-01T10:00", "end": "2024-01-01T09:00"}]}
    )
    r = run_cli(p, "agenda", "2024-01-01", "2024-01-02")
    assert r.returncode == 2 and r.stderr.startswith("error:")
    r = run_cli(_write(tmp_path, SAMPLE), "agenda", "2024-13-01", "2024-01-02")
    assert r.returncode == 2
