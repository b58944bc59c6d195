"""python -m inventory --db PATH COMMAND ..."""

import argparse
import sys

from inventory.models import InventoryError, Item, format_price, parse_price
from inventory.report import stock_report
from inventory.store import Store


def _parser():
    p = argparse.ArgumentParser(prog="python -m inventory")
    p.add_argument("--db", default="inventory.json", help="the JSON database file")
    sub = p.add_subparsers(dest="command", required=True)
    add = sub.add_parser("add")
    add.add_argument("sku")
    add.add_argument("name")
    add.add_argument("price")
    add.add_argument("qty", type=int, nargs="?", default=0)
    restock = sub.add_parser("restock")
    restock.add_argument("sku")
    restock.add_argument("qty", type=int)
    sell = sub.add_parser("sell")
    sell.add_argument("sku")
    sell.add_argument("qty", type=int)
    report = sub.add_parser("report")
    report.add_argument("--discount", type=int, default=0)
    return p


def _run(args, store):
    if args.command == "add":
        store.add(Item(args.sku, args.name, parse_price(args.price), args.qty))
        return f"added {args.sku}"
    if args.command == "restock":
        return f"{args.sku}: {store.restock(args.sku, args.qty)} in stock"
    if args.command == "sell":
        total = store.sell(args.sku, args.qty)
        return f"sold {args.qty} x {store.get(args.sku).name} for {format_price(total)}"
    if not 0 <= args.discount <= 100:
        raise InventoryError("--discount must be within 0..100")
    return stock_report(store, args.discount)


def main(argv=None):
    args = _parser().parse_args(argv)
    try:
        store = Store.load(args.db)
        out = _run(args, store)
    except InventoryError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    store.save(args.db)  # every successful command rewrites the file (migrating old formats)
    print(out)
    return 0
