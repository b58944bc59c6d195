"""Money values: Decimals with exactly two decimal places."""

from decimal import ROUND_HALF_UP, Decimal  # noqa: F401

CENT = Decimal("0.01")


def to_money(x):
    """Convert an int, str, Decimal or float to a Decimal rounded half-up to cents.

    Floats are converted through their shortest repr, so 1.005 is Decimal("1.005") -> Decimal("1.01").
    Raises TypeError for other types (bool included) and ValueError for unparsable strings.
    """
    if isinstance(x, bool) or not isinstance(x, (int, str, Decimal, float)):
        raise TypeError(f"cannot use {type(x).__name__} as money; pass int, str, Decimal or float")
    try:
        d = Decimal(x)
    except ArithmeticError:
        raise ValueError(f"not a money amount: {x!r}") from None
    return d.quantize(CENT)
