"""Recursive-descent parser producing a small tree of nodes."""

from calc.errors import ParseError
from calc.nodes import BinOp, Expression, Name, Num, Unary
from calc.tokens import tokenize


class _Parser:
    def __init__(self, text):
        self.tokens = tokenize(text)
        self.i = 0

    @property
    def tok(self):
        return self.tokens[self.i]

    def take(self):
        tok = self.tokens[self.i]
        self.i += 1
        return tok

    def fail(self, what):
        tok = self.tok
        found = "end of input" if tok.kind == "EOF" else repr(tok.text)
        raise ParseError(f"expected {what}, found {found}", tok.pos)

    def is_op(self, *ops):
        return self.tok.kind == "OP" and self.tok.text in ops

    def expr(self):
        node = self.term()
        while self.is_op("+", "-"):
            op = self.take()
            node = BinOp(op.text, op.pos, node, self.term())
        return node

    def term(self):
        node = self.unary()
        while self.is_op("*", "/", "//", "%"):
            op = self.take()
            node = BinOp(op.text, op.pos, node, self.unary())
        return node

    def unary(self):
        if self.is_op("+", "-"):
            op = self.take()
            return Unary(op.text, op.pos, self.unary())
        return self.power()

    def power(self):
        node = self.atom()
        if self.is_op("**"):
            op = self.take()
            node = BinOp("**", op.pos, node, self.unary())
        return node

    def atom(self):
        tok = self.tok
        if tok.kind == "NUMBER":
            self.take()
            is_float = any(c in tok.text for c in ".eE")
            return Num(float(tok.text) if is_float else int(tok.text), tok.pos)
        if tok.kind == "NAME":
            self.take()
            return Name(tok.text, tok.pos)
        if tok.kind == "LPAREN":
            self.take()
            node = self.expr()
            if self.tok.kind != "RPAREN":
                self.fail("')'")
            self.take()
            return node
        self.fail("a number, a name or '('")


def parse(text):
    p = _Parser(text)
    node = p.expr()
    if p.tok.kind != "EOF":
        p.fail("an operator or end of input")
    return Expression(text, node)
