"""Expression tree nodes and their evaluation."""

from dataclasses import dataclass

from calc.errors import EvalError

MAX_INT_EXPONENT = 10000


@dataclass(frozen=True)
class Num:
    value: object
    pos: int

    def eval(self, env):
        return self.value


@dataclass(frozen=True)
class Name:
    name: str
    pos: int

    def eval(self, env):
        if self.name not in env:
            raise EvalError(f"unknown variable {self.name!r}", self.pos)
        return env[self.name]


@dataclass(frozen=True)
class Unary:
    op: str
    pos: int
    operand: object

    def eval(self, env):
        value = self.operand.eval(env)
        return -value if self.op == "-" else +value


def _power(a, b, pos):
    if isinstance(a, int) and isinstance(b, int) and b > MAX_INT_EXPONENT:
        raise EvalError(f"exponent too large (> {MAX_INT_EXPONENT})", pos)
    try:
        result = a**b
    except ZeroDivisionError:
        raise EvalError("zero to a negative power", pos) from None
    except OverflowError:
        raise EvalError("result too large", pos) from None
    if isinstance(result, complex):
        raise EvalError("result is not a real number", pos)
    return result


@dataclass(frozen=True)
class BinOp:
    op: str
    pos: int
    left: object
    right: object

    def eval(self, env):
        a, b = self.left.eval(env), self.right.eval(env)
        if self.op == "**":
            return _power(a, b, self.pos)
        if self.op in ("/", "//", "%") and b == 0:
            raise EvalError("division by zero", self.pos)
        try:
            if self.op == "+":
                return a + b
            if self.op == "-":
                return a - b
            if self.op == "*":
                return a * b
            if self.op == "/":
                return a / b
            if self.op == "//":
                return a // b
            return a % b
        except OverflowError:
            raise EvalError("result too large", self.pos) from None


class Expression:
    """A parsed expression; evaluate it any number of times."""

    def __init__(self, text, node):
        self.text = text
        self.node = node

    def evaluate(self, variables=None):
        return self.node.eval(dict(variables or {}))

    def __repr__(self):
        return f"Expression({self.text!r})"
