"""Data model: items and money (prices are kept as integer cents)."""

from dataclasses import dataclass
from decimal import Decimal, InvalidOperation


class InventoryError(Exception):
    """A user error: the CLI prints it as `error: <message>` and exits with status 1."""


@dataclass
class Item:
    sku: str
    name: str
    price_cents: int
    quantity: int = 0

    def value_cents(self):
        return self.price_cents * self.quantity


def parse_price(text):
    """'12.05' -> 1205. At most two decimals, not negative."""
    try:
        amount = Decimal(text)
    except InvalidOperation:
        raise InventoryError(f"bad price {text!r}: write it like 12.05") from None
    if not amount.is_finite() or amount < 0 or amount.as_tuple().exponent < -2:
        raise InventoryError(f"bad price {text!r}: a non-negative amount with at most two decimals")
    return int(amount * 100)


def format_price(cents):
    """1205 -> '12.05'."""
    return f"{cents // 100}.{cents % 100:02d}"
