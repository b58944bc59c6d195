"""Interest."""

from decimal import Decimal

from ledger.money import to_money


def apply_monthly_interest(account, annual_rate, months):
    """Credit `months` months of interest at `annual_rate` (e.g. "0.06"), compounding monthly.

    Each month's interest is to_money(balance * annual_rate / 12) on the balance at the start of
    that month; it is credited (history kind "interest") before the next month is computed. Months
    whose interest rounds to zero add no history entry. Returns the total interest credited.
    A negative rate or month count raises ValueError; a negative balance earns nothing.
    """
    rate = Decimal(str(annual_rate))
    if rate < 0 or months < 0:
        raise ValueError(f"rate and months must be >= 0, got {annual_rate!r}, {months!r}")
    total = to_money(0)
    principal = account.balance
    for _ in range(months):
        if account.balance <= 0:
            break
        interest = to_money(principal * rate / 12)
        if interest > 0:
            account.deposit(interest, kind="interest")
            total += interest
    return total
