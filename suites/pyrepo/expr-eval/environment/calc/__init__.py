"""calc: tokenizer, recursive-descent parser and evaluator for arithmetic expressions.

See the task instruction for the specification. Split the work into modules as you see fit; these names
must be importable from `calc`.
"""


class CalcError(Exception):
    """Base class of every calc error; has `.pos` (0-based offset into the text) and `.message`."""


class TokenizeError(CalcError):
    pass


class ParseError(CalcError):
    pass


class EvalError(CalcError):
    pass


def tokenize(text):
    raise NotImplementedError


def parse(text):
    raise NotImplementedError


def evaluate(text, variables=None):
    raise NotImplementedError
