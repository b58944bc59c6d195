#!/usr/bin/env bash
# Oracle: the three fixes, applied as edits to the existing files.
set -euo pipefail
python3 - <<'EOF'
import pathlib


def patch(path, old, new):
    p = pathlib.Path(path)
    s = p.read_text()
    assert s.count(old) == 1, (path, old)
    p.write_text(s.replace(old, new))


# 1. floats through repr, half-up rounding
patch("ledger/money.py", "        d = Decimal(x)\n", "        d = Decimal(repr(x)) if isinstance(x, float) else Decimal(x)\n")
patch("ledger/money.py", "    return d.quantize(CENT)\n", "    return d.quantize(CENT, rounding=ROUND_HALF_UP)\n")
# 2. atomic transfer: check and withdraw before depositing
patch(
    "ledger/bank.py",
    '        dst.deposit(amount, kind="transfer-in")\n        src.withdraw(amount + fee, kind="transfer-out")\n',
    '        src.withdraw(amount + fee, kind="transfer-out")\n        dst.deposit(amount, kind="transfer-in")\n',
)
# 3. compound on the current balance
patch("ledger/interest.py", "    principal = account.balance\n", "")
patch("ledger/interest.py", "to_money(principal * rate / 12)", "to_money(account.balance * rate / 12)")
EOF
