"""Sampler: chain semantics, RNG discipline (one draw per sample), determinism, speed on a real vocab row."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from spekula.core.errors import ConfigError
from spekula.core.params import SamplingParams
from spekula.core.verify.sampling import Sampler, pick, resolve_seed

NEUTRAL = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def test_greedy_is_argmax_and_draws_nothing() -> None:
    s = Sampler(SamplingParams(temperature=0.0), 5, seed=1)
    state = s.rng.bit_generator.state
    assert s.sample(np.array([0.1, 2.0, -1.0, 1.9, 0.0], dtype=np.float32)) == 1
    assert s.rng.bit_generator.state == state
    ids, probs = s.distribution(np.array([0.1, 2.0, -1.0, 3.0, 0.0], dtype=np.float32))
    assert ids.tolist() == [3] and probs.tolist() == [1.0]


def test_sample_consumes_exactly_one_draw() -> None:
    logits = np.random.default_rng(0).normal(size=50).astype(np.float32)
    s = Sampler(SamplingParams(temperature=0.7), 50, seed=9)
    ref = np.random.default_rng(9)
    for _ in range(20):
        s.sample(logits)
        ref.random()
    assert s.rng.bit_generator.state == ref.bit_generator.state


def test_rng_made_at_first_draw_is_the_seeds_stream_and_clones_alike() -> None:
    """The dist RNG is made when first drawn from (greedy requests never make one): the same stream as
    one seeded up front, in the sampler and in a copy taken before or after its first draw."""
    logits = np.random.default_rng(3).normal(size=40).astype(np.float32)
    eager = Sampler(SamplingParams(temperature=0.9), 40, seed=5)
    eager.rng  # noqa: B018 - made up front
    lazy = Sampler(SamplingParams(temperature=0.9), 40, seed=5)
    early_copy = lazy.clone()
    first = [lazy.sample(logits) for _ in range(10)]
    late_copy = lazy.clone()
    assert first == [eager.sample(logits) for _ in range(10)] == [early_copy.sample(logits) for _ in range(10)]
    assert [lazy.sample(logits) for _ in range(10)] == [late_copy.sample(logits) for _ in range(10)]


def test_neutral_chain_is_softmax() -> None:
    logits = np.random.default_rng(1).normal(size=30).astype(np.float32)
    ids, probs = Sampler(NEUTRAL, 30, seed=0).distribution(logits)
    np.testing.assert_allclose(probs, softmax(logits.astype(np.float64))[ids], rtol=1e-6)
    assert sorted(ids.tolist()) == list(range(30))
    assert np.all(np.diff(probs) <= 1e-12)  # sorted descending


def test_top_k_top_p_min_p_and_temperature() -> None:
    logits = np.log(np.array([0.4, 0.3, 0.15, 0.1, 0.05], dtype=np.float32))
    ids, _ = Sampler(NEUTRAL.with_(top_k=2), 5, 0).distribution(logits)
    assert ids.tolist() == [0, 1]
    # top-p keeps the smallest prefix whose mass reaches p (0.4+0.3 = 0.7 >= 0.7).
    ids, _ = Sampler(NEUTRAL.with_(top_p=0.7), 5, 0).distribution(logits)
    assert ids.tolist() == [0, 1]
    ids, _ = Sampler(NEUTRAL.with_(top_p=0.71), 5, 0).distribution(logits)
    assert ids.tolist() == [0, 1, 2]
    # min-p keeps p >= min_p * p_max: 0.4*0.3 = 0.12 keeps 0.15 but not 0.1.
    ids, _ = Sampler(NEUTRAL.with_(min_p=0.3), 5, 0).distribution(logits)
    assert ids.tolist() == [0, 1, 2]
    # min_keep: top-p and min-p keep at least that many (top-k still bounds them).
    assert Sampler(NEUTRAL.with_(top_p=0.7, min_keep=4), 5, 0).distribution(logits)[0].tolist() == [0, 1, 2, 3]
    assert Sampler(NEUTRAL.with_(min_p=0.3, min_keep=4), 5, 0).distribution(logits)[0].tolist() == [0, 1, 2, 3]
    assert Sampler(NEUTRAL.with_(min_p=0.3, min_keep=9), 5, 0).distribution(logits)[0].tolist() == [0, 1, 2, 3, 4]
    assert Sampler(NEUTRAL.with_(top_k=2, min_p=0.01, min_keep=4), 5, 0).distribution(logits)[0].tolist() == [0, 1]
    # Temperature applies after the filters: top-k 3 at T=0.5 squares and renormalises.
    ids, probs = Sampler(NEUTRAL.with_(top_k=3, temperature=0.5), 5, 0).distribution(logits)
    expect = np.array([0.4, 0.3, 0.15]) ** 2
    np.testing.assert_allclose(probs, expect / expect.sum(), rtol=1e-5)


def test_repetition_penalty_window() -> None:
    logits = np.array([2.0, -1.0, 1.0, 0.5], dtype=np.float32)
    s = Sampler(SamplingParams(temperature=0.0, repeat_penalty=4.0, repeat_last_n=2), 4, 0)
    s.accept(0)
    assert s.sample(logits) == 2  # 2.0/4 = 0.5 < 1.0
    s.accept(1)
    s.accept(2)  # window of 2 now holds [1, 2]: token 0 is no longer penalised
    assert s.sample(logits) == 0
    row = s._penalized(logits)
    assert row[1] == pytest.approx(-4.0) and row[2] == pytest.approx(0.25)


def test_frequency_and_presence_penalties_follow_the_repeat_penalty() -> None:
    logits = np.array([2.0, -1.0, 1.0, 0.5, 3.0], dtype=np.float32)
    s = Sampler(SamplingParams(temperature=0.0, repeat_penalty=2.0, repeat_last_n=4, frequency_penalty=0.5,
                               presence_penalty=0.25), 5, 0)
    for t in (0, 0, 1, 4, 4):  # the window of 4 keeps [0, 1, 4, 4]
        s.accept(t)
    row = s._penalized(logits)
    want = [2.0 / 2 - (1 * 0.5 + 0.25), -1.0 * 2 - (0.5 + 0.25), 1.0, 0.5, 3.0 / 2 - (2 * 0.5 + 0.25)]
    np.testing.assert_allclose(row, want, rtol=1e-6)
    assert not s.plain_greedy and s.sample(logits) == 2
    only_presence = Sampler(SamplingParams(temperature=0.0, presence_penalty=10.0), 5, 0)
    assert not only_presence.plain_greedy  # a penalty without repeat_penalty still needs the history
    only_presence.accept(4)
    assert only_presence.sample(logits) == 0


def test_fixed_seed_is_reproducible_and_clone_is_independent() -> None:
    logits = np.random.default_rng(2).normal(size=100).astype(np.float32)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    a, b = Sampler(params, 100, 42), Sampler(params, 100, 42)
    seq_a = [a.sample(logits) for _ in range(50)]
    assert seq_a == [b.sample(logits) for _ in range(50)]
    c = a.clone()
    assert [a.sample(logits) for _ in range(10)] == [c.sample(logits) for _ in range(10)]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0.0, 1.0, allow_nan=False), min_size=1, max_size=6), st.floats(0.0, 0.999999))
def test_pick_inverse_cdf(weights: list[float], u: float) -> None:
    w = np.array(weights) + 1e-3
    probs = w / w.sum()
    got = pick(np.arange(len(w)), probs, u)
    cdf = np.cumsum(probs)
    assert (cdf[got] >= u - 1e-9) and (got == 0 or cdf[got - 1] <= u + 1e-9)


def test_sample_frequencies_match_distribution() -> None:
    logits = np.log(np.array([0.5, 0.25, 0.125, 0.125], dtype=np.float32))
    s = Sampler(NEUTRAL, 4, seed=3)
    n = 20000
    counts = np.bincount([s.sample(logits) for _ in range(n)], minlength=4)
    expect = np.array([0.5, 0.25, 0.125, 0.125]) * n
    chi2 = float(((counts - expect) ** 2 / expect).sum())
    assert chi2 < 30.0  # df=3; p ~ 1e-6 — seeded, so deterministic anyway


def test_resolve_seed() -> None:
    assert resolve_seed(7) == 7
    r = resolve_seed(-1)
    assert 0 <= r < 2**32
    with pytest.raises(ConfigError):
        resolve_seed(-5)


@pytest.mark.parametrize(
    "bad",
    [dict(temperature=math.nan), dict(repeat_penalty=0.0), dict(repeat_last_n=-2), dict(top_p=math.inf)],
)
def test_bad_params_are_config_errors(bad: dict) -> None:
    with pytest.raises(ConfigError):
        Sampler(SamplingParams(**bad), 10, 0)


def test_full_vocab_row_top_k_matches_full_sort() -> None:
    logits = np.random.default_rng(4).normal(size=49152).astype(np.float32)
    ids, probs = Sampler(SamplingParams(top_p=1.0, min_p=0.0), 49152, seed=5).distribution(logits)
    assert ids.tolist() == np.argsort(-logits, kind="stable")[:40].tolist()
    np.testing.assert_allclose(probs, softmax(logits[ids].astype(np.float64) / 0.8), rtol=1e-6)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    temperature=st.floats(0.05, 3.0),
    top_k=st.integers(0, 12),
    top_p=st.floats(0.0, 1.0),
    min_p=st.floats(0.0, 1.0),
)
def test_distribution_properties(seed: int, temperature: float, top_k: int, top_p: float, min_p: float) -> None:
    logits = np.random.default_rng(seed).normal(scale=3.0, size=10).astype(np.float32)
    s = Sampler(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p), 10, seed)
    ids, probs = s.distribution(logits)
    assert 1 <= len(ids) <= (top_k if top_k > 0 else 10)
    assert len(set(ids.tolist())) == len(ids)
    assert probs.sum() == pytest.approx(1.0) and np.all(np.diff(probs) <= 1e-12)
    assert int(ids[0]) == int(np.argmax(logits))  # no filter ever drops the most likely token
    kept = set(ids.tolist())
    assert all(logits[i] <= logits[ids].min() for i in range(10) if i not in kept)  # filters keep a top set
    assert s.sample(logits) in kept


def test_logit_bias_comes_before_the_penalty_and_adds_up() -> None:
    logits = np.array([1.0, 2.0, 3.0, 0.5], dtype=np.float32)
    # token 2 is biased twice (both count), then penalised as a repeat: (3 - 1.5 - 1.5) -> 0 * 2 = 0
    s = Sampler(SamplingParams(temperature=0.0, repeat_penalty=2.0, logit_bias=((2, -1.5), (2, -1.5), (3, 1.0))),
                4, seed=0)
    s.accept(2)
    assert not s.plain_greedy
    assert s._penalized(logits).tolist() == [1.0, 2.0, 0.0, 1.5]
    assert s.sample(logits) == 1
    ids, probs = Sampler(NEUTRAL.with_(logit_bias=((0, math.log(3.0)),)), 4, 0).distribution(np.zeros(4, np.float32))
    assert dict(zip(ids.tolist(), probs.tolist(), strict=True)) == pytest.approx({0: 0.5, 1: 1 / 6, 2: 1 / 6, 3: 1 / 6})


@settings(max_examples=40, deadline=None)
@given(banned=st.sets(st.integers(0, 7), max_size=8), temperature=st.sampled_from([0.0, 0.5, 1.5]),
       seed=st.integers(0, 2**32 - 1))
def test_a_banned_token_is_never_sampled(banned: set[int], temperature: float, seed: int) -> None:
    """A -inf bias (llama-server's false) bans the token; when every token is banned the lowest id stays
    the one answer instead of a NaN distribution."""
    bias = tuple((t, -math.inf) for t in sorted(banned))
    s = Sampler(SamplingParams(temperature=temperature, top_k=0, top_p=1.0, min_p=0.0, seed=seed, logit_bias=bias),
                8, seed)
    logits = np.random.default_rng(seed).standard_normal(8).astype(np.float32)
    ids, probs = s.distribution(logits)
    assert np.isfinite(probs).all() and probs.sum() == pytest.approx(1.0)
    picks = {s.sample(logits) for _ in range(20)}
    assert picks.isdisjoint(banned) if len(banned) < 8 else picks == {0}


@pytest.mark.parametrize("bias", [((0, math.nan),), ((1, math.inf),), ((9, 1.0),), ((-1, 1.0),)])
def test_bad_logit_bias_is_a_config_error(bias: tuple[tuple[int, float], ...]) -> None:
    with pytest.raises(ConfigError, match="logit_bias"):
        Sampler(SamplingParams(logit_bias=bias), 8, seed=0)


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    size=st.sampled_from([64 * 40 - 1, 64 * 40, 3000, 49152]),
    top_k=st.sampled_from([1, 2, 40, 41, 100]),
    ties=st.booleans(),
    banned=st.sampled_from([0.0, 0.5, 0.99, 0.9995]),
)
def test_top_k_keeps_the_k_best_ties_to_the_lower_id(seed: int, size: int, top_k: int, ties: bool,
                                                      banned: float) -> None:
    """On rows as wide as a vocabulary, with ties at the k-th logit and many tokens banned (-inf), top-k
    keeps what a full stable sort keeps: the k highest finite logits, ties to the lower token id."""
    r = np.random.default_rng(seed)
    logits = (r.standard_normal(size) * 3.0).astype(np.float32)
    if ties:
        logits = np.round(logits).astype(np.float32)  # a handful of distinct values: ties at every k
    logits[r.random(size) < banned] = -np.inf
    finite = np.flatnonzero(np.isfinite(logits))
    s = Sampler(SamplingParams(temperature=0.7, top_k=top_k, top_p=1.0, min_p=0.0), size, seed)
    ids, probs = s.distribution(logits)
    if finite.size == 0:  # every token banned: one candidate is left, as before
        assert len(ids) == 1 and probs.tolist() == [1.0]
        return
    want = finite[np.argsort(-logits[finite], kind="stable")][:top_k]
    assert ids.tolist() == want.tolist()
    np.testing.assert_allclose(probs, softmax(logits[want].astype(np.float64) / 0.7), rtol=1e-9)


def chain_by_full_sort(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """top-p, min-p and temperature without top-k, by sorting the whole row: top-p weighs each token
    against the whole vocabulary's mass (summed in id order), min-p keeps tokens within a factor of
    the best."""
    ids = np.argsort(-logits, kind="stable")
    lg = logits[ids].astype(np.float64)
    finite = int(np.count_nonzero(lg > -np.inf))
    ids, lg = ids[: max(finite, 1)], lg[: max(finite, 1)]
    if finite == 0:  # every token banned: the first stays, alone
        return ids, np.ones(1)
    if params.top_p < 1.0:
        cum = np.cumsum(np.exp(lg - lg[0]) / np.exp(logits.astype(np.float64) - lg[0]).sum())
        keep = min(max(int(np.searchsorted(cum, params.top_p, side="left")) + 1, 1, params.min_keep), len(ids))
        ids, lg = ids[:keep], lg[:keep]
    if params.min_p > 0.0:
        keep = min(max(int(np.count_nonzero(lg >= lg[0] + math.log(params.min_p))), 1, params.min_keep), len(ids))
        ids, lg = ids[:keep], lg[:keep]
    return ids, softmax(lg / params.temperature)


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    size=st.sampled_from([3000, 49152]),
    scale=st.sampled_from([0.5, 3.0, 12.0]),
    ties=st.booleans(),
    banned=st.sampled_from([0.0, 0.5, 0.999]),
    top_p=st.sampled_from([1.0, 0.95, 0.5]),
    min_p=st.sampled_from([0.0, 0.05, 0.3, 1.0, 5.0]),
    min_keep=st.sampled_from([0, 1, 5, 400]),
)
@example(seed=1022, size=3000, scale=0.5, ties=False, banned=0.999, top_p=1.0, min_p=0.0, min_keep=0)  # all banned
def test_without_top_k_only_the_tokens_min_p_can_keep_are_sorted(
        seed: int, size: int, scale: float, ties: bool, banned: float, top_p: float, min_p: float,
        min_keep: int) -> None:
    """Without top-k the chain orders only the tokens min-p can keep, and gives exactly what sorting the
    whole vocabulary gives."""
    r = np.random.default_rng(seed)
    logits = (r.standard_normal(size) * scale).astype(np.float32)
    if ties:
        logits = np.round(logits).astype(np.float32)
    logits[r.random(size) < banned] = -np.inf
    params = SamplingParams(temperature=0.9, top_k=0, top_p=top_p, min_p=min_p, min_keep=min_keep)
    ids, probs = Sampler(params, size, seed).distribution(logits)
    want_ids, want_probs = chain_by_full_sort(logits, params)
    assert ids.tolist() == want_ids.tolist()
    assert np.array_equal(probs, want_probs)
