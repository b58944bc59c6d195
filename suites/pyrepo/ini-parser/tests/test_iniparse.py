import pytest
from iniparse import (
    InterpolationCycleError,
    InterpolationError,
    NoOptionError,
    NoSectionError,
    ParseError,
    parse,
)

SAMPLE = """\
; global settings
[DEFAULT]
home = /srv
Debug = off

[server]
Host = example.org   ; inline comment
port: 8080
url = http://${host}:${port}/#top
root = ${home}/www
price = $$5 and $x
modules = auth, cache,
    metrics
    ; a comment inside a continuation
    logging  # trailing comment

[client]
server_url = ${server:url}
debug = YES
ratio = 0.25
"""


def test_sections_and_options_order():
    cfg = parse(SAMPLE)
    assert cfg.sections() == ["server", "client"]
    assert cfg.has_section("server") and not cfg.has_section("DEFAULT") and not cfg.has_section("Server")
    assert cfg.options("server") == ["host", "port", "url", "root", "price", "modules", "home", "debug"]
    assert cfg.options("client") == ["server_url", "debug", "ratio", "home"]


def test_values_comments_and_case():
    cfg = parse(SAMPLE)
    assert cfg.get("server", "HOST") == "example.org"
    assert cfg.get("server", "port") == "8080"
    assert cfg.get("server", "debug") == "off"


def test_continuation_lines():
    cfg = parse(SAMPLE)
    assert cfg.get("server", "modules", raw=True) == "auth, cache,\nmetrics\nlogging"
    assert cfg.getlist("server", "modules") == ["auth", "cache", "metrics", "logging"]


def test_interpolation_same_section_default_and_other_section():
    cfg = parse(SAMPLE)
    assert cfg.get("server", "url") == "http://example.org:8080/#top"
    assert cfg.get("server", "root") == "/srv/www"
    assert cfg.get("client", "server_url") == "http://example.org:8080/#top"
    assert cfg.get("server", "url", raw=True) == "http://${host}:${port}/#top"


def test_dollar_escapes():
    cfg = parse(SAMPLE)
    assert cfg.get("server", "price") == "$5 and $x"
    assert cfg.get("server", "price", raw=True) == "$$5 and $x"


def test_typed_getters():
    cfg = parse(SAMPLE)
    assert cfg.getint("server", "port") == 8080
    assert cfg.getfloat("client", "ratio") == 0.25
    assert cfg.getbool("client", "debug") is True
    assert cfg.getbool("server", "debug") is False
    with pytest.raises(ValueError, match="host"):
        cfg.getint("server", "host")
    with pytest.raises(ValueError):
        cfg.getbool("server", "host")


def test_getlist_custom_sep():
    cfg = parse("[a]\npath = /bin:/usr/bin: :/opt\nempty =\n")
    assert cfg.getlist("a", "path", sep=":") == ["/bin", "/usr/bin", "/opt"]
    assert cfg.getlist("a", "empty") == []
    assert cfg.get("a", "empty") == ""


def test_missing_and_fallback():
    cfg = parse(SAMPLE)
    with pytest.raises(NoSectionError):
        cfg.get("nope", "x")
    with pytest.raises(NoOptionError):
        cfg.get("server", "nope")
    with pytest.raises(KeyError):
        cfg.get("server", "nope")
    sentinel = object()
    assert cfg.get("server", "nope", fallback=sentinel) is sentinel
    assert cfg.get("nope", "x", fallback=None) is None
    assert cfg.getint("server", "nope", fallback=3) == 3
    assert cfg.getbool("server", "nope", fallback="maybe") == "maybe"
    assert cfg.getlist("server", "nope", fallback=None) is None


def test_as_dict():
    cfg = parse("[DEFAULT]\nb = 2\n[x]\na = ${b}${b}\n[y]\nb = 3\nc = ${x:a}\n")
    assert cfg.as_dict() == {"x": {"a": "22", "b": "2"}, "y": {"b": "3", "c": "22"}}


def test_interpolation_missing_reference():
    cfg = parse("[a]\nx = ${nope}\ny = ${zz:x}\nz = ${a:x\n")
    with pytest.raises(InterpolationError, match="nope"):
        cfg.get("a", "x")
    with pytest.raises(InterpolationError, match="zz:x"):
        cfg.get("a", "y")
    with pytest.raises(InterpolationError):
        cfg.get("a", "z")
    assert cfg.get("a", "x", raw=True) == "${nope}"


def test_interpolation_cycle_chain():
    cfg = parse("[a]\nx = ${y}\ny = ${b:z}\nstart = ${x}\n[b]\nz = pre ${a:x}\n")
    with pytest.raises(InterpolationCycleError) as ei:
        cfg.get("a", "start")
    assert ei.value.chain == ["a:x", "a:y", "b:z", "a:x"]
    assert isinstance(ei.value, InterpolationError) and isinstance(ei.value, ValueError)
    self_ref = parse("[s]\nk = ${K}\n")
    with pytest.raises(InterpolationCycleError) as ei:
        self_ref.get("s", "k")
    assert ei.value.chain == ["s:k", "s:k"]


def test_interpolation_cycle_through_default():
    cfg = parse("[DEFAULT]\nd = ${e}\n[s]\ne = ${d}\n")
    with pytest.raises(InterpolationCycleError) as ei:
        cfg.get("s", "e")
    assert ei.value.chain == ["s:e", "s:d", "s:e"]


def _err(text):
    with pytest.raises(ParseError) as ei:
        parse(text)
    return ei.value


def test_parse_errors_have_line_numbers():
    e = _err("[a]\nx = 1\n\n  indented after blank\n")
    assert e.lineno == 4 and e.line == "  indented after blank" and str(e).startswith("line 4: ")
    e = _err("x = 1\n[a]\n")
    assert e.lineno == 1
    e = _err("[a]\nx = 1\njust words\n")
    assert e.lineno == 3 and isinstance(e, ValueError)


def test_parse_errors_sections_and_duplicates():
    assert _err("[a]\n[b]\n[a]\n").lineno == 3
    assert _err("[a]\nk=1\nK = 2\n").lineno == 3
    assert _err("[]\n").lineno == 1
    assert _err("[a:b]\n").lineno == 1
    assert _err("\n[a\n").lineno == 2
    assert _err("[a]\n= value\n").lineno == 2
    assert _err("[a]\n  cont\n").lineno == 2


def test_crlf_and_comment_inside_continuation():
    cfg = parse("[a]\r\nk = 1\r\n# note\r\n\tmore ; c\r\n")
    assert cfg.get("a", "k") == "1\nmore"
    assert parse("[a]\nk =;x\n").get("a", "k") == ";x"
