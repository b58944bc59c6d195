import pytest
from mdtable import parse_table, render_table


def test_example_from_spec():
    got = render_table([{"name": "ab", "n": 5}, {"name": "c|d", "n": None}], align="lr")
    assert got == "| name |   n |\n| :--- | --: |\n| ab   |   5 |\n| c\\|d |     |\n"


def test_default_columns_order_and_missing():
    rows = [{"b": 1, "a": 2}, {"c": 3, "a": 4}]
    assert render_table(rows) == (
        "| b   | a   | c   |\n| --- | --- | --- |\n| 1   | 2   |     |\n|     | 4   | 3   |\n"
    )


def test_explicit_columns_headers_and_center():
    rows = [{"id": 7, "title": "x", "extra": "ignored"}, {"id": 12345, "title": "longer"}]
    got = render_table(rows, columns=["title", "id"], align="cc", headers={"id": "ID"})
    assert got == ("| title  |  ID   |\n| :----: | :---: |\n|   x    |   7   |\n| longer | 12345 |\n")


def test_center_odd_gap_extra_space_right():
    got = render_table([{"k": "ab"}, {"k": "abcde"}], align="c")
    assert got == "|   k   |\n| :---: |\n|  ab   |\n| abcde |\n"


def test_bool_float_precision_and_newlines():
    rows = [{"ok": True, "x": 1.5, "note": "a\nb"}, {"ok": False, "x": 2.0, "note": "c\r\nd\re"}]
    assert render_table(rows) == (
        "| ok    | x   | note        |\n"
        "| ----- | --- | ----------- |\n"
        "| true  | 1.5 | a<br>b      |\n"
        "| false | 2.0 | c<br>d<br>e |\n"
    )
    assert render_table(rows, columns=["x"], precision=2, align="r") == ("|    x |\n| ---: |\n| 1.50 |\n| 2.00 |\n")


def test_no_rows_with_columns_and_errors():
    assert render_table([], columns=["a", "bb"], align="-l") == "| a   | bb  |\n| --- | :-- |\n"
    with pytest.raises(ValueError):
        render_table([])
    with pytest.raises(ValueError):
        render_table([{"a": 1}], align="lr")
    with pytest.raises(ValueError):
        render_table([{"a": 1}], align="x")
    with pytest.raises(TypeError):
        render_table([{"a": 1}, ["a", 1]])
    with pytest.raises(TypeError):
        render_table({"a": 1})


def test_escaped_pipes_in_header():
    got = render_table([{"a|b": "|"}])
    assert got == "| a\\|b |\n| ---- |\n| \\|   |\n"


def test_parse_basic():
    text = "\n\n  | name | n |  \n|:--|--:|\n| ab | 5 |\n|c\\|d|   |\n\n"
    assert parse_table(text) == [{"name": "ab", "n": "5"}, {"name": "c|d", "n": ""}]


def test_parse_roundtrip():
    rows = [{"a": "x|y", "b": "line1\nline2", "c": None}, {"a": "", "b": "  pad", "c": "z"}]
    back = parse_table(render_table(rows, align="lcr"))
    assert back == [{"a": "x|y", "b": "line1\nline2", "c": ""}, {"a": "", "b": "pad", "c": "z"}]


def test_parse_errors_name_the_line():
    with pytest.raises(ValueError, match="line 3"):
        parse_table("| a | b |\n| - | - |\n| 1 | 2 | 3 |\n")
    with pytest.raises(ValueError, match="line 2"):
        parse_table("| a | b |\n| x | - |\n")
    with pytest.raises(ValueError, match="line 4"):
        parse_table("\n| a |\n| - |\n| 1\n")
    with pytest.raises(ValueError, match="line 1"):
        parse_table("| a |\n")
