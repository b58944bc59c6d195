"""calc's errors: each knows the offset in the text where the problem is."""


class CalcError(Exception):
    """Base class of every calc error; has `.pos` (0-based offset into the text) and `.message`."""

    def __init__(self, message, pos):
        super().__init__(f"{message} at position {pos}")
        self.message = message
        self.pos = pos


class TokenizeError(CalcError):
    pass


class ParseError(CalcError):
    pass


class EvalError(CalcError):
    pass
