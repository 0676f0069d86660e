"""The target's token sampler: llama.cpp's default chain, numpy only.

Chain order (llama.cpp's common sampler): logit bias -> penalties (repeat, then frequency and
presence) -> top-k -> top-p -> min-p -> temperature -> dist. top-p and min-p look at the temperature-1 distribution because they run
before the temperature stage, exactly as in llama.cpp. top-k keeps the k highest logits, ties at the
k-th to the lower token id, found without partitioning the whole row (core/verify/top_entries.py: a
partition of a 49152-wide row cost about a tenth of a SmolLM2 decode step).

`sample` draws exactly one uniform from the request's Generator when temperature > 0 and none when
greedy. Verification by sample-and-match calls `sample` once per verified position, in order, on the
same logits plain decoding would see; that is why speculative output with a fixed seed is
token-identical to plain output.
"""

from __future__ import annotations

import math
import secrets
from collections import Counter, deque
from collections.abc import Iterable

import numpy as np

from spekula.core.errors import ConfigError
from spekula.core.params import SamplingParams
from spekula.core.verify.top_entries import best_first, bounded_top, partition_top

# Without top-k or min-p, top-p's tokens are looked for within these distances of the best logit
# (a token e^-8 below the best weighs 3e-4 of it) before the whole row is sorted.
TOP_P_SPREADS = (8.0, 16.0)


def resolve_seed(seed: int) -> int:
    """-1 means "random", drawn once per request; any other value must be a uint32."""
    if seed == -1:
        return secrets.randbits(32)
    if not 0 <= seed < 2**32:
        raise ConfigError(f"seed must be -1 (random) or in [0, 2^32); got {seed}")
    return int(seed)


def _validate(params: SamplingParams) -> None:
    for name in ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not math.isfinite(value):
            raise ConfigError(f"sampling parameter {name} must be finite; got {value}")
    if params.repeat_penalty <= 0.0:
        raise ConfigError(f"repeat_penalty must be > 0; got {params.repeat_penalty}")
    if not -1 <= params.repeat_last_n < 2**31:
        raise ConfigError(f"repeat_last_n must be in [-1, 2^31); got {params.repeat_last_n}")
    for token, bias in params.logit_bias:
        if not math.isfinite(bias) and bias != -math.inf:
            raise ConfigError(f"logit_bias for token {token} must be finite or -inf (a ban); got {bias}")
    if not -(2**31) <= params.top_k < 2**31:
        raise ConfigError(f"top_k must be a 32-bit integer; got {params.top_k}")
    if not 0 <= params.min_keep < 2**31:
        raise ConfigError(f"min_keep must be in [0, 2^31); got {params.min_keep}")


def banning_end_of_generation(params: SamplingParams, eog_ids: Iterable[int]) -> SamplingParams:
    """llama.cpp's `ignore_eos`: a -inf bias on every end-of-generation token, so none is sampled
    (the engine's own `ignore_eos` only keeps going past one). The frontends apply it, as
    llama-server and llama-cli do when they read the option."""
    bans = tuple((int(t), -math.inf) for t in sorted(eog_ids) if (int(t), -math.inf) not in params.logit_bias)
    return params.with_(logit_bias=(*params.logit_bias, *bans)) if bans else params


def check_bias_tokens(logit_bias: tuple[tuple[int, float], ...], n_vocab: int) -> None:
    bad = next((t for t, _ in logit_bias if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise ConfigError(f"logit_bias names token {bad}, outside the vocabulary [0, {n_vocab})")


class Sampler:
    """One request's sampler: the chain's parameters, the penalty history and the dist RNG."""

    def __init__(self, params: SamplingParams, n_vocab: int, seed: int) -> None:
        _validate(params)
        if n_vocab <= 0:
            raise ConfigError(f"n_vocab must be positive; got {n_vocab}")
        self.params = params
        self.n_vocab = n_vocab
        self.seed = seed
        self._rng: np.random.Generator | None = None  # made at the first draw (see `rng`)
        # -1 means "the whole history" (llama.cpp: the context size); 0 disables the penalty.
        window = None if params.repeat_last_n == -1 else max(params.repeat_last_n, 0)
        self._history: deque[int] = deque(maxlen=window)
        self._counts: Counter[int] = Counter()
        check_bias_tokens(params.logit_bias, n_vocab)
        self._bias_ids = np.array([t for t, _ in params.logit_bias], dtype=np.int64)
        self._bias = np.array([b for _, b in params.logit_bias], dtype=np.float32)

    @property
    def rng(self) -> np.random.Generator:
        """The dist RNG, seeded with `seed`, made when first drawn from: greedy requests never draw, and
        numpy.random's import and a generator's seeding are a few milliseconds of a command's start."""
        if self._rng is None:
            self._rng = np.random.default_rng(self.seed)
        return self._rng

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    @property
    def plain_greedy(self) -> bool:
        """Greedy with no repetition penalty or bias: every row's token is its raw argmax, whatever came
        before."""
        return self.params.greedy and not self._penalize and not self._bias_ids.size

    @property
    def _penalize(self) -> bool:
        p = self.params
        return p.repeat_last_n != 0 and (p.repeat_penalty != 1.0 or p.frequency_penalty != 0.0
                                         or p.presence_penalty != 0.0)

    # --- chain -------------------------------------------------------------------------------

    def _penalized(self, logits: np.ndarray) -> np.ndarray:
        row = np.asarray(logits, dtype=np.float32)
        if row.shape != (self.n_vocab,):
            raise ValueError(f"expected a logits row of shape ({self.n_vocab},); got {row.shape}")
        penalize = self._penalize and bool(self._counts)
        if not (self._bias_ids.size or penalize):
            return row
        row = row.copy()
        if self._bias_ids.size:
            np.add.at(row, self._bias_ids, self._bias)  # unbuffered: a token named twice gets both biases
        if not penalize:
            return row
        ids = np.fromiter(self._counts.keys(), dtype=np.int64, count=len(self._counts))
        counts = np.fromiter(self._counts.values(), dtype=np.float32, count=len(self._counts))
        inside = (ids >= 0) & (ids < self.n_vocab)
        ids, counts = ids[inside], counts[inside]
        vals = row[ids]
        p = self.params
        pen = np.float32(p.repeat_penalty)
        # Multiply non-positive logits instead of dividing, so a penalty never makes them likelier.
        vals = np.where(vals <= 0, vals * pen, vals / pen)
        if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            vals = vals - (counts * np.float32(p.frequency_penalty) + np.float32(p.presence_penalty))
        row[ids] = vals
        return row

    def distribution(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Post-chain candidates: ids (int64) sorted by descending probability, probs (float64, sum 1)."""
        row = self._penalized(logits)
        p = self.params
        if p.greedy:
            return np.array([int(np.argmax(row))], dtype=np.int64), np.ones(1, dtype=np.float64)

        top_k = 0 < p.top_k < self.n_vocab
        vocab_mass = 0.0
        if top_k:
            ids = top_k_ids(row, p.top_k)
        else:
            ids, vocab_mass = self._without_top_k(row)
        lg = row[ids].astype(np.float64)
        if lg[-1] == -np.inf:  # banned tokens (a -inf bias) have no mass; if every one is, the first stays
            keep = max(int(np.count_nonzero(lg > -np.inf)), 1)
            ids, lg = ids[:keep], lg[:keep]
            if lg[0] == -np.inf:
                return ids, np.ones(1, dtype=np.float64)

        if p.top_p < 1.0:
            probs = _softmax(lg) if top_k or not vocab_mass else np.exp(lg - lg[0]) / vocab_mass
            cum = np.cumsum(probs)
            keep = int(np.searchsorted(cum, p.top_p, side="left")) + 1  # first index with cum >= p
            keep = min(max(keep, 1, p.min_keep), len(ids))
            ids, lg = ids[:keep], lg[:keep]

        if p.min_p > 0.0:
            keep = int(np.count_nonzero(lg >= lg[0] + math.log(p.min_p)))
            keep = min(max(keep, 1, p.min_keep), len(ids))
            ids, lg = ids[:keep], lg[:keep]

        return ids, _softmax(lg / p.temperature)

    def _without_top_k(self, row: np.ndarray) -> tuple[np.ndarray, float]:
        """The candidates in the chain's order when there is no top-k, and the mass top-p weighs them
        against (0.0 without top-p). Every token could be kept, but sorting a 49152-wide row takes
        longer than a SmolLM2 forward, so only a leading part of the order is made where it is known to
        hold every token the chain can keep: the tokens min-p keeps (within a factor of the best), or,
        without min-p, the tokens near the best once they hold top_p of the mass. top-p weighs each
        token against the whole vocabulary's mass summed in id order, so the result does not depend on
        how much was sorted."""
        p = self.params
        row64 = row.astype(np.float64)
        best = float(row64.max())
        if not math.isfinite(best):  # NaN, +inf or nothing allowed: the whole row, in order
            return np.argsort(-row, kind="stable").astype(np.int64), 0.0
        mass = float(np.exp(row64 - best).sum()) if p.top_p < 1.0 else 0.0
        floor = max(p.min_keep, 1)  # min_keep may keep tokens past both cuts; min-p above 1 keeps none
        if p.min_p > 0.0:
            near = np.flatnonzero(row64 >= best + math.log(p.min_p))
            if near.size >= floor:
                return best_first(row, near, near.size).astype(np.int64), mass
        elif p.top_p < 1.0:
            for spread in TOP_P_SPREADS:
                near = np.flatnonzero(row64 >= best - spread)
                if near.size < floor:
                    continue
                ids = best_first(row, near, near.size)
                if np.cumsum(np.exp(row64[ids] - best) / mass)[-1] >= p.top_p:  # top-p stops within them
                    return ids.astype(np.int64), mass
        return np.argsort(-row, kind="stable").astype(np.int64), mass  # lower ids first among ties

    def sample(self, logits: np.ndarray) -> int:
        """One token; exactly one RNG draw when temperature > 0, none when greedy."""
        if self.greedy:
            return int(np.argmax(self._penalized(logits)))
        ids, probs = self.distribution(logits)
        return pick(ids, probs, float(self.rng.random()))

    def accept(self, token: int) -> None:
        """Record an emitted token (advances the repetition-penalty window)."""
        if not self._penalize:
            return
        if self._history.maxlen is not None and len(self._history) == self._history.maxlen:
            old = self._history[0]
            self._counts[old] -= 1
            if self._counts[old] <= 0:
                del self._counts[old]
        self._history.append(int(token))
        self._counts[int(token)] += 1

    def accept_many(self, tokens: object) -> None:
        """Record several tokens in order (e.g. the prompt, as llama-server does before generating)."""
        for t in np.asarray(tokens, dtype=np.int64).ravel():
            self.accept(int(t))

    def clone(self) -> Sampler:
        """An independent copy with the same RNG state and history."""
        other = Sampler.__new__(Sampler)
        other.params = self.params
        other.n_vocab = self.n_vocab
        other.seed = self.seed
        other._rng = None
        if self._rng is not None:  # else the copy makes its own from the same seed, as this one would
            other._rng = np.random.default_rng()
            other._rng.bit_generator.state = self._rng.bit_generator.state
        other._history = deque(self._history, maxlen=self._history.maxlen)
        other._counts = Counter(self._counts)
        other._bias_ids, other._bias = self._bias_ids, self._bias
        return other


def top_k_ids(row: np.ndarray, k: int) -> np.ndarray:
    """The k highest logits' ids, highest first, ties to the lower id (int64): by the group-maxima bound
    where it applies, else by a partition that finds the k-th highest value and then orders every
    entry tied with it or above (NaN entries left out, unless too few others remain)."""
    ids = bounded_top(row, k)
    if ids is None:
        ids = partition_top(row, k)
        if ids.size < k:  # NaN among the k best: as a partition ranks it
            ids = best_first(row, np.argpartition(-row, k - 1)[:k], k)
    return ids.astype(np.int64)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def pick(ids: np.ndarray, probs: np.ndarray, u: float) -> int:
    """Inverse-CDF pick with a uniform u in [0, 1): the first id whose cumulative mass exceeds u."""
    cdf = np.cumsum(probs)
    i = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    return int(ids[min(i, len(ids) - 1)])


def dense(ids: np.ndarray, probs: np.ndarray, n_vocab: int) -> np.ndarray:
    """Scatter a candidate list into a float64 [n_vocab] probability vector (0 outside the list)."""
    out = np.zeros(n_vocab, dtype=np.float64)
    out[ids] = probs
    return out
