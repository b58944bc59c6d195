"""The old tests (they pass)."""

from legacy.billing import invoice_total
from legacy.parse import parse_transactions
from legacy.util import format_cents, normalize_amount


def test_normalize_amount():
    assert normalize_amount("$1,234.56") == 123456
    assert normalize_amount("(3.20)") == -320
    assert normalize_amount("-7") == -700


def test_format_cents():
    assert format_cents(123450) == "$1,234.50"
    assert format_cents(-5) == "-$0.05"


def test_parse():
    rows = parse_transactions("date,description,amount\n2024-01-02,Rent,-950.00\n")
    assert rows[0].amount_cents == -95000 and rows[0].category == "uncategorized"


def test_invoice():
    assert invoice_total([("Widget", 2, "$10.00")], 10)["total"] == 2200
