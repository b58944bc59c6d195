import pytest
from legacy.billing import invoice_total, line_total, render_invoice
from legacy.parse import parse_transactions
from legacy.reports import monthly_summary, render_summary
from legacy.util import normalize_amount

STATEMENT = """date,description,amount,category
2024-03-01,Salary,"$2,500.00",Income
2024-03-04,Coffee,-4.5,Food & Drink
03/09/2024,Books,(12.9),Education
2024-03-30,Refund,0.7,Food & Drink
2024-04-02,Rent,-950,Housing
2024-04-05,Snacks,-.5,
"""


def test_normalize_one_decimal():
    assert normalize_amount("4.5") == 450
    assert normalize_amount("-4.5") == -450
    assert normalize_amount("$1,234.5") == 123450
    assert normalize_amount("(0.9)") == -90
    assert normalize_amount(".5") == 50


def test_normalize_unchanged_cases_and_errors():
    assert normalize_amount("$1,234.56") == 123456
    assert normalize_amount("0.05") == 5
    assert normalize_amount("12.") == 1200
    assert normalize_amount("9.1") == 910
    for bad in ("", "abc", "1.234", "1.2.3", "$-", "."):
        with pytest.raises(ValueError):
            normalize_amount(bad)


def test_parse_statement_amounts():
    txs = parse_transactions(STATEMENT)
    assert [t.amount_cents for t in txs] == [250000, -450, -1290, 70, -95000, -50]
    assert [t.category for t in txs] == ["income", "food-drink", "education", "food-drink", "housing", "uncategorized"]


def test_parse_bad_row_still_reports_row_number():
    with pytest.raises(ValueError, match="row 2"):
        parse_transactions("date,description,amount\n2024-01-01,A,1.5\n2024-01-02,B,1.555\n")
    assert parse_transactions("date,description,amount\n2024-01-01,A,1.5\n")[0].amount_cents == 150


def test_invoice_one_decimal_prices():
    assert line_total(3, "$2.5") == 750
    t = invoice_total([("Notebook", 3, "$2.5"), ("Pen", 10, "0.9")], tax_rate_percent=8)
    assert t == {"subtotal": 1650, "discount": 0, "tax": 132, "total": 1782}


def test_invoice_discount_one_decimal():
    t = invoice_total([("Widget", 4, "$10.00")], tax_rate_percent=10, discount="$5.5")
    assert t == {"subtotal": 4000, "discount": 550, "tax": 345, "total": 3795}
    t = invoice_total([("Gadget", 1, "3.3")], discount="10")
    assert t == {"subtotal": 330, "discount": 330, "tax": 0, "total": 0}


def test_render_invoice():
    text = render_invoice("ACME", [("Notebook", 3, "$2.5")], tax_rate_percent=0)
    assert "$7.50" in text
    assert text.splitlines()[-1].endswith("$7.50")
    assert "$2.50" in text.splitlines()[1]


def test_monthly_summary():
    assert monthly_summary(parse_transactions(STATEMENT)) == {
        "2024-03": {"education": -1290, "food-drink": -380, "income": 250000},
        "2024-04": {"housing": -95000, "uncategorized": -50},
    }


def test_render_summary():
    text = render_summary(parse_transactions(STATEMENT))
    assert text == (
        "2024-03\n"
        "  education            -$12.90\n"
        "  food-drink            -$3.80\n"
        "  income             $2,500.00\n"
        "  net                $2,483.30\n"
        "2024-04\n"
        "  housing             -$950.00\n"
        "  uncategorized         -$0.50\n"
        "  net                 -$950.50\n"
    )
