"""Verifier: greedy cases one by one, seeded equivalence with plain decoding, and exact losslessness
of rejection sampling (by enumerating its branches on a tiny vocabulary), plus a seeded frequency check."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spekula.core.params import SamplingParams
from spekula.core.verify.sampling import Sampler, dense
from spekula.core.verify.verifier import (
    VerifyResult,
    acceptance_probability,
    residual_distribution,
    verify_match,
    verify_rejection,
)

V = 8
EOG = 7
GREEDY = SamplingParams(temperature=0.0)


def no_eog(t: int) -> bool:
    return False


def is_eog(t: int) -> bool:
    return t == EOG


def argmax_logits(tokens: list[int], n_vocab: int = V) -> np.ndarray:
    """Rows whose argmax is the given token."""
    rows = np.zeros((len(tokens), n_vocab), dtype=np.float32)
    for i, t in enumerate(tokens):
        rows[i, t] = 5.0
    return rows


# --- sample-and-match, greedy: the cases one by one --------------------------------------------


def test_match_perfect_gives_bonus() -> None:
    r = verify_match([1, 2, 3], argmax_logits([1, 2, 3, 4]), Sampler(GREEDY, V, 0), no_eog)
    assert r == VerifyResult([1, 2, 3, 4], 3)


def test_match_early_mismatch_emits_correction() -> None:
    r = verify_match([1, 2, 3], argmax_logits([1, 5, 3, 4]), Sampler(GREEDY, V, 0), no_eog)
    assert r == VerifyResult([1, 5], 1)


def test_match_first_mismatch() -> None:
    r = verify_match([1, 2], argmax_logits([6, 2, 3]), Sampler(GREEDY, V, 0), no_eog)
    assert r == VerifyResult([6], 0)


def test_match_empty_draft_is_plain_step() -> None:
    r = verify_match([], argmax_logits([4]), Sampler(GREEDY, V, 0), no_eog)
    assert r == VerifyResult([4], 0)


def test_match_eog_before_last_position_stops_without_bonus() -> None:
    r = verify_match([1, EOG, 3], argmax_logits([1, EOG, 3, 4]), Sampler(GREEDY, V, 0), is_eog)
    assert r == VerifyResult([1, EOG], 1)


def test_match_eog_in_last_position_is_accepted_with_bonus() -> None:
    r = verify_match([1, EOG], argmax_logits([1, EOG, 4]), Sampler(GREEDY, V, 0), is_eog)
    assert r == VerifyResult([1, EOG, 4], 2)


def test_match_never_accepts_after_accepted_eog() -> None:
    # Invariant docs/semantics.md §8.11, also when the target agrees with the rest of the draft.
    r = verify_match([EOG, EOG, EOG], argmax_logits([EOG, EOG, EOG, EOG]), Sampler(GREEDY, V, 0), is_eog)
    assert r.emitted == [EOG] and r.n_accepted == 0


def test_shape_mismatch_raises() -> None:
    with pytest.raises(ValueError):
        verify_match([1, 2], argmax_logits([1, 2]), Sampler(GREEDY, V, 0), no_eog)


# --- sample-and-match at temperature > 0: token-identical to plain decoding ---------------------


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    temperature=st.sampled_from([0.0, 0.3, 0.8, 1.5]),
    penalty=st.sampled_from([1.0, 1.3]),
    drafts=st.lists(st.tuples(st.integers(0, 4), st.floats(0.0, 1.0)), min_size=1, max_size=25),
)
def test_match_reproduces_plain_sampling(
    seed: int, temperature: float, penalty: float, drafts: list[tuple[int, float]]
) -> None:
    params = SamplingParams(temperature=temperature, top_k=6, repeat_penalty=penalty, repeat_last_n=5)
    n = 60
    rows = np.random.default_rng(seed % 1000).normal(scale=2.0, size=(n + 8, V)).astype(np.float32)

    plain_sampler = Sampler(params, V, seed)
    plain: list[int] = []
    for j in range(n + 8):
        t = plain_sampler.sample(rows[j])
        plain_sampler.accept(t)
        plain.append(t)

    spec_sampler = Sampler(params, V, seed)
    noise = np.random.default_rng(seed)
    pos, r = 0, 0
    while pos < n:
        k, good = drafts[r % len(drafts)]
        r += 1
        # A drafter that is right with probability `good` per token, else random.
        draft = [plain[pos + i] if noise.random() < good else int(noise.integers(V)) for i in range(k)]
        res = verify_match(draft, rows[pos : pos + k + 1], spec_sampler, is_eog)
        assert res.emitted == plain[pos : pos + len(res.emitted)]
        assert res.emitted[: res.n_accepted] == draft[: res.n_accepted]
        assert 1 <= len(res.emitted) <= k + 1
        pos += len(res.emitted)


# --- rejection sampling: exact output distribution by enumeration -------------------------------


def random_table(rng: np.random.Generator, n_vocab: int, sparse: bool) -> np.ndarray:
    w = rng.dirichlet(np.ones(n_vocab))
    if sparse:
        w[rng.random(n_vocab) < 0.3] = 0.0
        if w.sum() == 0.0:
            w[rng.integers(n_vocab)] = 1.0
    return w / w.sum()


def enumerate_round(p: list, q: list, k: int, n_vocab: int, horizon: int) -> dict[tuple[int, ...], float]:
    """Exact distribution of the first `horizon` tokens: one rejection round of k drafts, then plain decoding.

    p(prefix) -> target distribution after `prefix`; q(prefix) -> drafter distribution. Every
    random branch (draft choice, accept coin, residual pick, bonus) is walked with its probability,
    using the same acceptance_probability / residual_distribution the verifier uses.
    """
    out: dict[tuple[int, ...], float] = {}

    def plain(prefix: tuple[int, ...], mass: float) -> None:
        if len(prefix) == horizon:
            out[prefix] = out.get(prefix, 0.0) + mass
            return
        for t, pt in enumerate(p(prefix)):
            if pt > 0:
                plain(prefix + (t,), mass * pt)

    def step(prefix: tuple[int, ...], i: int, mass: float) -> None:
        if i == k:
            plain(prefix, mass)  # bonus from row k, then the continuation: both from p
            return
        pt, qt = p(prefix), q(prefix)
        for d, qd in enumerate(qt):
            if qd == 0:
                continue
            a = acceptance_probability(pt[d], qd)
            if a > 0:
                step(prefix + (d,), i + 1, mass * qd * a)
            if a < 1:
                res = residual_distribution(pt, qt)
                rec = pt if res is None else res
                for t, rt in enumerate(rec):
                    if rt > 0:
                        plain(prefix + (t,), mass * qd * (1 - a) * rt)

    step((), 0, 1.0)
    return out


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    n_vocab=st.integers(2, 4),
    k=st.integers(1, 2),
    sparse=st.booleans(),
)
def test_rejection_is_exactly_lossless(seed: int, n_vocab: int, k: int, sparse: bool) -> None:
    rng = np.random.default_rng(seed)
    horizon = k + 1
    ptab: dict[tuple[int, ...], np.ndarray] = {}
    qtab: dict[tuple[int, ...], np.ndarray] = {}
    for length in range(horizon):
        for prefix in itertools.product(range(n_vocab), repeat=length):
            ptab[prefix] = random_table(rng, n_vocab, sparse)
            qtab[prefix] = random_table(rng, n_vocab, sparse)
    got = enumerate_round(ptab.__getitem__, qtab.__getitem__, k, n_vocab, horizon)
    for seq in itertools.product(range(n_vocab), repeat=horizon):
        target = math.prod(ptab[seq[:j]][seq[j]] for j in range(horizon))
        assert got.get(seq, 0.0) == pytest.approx(target, abs=1e-12)


def test_residual_and_acceptance_edge_cases() -> None:
    assert acceptance_probability(0.2, 0.0) == 0.0
    assert acceptance_probability(0.5, 0.25) == 1.0
    assert acceptance_probability(0.1, 0.4) == pytest.approx(0.25)
    p = np.array([0.5, 0.5, 0.0])
    assert residual_distribution(p, p) is None
    np.testing.assert_allclose(residual_distribution(p, np.array([1.0, 0.0, 0.0])), [0.0, 1.0, 0.0])


def chi2_threshold(df: int, z: float = 4.75) -> float:
    """Wilson–Hilferty chi-square quantile at p ≈ 1e-6 (no scipy here)."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * math.sqrt(c)) ** 3


@pytest.mark.parametrize("with_probs", [True, False])
def test_rejection_verifier_frequencies_match_target(with_probs: bool) -> None:
    """The real verify_rejection (not the enumeration) against the target's joint, seeded, 2 drafts."""
    n_vocab, k, n = 4, 2, 5000
    params = SamplingParams(temperature=0.9, top_k=3, top_p=1.0, min_p=0.0)
    rng = np.random.default_rng(11)
    tgt_logits = {pre: rng.normal(scale=1.5, size=n_vocab).astype(np.float32)
                  for length in range(k + 1) for pre in itertools.product(range(n_vocab), repeat=length)}
    drf = {pre: random_table(rng, n_vocab, sparse=False) for pre in tgt_logits}

    p_table = {pre: dense(*Sampler(params, n_vocab, 0).distribution(lg), n_vocab) for pre, lg in tgt_logits.items()}
    cdf_table = {pre: np.cumsum(p) for pre, p in p_table.items()}
    q_cdf = {pre: np.cumsum(q) for pre, q in drf.items()}

    def p_of(prefix: tuple[int, ...]) -> np.ndarray:
        return p_table[prefix]

    def draw(cdf: np.ndarray) -> int:
        return min(int(np.searchsorted(cdf, draws.random() * cdf[-1], side="right")), len(cdf) - 1)

    sampler = Sampler(params, n_vocab, seed=5)
    coin = np.random.default_rng(6)
    draws = np.random.default_rng(7)
    counts: dict[tuple[int, ...], int] = {}
    accepted_total = 0
    for _ in range(n):
        draft: list[int] = []
        for _i in range(k):
            draft.append(draw(q_cdf[tuple(draft)]) if with_probs else int(draws.integers(n_vocab)))
        probs = np.stack([drf[tuple(draft[:i])] for i in range(k)]).astype(np.float32) if with_probs else None
        logits = np.stack([tgt_logits[tuple(draft[:i])] for i in range(k + 1)])
        res = verify_rejection(draft, probs, logits, sampler, coin)
        assert res.emitted[: res.n_accepted] == draft[: res.n_accepted]
        accepted_total += res.n_accepted
        seq = tuple(res.emitted)
        while len(seq) < k + 1:  # continue plainly to a common horizon
            seq += (draw(cdf_table[seq]),)
        counts[seq] = counts.get(seq, 0) + 1
    chi2, df = 0.0, -1
    for seq in itertools.product(range(n_vocab), repeat=k + 1):
        pt = math.prod(p_of(seq[:j])[seq[j]] for j in range(k + 1))
        if pt == 0:
            assert seq not in counts  # top-k removed it: the verifier must never emit it
            continue
        chi2 += (counts.get(seq, 0) - n * pt) ** 2 / (n * pt)
        df += 1
    assert chi2 < chi2_threshold(df)
    assert accepted_total > 0


@settings(max_examples=200, deadline=None)
@given(k=st.integers(0, 8), seed=st.integers(0, 2**32 - 1), ties=st.booleans())
def test_plain_greedy_argmax_path_equals_sampling_row_by_row(k: int, seed: int, ties: bool) -> None:
    """verify_match's one-argmax path for a plain greedy sampler gives what sampling each row in turn
    gives (the loop a penalised sampler still takes, written out here), EOG rule and ties included."""
    rng = np.random.default_rng(seed)
    logits = rng.integers(0, 3 if ties else 1000, (k + 1, V)).astype(np.float32)
    draft = [int(np.argmax(r)) if rng.random() < 0.7 else int(rng.integers(0, V)) for r in logits[:k]]
    fast = verify_match(draft, logits, Sampler(GREEDY, V, 0), is_eog)
    slow_sampler = Sampler(GREEDY, V, 0)
    out: list[int] = []
    n_acc = k
    for i in range(k):
        t = slow_sampler.sample(logits[i])
        out.append(t)
        if t != draft[i] or (is_eog(t) and i < k - 1):
            n_acc = i
            break
    else:
        out.append(slow_sampler.sample(logits[k]))
    assert (fast.emitted, fast.n_accepted) == (out, n_acc)
