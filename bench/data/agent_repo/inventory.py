"""Stock levels for a small shop: items, restocking and a daily report."""

from dataclasses import dataclass, field


@dataclass
class Item:
    sku: str
    name: str
    price: float
    quantity: int = 0
    tags: list = field(default_factory=list)


class Inventory:
    def __init__(self):
        self.items = {}
        self.log = []

    def add(self, item):
        if item.sku in self.items:
            raise ValueError(f"duplicate sku {item.sku}")
        self.items[item.sku] = item
        self.log.append(("add", item.sku, item.quantity))

    def restock(self, sku, amount):
        item = self.items[sku]
        item.quantity += amount
        self.log.append(("restock", sku, amount))
        return item.quantity

    def sell(self, sku, amount):
        item = self.items[sku]
        if amount > item.quantity:
            raise ValueError(f"only {item.quantity} of {sku} left")
        item.quantity -= amount
        self.log.append(("sell", sku, amount))
        return item.price * amount

    def low_stock(self, threshold=5):
        return [item for item in self.items.values() if item.quantity < threshold]

    def value(self):
        total = 0
        for item in self.items.values():
            total += item.price * item.quantity
        return total

    def report(self):
        lines = [f"{len(self.items)} items, stock value {self.value():.2f}"]
        for item in sorted(self.items.values(), key=lambda i: i.sku):
            flag = " LOW" if item.quantity < 5 else ""
            lines.append(f"{item.sku:<8} {item.name:<20} {item.quantity:>5}{flag}")
        return "\n".join(lines)
