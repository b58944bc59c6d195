import random

import pytest
from semver import Version, compare

CHAIN = [
    "1.0.0-alpha",
    "1.0.0-alpha.1",
    "1.0.0-alpha.beta",
    "1.0.0-beta",
    "1.0.0-beta.2",
    "1.0.0-beta.11",
    "1.0.0-rc.1",
    "1.0.0",
    "1.0.1",
    "1.9.0",
    "1.10.0",
    "2.0.0",
    "10.0.0",
]


def test_parse_fields():
    v = Version.parse("1.0.0-alpha.1+exp.sha.5114f85")
    assert (v.major, v.minor, v.patch) == (1, 0, 0)
    assert v.prerelease == ("alpha", 1)
    assert v.build == ("exp", "sha", "5114f85")
    w = Version.parse("0.0.0")
    assert (w.major, w.minor, w.patch, w.prerelease, w.build) == (0, 0, 0, (), ())
    assert Version.parse("1.2.3-0a.0.x-y+001").prerelease == ("0a", 0, "x-y")


@pytest.mark.parametrize(
    "bad",
    [
        ["1.2", "1.2.3.4", "1", "", "1..3", "a.b.c"],
        ["01.2.3", "1.02.3", "1.2.03", "1.2.3-01", "1.2.3-alpha.007"],
        ["1.2.3-", "1.2.3+", "1.2.3-a..b", "1.2.3+a..b", "1.2.3-a_b", "1.2.3+a+b"],
        ["v1.2.3", " 1.2.3", "1.2.3 ", "-1.2.3", "1.2.3\n"],
    ],
    ids=["shape", "leading-zeros", "identifiers", "decoration"],
)
def test_parse_rejects(bad):
    for text in bad:
        with pytest.raises(ValueError):
            Version.parse(text)


def test_str_round_trip():
    for text in CHAIN + ["1.0.0+20130313144700", "1.0.0-beta+exp.sha.5114f85", "0.1.2-x.7.z.92+001", "1.2.3--"]:
        assert str(Version.parse(text)) == text


def test_precedence_chain():
    versions = [Version.parse(t) for t in CHAIN]
    for a, b in zip(versions, versions[1:]):
        assert a < b and b > a and a <= b and a != b and not a >= b
    shuffled = versions[:]
    random.Random(3).shuffle(shuffled)
    assert [str(v) for v in sorted(shuffled)] == CHAIN


def test_identifier_rules():
    p = Version.parse
    assert p("1.0.0-rc.9") < p("1.0.0-rc.10")
    assert p("1.0.0-2") < p("1.0.0-10")
    assert p("1.0.0-999") < p("1.0.0-a")
    assert p("1.0.0-Z") < p("1.0.0-a")
    assert p("1.0.0-alpha.2") < p("1.0.0-alpha.a")
    assert p("1.0.0-a.b") < p("1.0.0-a.b.0")
    assert p("1.0.0-10a") < p("1.0.0-9b")


def test_build_metadata_ignored_for_precedence():
    a, b = Version.parse("1.0.0+a"), Version.parse("1.0.0+b")
    assert a == b and hash(a) == hash(b) and not a < b and not b < a
    assert str(a) == "1.0.0+a"
    assert len({a, b, Version.parse("1.0.0")}) == 1
    assert Version.parse("1.0.0-rc.1+zzz") < Version.parse("1.0.0+aaa")


def test_comparison_with_other_types():
    v = Version.parse("1.0.0")
    assert (v == "1.0.0") is False
    assert v != "1.0.0"
    with pytest.raises(TypeError):
        v < "2.0.0"  # noqa: B015


def test_constructor_and_immutability():
    v = Version(1, 2, 3, ["rc", "1"], ["b", "007"])
    assert v.prerelease == ("rc", 1) and v.build == ("b", "007")
    assert str(v) == "1.2.3-rc.1+b.007"
    assert str(Version(4)) == "4.0.0"
    with pytest.raises(AttributeError):
        v.major = 2
    for args in [(-1, 0, 0), (1, 0, 0, ["01"]), (1, 0, 0, [""]), (1, 0, 0, (), ["a b"]), (1, 0, 0, ["a.b"])]:
        with pytest.raises(ValueError):
            Version(*args)
    for args in [(1.0, 0, 0), (True, 0, 0), ("1", 0, 0)]:
        with pytest.raises((TypeError, ValueError)):
            Version(*args)


def test_bump_release():
    v = Version.parse("1.2.3+build.9")
    assert str(v.bump_major()) == "2.0.0"
    assert str(v.bump_minor()) == "1.3.0"
    assert str(v.bump_patch()) == "1.2.4"
    assert str(v) == "1.2.3+build.9"  # unchanged


def test_bump_prerelease_to_release():
    p = Version.parse
    assert str(p("2.0.0-rc.1").bump_major()) == "2.0.0"
    assert str(p("2.1.0-rc.1").bump_major()) == "3.0.0"
    assert str(p("1.3.0-beta").bump_minor()) == "1.3.0"
    assert str(p("1.3.1-beta").bump_minor()) == "1.4.0"
    assert str(p("1.2.4-rc.2+b").bump_patch()) == "1.2.4"


def test_bump_prerelease():
    p = Version.parse
    assert str(p("1.2.3").bump_prerelease()) == "1.2.4-rc.1"
    assert str(p("1.2.3+b").bump_prerelease("alpha.x")) == "1.2.4-alpha.x.1"
    assert str(p("1.0.0-alpha.beta.3").bump_prerelease()) == "1.0.0-alpha.beta.4"
    assert str(p("1.0.0-alpha").bump_prerelease()) == "1.0.0-alpha.1"
    assert str(p("1.0.0-rc.9").bump_prerelease("beta")) == "1.0.0-rc.10"
    with pytest.raises(ValueError):
        p("1.0.0").bump_prerelease("bad..label")


def test_compare_function():
    assert compare("1.0.0", "2.0.0") == -1
    assert compare("2.0.0", "1.0.0") == 1
    assert compare("1.0.0+x", "1.0.0+y") == 0
    assert compare("1.0.0-alpha", "1.0.0") == -1
    with pytest.raises(ValueError):
        compare("1.0", "1.0.0")
