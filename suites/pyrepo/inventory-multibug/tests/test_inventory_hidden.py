import json
import os
import subprocess
import sys

import pytest
from inventory.models import InventoryError, Item, format_price, parse_price
from inventory.report import stock_report
from inventory.store import Store


def make_store():
    s = Store()
    s.add(Item("C-3", "Gizmo", 100, 0))
    s.add(Item("A-1", "Widget", 1205, 3))
    s.add(Item("B-2", "Gadget", 1999, 10))
    return s


def cli(db, *args):
    return subprocess.run(
        [sys.executable, "-m", "inventory", "--db", str(db), *args],
        cwd=os.getcwd(),
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_format_price_pads_cents():
    assert format_price(1205) == "12.05"
    assert format_price(500) == "5.00"
    assert format_price(7) == "0.07"
    assert format_price(0) == "0.00"
    assert format_price(1999) == "19.99"


def test_price_text_round_trip_and_validation():
    assert all(parse_price(format_price(c)) == c for c in range(0, 5000, 7))
    for bad in ("abc", "-1", "1.234", "NaN", ""):
        with pytest.raises(InventoryError):
            parse_price(bad)


def test_sell_all_stock():
    s = make_store()
    assert s.sell("A-1", 3) == 3615
    assert s.get("A-1").quantity == 0
    with pytest.raises(InventoryError):
        s.sell("A-1", 1)


def test_failed_sale_changes_nothing_then_full_sale_works():
    s = make_store()
    with pytest.raises(InventoryError):
        s.sell("B-2", 11)
    assert s.get("B-2").quantity == 10
    assert s.sell("B-2", 10) == 19990


def test_restock_then_sell_everything():
    s = make_store()
    assert s.restock("C-3", 2) == 2
    assert s.sell("C-3", 2) == 200
    assert [(i.sku, i.quantity) for i in s.items()] == [("A-1", 3), ("B-2", 10), ("C-3", 0)]


def test_report_text():
    assert stock_report(make_store()) == (
        "A-1 | Widget | 3 | 12.05 | 36.15\n"
        "B-2 | Gadget | 10 | 19.99 | 199.90\n"
        "C-3 | Gizmo | 0 | 1.00 | 0.00\n"
        "TOTAL | 13 | 236.05"
    )


def test_discounted_report_values():
    assert stock_report(make_store(), 10) == (
        "A-1 | Widget | 3 | 10.84 | 32.52\n"
        "B-2 | Gadget | 10 | 17.99 | 179.90\n"
        "C-3 | Gizmo | 0 | 0.90 | 0.00\n"
        "TOTAL | 13 | 212.42"
    )


def test_report_never_changes_the_store():
    s = make_store()
    first = stock_report(s, 25)
    assert stock_report(s, 25) == first
    assert [i.price_cents for i in s.items()] == [1205, 1999, 100]
    assert s.sell("A-1", 1) == 1205


def test_save_load_round_trip(tmp_path):
    s = make_store()
    s.add(Item("D-4", "Doohickey", 5, 1))
    path = tmp_path / "db.json"
    s.save(path)
    loaded = Store.load(path)
    assert [(i.sku, i.name, i.price_cents, i.quantity) for i in loaded.items()] == [
        ("A-1", "Widget", 1205, 3),
        ("B-2", "Gadget", 1999, 10),
        ("C-3", "Gizmo", 100, 0),
        ("D-4", "Doohickey", 5, 1),
    ]
    assert json.loads(path.read_text())["items"][0]["price"] == "12.05"


def test_cli_add_and_report(tmp_path):
    db = tmp_path / "inv.json"
    assert cli(db, "add", "A-1", "Widget", "12.05", "3").stdout == "added A-1\n"
    assert cli(db, "add", "B-2", "Gadget", "5").returncode == 0
    p = cli(db, "report")
    assert p.returncode == 0, p.stderr
    assert p.stdout == "A-1 | Widget | 3 | 12.05 | 36.15\nB-2 | Gadget | 0 | 5.00 | 0.00\nTOTAL | 3 | 36.15\n"


def test_cli_prices_survive_many_commands(tmp_path):
    db = tmp_path / "inv.json"
    cli(db, "add", "A-1", "Widget", "12.05", "5")
    cli(db, "add", "B-2", "Bolt", "0.09", "5")
    for _ in range(3):
        assert cli(db, "restock", "A-1", "1").returncode == 0
    p = cli(db, "sell", "A-1", "2")
    assert p.stdout == "sold 2 x Widget for 24.10\n"
    assert cli(db, "sell", "B-2", "1").stdout == "sold 1 x Bolt for 0.09\n"


def test_cli_sell_all_and_too_many(tmp_path):
    db = tmp_path / "inv.json"
    cli(db, "add", "A-1", "Widget", "2.50", "2")
    before = db.read_text()
    p = cli(db, "sell", "A-1", "3")
    assert p.returncode == 1 and p.stdout == "" and p.stderr.startswith("error: ")
    assert db.read_text() == before
    p = cli(db, "sell", "A-1", "2")
    assert (p.returncode, p.stdout) == (0, "sold 2 x Widget for 5.00\n")
    assert cli(db, "restock", "A-1", "4").stdout == "A-1: 4 in stock\n"


def test_cli_discount_is_not_persisted(tmp_path):
    db = tmp_path / "inv.json"
    cli(db, "add", "A-1", "Widget", "19.99", "1")
    assert cli(db, "report", "--discount", "50").stdout.startswith("A-1 | Widget | 1 | 9.99 | 9.99\n")
    assert cli(db, "report").stdout.startswith("A-1 | Widget | 1 | 19.99 | 19.99\n")
    assert cli(db, "sell", "A-1", "1").stdout == "sold 1 x Widget for 19.99\n"


def test_cli_errors_leave_db_unchanged(tmp_path):
    db = tmp_path / "inv.json"
    cli(db, "add", "A-1", "Widget", "1.05", "1")
    before = db.read_text()
    for args in (["sell", "Z-9", "1"], ["add", "A-1", "Again", "1.00"], ["add", "X", "Y", "1.001"]):
        p = cli(db, *args)
        assert p.returncode == 1 and p.stderr.startswith("error: ")
    assert db.read_text() == before
    assert cli(db, "sell", "A-1", "1").stdout == "sold 1 x Widget for 1.05\n"
