import os
import subprocess
import sys

import pytest
from intervals import contains, intersect, merge, subtract, total_length


def cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "intervals", *args], cwd=os.getcwd(), capture_output=True, text=True, timeout=30
    )


def test_merge_overlapping_and_touching():
    assert merge([(5, 7), (1, 3), (2, 4), (7, 8)]) == [(1, 4), (5, 8)]
    assert merge([[1, 3], [3, 5]]) == [(1, 5)]
    assert merge([(0, 10), (2, 3)]) == [(0, 10)]


def test_merge_keeps_gaps_and_empty():
    assert merge([(4, 5), (1, 2)]) == [(1, 2), (4, 5)]
    assert merge([]) == []
    assert merge(iter([(-5, -1)])) == [(-5, -1)]
    out = merge([(1, 2)])
    assert isinstance(out, list) and isinstance(out[0], tuple)


def test_invalid_intervals_raise():
    for bad in [(3, 3), (4, 2), (1,), (1, 2, 3), (1.0, 2), ("1", 2), (True, 3), 7]:
        with pytest.raises(ValueError):
            merge([(0, 1), bad])
    with pytest.raises(ValueError):
        total_length([(2, 1)])
    with pytest.raises(ValueError):
        subtract([(0, 1)], [(5, 5)])


def test_intersect():
    assert intersect([(0, 10)], [(2, 4), (8, 12)]) == [(2, 4), (8, 10)]
    assert intersect([(0, 3), (5, 9)], [(2, 6)]) == [(2, 3), (5, 6)]
    assert intersect([(0, 3)], [(3, 6)]) == []
    assert intersect([], [(0, 1)]) == []
    assert intersect([(0, 2), (1, 5)], [(4, 9), (0, 1)]) == [(0, 1), (4, 5)]


def test_subtract():
    assert subtract([(0, 10)], [(2, 4), (8, 12)]) == [(0, 2), (4, 8)]
    assert subtract([(0, 5)], [(0, 5)]) == []
    assert subtract([(0, 5), (7, 9)], [(-3, 1), (4, 8)]) == [(1, 4), (8, 9)]
    assert subtract([(0, 5)], []) == [(0, 5)]
    assert subtract([(1, 3), (3, 6)], [(2, 4)]) == [(1, 2), (4, 6)]


def test_contains_half_open():
    ivs = [(1, 3), (6, 8)]
    assert contains(ivs, 1) and contains(ivs, 2) and contains(ivs, 7)
    assert not contains(ivs, 3) and not contains(ivs, 0) and not contains(ivs, 8)
    assert not contains([], 0)
    with pytest.raises(ValueError):
        contains(ivs, 1.5)


def test_total_length_counts_overlap_once():
    assert total_length([(1, 3), (2, 5), (10, 11)]) == 5
    assert total_length([]) == 0
    assert total_length([(-3, 3)]) == 6


def test_algebra_against_brute_force():
    sets = [[(0, 4), (6, 9)], [(3, 7)], [(1, 2), (2, 3), (8, 12)], [], [(-2, 0), (5, 6)]]

    def points(ivs):
        return {x for s, e in ivs for x in range(s, e)}

    for a in sets:
        for b in sets:
            assert points(intersect(a, b)) == points(a) & points(b)
            assert points(subtract(a, b)) == points(a) - points(b)
            for result in (intersect(a, b), subtract(a, b)):
                assert result == merge(result)


def test_cli_merge():
    p = cli("merge", "5-7", "1-3", "2-4", "7-8")
    assert p.returncode == 0, p.stderr
    assert p.stdout == "1-4 5-8\n"
    p = cli("merge")
    assert (p.returncode, p.stdout) == (0, "empty\n")


def test_cli_intersect_and_subtract():
    p = cli("intersect", "0-10", "--", "2-4", "8-12")
    assert (p.returncode, p.stdout) == (0, "2-4 8-10\n")
    p = cli("subtract", "0-10", "--", "2-4", "8-12")
    assert (p.returncode, p.stdout) == (0, "0-2 4-8\n")
    p = cli("subtract", "0-3", "--", "0-5")
    assert (p.returncode, p.stdout) == (0, "empty\n")


def test_cli_contains_and_length():
    assert cli("contains", "2", "1-3").stdout == "true\n"
    assert cli("contains", "3", "1-3").stdout == "false\n"
    assert cli("contains", "-1", "0-3").stdout == "false\n"
    p = cli("length", "1-3", "2-5", "10-11")
    assert (p.returncode, p.stdout) == (0, "5\n")


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["frobnicate", "1-2"],
        ["merge", "1-x"],
        ["merge", "5-5"],
        ["merge", "7-2"],
        ["intersect", "1-2", "3-4"],
        ["contains", "1-3"],
        ["contains"],
    ],
)
def test_cli_errors(args):
    p = cli(*args)
    assert p.returncode == 2
    assert p.stdout == ""
    assert p.stderr.startswith("error: ")
