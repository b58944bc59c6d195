"""A tiny in-memory bank ledger."""

from ledger.accounts import Account, InsufficientFunds, LedgerError
from ledger.bank import Bank, UnknownAccount
from ledger.interest import apply_monthly_interest
from ledger.money import to_money

__all__ = [
    "Account",
    "Bank",
    "InsufficientFunds",
    "LedgerError",
    "UnknownAccount",
    "apply_monthly_interest",
    "to_money",
]
