import pytest
from csvlite import CSVError, format_row, parse, write_rows


def test_quotes_are_doubled_inside_quoted_fields():
    assert format_row(["a,b", 'say "hi"']) == '"a,b","say ""hi"""'
    assert format_row(['"']) == '""""'


def test_newlines_force_quoting():
    assert format_row(["line1\nline2", "x"]) == '"line1\nline2",x'
    assert format_row(["a\r\nb"]) == '"a\r\nb"'


def test_custom_delimiter_is_what_gets_quoted():
    assert format_row(["a;b", "c,d", "e"], delimiter=";") == '"a;b";c,d;e'
    assert format_row(["x\ty", "z"], delimiter="\t") == '"x\ty"\tz'


def test_none_is_empty_and_values_are_str():
    assert format_row([None, 1, 2.5, "", "a,"]) == ',1,2.5,,"a,"'


def test_single_empty_field_and_empty_row():
    assert write_rows([[""], ["a"], [None]]) == '""\na\n""\n'
    with pytest.raises(ValueError):
        write_rows([[]])


def test_parse_quoted_newlines():
    assert parse('"a\nb",c\nd,e\n') == [["a\nb", "c"], ["d", "e"]]
    assert parse('"x\r\ny",z\r\nw\r\n') == [["x\r\ny", "z"], ["w"]]


def test_parse_does_not_split_on_other_line_breaks():
    assert parse("a\u2028b,c\x0cd\n") == [["a\u2028b", "c\x0cd"]]
    assert parse("a\rb,c") == [["a\rb", "c"]]


def test_parse_errors():
    with pytest.raises(CSVError):
        parse('"abc\n')
    with pytest.raises(CSVError):
        parse('"ab"c,d\n')
    with pytest.raises(ValueError):
        parse('x,"a""\n')
    assert parse('"ab",c\n"",""\n') == [["ab", "c"], ["", ""]]


ROWS = [
    ["plain", "with,comma", 'with "quotes"', ""],
    ["multi\nline", "cr\ronly", "crlf\r\nend", '"'],
    [""],
    ["", ""],
    ["tab\there", "semi;colon", ",", '""'],
    ["trailing,", " spaced ", "\u00e9\u2028x"],
]


def test_round_trip_default_delimiter():
    text = write_rows(ROWS)
    assert parse(text) == ROWS
    assert text.endswith("\n") and text.count('"') % 2 == 0


@pytest.mark.parametrize("delimiter", [";", "\t", "|"])
def test_round_trip_other_delimiters(delimiter):
    assert parse(write_rows(ROWS, delimiter), delimiter) == ROWS
