"""Draft verification: pure functions of (draft, target logits, sampler[, rng]).

Vocabulary used across the project:

- **draft**: the k tokens a drafter proposed after the last target token x.
- **accepted**: the longest draft prefix the verifier keeps; ``n_accepted`` in [0, k].
- **recovered**: the target's token at the first rejected position (sample-and-match: the target's
  own sample; rejection sampling: a sample from the residual ``normalize(max(0, p - q))``).
- **bonus**: the extra target token drawn from row k when every draft token was accepted.
- **emitted**: accepted + exactly one recovered-or-bonus token, so 1 <= len(emitted) <= k + 1.

``target_logits`` is float32 [k+1, V]: row i scores the position of draft[i] (row 0 follows x),
row k is the bonus row. The sampler's state (penalty and DRY histories, Mirostat's mu) is advanced with
every emitted token, in order, right after the row it was drawn from; rejected draft tokens never reach it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from spekula.core.verify.sampling import Sampler, dense, pick


@dataclass(slots=True)
class VerifyResult:
    emitted: list[int]  # accepted draft prefix + exactly one target token (recovered or bonus)
    n_accepted: int


def _check_shapes(draft: Sequence[int], target_logits: np.ndarray) -> None:
    if target_logits.ndim != 2 or target_logits.shape[0] != len(draft) + 1:
        raise ValueError(f"target_logits must be [k+1, V] with k={len(draft)}; got {target_logits.shape}")


def _take(sampler: Sampler, out: list[int], token: int) -> None:
    sampler.accept(token)
    out.append(token)


def verify_match(
    draft: Sequence[int],
    target_logits: np.ndarray,
    sampler: Sampler,
    is_eog: Callable[[int], bool],
) -> VerifyResult:
    """llama.cpp's sample-and-match: the target samples each row; a draft token survives only if equal.

    The sampler consumes one RNG draw per emitted token on the same rows plain decoding would use,
    so the output is token-identical to non-speculative decoding with the same seed, at any
    temperature. A matched EOG before the last draft position ends the round without a bonus.
    """
    _check_shapes(draft, target_logits)
    k = len(draft)
    if sampler.plain_greedy:
        return _verify_argmax(draft, target_logits, is_eog)
    out: list[int] = []
    for i in range(k):
        t = sampler.sample(target_logits[i])
        _take(sampler, out, t)
        if t != int(draft[i]):
            return VerifyResult(out, i)
        if is_eog(t) and i < k - 1:
            # The EOG counts as the target token of this round: n_accepted excludes it.
            return VerifyResult(out, i)
    _take(sampler, out, sampler.sample(target_logits[k]))
    return VerifyResult(out, k)


def _verify_argmax(draft: Sequence[int], target_logits: np.ndarray, is_eog: Callable[[int], bool]) -> VerifyResult:
    """verify_match for a plain greedy sampler, with one argmax over all rows instead of k + 1 samples:
    the same tokens, since each row's sample is its argmax whatever was accepted before it."""
    k = len(draft)
    if k == 0:  # a plain decode step: one row, one argmax
        return VerifyResult([int(target_logits[0].argmax())], 0)
    targets = np.argmax(target_logits, axis=1)
    mismatch = np.flatnonzero(targets[:k] != np.asarray(draft, dtype=targets.dtype))
    n_acc = int(mismatch[0]) if mismatch.size else k
    for i in range(min(n_acc, k - 1)):  # a matched EOG before the last position ends the round there
        if is_eog(int(targets[i])):
            return VerifyResult([int(t) for t in targets[: i + 1]], i)
    return VerifyResult([int(t) for t in targets[: n_acc + 1]], n_acc)


def acceptance_probability(px: float, qx: float) -> float:
    """P(accept draft token x) = min(1, p(x)/q(x)); 0 when the drafter gave x no mass."""
    if qx <= 0.0:
        return 0.0
    return 1.0 if px >= qx else px / qx


def residual_distribution(p: np.ndarray, q: np.ndarray) -> np.ndarray | None:
    """normalize(max(0, p - q)) over the vocabulary, or None when it has no mass (then p == q on p's support)."""
    r = np.maximum(p - q, 0.0)
    total = float(r.sum())
    if total <= 0.0:
        return None
    return r / total


def verify_rejection(
    draft: Sequence[int],
    draft_probs: np.ndarray | None,
    target_logits: np.ndarray,
    sampler: Sampler,
    rng: np.random.Generator,
) -> VerifyResult:
    """Speculative sampling (Leviathan et al. / Chen et al.): lossless in distribution at any temperature.

    With p the target's post-chain distribution for row i and q the drafter's (``draft_probs[i]``,
    dense [k, V]; None means one-hot drafts, as for n-gram drafters): accept d with probability
    min(1, p(d)/q(d)); on rejection emit a token from normalize(max(0, p - q)). Then
    P(emit x) = q(x)·min(1, p(x)/q(x)) + (1 - Σ_y min(q(y), p(y)))·r(x) = p(x).

    As in llama.cpp, the sampler still samples every visited row (advancing its own RNG once per
    emitted token); that sample is used only when the residual is empty. The acceptance and
    residual uniforms come from ``rng``, a generator separate from the sampler's.
    """
    _check_shapes(draft, target_logits)
    k = len(draft)
    n_vocab = target_logits.shape[1]
    if draft_probs is not None and draft_probs.shape != (k, n_vocab):
        raise ValueError(f"draft_probs must be [k, V] = [{k}, {n_vocab}]; got {draft_probs.shape}")
    out: list[int] = []
    for i in range(k):
        ids, probs = sampler.distribution(target_logits[i])
        t_target = pick(ids, probs, float(sampler.rng.random())) if not sampler.greedy else int(ids[0])
        p = dense(ids, probs, n_vocab)
        d = int(draft[i])
        if draft_probs is None:
            q = np.zeros(n_vocab, dtype=np.float64)
            q[d] = 1.0
        else:
            q = draft_probs[i].astype(np.float64)
        a = acceptance_probability(float(p[d]), float(q[d]))
        # Draw the uniform only for a genuine coin flip, like llama.cpp (U only when px < qx).
        if a >= 1.0 or (a > 0.0 and float(rng.random()) < a):
            _take(sampler, out, d)
            continue
        r = residual_distribution(p, q)
        recovered = t_target if r is None else pick(np.arange(n_vocab), r, float(rng.random()))
        _take(sampler, out, recovered)
        return VerifyResult(out, i)
    _take(sampler, out, sampler.sample(target_logits[k]))
    return VerifyResult(out, k)


def verify_synthetic(
    draft: Sequence[int],
    target_logits: np.ndarray,
    sampler: Sampler,
    cond_rates: Sequence[float],
    rng: np.random.Generator,
    is_eog: Callable[[int], bool],
) -> VerifyResult:
    """Benchmark-only acceptance (docs/semantics.md §1.5): accept draft[i] iff U < cond_rates[i], never a drafted EOG.

    The target still samples every visited row (advancing its RNG), and exactly one double uniform
    per visited position is drawn from ``rng`` (the slot's own generator). ``cond_rates`` are the
    *conditional* rates (see core.synthetic.conditional_rates). With all rates 0 the output equals
    plain decoding and n_accepted is 0. The output is NOT the target's distribution.
    """
    _check_shapes(draft, target_logits)
    k = len(draft)
    out: list[int] = []
    for i in range(k):
        t = sampler.sample(target_logits[i])
        rate = float(cond_rates[i]) if i < len(cond_rates) else 0.0
        d = int(draft[i])
        accepted = float(rng.random()) < rate and not is_eog(d)
        if accepted:
            _take(sampler, out, d)
            continue
        _take(sampler, out, t)
        return VerifyResult(out, i)
    _take(sampler, out, sampler.sample(target_logits[k]))
    return VerifyResult(out, k)


# ---- one verifier per request ------------------------------------------------------------------
# The engine picks the verification rule once, when a request is planned (docs/semantics.md §1.2);
# a round is then `plan.verifier.verify(tokens, probs, logits)`. Each object only binds the pure
# functions above to the request's sampler and random streams.


class Verifier(Protocol):
    """One request's verification rule, bound to its sampler and random streams."""

    def verify(self, draft: Sequence[int], probs: np.ndarray | None, target_logits: np.ndarray) -> VerifyResult:
        """Verify `draft` (with its distributions `probs`, or None) against rows [k+1, V]."""
        ...

    @property
    def takes_argmax(self) -> bool:
        """Whether every emitted token is its row's raw argmax (a plain greedy sampler matching drafts)."""
        ...


class MatchVerifier:
    """Sample-and-match: every n-gram drafter, greedy draft models, and temperature 0."""

    def __init__(self, sampler: Sampler, is_eog: Callable[[int], bool]) -> None:
        self.sampler, self.is_eog = sampler, is_eog

    def verify(self, draft: Sequence[int], probs: np.ndarray | None, target_logits: np.ndarray) -> VerifyResult:
        return verify_match(draft, target_logits, self.sampler, self.is_eog)

    @property
    def takes_argmax(self) -> bool:
        return self.sampler.plain_greedy  # a greedy sampler never gets a rejection verifier


class RejectionVerifier(MatchVerifier):
    """Rejection sampling for drafts that carry their distribution q (probabilistic draft models at
    temperature > 0); a draft without q (an n-gram drafter's) is still matched."""

    def __init__(self, sampler: Sampler, is_eog: Callable[[int], bool], rng: np.random.Generator) -> None:
        super().__init__(sampler, is_eog)
        self.rng = rng

    def verify(self, draft: Sequence[int], probs: np.ndarray | None, target_logits: np.ndarray) -> VerifyResult:
        if draft and probs is not None:
            return verify_rejection(draft, probs, target_logits, self.sampler, self.rng)
        return verify_match(draft, target_logits, self.sampler, self.is_eog)


class SyntheticVerifier(MatchVerifier):
    """Benchmark-only chosen acceptance rates (docs/semantics.md §1.5)."""

    def __init__(self, sampler: Sampler, is_eog: Callable[[int], bool], cond_rates: Sequence[float],
                 rng: np.random.Generator) -> None:
        super().__init__(sampler, is_eog)
        self.cond_rates, self.rng = tuple(cond_rates), rng

    @property
    def takes_argmax(self) -> bool:
        return False  # chosen acceptances emit draft tokens whatever the rows say

    def verify(self, draft: Sequence[int], probs: np.ndarray | None, target_logits: np.ndarray) -> VerifyResult:
        if draft:
            return verify_synthetic(draft, target_logits, self.sampler, self.cond_rates, self.rng, self.is_eog)
        return verify_match(draft, target_logits, self.sampler, self.is_eog)


def choose_verifier(sampler: Sampler, is_eog: Callable[[int], bool], *, probabilistic: bool,
                    synth_rates: Sequence[float] | None, seed: int) -> Verifier:
    """Separate random streams, as in llama.cpp: the rejection uniforms use seed ^ 0x9e3779b9, the
    synthetic acceptance a generator of its own, so neither perturbs the target's draws."""
    if synth_rates is not None:
        return SyntheticVerifier(sampler, is_eog, synth_rates, np.random.default_rng(seed))
    if probabilistic and not sampler.greedy:
        return RejectionVerifier(sampler, is_eog, np.random.default_rng(seed ^ 0x9E3779B9))
    return MatchVerifier(sampler, is_eog)
