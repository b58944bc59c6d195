import datetime as dt
import random

import pytest
from bizdays import Calendar

D = dt.date
ONE = dt.timedelta(days=1)


def brute_between(cal_weekend, hols, start, end):
    sign = 1
    if end < start:
        start, end, sign = end, start, -1
    n = 0
    d = start
    while d < end:
        if d.weekday() not in cal_weekend and d not in hols:
            n += 1
        d += ONE
    return sign * n


def brute_add(cal_weekend, hols, start, n):
    def biz(d):
        return d.weekday() not in cal_weekend and d not in hols

    if n == 0:
        d = start
        while not biz(d):
            d += ONE
        return d
    step = ONE if n > 0 else -ONE
    d, left = start, abs(n)
    while left:
        d += step
        if biz(d):
            left -= 1
    return d


def test_defaults_and_attributes():
    cal = Calendar(holidays=["2024-12-25", D(2024, 1, 1)])
    assert cal.weekend == frozenset({5, 6})
    assert isinstance(cal.weekend, frozenset)
    assert cal.holidays == frozenset({D(2024, 12, 25), D(2024, 1, 1)})
    assert cal.is_business_day(D(2024, 12, 24))
    assert not cal.is_business_day(D(2024, 12, 25))
    assert not cal.is_business_day(D(2024, 12, 28))  # Saturday


def test_constructor_errors():
    for bad in ([7], [-1], [True], ["5"], [0, 1, 2, 3, 4, 5, 6]):
        with pytest.raises(ValueError):
            Calendar(weekend=bad)
    with pytest.raises(ValueError):
        Calendar(holidays=["2024-02-30"])
    with pytest.raises(TypeError):
        Calendar(holidays=[dt.datetime(2024, 1, 1, 0, 0)])
    with pytest.raises(TypeError):
        Calendar(holidays=[20240101])
    assert Calendar(weekend=[]).is_business_day(D(2024, 6, 1))


def test_date_type_checks():
    cal = Calendar()
    with pytest.raises(TypeError):
        cal.is_business_day(dt.datetime(2024, 1, 1))
    with pytest.raises(TypeError):
        cal.business_days_between("2024-01-01", D(2024, 1, 5))
    with pytest.raises(TypeError):
        cal.add_business_days(D(2024, 1, 1), 1.0)
    with pytest.raises(TypeError):
        cal.add_business_days(D(2024, 1, 1), True)


def test_next_previous():
    cal = Calendar(holidays=[D(2024, 3, 29), D(2024, 4, 1)])  # Good Friday, Easter Monday
    assert cal.next_business_day(D(2024, 3, 28)) == D(2024, 4, 2)
    assert cal.previous_business_day(D(2024, 4, 2)) == D(2024, 3, 28)
    assert cal.next_business_day(D(2024, 4, 2)) == D(2024, 4, 3)


def test_between_half_open_and_negative():
    cal = Calendar()
    mon, fri, next_mon = D(2024, 6, 3), D(2024, 6, 7), D(2024, 6, 10)
    assert cal.business_days_between(mon, fri) == 4
    assert cal.business_days_between(mon, next_mon) == 5
    assert cal.business_days_between(next_mon, mon) == -5
    assert cal.business_days_between(fri, fri) == 0
    assert cal.business_days_between(D(2024, 6, 8), D(2024, 6, 10)) == 0


def test_between_holiday_on_weekend_not_double_counted():
    cal = Calendar(holidays=[D(2024, 6, 8), D(2024, 6, 12)])  # a Saturday and a Wednesday
    assert cal.business_days_between(D(2024, 6, 3), D(2024, 6, 17)) == 9


def test_add_forward_and_backward():
    cal = Calendar()
    fri, sat, sun, mon = D(2024, 6, 7), D(2024, 6, 8), D(2024, 6, 9), D(2024, 6, 10)
    assert cal.add_business_days(fri, 1) == mon
    assert cal.add_business_days(sat, 1) == mon
    assert cal.add_business_days(mon, -1) == fri
    assert cal.add_business_days(sun, -1) == fri
    assert cal.add_business_days(fri, 0) == fri
    assert cal.add_business_days(sat, 0) == mon
    assert cal.add_business_days(mon, 10) == D(2024, 6, 24)
    assert cal.add_business_days(mon, -10) == D(2024, 5, 27)


def test_add_with_holidays():
    cal = Calendar(holidays=["2024-12-25", "2024-12-26", "2025-01-01"])
    assert cal.add_business_days(D(2024, 12, 24), 1) == D(2024, 12, 27)
    assert cal.add_business_days(D(2024, 12, 24), 4) == D(2025, 1, 2)
    assert cal.add_business_days(D(2025, 1, 2), -4) == D(2024, 12, 24)


def test_custom_weekend():
    cal = Calendar(weekend=[4, 5])  # Friday + Saturday
    thu, sun = D(2024, 6, 6), D(2024, 6, 9)
    assert cal.add_business_days(thu, 1) == sun
    assert cal.business_days_between(thu, sun) == 1
    cal6 = Calendar(weekend=[6])
    assert cal6.business_days_between(D(2024, 6, 3), D(2024, 6, 17)) == 12


def test_business_days_in_month():
    cal = Calendar(holidays=["2024-02-19"])
    days = cal.business_days_in_month(2024, 2)
    assert len(days) == 20
    assert days[0] == D(2024, 2, 1) and days[-1] == D(2024, 2, 29)
    assert D(2024, 2, 19) not in days
    with pytest.raises(ValueError):
        cal.business_days_in_month(2024, 13)


def test_random_against_brute_force():
    rng = random.Random(7)
    base = D(2023, 1, 1)
    for _ in range(40):
        weekend = set(rng.sample(range(7), rng.randint(0, 3)))
        hols = {base + dt.timedelta(days=rng.randint(0, 800)) for _ in range(rng.randint(0, 40))}
        cal = Calendar(weekend=weekend, holidays=hols)
        for _ in range(15):
            a = base + dt.timedelta(days=rng.randint(0, 700))
            b = base + dt.timedelta(days=rng.randint(0, 700))
            assert cal.business_days_between(a, b) == brute_between(weekend, hols, a, b)
            n = rng.randint(-150, 150)
            mid = base + dt.timedelta(days=400)
            got = cal.add_business_days(mid, n)
            assert got == brute_add(weekend, hols, mid, n), (weekend, mid, n)


def test_roundtrip_identity():
    cal = Calendar(holidays=[D(2024, 1, 1), D(2024, 5, 1), D(2024, 12, 25)])
    s = D(2024, 3, 4)
    for n in range(-300, 301, 17):
        assert cal.business_days_between(s, cal.add_business_days(s, n)) == n


def test_long_spans():
    # Counts here are only checked for consistency; a day-by-day loop over 400 years passes too,
    # the speed requirement is not measured by wall clock.
    cal = Calendar(holidays=[D(2000 + i, 1, 1) for i in range(0, 400)])
    start, end = D(2000, 1, 1), D(2400, 1, 1)
    n = cal.business_days_between(start, end)
    weekdays = 0
    # 400 Gregorian years are exactly 20871 weeks
    assert (end - start).days == 20871 * 7
    weekdays = 20871 * 5
    weekday_new_years = sum(1 for i in range(400) if D(2000 + i, 1, 1).weekday() < 5)
    assert n == weekdays - weekday_new_years
    far = cal.add_business_days(D(2000, 1, 3), 100_000)
    assert cal.business_days_between(D(2000, 1, 3), far) == 100_000
    assert cal.is_business_day(far)
