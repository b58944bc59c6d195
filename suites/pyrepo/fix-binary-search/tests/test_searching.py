import bisect
import random

import searching


def test_bisect_left_duplicates_and_end():
    a = [1, 2, 2, 2, 3]
    assert searching.bisect_left(a, 2) == 1
    assert searching.bisect_left(a, 4) == 5
    assert searching.bisect_left(a, 0) == 0


def test_bisect_left_empty():
    assert searching.bisect_left([], 7) == 0


def test_bisect_right_duplicates_and_end():
    a = [1, 2, 2, 2, 3]
    assert searching.bisect_right(a, 2) == 4
    assert searching.bisect_right(a, 3) == 5
    assert searching.bisect_right([], 1) == 0


def test_find_first_occurrence():
    a = [0, 5, 5, 5, 5, 5, 5, 9]
    assert searching.find(a, 5) == 1
    assert searching.find(["a", "b", "b", "c"], "b") == 1
    assert searching.find([4], 4) == 0


def test_find_missing_and_empty():
    assert searching.find([], 3) == -1
    assert searching.find([1, 3, 5], 4) == -1
    assert searching.find([1, 3, 5], 6) == -1


def test_find_last():
    a = [1, 2, 2, 2, 3, 3]
    assert searching.find_last(a, 2) == 3
    assert searching.find_last(a, 3) == 5
    assert searching.find_last(a, 4) == -1
    assert searching.find_last([], 4) == -1


def test_count():
    a = [1, 1, 2, 3, 3, 3, 3]
    assert searching.count(a, 3) == 4
    assert searching.count(a, 1) == 2
    assert searching.count(a, 9) == 0
    assert searching.count([], 9) == 0


def test_find_range():
    a = [(1, "x"), (2, "y"), (2, "y"), (5, "z")]
    assert searching.find_range(a, (2, "y")) == (1, 3)
    assert searching.find_range(a, (3, "q")) == (3, 3)
    assert searching.find_range(a, (9, "q")) == (4, 4)
    assert searching.find_range([], 1) == (0, 0)


def test_does_not_modify_input():
    a = [3, 3, 1]  # not sorted on purpose: the list must come back untouched
    b = sorted(a)
    snapshot = list(b)
    searching.find_range(b, 3)
    searching.find(b, 3)
    assert b == snapshot
    assert searching.find_range(b, 3) == (1, 3)


def test_random_against_stdlib():
    rng = random.Random(1234)
    for _ in range(300):
        a = sorted(rng.randint(0, 6) for _ in range(rng.randint(0, 12)))
        x = rng.randint(-1, 7)
        lo, hi = bisect.bisect_left(a, x), bisect.bisect_right(a, x)
        assert searching.bisect_left(a, x) == lo
        assert searching.bisect_right(a, x) == hi
        assert searching.count(a, x) == hi - lo
        assert searching.find(a, x) == (lo if hi > lo else -1)
        assert searching.find_last(a, x) == (hi - 1 if hi > lo else -1)
        assert searching.find_range(a, x) == (lo, hi)


def test_logarithmic_comparisons():
    calls = 0

    class Counted:
        def __init__(self, v):
            self.v = v

        def __lt__(self, other):
            nonlocal calls
            calls += 1
            return self.v < other.v

        def __le__(self, other):
            nonlocal calls
            calls += 1
            return self.v <= other.v

        def __gt__(self, other):
            nonlocal calls
            calls += 1
            return self.v > other.v

        def __ge__(self, other):
            nonlocal calls
            calls += 1
            return self.v >= other.v

        def __eq__(self, other):
            nonlocal calls
            calls += 1
            return self.v == other.v

    a = [Counted(i // 3) for i in range(3000)]
    assert searching.find(a, Counted(500)) == 1500
    assert searching.find_last(a, Counted(999)) == 2999
    assert searching.count(a, Counted(1000)) == 0
    assert calls < 200
