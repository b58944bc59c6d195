"""Import bank statements (CSV exports)."""

import csv
import io
from dataclasses import dataclass

from legacy.util import normalize_amount, parse_date, slugify


@dataclass(frozen=True)
class Transaction:
    date: object  # datetime.date
    description: str
    amount_cents: int  # negative = money out
    category: str


def parse_transactions(csv_text):
    """Rows 'date,description,amount[,category]' with a header row. Returns a list of Transaction.

    Amounts like '-4.5' or '(4.50)' are money out. A missing category becomes 'uncategorized'.
    Raises ValueError naming the row number (1 = first data row) for a bad row.
    """
    reader = csv.reader(io.StringIO(csv_text))
    rows = list(reader)
    if not rows or [h.strip().lower() for h in rows[0][:3]] != ["date", "description", "amount"]:
        raise ValueError("expected a header row 'date,description,amount[,category]'")
    out = []
    for n, row in enumerate(rows[1:], start=1):
        if not row or not any(c.strip() for c in row):
            continue
        try:
            date, desc, amount = row[0], row[1], row[2]
            category = slugify(row[3]) if len(row) > 3 and row[3].strip() else "uncategorized"
            out.append(Transaction(parse_date(date), desc.strip(), normalize_amount(amount), category))
        except (IndexError, ValueError) as e:
            raise ValueError(f"row {n}: {e}") from None
    return out
