from decimal import Decimal

import pytest
from ledger import Bank, InsufficientFunds, LedgerError, apply_monthly_interest, to_money
from ledger.accounts import Account


def test_to_money_floats_through_repr():
    assert to_money(1.005) == Decimal("1.01")
    assert to_money(2.675) == Decimal("2.68")
    assert str(to_money(0.1)) == "0.10"


def test_to_money_half_up():
    assert to_money("2.665") == Decimal("2.67")
    assert to_money(Decimal("0.125")) == Decimal("0.13")
    assert to_money("-0.125") == Decimal("-0.13")
    assert str(to_money(7)) == "7.00"


def test_deposit_rounds_half_up():
    a = Account(1, "ann")
    a.deposit("0.005")
    a.deposit(1.005)
    assert a.balance == Decimal("1.02")
    assert a.history == [("deposit", Decimal("0.01")), ("deposit", Decimal("1.01"))]


def test_fee_half_cent_rounds_up():
    bank = Bank(fee_rate="0.005")
    a = bank.open("alice", "100.00")
    b = bank.open("bob")
    assert bank.transfer(a.id, b.id, "49.00") == (Decimal("49.00"), Decimal("0.25"))
    assert a.balance == Decimal("50.75")
    assert b.balance == Decimal("49.00")
    assert bank.fees.balance == Decimal("0.25")


def test_failed_transfer_changes_nothing():
    bank = Bank(fee_rate="0.01")
    a = bank.open("alice", "10.00")
    b = bank.open("bob", "5.00")
    with pytest.raises(InsufficientFunds):
        bank.transfer(a.id, b.id, "9.95")  # 9.95 + 0.10 fee > 10.00
    assert (a.balance, b.balance, bank.fees.balance) == (Decimal("10.00"), Decimal("5.00"), Decimal("0.00"))
    assert a.history == [] and b.history == [] and bank.fees.history == []


def test_money_is_conserved_across_failures():
    bank = Bank(fee_rate="0.02")
    accts = [bank.open(f"u{i}", "20.00", overdraft_limit="5.00" if i == 0 else 0) for i in range(3)]
    start_total = bank.total()
    plan = [(0, 1, "24.00"), (1, 2, "44.00"), (2, 0, "19.61"), (2, 1, "0.01"), (0, 2, "20.00"), (1, 2, 1.005)]
    failures = 0
    for s, d, amt in plan:
        try:
            bank.transfer(accts[s].id, accts[d].id, amt)
        except InsufficientFunds:
            failures += 1
    assert failures == 3
    assert bank.total() == start_total
    assert [a.balance for a in accts] == [Decimal("15.13"), Decimal("42.97"), Decimal("1.01")]
    assert bank.fees.balance == Decimal("0.89")


def test_overdraft_transfer_allowed_up_to_limit():
    bank = Bank()
    a = bank.open("a", "1.00", overdraft_limit="10.00")
    b = bank.open("b")
    bank.transfer(a.id, b.id, "11.00")
    with pytest.raises(InsufficientFunds):
        bank.transfer(a.id, b.id, "0.01")
    assert (a.balance, b.balance) == (Decimal("-10.00"), Decimal("11.00"))
    assert b.history == [("transfer-in", Decimal("11.00"))]


def test_interest_compounds_monthly():
    a = Account(1, "saver", "1000.00")
    total = apply_monthly_interest(a, "0.12", 12)
    # 1% a month on the current balance, rounded half-up to cents each month
    assert a.balance == Decimal("1126.84")
    assert total == Decimal("126.84")
    assert len(a.history) == 12
    assert a.history[1] == ("interest", Decimal("10.10"))


def test_interest_month_rounding_half_up():
    c = Account(3, "saver", "2.50")
    # month 1: 2.50 * 0.024 / 12 = 0.005 -> 0.01 (half-up); month 2: 2.51 * 0.002 = 0.00502 -> 0.01
    assert apply_monthly_interest(c, "0.024", 2) == Decimal("0.02")
    assert c.balance == Decimal("2.52")
    d = Account(4, "saver", "5000.00")
    assert apply_monthly_interest(d, "0.05", 24) == Decimal("524.70")


def test_interest_errors_and_negative_balance():
    a = Account(1, "x", "-5.00", overdraft_limit="10")
    assert apply_monthly_interest(a, "0.1", 6) == Decimal("0.00")
    assert a.balance == Decimal("-5.00")
    with pytest.raises(ValueError):
        apply_monthly_interest(a, "-0.1", 1)
    bank = Bank()
    x = bank.open("x", 1.005)
    with pytest.raises(LedgerError):
        bank.transfer(x.id, x.id, "1")
    assert x.balance == Decimal("1.01")
