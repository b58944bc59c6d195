"""calc: tokenizer, recursive-descent parser and evaluator for arithmetic expressions."""

from calc.errors import CalcError, EvalError, ParseError, TokenizeError
from calc.parser import parse
from calc.tokens import Token, tokenize


def evaluate(text, variables=None):
    return parse(text).evaluate(variables)


__all__ = ["CalcError", "EvalError", "ParseError", "Token", "TokenizeError", "evaluate", "parse", "tokenize"]
