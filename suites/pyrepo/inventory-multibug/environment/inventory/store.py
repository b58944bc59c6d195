"""The stock: items by SKU, kept in a JSON file between runs."""

import json
import os

from inventory.models import InventoryError, Item, format_price, parse_price


class Store:
    def __init__(self):
        self._items = {}

    def add(self, item):
        if item.sku in self._items:
            raise InventoryError(f"SKU {item.sku} already exists; use restock to add stock")
        if item.quantity < 0:
            raise InventoryError("quantity must be >= 0")
        self._items[item.sku] = item

    def get(self, sku):
        try:
            return self._items[sku]
        except KeyError:
            raise InventoryError(f"unknown SKU {sku}") from None

    def restock(self, sku, qty):
        if qty < 1:
            raise InventoryError("restock quantity must be >= 1")
        item = self.get(sku)
        item.quantity += qty
        return item.quantity

    def sell(self, sku, qty):
        """Take `qty` units out of stock; returns the sale's total in cents."""
        if qty < 1:
            raise InventoryError("sell quantity must be >= 1")
        item = self.get(sku)
        if qty >= item.quantity:
            raise InventoryError(f"only {item.quantity} of {sku} in stock")
        item.quantity -= qty
        return qty * item.price_cents

    def items(self):
        """All items, sorted by SKU. These are the store's own objects: callers must not modify them."""
        return [self._items[sku] for sku in sorted(self._items)]

    def save(self, path):
        data = {
            "version": 2,
            "items": [
                {"sku": i.sku, "name": i.name, "price": format_price(i.price_cents), "quantity": i.quantity}
                for i in self.items()
            ],
        }
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path):
        store = cls()
        if not os.path.exists(path):
            return store
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        for row in data["items"]:
            store.add(Item(row["sku"], row["name"], parse_price(row["price"]), row["quantity"]))
        return store
