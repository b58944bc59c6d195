import pytest
from slugify import slugify


def test_basic_lowercase_and_separator():
    assert slugify("Hello World") == "hello-world"
    assert slugify("Hello World", lowercase=False) == "Hello-World"
    assert slugify("Hello World", separator="_") == "hello_world"
    assert slugify("a b c", separator="--") == "a--b--c"


def test_accents_are_stripped_not_dropped():
    assert slugify("Crème Brûlée") == "creme-brulee"
    assert slugify("naïve café") == "naive-cafe"
    assert slugify("Ångström", lowercase=False) == "Angstrom"
    assert slugify("Straße") == "strae"
    assert slugify("日本 abc") == "abc"


def test_apostrophes_are_removed():
    assert slugify("Don't stop") == "dont-stop"
    assert slugify("it\u2019s here") == "its-here"


def test_runs_collapse_and_ends_are_stripped():
    assert slugify("  Hello,   World!  ") == "hello-world"
    assert slugify("a -- b__c") == "a-b-c"
    assert slugify("--x--") == "x"
    assert slugify("!!!a") == "a"
    assert slugify("***") == ""
    assert slugify("") == ""
    assert slugify("  a  b  ", separator="+") == "a+b"


def test_max_length_drops_whole_words():
    assert slugify("hello-big-world", max_length=10) == "hello-big"
    assert slugify("hello world", max_length=8) == "hello"
    assert slugify("hello world", max_length=11) == "hello-world"
    assert slugify("hello world", max_length=100) == "hello-world"
    assert slugify("ab cd", separator="--", max_length=5) == "ab"
    assert slugify("ab cd", separator="--", max_length=6) == "ab--cd"


def test_max_length_cuts_a_long_first_word():
    assert slugify("supercalifragilistic", max_length=5) == "super"
    assert slugify("supercalifragilistic word", max_length=3) == "sup"
    assert slugify("a b", max_length=1) == "a"
    assert slugify("***", max_length=3) == ""


def test_errors():
    with pytest.raises(TypeError):
        slugify(None)
    with pytest.raises(TypeError):
        slugify(b"bytes")
    with pytest.raises(ValueError):
        slugify("x", separator="")
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError):
            slugify("x", max_length=bad)
