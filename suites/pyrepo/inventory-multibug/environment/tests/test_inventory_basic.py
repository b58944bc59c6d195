import pytest
from inventory.models import InventoryError, Item, format_price, parse_price
from inventory.report import stock_report
from inventory.store import Store


def make_store():
    s = Store()
    s.add(Item("A-1", "Widget", 1299, 3))
    s.add(Item("B-2", "Gadget", 1999, 10))
    return s


def test_parse_price():
    assert parse_price("12.99") == 1299
    assert parse_price("3") == 300
    with pytest.raises(InventoryError):
        parse_price("1.234")


def test_format_price():
    assert format_price(1299) == "12.99"
    assert format_price(1205) == "12.05"


def test_sell_some():
    s = make_store()
    assert s.sell("A-1", 2) == 2598
    assert s.get("A-1").quantity == 1


def test_sell_too_many():
    s = make_store()
    with pytest.raises(InventoryError):
        s.sell("A-1", 4)


def test_report():
    assert stock_report(make_store()).splitlines()[-1] == "TOTAL | 13 | 238.87"


def test_save_and_load(tmp_path):
    s = make_store()
    s.save(tmp_path / "db.json")
    assert [i.price_cents for i in Store.load(tmp_path / "db.json").items()] == [1299, 1999]
