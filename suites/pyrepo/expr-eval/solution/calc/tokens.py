"""The tokenizer."""

import re
from dataclasses import dataclass

from calc.errors import TokenizeError

_EXP = r"(?:[eE][+-]?\d+)"
_SPEC = [
    ("NUMBER", rf"(?:\d+\.\d*|\.\d+){_EXP}?|\d+{_EXP}?"),
    ("NAME", r"[A-Za-z_][A-Za-z0-9_]*"),
    ("OP", r"\*\*|//|[+\-*/%]"),
    ("LPAREN", r"\("),
    ("RPAREN", r"\)"),
    ("SPACE", r"\s+"),
]
_TOKEN = re.compile("|".join(f"(?P<{kind}>{pattern})" for kind, pattern in _SPEC))


@dataclass(frozen=True)
class Token:
    kind: str
    text: str
    pos: int


def tokenize(text):
    tokens, pos = [], 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            raise TokenizeError(f"unexpected character {text[pos]!r}", pos)
        if m.lastgroup != "SPACE":
            tokens.append(Token(m.lastgroup, m.group(), pos))
        pos = m.end()
    tokens.append(Token("EOF", "", len(text)))
    return tokens
