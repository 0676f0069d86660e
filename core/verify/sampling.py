"""The target's token sampler: llama.cpp's sampler chain, numpy only.

Logit bias runs first, then the stages of `samplers` in their order (llama.cpp's default: penalties,
DRY, top-n-sigma, top-k, typical-p, top-p, min-p, XTC, temperature), then the draw; Mirostat 1 or
2 replaces the stages with temperature then Mirostat, as in llama.cpp. A chain of only the classic
stages in their default order (penalties, top-k, top-p, min-p, temperature) takes a fast path: top-p
and min-p look at the temperature-1 distribution because they run before the temperature stage;
top-k keeps the k highest logits, ties at the k-th to the lower token id, found without
partitioning the whole row (core/verify/top_entries.py: a partition of a 49152-wide row cost about a
tenth of a SmolLM2 decode step). Every other chain runs stage by stage (core/verify/chain_stages.py).

`sample` draws exactly one uniform from the request's Generator when sampling and none when greedy;
XTC draws its coin from a generator of its own, so turning it on moves no other draw. State that
depends on the output (the penalty and DRY histories, Mirostat's mu) advances in `accept`, once per
emitted token, and Mirostat's mu from the distribution the token was drawn from. Verification by
sample-and-match calls `sample` then `accept` once per emitted position, in order, on the same
logits plain decoding would see, and rejected draft tokens never reach `accept`: that is why
speculative output with a fixed seed is token-identical to plain output.
"""

from __future__ import annotations

import math
import secrets
from collections import Counter, deque
from collections.abc import Iterable

import numpy as np

from spekula.core.errors import ConfigError
from spekula.core.params import SamplingParams
from spekula.core.verify import chain_stages as stages
from spekula.core.verify.dry import Breakers, DryHistory
from spekula.core.verify.sampler_chain import effective_params, fast_path, uses_dry
from spekula.core.verify.sampling_checks import validate
from spekula.core.verify.top_entries import best_first, bounded_top, partition_top

# Without top-k or min-p, top-p's tokens are looked for within these distances of the best logit
# (a token e^-8 below the best weighs 3e-4 of it) before the whole row is sorted.
TOP_P_SPREADS = (8.0, 16.0)
XTC_STREAM = 0x58544321  # XTC's generator: the request's seed with this, apart from the draw's
MIROSTAT_M = 100  # Mirostat 1 estimates the Zipf exponent from this many best tokens


def resolve_seed(seed: int) -> int:
    """-1 means "random", drawn once per request; any other value must be a uint32."""
    if seed == -1:
        return secrets.randbits(32)
    if not 0 <= seed < 2**32:
        raise ConfigError(f"seed must be -1 (random) or in [0, 2^32); got {seed}")
    return int(seed)


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
    """One request's sampler: the chain's parameters, its histories and Mirostat's mu, and its RNGs."""

    def __init__(self, params: SamplingParams, n_vocab: int, seed: int, dry_breakers: Breakers | None = None) -> None:
        validate(params)
        if n_vocab <= 0:
            raise ConfigError(f"n_vocab must be positive; got {n_vocab}")
        self.params = params
        self.n_vocab = n_vocab
        self.seed = seed
        self._eff = effective_params(params)  # what the stages apply
        self._fast = fast_path(self._eff)
        self._rng: np.random.Generator | None = None  # made at the first draw (see `rng`)
        self._xtc_rng: np.random.Generator | None = None
        # -1 means "the whole history" (llama.cpp: the context size); 0 disables the penalty.
        window = None if params.repeat_last_n == -1 else max(params.repeat_last_n, 0)
        self._history: deque[int] = deque(maxlen=window)
        self._counts: Counter[int] = Counter()
        check_bias_tokens(params.logit_bias, n_vocab)
        self._bias_ids = np.array([t for t, _ in params.logit_bias], dtype=np.int64)
        self._bias = np.array([b for _, b in params.logit_bias], dtype=np.float32)
        e = self._eff
        self._dry: DryHistory | None = None
        if uses_dry(params):
            if dry_breakers is None:
                raise ConfigError("DRY needs its sequence breakers as tokens (the engine makes them from the tokenizer)")
            self._dry = DryHistory(e.dry_multiplier, e.dry_base, e.dry_allowed_length, e.dry_penalty_last_n,
                                   dry_breakers)
        self.mu = 2.0 * e.mirostat_tau  # Mirostat's surprise bound, advanced per emitted token
        self._drawn_from: tuple[np.ndarray, np.ndarray] | None = None  # Mirostat: the last distribution

    @property
    def rng(self) -> np.random.Generator:
        """The dist RNG, seeded with `seed`, made when first drawn from: greedy requests never draw, and
        numpy.random's import and a generator's seeding are a few milliseconds of a command's start."""
        if self._rng is None:
            self._rng = np.random.default_rng(self.seed)
        return self._rng

    @property
    def xtc_rng(self) -> np.random.Generator:
        if self._xtc_rng is None:
            self._xtc_rng = np.random.default_rng([self.seed, XTC_STREAM])
        return self._xtc_rng

    @property
    def greedy(self) -> bool:
        return self._eff.greedy

    @property
    def plain_greedy(self) -> bool:
        """Greedy with no repetition penalty, bias or other chain stage that could move the choice:
        every row's token is its raw argmax, whatever came before."""
        return self.greedy and (self._fast or bool(self._eff.mirostat)) and not self._penalize \
            and not self._bias_ids.size

    @property
    def _penalize(self) -> bool:
        p = self._eff
        return not p.mirostat and p.repeat_last_n != 0 and (
            p.repeat_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0)

    # --- chain -------------------------------------------------------------------------------

    def _penalized(self, logits: np.ndarray) -> np.ndarray:
        row = self._biased(logits)
        if not (self._penalize and self._counts):
            return row
        if not self._bias_ids.size:
            row = row.copy()
        ids, counts = self._seen()
        row[ids] = self._penalty_of(row[ids], counts)
        return row

    def _biased(self, logits: np.ndarray) -> np.ndarray:
        row = np.asarray(logits, dtype=np.float32)
        if row.shape != (self.n_vocab,):
            raise ValueError(f"expected a logits row of shape ({self.n_vocab},); got {row.shape}")
        if not self._bias_ids.size:
            return row
        row = row.copy()
        np.add.at(row, self._bias_ids, self._bias)  # unbuffered: a token named twice gets both biases
        return row

    def _seen(self) -> tuple[np.ndarray, np.ndarray]:
        """The tokens in the penalty window (inside the vocabulary) and how often each occurs."""
        ids = np.fromiter(self._counts.keys(), dtype=np.int64, count=len(self._counts))
        counts = np.fromiter(self._counts.values(), dtype=np.float32, count=len(self._counts))
        inside = (ids >= 0) & (ids < self.n_vocab)
        return ids[inside], counts[inside]

    def _penalty_of(self, vals: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """The repeat, frequency and presence penalties on float32 logits of tokens seen `counts` times."""
        p = self._eff
        pen = np.float32(p.repeat_penalty)
        # Multiply non-positive logits instead of dividing, so a penalty never makes them likelier.
        vals = np.where(vals <= 0, vals * pen, vals / pen)
        if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            vals = vals - (counts * np.float32(p.frequency_penalty) + np.float32(p.presence_penalty))
        return vals

    def distribution(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Post-chain candidates: ids (int64) sorted by descending probability, probs (float64, sum 1).
        XTC's coin, if the chain reaches it, is drawn here."""
        if self._eff.mirostat:
            return self._mirostat(logits)
        if not self._fast:
            return self._staged(logits)
        row = self._penalized(logits)
        p = self._eff
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
        p = self._eff
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

    def _staged(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Any other chain: each stage of `samplers` in turn over the candidate list."""
        p = self._eff
        c = stages.Candidates.from_row(self._biased(logits))
        for stage in p.samplers:
            if stage == "penalties" and self._penalize and self._counts:
                ids, counts = self._seen()
                pos, which = c.positions(ids)
                vals = c.logits[pos].astype(np.float32)  # the fast path's float32 arithmetic
                c.logits[pos] = self._penalty_of(vals, counts[which])
                c.is_sorted = False
            elif stage == "dry" and self._dry is not None:
                stages.lower_logits(c, self._dry.penalties())
            elif stage == "top_n_sigma":
                stages.top_n_sigma(c, p.top_n_sigma)
            elif stage == "top_k" and p.top_k < self.n_vocab:
                stages.top_k(c, p.top_k)
            elif stage == "typ_p":
                stages.typical(c, p.typical_p, p.min_keep)
            elif stage == "top_p":
                stages.top_p(c, p.top_p, p.min_keep)
            elif stage == "min_p":
                stages.min_p(c, p.min_p, p.min_keep)
            elif stage == "xtc" and p.xtc_probability > 0.0 and p.xtc_threshold <= 0.5 and c.size >= 2:
                stages.xtc(c, p.xtc_probability, p.xtc_threshold, p.min_keep, self.xtc_rng)
            elif stage == "temperature":
                stages.temperature(c, p.temperature, p.dynatemp_range, p.dynatemp_exponent)
        return _by_probability(c.ids, c.probs())

    def _mirostat(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """llama.cpp's Mirostat chain: logit bias, temperature, then Mirostat 1 or 2 at the current mu.
        Greedy picks the best biased logit (Mirostat could only keep it) and leaves mu alone."""
        row = self._biased(logits)
        if self.greedy:
            self._drawn_from = None
            return np.array([int(np.argmax(row))], dtype=np.int64), np.ones(1, dtype=np.float64)
        c = stages.Candidates.from_row(row)
        stages.scale(c, self._eff.temperature)
        if self._eff.mirostat == 1:
            stages.mirostat_v1(c, self.mu, self.n_vocab, MIROSTAT_M)
        else:
            stages.mirostat_v2(c, self.mu)
        ids, probs = _by_probability(c.ids, c.probs())
        self._drawn_from = (ids, probs)
        return ids, probs

    def sample(self, logits: np.ndarray) -> int:
        """One token; exactly one RNG draw when sampling, none when greedy."""
        if self.greedy and (self._fast or self._eff.mirostat):
            return int(np.argmax(self._penalized(logits)))
        ids, probs = self.distribution(logits)
        if self.greedy:
            return int(ids[0])
        return pick(ids, probs, float(self.rng.random()))

    def accept(self, token: int) -> None:
        """Record an emitted token: the penalty and DRY windows advance, and Mirostat's mu moves by the
        token's surprise under the distribution it was last drawn from (the prompt's tokens, accepted
        with none drawn, leave mu alone)."""
        token = int(token)
        if self._dry is not None:
            self._dry.accept(token)
        if self._drawn_from is not None:
            ids, probs = self._drawn_from
            self._drawn_from = None
            where = np.flatnonzero(ids == token)
            if where.size:
                surprise = -math.log2(float(probs[where[0]]))
                self.mu -= self._eff.mirostat_eta * (surprise - self._eff.mirostat_tau)
        if not self._penalize:
            return
        if self._history.maxlen is not None and len(self._history) == self._history.maxlen:
            old = self._history[0]
            self._counts[old] -= 1
            if self._counts[old] <= 0:
                del self._counts[old]
        self._history.append(token)
        self._counts[token] += 1

    def accept_many(self, tokens: object) -> None:
        """Record several tokens in order (e.g. the prompt, as llama-server does before generating)."""
        for t in np.asarray(tokens, dtype=np.int64).ravel():
            self.accept(int(t))

    def clone(self) -> Sampler:
        """An independent copy with the same RNG states, histories and mu."""
        other = Sampler.__new__(Sampler)
        other.params, other._eff, other._fast = self.params, self._eff, self._fast
        other.n_vocab = self.n_vocab
        other.seed = self.seed
        other._rng = _copy_rng(self._rng)  # None: the copy makes its own from the same seed, as this one would
        other._xtc_rng = _copy_rng(self._xtc_rng)
        other._history = deque(self._history, maxlen=self._history.maxlen)
        other._counts = Counter(self._counts)
        other._bias_ids, other._bias = self._bias_ids, self._bias
        other._dry = None if self._dry is None else self._dry.copy()
        other.mu, other._drawn_from = self.mu, self._drawn_from
        return other


def _copy_rng(rng: np.random.Generator | None) -> np.random.Generator | None:
    if rng is None:
        return None
    out = np.random.default_rng()
    out.bit_generator.state = rng.bit_generator.state
    return out


def _by_probability(ids: np.ndarray, probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Candidates with mass, most likely first (ties to the lower id); the first if none has any."""
    order = np.lexsort((ids, -probs))
    ids, probs = ids[order], probs[order]
    keep = max(int(np.count_nonzero(probs > 0.0)), 1)
    ids, probs = ids[:keep], probs[:keep]
    return ids.astype(np.int64), probs / probs.sum()


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
