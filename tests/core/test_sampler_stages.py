"""Each sampler stage against llama.cpp's reference cases (its tests/test-sampling.cpp, reproduced here
as input distributions and expected outputs), DRY's repeat detection and breakers, Mirostat's mu,
and the `samplers` order."""

from __future__ import annotations

import math

import numpy as np
import pytest

from spekula.core.errors import ConfigError
from spekula.core.params import DEFAULT_SAMPLERS, SamplingParams
from spekula.core.verify.dry import DryHistory, breaker_sequences
from spekula.core.verify.sampler_chain import samplers_from_chars, samplers_from_names
from spekula.core.verify.sampling import Sampler

P4 = [0.1, 0.2, 0.3, 0.4]


def only(stage: str, **kw: object) -> SamplingParams:
    """A chain of one stage (no temperature stage: the draw is from its plain softmax)."""
    return SamplingParams(samplers=(stage,), min_keep=0, **kw)  # type: ignore[arg-type]


def dist(params: SamplingParams, probs: list[float], history: tuple[int, ...] = (), seed: int = 0,
         breakers: dict[int, tuple[tuple[int, ...], ...]] | None = None) -> dict[int, float]:
    s = Sampler(params, len(probs), seed, breakers if breakers is not None else {})
    s.accept_many(history)
    with np.errstate(divide="ignore"):
        ids, p = s.distribution(np.log(np.asarray(probs, dtype=np.float32)))
    return {int(i): float(x) for i, x in zip(ids, p, strict=True)}


def close(got: dict[int, float], want: dict[int, float]) -> None:
    """Each token's probability within llama.cpp's test tolerance (a token not listed: 0)."""
    for k in set(got) | set(want):
        assert got.get(k, 0.0) == pytest.approx(want.get(k, 0.0), abs=1e-5), (k, got, want)


def test_temperature_zero_keeps_the_best_and_one_keeps_all() -> None:
    close(dist(only("temperature", temperature=1.0), P4), {0: 0.1, 1: 0.2, 2: 0.3, 3: 0.4})
    close(dist(only("temperature", temperature=0.0), P4), {3: 1.0})


def test_dynamic_temperature() -> None:
    # range 0 is the plain temperature
    close(dist(only("temperature", temperature=1.0, dynatemp_range=0.0), P4), {0: 0.1, 1: 0.2, 2: 0.3, 3: 0.4})
    # with a range, the temperature is low + (high - low) * (entropy / max entropy)^exponent
    probs = np.array(P4)
    norm = float(-(probs * np.log(probs)).sum() / math.log(4))
    for exponent in (1.0, 2.0):
        t = 0.5 + 1.0 * norm ** exponent
        want = probs ** (1 / t) / (probs ** (1 / t)).sum()
        got = dist(only("temperature", temperature=1.0, dynatemp_range=0.5, dynatemp_exponent=exponent), P4)
        close(got, dict(enumerate(want.tolist())))


def test_top_k_top_p_min_p_cases() -> None:
    close(dist(only("top_k", top_k=1), P4), {3: 1.0})
    close(dist(only("top_k", top_k=3), P4), {3: 0.44444, 2: 0.33333, 1: 0.22222})
    close(dist(only("top_k", top_k=4), P4), dict(enumerate(P4)))
    close(dist(only("top_k", top_k=0), P4), dict(enumerate(P4)))
    close(dist(only("top_p", top_p=0.0), P4), {3: 1.0})
    close(dist(only("top_p", top_p=0.7), P4), {3: 0.571429, 2: 0.428571})
    close(dist(only("top_p", top_p=0.8), P4), {3: 0.44444, 2: 0.33333, 1: 0.22222})
    close(dist(only("top_p", top_p=1.0), P4), dict(enumerate(P4)))
    for p, want in ((0.0, dict(enumerate(P4))), (0.24, dict(enumerate(P4))),
                    (0.26, {1: 0.2 / 0.9, 2: 0.3 / 0.9, 3: 0.4 / 0.9}), (0.49, {1: 0.2 / 0.9, 2: 0.3 / 0.9, 3: 0.4 / 0.9}),
                    (0.51, {2: 0.3 / 0.7, 3: 0.4 / 0.7}), (0.74, {2: 0.3 / 0.7, 3: 0.4 / 0.7}),
                    (0.76, {3: 1.0}), (1.0, {3: 1.0})):
        close(dist(only("min_p", min_p=p), P4), want)


def test_xtc_removes_all_above_the_threshold_but_the_least_likely() -> None:
    q = [0.4, 0.3, 0.2, 0.1]
    for threshold, kept in ((0.09, {3}), (0.19, {2, 3}), (0.29, {1, 2, 3}), (0.39, {0, 1, 2, 3})):
        got = dist(only("xtc", xtc_probability=1.0, xtc_threshold=threshold), q)
        close(got, {i: q[i] / sum(q[j] for j in kept) for i in kept})
    # above 0.5 or at probability 0 it is off (and draws nothing)
    close(dist(only("xtc", xtc_probability=1.0, xtc_threshold=0.6), q), dict(enumerate(q)))


def test_xtc_applies_with_its_probability_from_its_own_generator() -> None:
    q = [0.4, 0.3, 0.2, 0.1]
    s = Sampler(only("xtc", xtc_probability=0.5, xtc_threshold=0.09), 4, seed=7)
    rows = np.log(np.asarray(q, dtype=np.float32))
    applied = [len(s.distribution(rows)[0]) == 1 for _ in range(400)]
    assert 150 < sum(applied) < 250
    assert s._rng is None  # the draw's generator was never touched


def test_typical() -> None:
    close(dist(only("typ_p", typical_p=0.5), [0.97, 0.01, 0.01, 0.01]), {0: 1.0})
    close(dist(only("typ_p", typical_p=0.5), [0.4, 0.2, 0.2, 0.2]), {1: 1 / 3, 2: 1 / 3, 3: 1 / 3})


def test_penalties_cases() -> None:
    five = [0.2] * 5
    pen = {"repeat_last_n": 64}
    close(dist(only("penalties", repeat_penalty=50.0, **pen), five, (0,)), {1: .25, 2: .25, 3: .25, 4: .25})
    close(dist(only("penalties", repeat_penalty=50.0, **pen), five, (0, 1, 2)), {3: .5, 4: .5})
    close(dist(only("penalties", repeat_penalty=50.0, **pen), five, (0, 1, 2, 0, 0)), {3: .5, 4: .5})
    fp = {"frequency_penalty": 5.0, "presence_penalty": 5.0, **pen}
    close(dist(only("penalties", **fp), five, (0,)), {0: 0.000011, 1: .249997, 2: .249997, 3: .249997, 4: .249997})
    close(dist(only("penalties", **fp), five, (0, 1, 2)),
          {0: 0.000023, 1: 0.000023, 2: 0.000023, 3: 0.499966, 4: 0.499966})
    close(dist(only("penalties", **fp), five, (0, 1, 2, 0, 0)),
          {1: 0.000023, 2: 0.000023, 3: 0.499977, 4: 0.499977})


def dry(mult: float, base: float, allowed: int, last_n: int) -> SamplingParams:
    return only("dry", dry_multiplier=mult, dry_base=base, dry_allowed_length=allowed, dry_penalty_last_n=last_n)


def test_dry_cases() -> None:
    quarter = [0.25] * 4
    fifth = [0.2] * 5
    close(dist(dry(1.0, 1.1, 2, 4), quarter, (0, 1)), dict(enumerate(quarter)))
    close(dist(dry(1.0, 1.1, 2, 5), quarter, (0, 1, 2, 0, 1)),
          {0: 0.296923, 1: 0.296923, 2: 0.109232, 3: 0.296923})
    # token 3 breaks the sequence: the repeat of (0, 1) cannot reach back across it
    close(dist(dry(1.0, 1.1, 2, 6), fifth, (0, 1, 3, 4, 0, 1), breakers={3: ((),)}), dict(enumerate(fifth)))
    close(dist(dry(2.0, 1.1, 2, 5), fifth, (0, 1, 2, 0, 1)),
          {0: 0.241818, 1: 0.241818, 2: 0.032727, 3: 0.241818, 4: 0.241818})
    close(dist(dry(1.0, 1.1, 4, 7), fifth, (0, 1, 2, 3, 4, 0, 1)), dict(enumerate(fifth)))


def test_dry_repeat_lengths_and_breakers() -> None:
    # "a b c c b c y a b c": c would extend "a b c" (3), b extends "c" (1), y extends "b c" (2)
    a, b, c, y = 0, 1, 2, 3
    h = DryHistory(1.0, 2.0, 2, 64, {})
    for t in (a, b, c, c, b, c, y, a, b, c):
        h.accept(t)
    assert h.penalties() == {c: 2.0 ** 1, y: 2.0 ** 0}  # lengths 3 and 2 reach allowed 2; b's 1 does not
    # a two-token breaker (y then a) limits a repeat to the 2 tokens after it
    h.breakers = {y: ((a,),)}
    assert h.penalties() == {c: 1.0, y: 1.0}
    # a token that is a breaker by itself limits the reach and is never penalised
    h.breakers = {y: ((),)}
    assert h.penalties() == {c: 2.0}
    h.breakers = {c: ((),)}  # the newest token is a breaker: nothing before it repeats
    assert h.penalties() == {}
    # only the last n tokens count
    short = DryHistory(1.0, 2.0, 1, 3, {})
    for t in (a, b, c, c, b, c, y, a, b, c):
        short.accept(t)
    assert short.penalties() == {}


class _Vocab:
    """Token texts for breaker_sequences: single tokens and a tokenizer of the rest."""

    def __init__(self, texts: list[str]) -> None:
        self.texts, self.n_vocab = texts, len(texts)

    def token_bytes(self, token: int) -> bytes:
        return self.texts[token].encode()

    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return [self.texts.index(ch) for ch in text]


def test_breaker_sequences_from_strings() -> None:
    vocab = _Vocab(["a", "b", ":", "x:", "ab", "b:", "c"])
    got = breaker_sequences(vocab, [":", "ab"])
    assert got[2] == ((),) and got[3] == ((),) and got[5] == ((),)  # every token containing ':'
    assert got[4] == ((),)  # contains "ab"
    assert got[0] == ((1,),)  # "a" then "b" spells "ab"
    assert 6 not in got and 1 not in got


def test_top_n_sigma_cases() -> None:
    close(dist(only("top_n_sigma", top_n_sigma=1.0), P4), {2: 0.428571, 3: 0.571429})
    close(dist(only("top_n_sigma", top_n_sigma=0.0), P4), dict(enumerate(P4)))
    close(dist(only("top_n_sigma", top_n_sigma=3.0), P4), dict(enumerate(P4)))


@pytest.mark.parametrize(("order", "top_k", "top_p", "min_p"), [
    ("k", 10000, 1.0, 1.0), ("k", 1, 1.0, 1.0), ("p", 10000, 1.0, 1.0), ("p", 10000, 0.0, 1.0),
    ("m", 10000, 1.0, 1.0), ("m", 10000, 1.0, 1e-12), ("k", 100, 1.0, 1.0), ("p", 10000, 0.0003, 1.0),
    ("p", 10000, 0.8, 1.0), ("m", 10000, 1.0, 9997.9 / 9999.0), ("m", 10000, 1.0, 0.1),
    ("kp", 100, 0.8, 0.1), ("km", 100, 0.8, 0.1), ("pk", 100, 0.8, 0.1), ("pm", 100, 0.8, 0.1),
    ("mk", 100, 0.8, 0.1), ("mp", 100, 0.8, 9997.9 / 9999.0), ("mp", 100, 0.8, 0.1), ("kpm", 100, 0.8, 0.1),
    ("kmp", 100, 0.8, 0.1), ("pkm", 100, 0.8, 0.1), ("pmk", 100, 0.8, 0.1), ("mkp", 100, 0.8, 0.1),
    ("mpk", 100, 0.8, 0.1),
])
def test_sampler_queue(order: str, top_k: int, top_p: float, min_p: float) -> None:
    """llama.cpp's sampler-queue cases: logits log(id) over 10000 tokens; after each stage the kept
    tokens are n-1 down to the smallest id its formulas give. (Token 0, log 0 = -inf, has no mass:
    spekula leaves it out from the start, where llama.cpp carries it along.)"""
    n = 10000
    with np.errstate(divide="ignore"):
        row = np.log(np.arange(n, dtype=np.float32))
    min_id = 0
    for i, stage in enumerate(order):
        params = SamplingParams(samplers=samplers_from_chars(order[: i + 1]), top_k=top_k, top_p=top_p,
                                min_p=min_p, min_keep=1)
        ids, _ = Sampler(params, n, 0).distribution(row)
        size = len(ids)
        if stage == "k":
            min_id = max(min_id, n - top_k)
        elif stage == "p":
            target = math.ceil(np.float32(top_p) * (n * (n - 1) // 2 - min_id * (min_id - 1) // 2))
            min_id, cum = n, 0
            while True:  # at least one token is always kept
                min_id -= 1
                cum += min_id
                if cum >= target:
                    break
            if min_id == 1:
                min_id = 0
        else:
            min_id = min(max(math.floor(np.float32(min_p) * n), 1, n - size), n - 1)
        assert sorted(ids.tolist()) == list(range(max(min_id, 1), n)), (order[: i + 1], size, min_id)


def test_mirostat_keeps_mu_per_emitted_token_only() -> None:
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(6, 50)).astype(np.float32) * 3
    for version in (1, 2):
        params = SamplingParams(mirostat=version, mirostat_tau=3.0, mirostat_eta=0.5, temperature=1.0)
        s = Sampler(params, 50, seed=3)
        assert s.mu == 6.0
        s.accept_many([1, 2, 3])  # the prompt moves no mu
        assert s.mu == 6.0
        for row in rows:
            ids, probs = s.distribution(row)
            if version == 2:  # the tokens whose surprise is within mu (at least the best)
                surprise = -np.log2(_renormal(row, np.arange(50)))
                within = set(np.flatnonzero(surprise <= s.mu).tolist()) or {int(np.argmax(row))}
                assert set(ids.tolist()) == within
            tok = int(ids[0])
            before = s.mu
            s.accept(tok)
            assert s.mu == pytest.approx(before - 0.5 * (-math.log2(float(probs[0])) - 3.0))


def _renormal(row: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The full-vocabulary probabilities of `ids` (what Mirostat 2 compares with mu)."""
    e = np.exp(row.astype(np.float64) - row.max())
    return e[ids] / e.sum()


def test_mirostat_ignores_the_chain_and_greedy_takes_the_best() -> None:
    row = np.log(np.asarray(P4, dtype=np.float32))
    s = Sampler(SamplingParams(mirostat=2, temperature=0.0, repeat_penalty=50.0), 4, 0)
    s.accept_many([3, 3])
    assert s.sample(row) == 3 and s.plain_greedy  # penalties are not in Mirostat's chain


def test_order_is_honoured() -> None:
    """top-k before temperature differs from top-p before or after temperature."""
    probs = [0.5, 0.3, 0.15, 0.05]
    tp_first = SamplingParams(samplers=("top_p", "temperature"), top_p=0.75, temperature=3.0)
    temp_first = SamplingParams(samplers=("temperature", "top_p"), top_p=0.75, temperature=3.0)
    assert set(dist(tp_first, probs)) == {0, 1}
    assert set(dist(temp_first, probs)) == {0, 1, 2}  # flattened first: more tokens to reach 0.75
    # a chain without temperature draws from the plain softmax, even at temperature 0
    no_temp = SamplingParams(samplers=("top_k",), top_k=2, temperature=0.0)
    assert not no_temp.greedy
    close(dist(no_temp, probs), {0: 0.5 / 0.8, 1: 0.3 / 0.8})


def test_default_chain_general_path_matches_the_fast_path() -> None:
    """The same chain through the stage-by-stage path (forced by a DRY that penalises nothing) gives
    the fast path's distribution."""
    rng = np.random.default_rng(1)
    for _ in range(20):
        row = (rng.normal(size=300) * 2).astype(np.float32)
        base = SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.02, repeat_penalty=1.3)
        fast = Sampler(base, 300, 0)
        staged = Sampler(base.with_(dry_multiplier=1.0, dry_allowed_length=1000), 300, 0, {})
        for s in (fast, staged):
            s.accept_many([1, 2, 3, 1])
        assert not staged._fast
        (i1, p1), (i2, p2) = fast.distribution(row), staged.distribution(row)
        assert i1.tolist() == i2.tolist()
        np.testing.assert_allclose(p1, p2, rtol=1e-9)


def test_names_chars_and_refusals() -> None:
    assert samplers_from_chars("edskypmxt") == DEFAULT_SAMPLERS
    assert samplers_from_names(["penalties", "DRY", "top-n-sigma", "topk", "typ", "nucleus", "min_p", "xtc", "temp"]) \
        == DEFAULT_SAMPLERS
    for bad in (lambda: samplers_from_chars("kz"), lambda: samplers_from_names(["top_q"]),
                lambda: samplers_from_names(["infill"]), lambda: samplers_from_chars("a")):
        with pytest.raises(ConfigError):
            bad()


@pytest.mark.parametrize("field", [
    {"dry_multiplier": -1.0}, {"dry_base": 0.5}, {"dry_allowed_length": -1}, {"dry_penalty_last_n": -1},
    {"dry_sequence_breakers": ("x",) * 33}, {"xtc_probability": 1.5}, {"xtc_threshold": -0.1}, {"typical_p": 2.0},
    {"mirostat": 3}, {"mirostat_tau": -1.0}, {"mirostat_eta": math.nan}, {"dynatemp_range": -0.5},
    {"dynatemp_exponent": math.inf}, {"top_n_sigma": math.nan}, {"samplers": ("top_k", "adaptive_p")},
])
def test_out_of_range_parameters_are_refused(field: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match=next(iter(field)).split("_")[0]):
        Sampler(SamplingParams(**field), 10, 0, {})  # type: ignore[arg-type]


def test_dry_without_breaker_tokens_is_refused() -> None:
    with pytest.raises(ConfigError, match="DRY"):
        Sampler(SamplingParams(dry_multiplier=0.8), 10, 0)
