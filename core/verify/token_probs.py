"""The target's probabilities for emitted tokens (llama-server's `n_probs`, OpenAI's `logprobs`).

Row j of a round's target logits scored the position of the j-th emitted token, so the
probabilities of every emitted token, drafted or not, come from the target alone: what is reported
is exactly what plain decoding would report for the same tokens. Two views, as in llama-server:

- before sampling (the default): the softmax of the target's scores over the whole vocabulary,
  reported as natural-log probabilities;
- after sampling (`post_sampling_probs`): the distribution the request's sampler chain draws from
  (logit bias, penalties, top-k, top-p, min-p, temperature), reported as probabilities; tokens the
  chain removed are not listed.

No torch here: the scheduler imports this.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from spekula.core.verify.sampling import Sampler
from spekula.core.verify.top_entries import bounded_top, partition_top

# The most alternatives one emitted token lists: every one costs a JSON object per token.
MAX_N_PROBS = 100


@dataclass(frozen=True, slots=True)
class TokenProbs:
    """One emitted token: its own value and the `n` most likely alternatives, best first.

    value is a natural-log probability before sampling, a probability after (see `post_sampling`)."""

    token: int
    value: float
    top: tuple[tuple[int, float], ...]
    post_sampling: bool = False


def _top(ids: np.ndarray, values: np.ndarray, n: int) -> tuple[tuple[int, float], ...]:
    """The n best of (ids, values), by value then by lower id."""
    if n <= 0 or ids.size == 0:
        return ()
    n = min(n, ids.size)
    order = bounded_top(values, n, ids) if n < ids.size else None
    if order is None:  # every entry tied with the n-th competes, so ties go to the lower id
        order = partition_top(values, n, ids)
    return tuple((int(ids[i]), float(values[i])) for i in order)


def pre_sampling(row: np.ndarray, token: int, n: int) -> TokenProbs:
    """Log-softmax of the target's row: the emitted token's and the n best.

    A row of finite float32 scores (the usual case) is exponentiated in float32 and summed in float64:
    float64 exponentials of a 49152-wide row took 0.45 ms, and the whole computation 2.1 ms a token,
    about half a SmolLM2 decode step."""
    if isinstance(row, np.ndarray) and row.dtype == np.float32 and row.ndim == 1 and bool(np.isfinite(row).all()):
        best = row.max()
        logz = float(best) + math.log(float(np.exp(row - best).sum(dtype=np.float64)))
        value = float(row[token]) - logz
        if n <= 0:
            return TokenProbs(int(token), value, ())
        top = bounded_top(row, n) if n < row.size else None
        if top is not None:
            return TokenProbs(int(token), value, tuple((int(i), float(row[i]) - logz) for i in top))
        return TokenProbs(int(token), value, _top(np.arange(row.size), row.astype(np.float64) - logz, n))
    x = np.asarray(row, dtype=np.float64)
    finite = np.isfinite(x)
    m = x[finite].max() if finite.any() else 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        logz = m + np.log(np.exp(x[finite] - m).sum()) if finite.any() else 0.0
    logp = np.where(finite, x - logz, -np.inf)
    ids = np.flatnonzero(finite)
    return TokenProbs(int(token), float(logp[token]), _top(ids, logp[ids], n))


def post_sampling(sampler: Sampler, row: np.ndarray, token: int, n: int) -> TokenProbs:
    """The sampler chain's distribution on this row (the sampler's penalty history must be the one
    the token was drawn with)."""
    ids, probs = sampler.distribution(row)
    keep = probs > 0
    ids, probs = ids[keep], probs[keep]
    hit = np.flatnonzero(ids == token)
    value = float(probs[hit[0]]) if hit.size else 0.0
    return TokenProbs(int(token), value, _top(ids, probs, n), post_sampling=True)


def emitted_probs(rows: np.ndarray, emitted: Sequence[int], n: int, sampler: Sampler | None) -> list[TokenProbs]:
    """Probabilities of each emitted token from its row of the round's logits (rows[j] <-> emitted[j]).

    `sampler`: for the after-sampling view, a copy of the request's sampler as it was before the
    round's first token; it is advanced here token by token, as verification advanced the original."""
    out = []
    for j, token in enumerate(emitted):
        if sampler is None:
            out.append(pre_sampling(rows[j], token, n))
        else:
            out.append(post_sampling(sampler, rows[j], token, n))
            sampler.accept(int(token))
    return out
