"""Shared helpers."""

import datetime
import re

_SLUG = re.compile(r"[^a-z0-9]+")


def normalize_amount(text):
    """Parse a money string into integer cents.

    Accepts an optional '$', thousands separators ',', a leading '-' or accounting parentheses for
    negatives, and up to two decimals: '$1,234.5' -> 123450, '(3.20)' -> -320, '-7' -> -700.
    Raises ValueError for anything else.
    """
    s = str(text).strip().replace("$", "").replace(",", "")
    neg = False
    if s.startswith("(") and s.endswith(")"):
        neg, s = True, s[1:-1].strip()
    if s.startswith("-"):
        neg, s = not neg, s[1:]
    whole, dot, frac = s.partition(".")
    if not (whole or frac) or (whole and not whole.isdigit()) or (frac and not frac.isdigit()):
        raise ValueError(f"not a money amount: {text!r}")
    if len(frac) > 2:
        raise ValueError(f"more than two decimals: {text!r}")
    cents = int(whole or "0") * 100 + int(frac.zfill(2) if frac else "0")
    return -cents if neg else cents


def format_cents(cents):
    """123450 -> '$1,234.50'; -320 -> '-$3.20'."""
    sign = "-" if cents < 0 else ""
    whole, frac = divmod(abs(cents), 100)
    return f"{sign}${whole:,}.{frac:02d}"


def parse_date(text):
    """'2024-03-05' or '03/05/2024' (month/day/year) -> datetime.date."""
    text = text.strip()
    if "/" in text:
        m, d, y = text.split("/")
        return datetime.date(int(y), int(m), int(d))
    return datetime.date.fromisoformat(text)


def slugify(text):
    """'Office Supplies & Co.' -> 'office-supplies-co'."""
    return _SLUG.sub("-", text.lower()).strip("-")
