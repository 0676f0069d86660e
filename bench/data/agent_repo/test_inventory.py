import pytest

from inventory import Inventory, Item


def make():
    inv = Inventory()
    inv.add(Item("A1", "lamp", 12.5, 3))
    inv.add(Item("B2", "chair", 40.0, 10))
    return inv


def test_restock_and_sell():
    inv = make()
    assert inv.restock("A1", 4) == 7
    assert inv.sell("A1", 2) == 25.0
    with pytest.raises(ValueError):
        inv.sell("A1", 99)


def test_low_stock():
    assert [i.sku for i in make().low_stock()] == ["A1"]


def test_report():
    assert make().report().splitlines()[0] == "2 items, stock value 437.50"
