"""Monthly reports over imported transactions."""

from collections import defaultdict

from legacy.util import format_cents


def monthly_summary(transactions):
    """{'YYYY-MM': {category: cents}} with the categories sorted, months sorted."""
    acc = defaultdict(lambda: defaultdict(int))
    for t in transactions:
        acc[f"{t.date:%Y-%m}"][t.category] += t.amount_cents
    return {m: dict(sorted(acc[m].items())) for m in sorted(acc)}


def render_summary(transactions):
    """One block per month: the month, then '  category  amount' lines, then the net total."""
    out = []
    for month, cats in monthly_summary(transactions).items():
        out.append(month)
        for cat, cents in cats.items():
            out.append(f"  {cat:<16}{format_cents(cents):>12}")
        out.append(f"  {'net':<16}{format_cents(sum(cats.values())):>12}")
    return "\n".join(out) + "\n"
