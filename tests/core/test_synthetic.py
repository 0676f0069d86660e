"""Synthetic acceptance: option validation, the bisection, and the acceptance it actually produces."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spekula.core.errors import ConfigError
from spekula.core.params import SamplingParams
from spekula.core.verify.sampling import Sampler
from spekula.core.verify.synthetic import (
    conditional_rates,
    mean_length,
    resolve_synthetic_rates,
    verify_synthetic,
)

V = 6
EOG = 5


def is_eog(t: int) -> bool:
    return t == EOG


def test_off_when_neither_option() -> None:
    assert resolve_synthetic_rates(4, None, None) is None
    assert resolve_synthetic_rates(4, (), None) is None


def test_length_bisection_matches_llama_cpp_example() -> None:
    rates = resolve_synthetic_rates(4, None, 2.5)
    assert rates is not None and len(rates) == 4
    assert rates[0] == pytest.approx(0.644471, abs=1e-6)
    assert rates[3] == pytest.approx(rates[0] ** 4)
    assert mean_length(rates) == pytest.approx(2.5, abs=1e-6)


def test_length_endpoints() -> None:
    assert resolve_synthetic_rates(3, None, 4.0) == (1.0, 1.0, 1.0)
    assert resolve_synthetic_rates(3, None, 1.0) == (0.0, 0.0, 0.0)


@settings(max_examples=50, deadline=None)
@given(k=st.integers(1, 8), frac=st.floats(0.0, 1.0))
def test_length_gives_requested_mean(k: int, frac: float) -> None:
    length = 1.0 + frac * k
    rates = resolve_synthetic_rates(k, None, length)
    assert rates is not None
    assert mean_length(rates) == pytest.approx(length, abs=1e-6)
    assert all(a >= b for a, b in zip(rates, rates[1:], strict=False))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=6))
def test_valid_rates_pass_through(values: list[float]) -> None:
    rates = sorted(values, reverse=True)
    assert resolve_synthetic_rates(len(rates), rates, None) == tuple(rates)
    cond = conditional_rates(rates)
    # Conditional rates multiply back to the unconditional ones.
    for i, r in enumerate(rates):
        assert math.prod(cond[: i + 1]) == pytest.approx(r, abs=1e-12)


@pytest.mark.parametrize(
    ("k", "rates", "length", "message"),
    [
        (3, [0.5, 0.4, 0.3], 2.0, "mutually exclusive"),
        (0, [0.5], None, "at least one speculative token"),
        (0, None, 1.5, "at least one speculative token"),
        (3, [0.5, 0.4], None, "must contain 3 values"),
        (2, [0.5, math.nan], None, "finite"),
        (2, [1.5, 0.5], None, "within [0, 1]"),
        (2, [0.5, -0.1], None, "within [0, 1]"),
        (3, [0.5, 0.6, 0.1], None, "non-increasing"),
        (3, None, 0.5, "within [1, 4]"),
        (3, None, 4.01, "within [1, 4]"),
        (3, None, -1.0, "within [1, 4]"),
        (3, None, math.inf, "finite"),
    ],
)
def test_validation_errors(k: int, rates: list[float] | None, length: float | None, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve_synthetic_rates(k, rates, length)


def test_conditional_rates_after_zero() -> None:
    assert conditional_rates([0.8, 0.4, 0.0, 0.0]) == pytest.approx((0.8, 0.5, 0.0, 0.0))


def test_produces_requested_acceptance() -> None:
    rates = (0.9, 0.6, 0.3, 0.1)
    cond = conditional_rates(rates)
    sampler = Sampler(SamplingParams(temperature=0.0), V, seed=1)
    rng = np.random.default_rng(2)
    logits = np.random.default_rng(3).normal(size=(5, V)).astype(np.float32)
    n = 20000
    reached = np.zeros(4)
    for _ in range(n):
        res = verify_synthetic([0, 1, 2, 3], logits, sampler, cond, rng, is_eog)
        reached[: res.n_accepted] += 1
    for i, r in enumerate(rates):
        sigma = math.sqrt(r * (1 - r) / n)
        assert abs(reached[i] / n - r) <= 5 * sigma + 1e-9


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), temperature=st.sampled_from([0.0, 0.7]))
def test_zero_rates_equal_plain_output(seed: int, temperature: float) -> None:
    params = SamplingParams(temperature=temperature, repeat_penalty=1.2)
    rows = np.random.default_rng(seed % 97).normal(size=(40, V)).astype(np.float32)
    plain_s = Sampler(params, V, seed)
    plain = []
    for row in rows:
        t = plain_s.sample(row)
        plain_s.accept(t)
        plain.append(t)
    s, rng = Sampler(params, V, seed), np.random.default_rng(seed)
    pos = 0
    while pos < 36:
        draft = plain[pos : pos + 3]  # even a perfect draft is never accepted at rate 0
        res = verify_synthetic(draft, rows[pos : pos + len(draft) + 1], s, (0.0, 0.0, 0.0), rng, is_eog)
        assert res.n_accepted == 0 and res.emitted == plain[pos : pos + 1]
        pos += 1


def test_drafted_eog_never_accepted() -> None:
    sampler = Sampler(SamplingParams(temperature=0.0), V, seed=0)
    logits = np.zeros((4, V), dtype=np.float32)
    logits[:, 2] = 3.0
    res = verify_synthetic([1, EOG, 1], logits, sampler, (1.0, 1.0, 1.0), np.random.default_rng(0), is_eog)
    assert res.emitted == [1, 2] and res.n_accepted == 1
