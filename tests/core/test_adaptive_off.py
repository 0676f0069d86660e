"""`--spec-adaptive off` is the fixed-length engine, counter for counter (see tests/fixed_stats_golden.py)."""

from __future__ import annotations

import json
from pathlib import Path

from fixed_stats_golden import collect

GOLDEN = Path(__file__).parents[1] / "data" / "fixed_engine_stats.json"


def test_adaptive_off_reproduces_the_fixed_engine() -> None:
    expected = json.loads(GOLDEN.read_text())
    got = json.loads(json.dumps(collect()))  # the same JSON round trip as the file
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert g["case"] == e["case"]
        assert g["tokens"] == e["tokens"], e["case"]
        assert g["timings"] == e["timings"], e["case"]
        assert g["drafters"] == e["drafters"], e["case"]
        assert g["lines"] == e["lines"], e["case"]
