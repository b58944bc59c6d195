"""Invoices."""

from legacy.util import format_cents, normalize_amount


def line_total(qty, unit_price):
    """Cents for `qty` units at `unit_price` (a money string like '$9.5')."""
    if qty < 0:
        raise ValueError(f"quantity must be >= 0, got {qty}")
    return qty * normalize_amount(unit_price)


def invoice_total(lines, tax_rate_percent=0, discount=None):
    """Totals for invoice lines [(description, qty, unit_price), ...].

    discount: None or a money string subtracted from the subtotal (never below zero).
    Tax is tax_rate_percent of the discounted subtotal, rounded half-up to the cent.
    Returns a dict with integer cents: subtotal, discount, tax, total.
    """
    subtotal = sum(line_total(q, p) for _, q, p in lines)
    disc = min(normalize_amount(discount), subtotal) if discount else 0
    base = subtotal - disc
    tax = (base * tax_rate_percent * 2 + 100) // 200  # half-up for base >= 0
    return {"subtotal": subtotal, "discount": disc, "tax": tax, "total": base + tax}


def render_invoice(customer, lines, tax_rate_percent=0, discount=None):
    """Plain-text invoice."""
    t = invoice_total(lines, tax_rate_percent, discount)
    out = [f"Invoice for {customer}"]
    for desc, q, p in lines:
        out.append(
            f"  {desc:<20} {q:>3} x {format_cents(normalize_amount(p)):>10} = {format_cents(line_total(q, p)):>10}"
        )
    out.append(f"  {'Subtotal':<37} {format_cents(t['subtotal']):>10}")
    if t["discount"]:
        out.append(f"  {'Discount':<37} {format_cents(-t['discount']):>10}")
    out.append(f"  {'Tax':<37} {format_cents(t['tax']):>10}")
    out.append(f"  {'Total':<37} {format_cents(t['total']):>10}")
    return "\n".join(out) + "\n"
