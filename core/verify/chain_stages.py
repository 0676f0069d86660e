"""The sampler chain's stages over a candidate list, for chains the fast path in sampling.py does not
cover (DRY, XTC, typical-p, top-n-sigma, dynamic temperature, Mirostat, or any order of the stages).

Each stage follows llama.cpp's sampler of the same name: its parameters, its neutral values, its
min_keep rule and whether it removes candidates or only lowers their logits. Candidates are
token ids with float64 logits; "sorted" means by descending logit, ties to the lower id, which is
the order every stage that sorts leaves behind. Which token a uniform picks depends on the final
order, so the same chain on the same row always gives the same token for the same draw.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class Candidates:
    ids: np.ndarray  # int64
    logits: np.ndarray  # float64
    is_sorted: bool = False

    @classmethod
    def from_row(cls, row: np.ndarray) -> Candidates:
        """Every token of a (biased) row, but banned ones (-inf); the first token if all are."""
        logits = np.asarray(row, dtype=np.float64)
        allowed = np.flatnonzero(logits > -np.inf)
        if allowed.size == 0:
            allowed = np.zeros(1, dtype=np.int64)
        return cls(allowed.astype(np.int64), logits[allowed].copy())

    @property
    def size(self) -> int:
        return int(self.ids.size)

    def sort(self) -> None:
        if not self.is_sorted:
            order = np.lexsort((self.ids, -self.logits))
            self.ids, self.logits, self.is_sorted = self.ids[order], self.logits[order], True

    def keep(self, n: int) -> None:
        self.ids, self.logits = self.ids[:n], self.logits[:n]

    def select(self, index: np.ndarray, *, still_sorted: bool) -> None:
        self.ids, self.logits = self.ids[index], self.logits[index]
        self.is_sorted = self.is_sorted and still_sorted

    def probs(self) -> np.ndarray:
        return softmax(self.logits)

    def positions(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(positions in this list, which of `tokens` they are) for the tokens that are candidates."""
        order = np.argsort(self.ids, kind="stable")
        found = np.searchsorted(self.ids[order], tokens)
        inside = found < self.size
        inside[inside] = self.ids[order[found[inside]]] == tokens[inside]
        return order[found[inside]], np.flatnonzero(inside)


def softmax(logits: np.ndarray) -> np.ndarray:
    best = logits.max()
    if best == -np.inf:  # nothing has mass: the first keeps it all
        out = np.zeros_like(logits)
        out[0] = 1.0
        return out
    e = np.exp(logits - best)
    return e / e.sum()


def entropy(probs: np.ndarray) -> float:
    p = probs[probs > 0.0]
    return float(-(p * np.log(p)).sum())


def lower_logits(c: Candidates, penalties: Mapping[int, float]) -> None:
    """Subtract a per-token penalty (DRY's) from the candidates it names."""
    if not penalties:
        return
    tokens = np.fromiter(penalties.keys(), dtype=np.int64, count=len(penalties))
    amounts = np.fromiter(penalties.values(), dtype=np.float64, count=len(penalties))
    pos, which = c.positions(tokens)
    c.logits[pos] -= amounts[which]
    c.is_sorted = False


def top_n_sigma(c: Candidates, n: float) -> None:
    """Set every logit more than n standard deviations (of the finite logits) below the best to -inf."""
    if n <= 0.0 or c.size <= 1:
        return
    finite = c.logits[c.logits != -np.inf]
    if finite.size == 0:
        return
    cut = finite.max() - n * float(finite.std())
    c.logits[c.logits < cut] = -np.inf  # the lowest ones: a sorted list stays sorted


def top_k(c: Candidates, k: int) -> None:
    if k <= 0:
        return
    c.sort()
    c.keep(min(k, c.size))


def typical(c: Candidates, p: float, min_keep: int) -> None:
    """Keep the tokens whose surprise is closest to the entropy until they hold more than p."""
    if p >= 1.0:
        return
    c.sort()
    probs = c.probs()
    with np.errstate(divide="ignore"):
        scores = np.abs(-np.log(probs) - entropy(probs))
    order = np.argsort(scores, kind="stable")
    cum = np.cumsum(probs[order])
    first = max(min_keep - 1, 0)
    over = np.flatnonzero(cum[first:] > p)
    last = first + int(over[0]) + 1 if over.size else c.size
    c.select(order[:last], still_sorted=False)


def top_p(c: Candidates, p: float, min_keep: int) -> None:
    if p >= 1.0:
        return
    c.sort()
    cum = np.cumsum(c.probs())
    first = max(min_keep - 1, 0)
    over = np.flatnonzero(cum[first:] >= p)
    c.keep(first + int(over[0]) + 1 if over.size else c.size)


def min_p(c: Candidates, p: float, min_keep: int) -> None:
    if p <= 0.0 or c.size == 0:
        return
    log_p = math.log(p)
    if not c.is_sorted:
        keep = np.flatnonzero(c.logits >= c.logits.max() + log_p)
        if keep.size and keep.size >= min_keep:
            c.select(keep, still_sorted=False)
            return
    c.sort()
    below = np.flatnonzero(c.logits[1:] < c.logits[0] + log_p) + 1
    below = below[below >= min_keep]
    c.keep(int(below[0]) if below.size else c.size)


def xtc(c: Candidates, probability: float, threshold: float, min_keep: int, rng: np.random.Generator) -> None:
    """With `probability` (one draw from `rng`), drop every token at or above `threshold` but the last."""
    if probability <= 0.0 or threshold > 0.5 or c.size < 2:
        return
    if float(rng.random()) > probability:
        return
    c.sort()
    above = c.probs() >= threshold
    pos_last = 0
    if above[0]:
        below = np.flatnonzero(~above)
        pos_last = int(below[0]) - 1 if below.size else c.size - 1
    if c.size - pos_last >= min_keep and pos_last > 0:
        c.select(np.arange(pos_last, c.size), still_sorted=True)


def temperature(c: Candidates, temp: float, dyn_range: float = 0.0, exponent: float = 1.0) -> None:
    """llama.cpp's temp_ext: with a range, the temperature follows the normalised entropy."""
    if dyn_range > 0.0:
        if c.size <= 1:
            return
        low, high = max(0.0, temp - dyn_range), temp + dyn_range
        c.sort()
        normalised = entropy(c.probs()) / math.log(c.size)
        temp = low + (high - low) * normalised ** exponent
    scale(c, temp)


def scale(c: Candidates, temp: float) -> None:
    """Divide by the temperature; at <= 0 keep only the first best candidate."""
    if c.size == 0:
        return
    if temp <= 0.0:
        c.select(np.array([int(np.argmax(c.logits))]), still_sorted=True)
        return
    c.logits = c.logits / temp


def mirostat_v1(c: Candidates, mu: float, n_vocab: int, m: int = 100) -> None:
    """Mirostat 1: estimate the Zipf exponent from the m best, then top-k with the k that targets mu."""
    c.sort()
    if c.size <= 1:
        return
    probs = c.probs()
    n = min(m - 1, c.size - 1)
    i = np.arange(n, dtype=np.float64)
    t = np.log((i + 2.0) / (i + 1.0))
    with np.errstate(all="ignore"):  # numpy scalars: a degenerate estimate is NaN or inf, not an exception
        b = np.log(probs[:n] / probs[1 : n + 1])
        s_hat = np.float64((t * b).sum() / (t * t).sum())
        eps = s_hat - 1.0
        k = float(np.power(eps * np.power(2.0, mu) / (1.0 - np.power(np.float64(n_vocab), -eps)), 1.0 / s_hat))
    if math.isnan(k):
        k_int = 1
    elif k >= c.size:
        k_int = c.size
    else:
        k_int = max(int(k), 1)
    c.keep(k_int)


def mirostat_v2(c: Candidates, mu: float) -> None:
    """Mirostat 2: keep the best tokens while their surprise (-log2 p) is at most mu (at least one)."""
    c.sort()
    with np.errstate(divide="ignore"):
        surprise = -np.log2(c.probs())
    over = np.flatnonzero(surprise > mu)
    c.keep(max(int(over[0]) if over.size else c.size, 1))
