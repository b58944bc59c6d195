import os
import subprocess
import sys

import pytest
from roman import from_roman, to_roman

KNOWN = {
    1: "I",
    3: "III",
    4: "IV",
    9: "IX",
    14: "XIV",
    40: "XL",
    90: "XC",
    400: "CD",
    444: "CDXLIV",
    1994: "MCMXCIV",
    2024: "MMXXIV",
    3888: "MMMDCCCLXXXVIII",
    3999: "MMMCMXCIX",
}


def cli(*args, stdin=""):
    return subprocess.run(
        [sys.executable, "-m", "roman", *args], cwd=os.getcwd(), input=stdin, capture_output=True, text=True, timeout=30
    )


def test_to_roman_known_values():
    for n, s in KNOWN.items():
        assert to_roman(n) == s


def test_to_roman_errors():
    for bad in (0, -1, 4000, 10**6):
        with pytest.raises(ValueError):
            to_roman(bad)
    for bad in (1.0, "5", True, None):
        with pytest.raises(TypeError):
            to_roman(bad)


def test_from_roman_known_values():
    for n, s in KNOWN.items():
        assert from_roman(s) == n


@pytest.mark.parametrize(
    "bad",
    [
        ["IIII", "VV", "MMMM", "DD", "XXXX", "LL"],  # too many repeats
        ["IC", "XM", "IL", "VX", "IIV", "IXI", "XCX", "CMCM"],  # bad subtractive forms
        ["", "iv", " X", "X ", "A", "X1"],  # not a numeral at all
    ],
    ids=["repeats", "subtractive", "format"],
)
def test_from_roman_rejects_non_canonical(bad):
    for s in bad:
        with pytest.raises(ValueError):
            from_roman(s)


def test_from_roman_type_error():
    for bad in (5, None, b"X"):
        with pytest.raises(TypeError):
            from_roman(bad)


def test_round_trip_all_values():
    assert all(from_roman(to_roman(n)) == n for n in range(1, 4000))


def test_cli_to_and_from():
    p = cli("to", "1994", "4")
    assert (p.returncode, p.stdout, p.stderr) == (0, "MCMXCIV\nIV\n", "")
    p = cli("from", "MCMXCIV", "XLII")
    assert (p.returncode, p.stdout, p.stderr) == (0, "1994\n42\n", "")


def test_cli_reads_stdin_without_values():
    p = cli("to", stdin="1 2\n3\n\t10\n")
    assert (p.returncode, p.stdout) == (0, "I\nII\nIII\nX\n")
    p = cli("from", stdin="MMXXIV\n")
    assert (p.returncode, p.stdout) == (0, "2024\n")


def test_cli_invalid_values_continue_and_exit_1():
    p = cli("to", "5", "0", "abc", "7", "1.5")
    assert p.returncode == 1
    assert p.stdout == "V\nVII\n"
    lines = p.stderr.splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("error: 0: ")
    assert lines[1].startswith("error: abc: ")
    assert lines[2].startswith("error: 1.5: ")


def test_cli_from_rejects_lowercase_and_non_canonical():
    p = cli("from", "x", "IIII", "X")
    assert p.returncode == 1
    assert p.stdout == "10\n"
    assert [ln.split(":")[1].strip() for ln in p.stderr.splitlines()] == ["x", "IIII"]


@pytest.mark.parametrize("args", [[], ["frob", "1"], ["TO", "1"]])
def test_cli_usage_errors(args):
    p = cli(*args)
    assert p.returncode == 2
    assert p.stdout == ""
    assert p.stderr.startswith("usage:")
