"""What the package installs: every subpackage of the layers (pyproject.toml lists them by hand, since the
repository root is the `spekula` package), and not the test fixtures."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INSTALLED = ("core", "backends", "drafters", "training", "frontends")


def listed_packages() -> set[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    return set(config["tool"]["setuptools"]["packages"])


def test_every_subpackage_is_installed() -> None:
    on_disk = {"spekula"} | {
        "spekula." + ".".join(init.parent.relative_to(ROOT).parts)
        for top in INSTALLED for init in (ROOT / top).rglob("__init__.py")
    }
    assert listed_packages() == on_disk


def test_fixtures_tests_and_bench_are_not_installed() -> None:
    assert not {p for p in listed_packages() if p.split(".")[1:2] in (["fixtures"], ["tests"], ["bench"])}
