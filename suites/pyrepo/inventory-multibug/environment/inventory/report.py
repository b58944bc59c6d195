"""The stock report."""

from inventory.models import format_price


def discounted(cents, pct):
    """The price after a discount of `pct` percent, rounded down to a cent."""
    return cents * (100 - pct) // 100


def stock_report(store, discount_pct=0):
    """The report text: one line per item (by SKU), then a TOTAL line; see README.md."""
    if not 0 <= discount_pct <= 100:
        raise ValueError(f"discount must be within 0..100, got {discount_pct}")
    lines = []
    total_qty = total_value = 0
    for item in store.items():
        if discount_pct:
            item.price_cents = discounted(item.price_cents, discount_pct)
        value = item.value_cents()
        lines.append(
            f"{item.sku} | {item.name} | {item.quantity} | {format_price(item.price_cents)} | {format_price(value)}"
        )
        total_qty += item.quantity
        total_value += value
    lines.append(f"TOTAL | {total_qty} | {format_price(total_value)}")
    return "\n".join(lines)
