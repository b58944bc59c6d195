import os
import subprocess
import sys

import pytest
import wordfreq


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "wordfreq", *map(str, args)],
        cwd=os.getcwd(),
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_tokenize_punctuation_and_case():
    assert wordfreq.tokenize("Don't stop\u2014it's ROCK-n-roll!") == ["don't", "stop", "it's", "rock", "n", "roll"]


def test_tokenize_apostrophes():
    assert wordfreq.tokenize("'Tis the ''end''") == ["tis", "the", "end"]
    assert wordfreq.tokenize("DON\u2019T ' '' x") == ["don't", "x"]
    assert wordfreq.tokenize("snake_case café 42") == ["snake", "case", "café", "42"]
    assert wordfreq.tokenize("") == []


def test_count_words_plain_dict():
    got = wordfreq.count_words("a A a. b, B; c")
    assert type(got) is dict
    assert got == {"a": 3, "b": 2, "c": 1}


def test_count_words_stop_words_normalized():
    got = wordfreq.count_words("The cat and the hat. Don't! don\u2019t", stop_words=["THE", "Don\u2019t"])
    assert got == {"cat": 1, "and": 1, "hat": 1}


def test_top_k_ties_and_bounds():
    counts = {"pear": 2, "apple": 2, "zoo": 5, "fig": 1, "banana": 2}
    assert wordfreq.top_k(counts, 3) == [("zoo", 5), ("apple", 2), ("banana", 2)]
    assert wordfreq.top_k(counts, 99) == [("zoo", 5), ("apple", 2), ("banana", 2), ("pear", 2), ("fig", 1)]
    assert wordfreq.top_k({}, 3) == []
    with pytest.raises(ValueError):
        wordfreq.top_k(counts, 0)


def test_load_stop_words(tmp_path):
    p = tmp_path / "stops.txt"
    p.write_text("# comment\nThe\n\n   AND  \n  # also comment\nit\u2019s\n", encoding="utf-8")
    assert wordfreq.load_stop_words(p) == {"the", "and", "it's"}


def test_cli_top_k(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("b a c b a b. C c c!\nd", encoding="utf-8")
    r = run_cli(f, "-k", "2")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "c\t4\nb\t3\n"


def test_cli_default_k_and_stop_words(tmp_path):
    words = " ".join(f"w{i:02d} " * (i + 1) for i in range(12)) + " the THE the the the the the the the the the the the"
    f = tmp_path / "t.txt"
    f.write_text(words, encoding="utf-8")
    s = tmp_path / "s.txt"
    s.write_text("the\n", encoding="utf-8")
    r = run_cli(f, "--stop-words", s)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 10
    assert lines[0] == "w11\t12"
    assert lines[-1] == "w02\t3"


def test_cli_errors(tmp_path):
    r = run_cli(tmp_path / "missing.txt")
    assert r.returncode == 1
    assert r.stderr.startswith("error:")
    assert r.stdout == ""
    f = tmp_path / "t.txt"
    f.write_text("x", encoding="utf-8")
    r = run_cli(f, "-k", "0")
    assert r.returncode == 2
    assert "error:" in r.stderr
