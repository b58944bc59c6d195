"""The bank: opens accounts and moves money between them."""

from decimal import Decimal

from ledger.accounts import Account, LedgerError
from ledger.money import to_money


class UnknownAccount(LedgerError, KeyError):
    """No account has this id."""


class Bank:
    def __init__(self, fee_rate="0"):
        self.fee_rate = Decimal(str(fee_rate))
        self.accounts = {}
        self._next_id = 1
        self.fees = Account(0, "bank-fees")

    def open(self, owner, balance=0, overdraft_limit=0):
        acct = Account(self._next_id, owner, balance, overdraft_limit)
        self.accounts[acct.id] = acct
        self._next_id += 1
        return acct

    def get(self, account_id):
        try:
            return self.accounts[account_id]
        except KeyError:
            raise UnknownAccount(f"no account with id {account_id}") from None

    def fee_for(self, amount):
        """The transfer fee: fee_rate * amount, rounded half-up to cents."""
        return to_money(self.fee_rate * to_money(amount))

    def transfer(self, src_id, dst_id, amount):
        """Move `amount` from src to dst; the sender also pays the fee. Atomic: all or nothing."""
        src, dst = self.get(src_id), self.get(dst_id)
        if src is dst:
            raise LedgerError("cannot transfer to the same account")
        amount = to_money(amount)
        fee = self.fee_for(amount)
        dst.deposit(amount, kind="transfer-in")
        src.withdraw(amount + fee, kind="transfer-out")
        if fee > 0:
            self.fees.deposit(fee, kind="fee")
        return amount, fee

    def total(self):
        """Sum of all balances, the fee account included."""
        return sum((a.balance for a in self.accounts.values()), self.fees.balance)
