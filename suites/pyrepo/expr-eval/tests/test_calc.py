import pytest
from calc import CalcError, EvalError, ParseError, TokenizeError, evaluate, parse, tokenize


def toks(text):
    return [(t.kind, t.text, t.pos) for t in tokenize(text)]


def err(text, variables=None):
    with pytest.raises(CalcError) as info:
        evaluate(text, variables)
    return type(info.value), info.value.pos


def test_tokenize_kinds_and_positions():
    assert toks("x1 ** (2 // _y)\t% 3") == [
        ("NAME", "x1", 0),
        ("OP", "**", 3),
        ("LPAREN", "(", 6),
        ("NUMBER", "2", 7),
        ("OP", "//", 9),
        ("NAME", "_y", 12),
        ("RPAREN", ")", 14),
        ("OP", "%", 16),
        ("NUMBER", "3", 18),
        ("EOF", "", 19),
    ]
    assert toks("") == [("EOF", "", 0)]


def test_tokenize_number_forms():
    texts = [t.text for t in tokenize("12 2. .5 1.25 1e3 1.5E-3 7e+2 .5e1") if t.kind == "NUMBER"]
    assert texts == ["12", "2.", ".5", "1.25", "1e3", "1.5E-3", "7e+2", ".5e1"]
    assert toks("3*-4") == [("NUMBER", "3", 0), ("OP", "*", 1), ("OP", "-", 2), ("NUMBER", "4", 3), ("EOF", "", 4)]


def test_tokenize_errors():
    for text, pos in [("2 $ 3", 2), ("a @", 2), ("1 + 2;", 5), ("é", 0)]:
        with pytest.raises(TokenizeError) as info:
            tokenize(text)
        assert info.value.pos == pos
    assert err("1 + #") == (TokenizeError, 4)


def test_precedence_and_associativity():
    cases = {
        "1 + 2 * 3": 7,
        "(1 + 2) * 3": 9,
        "10 - 4 - 3": 3,
        "100 / 10 / 5": 2.0,
        "2 * 3 % 4": 2,
        "1 - 2 + 3": 2,
        "2 + 3 * 4 ** 2 - 1": 49,
    }
    for text, value in cases.items():
        assert evaluate(text) == value, text


def test_power_and_unary():
    cases = {
        "2 ** 3 ** 2": 512,
        "(2 ** 3) ** 2": 64,
        "-2 ** 2": -4,
        "(-2) ** 2": 4,
        "2 ** -1": 0.5,
        "--3": 3,
        "-+-3": 3,
        "+4": 4,
        "2 * -3": -6,
        "-2 ** -2 ** -1": -(2 ** (-(2**-1))),
    }
    for text, value in cases.items():
        assert evaluate(text) == value, text


def test_python_number_semantics():
    assert evaluate("7 / 2") == 3.5
    assert type(evaluate("6 / 3")) is float
    assert evaluate("7 // 2") == 3 and type(evaluate("7 // 2")) is int
    assert evaluate("-7 // 2") == -4
    assert evaluate("-7 % 3") == 2
    assert evaluate("7.5 // 2") == 3.0
    assert type(evaluate("2 ** 10")) is int and type(evaluate("2 ** -2")) is float
    assert type(evaluate("1e3")) is float and type(evaluate("2.")) is float and type(evaluate("12")) is int
    assert evaluate("2 ** 100") == 2**100


def test_variables():
    env = {"x": 2, "y": 2.5, "long_name_2": 10, "_": -1}
    assert evaluate("x * y - 1", env) == 4.0
    assert evaluate("long_name_2 // x + _", env) == 4
    assert evaluate("-x ** 2", env) == -4
    assert evaluate("1 + 2") == 3


def test_unknown_variable():
    assert err("1 + foo", {"fo": 1}) == (EvalError, 4)
    assert err("x") == (EvalError, 0)


def test_division_by_zero_positions():
    assert err("1 + 2 / (3 - 3)") == (EvalError, 6)
    assert err("5 % 0") == (EvalError, 2)
    assert err("5 // 0.0") == (EvalError, 2)
    assert err("0 ** -1") == (EvalError, 2)
    assert err("x / y", {"x": 1, "y": 0}) == (EvalError, 2)


def test_power_errors():
    assert err("(0 - 8) ** 0.5") == (EvalError, 8)
    assert err("10.0 ** 1000") == (EvalError, 5)
    assert err("2 ** 100000") == (EvalError, 2)
    assert evaluate("2 ** 10000") == 2**10000


@pytest.mark.parametrize(
    "text,pos",
    [("", 0), ("1 +", 3), ("1 2", 2), ("(1 + 2", 6), ("1 + * 2", 4), ("1 + ()", 5), (")", 0), ("2 ** ", 5)],
)
def test_parse_errors(text, pos):
    with pytest.raises(ParseError) as info:
        parse(text)
    assert info.value.pos == pos
    assert isinstance(info.value, CalcError)


def test_error_messages():
    with pytest.raises(ParseError) as info:
        evaluate("(1 + 2")
    e = info.value
    assert isinstance(e.message, str) and e.message
    assert str(e) == f"{e.message} at position 6"
    with pytest.raises(EvalError) as info:
        evaluate("a + b", {"a": 1})
    assert str(info.value).endswith(" at position 4")
    assert issubclass(EvalError, CalcError) and issubclass(CalcError, Exception)


def test_parse_does_not_evaluate_and_can_be_reused():
    assert parse("1 / 0") is not None
    e = parse("x * 2 + unknown_later")
    assert e.evaluate({"x": 3, "unknown_later": 1}) == 7
    assert e.evaluate({"x": 1.5, "unknown_later": 0}) == 3.0
    with pytest.raises(EvalError):
        e.evaluate({"x": 1})


def test_nesting_and_long_chains():
    assert evaluate("(" * 50 + "1" + ")" * 50) == 1
    assert evaluate(" + ".join(["1"] * 300)) == 300
    assert evaluate("\n 1\t+\n2 ") == 3
