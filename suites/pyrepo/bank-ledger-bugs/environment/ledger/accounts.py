"""Accounts."""

from ledger.money import to_money


class LedgerError(Exception):
    """Base class of ledger errors."""


class InsufficientFunds(LedgerError):
    """A withdrawal would take the balance below -overdraft_limit."""


class Account:
    """A bank account. `history` is a list of (kind, amount) tuples, oldest first."""

    def __init__(self, account_id, owner, balance=0, overdraft_limit=0):
        self.id = account_id
        self.owner = owner
        self.balance = to_money(balance)
        self.overdraft_limit = to_money(overdraft_limit)
        self.history = []

    def can_withdraw(self, amount):
        return self.balance - to_money(amount) >= -self.overdraft_limit

    def deposit(self, amount, kind="deposit"):
        amount = to_money(amount)
        if amount <= 0:
            raise ValueError(f"deposit must be positive, got {amount}")
        self.balance += amount
        self.history.append((kind, amount))
        return self.balance

    def withdraw(self, amount, kind="withdrawal"):
        amount = to_money(amount)
        if amount <= 0:
            raise ValueError(f"withdrawal must be positive, got {amount}")
        if not self.can_withdraw(amount):
            raise InsufficientFunds(
                f"account {self.id}: balance {self.balance} cannot cover {amount} "
                f"(overdraft limit {self.overdraft_limit})"
            )
        self.balance -= amount
        self.history.append((kind, -amount))
        return self.balance
