"""llama-server's `samplers` field: the chain it names, as spekula's sampling fields."""

from __future__ import annotations

import pytest

from spekula.frontends.http.errors import HttpError
from spekula.frontends.http.sampler_order import sampler_overrides


def test_the_full_chain_changes_nothing() -> None:
    assert sampler_overrides(None) == {}
    assert sampler_overrides("edskypmxt") == {}  # llama.cpp web UI's default order
    assert sampler_overrides(["penalties", "dry", "top-k", "typ_p", "nucleus", "minp", "xtc", "temp"]) == {}


def test_left_out_samplers_do_nothing() -> None:
    assert sampler_overrides(["top_k", "temperature"]) == {
        "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "top_p": 1.0, "min_p": 0.0}
    assert sampler_overrides("kpm") == {"repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                                        "temperature": 1.0}
    assert sampler_overrides([]) == {"repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                                     "top_k": 0, "top_p": 1.0, "min_p": 0.0, "temperature": 1.0}


@pytest.mark.parametrize(("value", "word"), [
    (["temperature", "top_k"], "one order"),
    ("kpkt", "repeated"),
    (["top_k", "mirror"], "'mirror'"),
    ("kz", "'z'"),
    (["infill"], "infill is not supported"),
    ("a", "adaptive_p is not supported"),
    (3, "must be a list"),
    ([1, 2], "must be a list"),
])
def test_orders_spekula_cannot_run_are_refused(value: object, word: str) -> None:
    with pytest.raises(HttpError, match=word):
        sampler_overrides(value)
