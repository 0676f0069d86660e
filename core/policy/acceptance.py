"""Acceptance estimates for the adaptive draft lengths: how likely each draft position of a drafter is
to be accepted, given that all before it were.

Decayed counts per drafter (global) and per (drafter, slot); a slot's counts lean on the drafter's
global ones, which lean on the priors below. No torch here (the core never imports it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# An observation weighs DECAY^age, a slot's own counts start with PRIOR_WEIGHT pseudo-observations
# of the drafter's global estimate, and a drafter nobody has seen yet starts optimistic enough to be
# tried. The first-token prior is above even odds because a draftless drafter only drafts when it
# has found a match, and a model drafter's first token is its best one; a cut made on a pessimistic
# prior costs a whole extra round to verify the rest.
DECAY = 0.9
PRIOR_WEIGHT = 1.5
FIRST_PRIOR = 0.7
LATER_PRIOR = 0.92


@dataclass(slots=True)
class _Counts:
    """Decayed successes / observations per draft position (conditional on the earlier ones), and the
    same pooled over every position after the first.

    The pool is there because a drafter's later positions share most of their behaviour (a copied
    span goes on until it diverges; a model's draft drifts a little more with every token) while
    each of them alone is tested rarely: a draft cut at 15 tokens and fully accepted says little
    about position 40 on its own, but its 14 later positions say a lot about how often this drafter
    goes wrong per token. A position's own counts lean on the pool, and a position never tested
    takes the pool's rate."""

    hit: list[float] = field(default_factory=list)
    seen: list[float] = field(default_factory=list)
    pool_hit: float = 0.0
    pool_seen: float = 0.0

    def observe(self, k: int, n_accepted: int) -> None:
        """A verified draft of k tokens of which the first n_accepted were accepted."""
        n_obs = min(k, n_accepted + 1)  # positions past the first rejection were not tested
        while len(self.seen) < n_obs:
            self.hit.append(0.0)
            self.seen.append(0.0)
        for i in range(len(self.seen)):
            self.hit[i] *= DECAY
            self.seen[i] *= DECAY
        for i in range(n_obs):
            self.seen[i] += 1.0
            if i < n_accepted:
                self.hit[i] += 1.0
        self.pool_hit = self.pool_hit * DECAY + max(n_accepted - 1, 0)
        self.pool_seen = self.pool_seen * DECAY + (n_obs - 1)

    def copy(self) -> _Counts:
        return _Counts(list(self.hit), list(self.seen), self.pool_hit, self.pool_seen)

    def first(self, prior: float, weight: float) -> float:
        if not self.seen:
            return prior
        return (self.hit[0] + weight * prior) / (self.seen[0] + weight)

    def pool(self, prior: float, weight: float) -> float:
        return (self.pool_hit + weight * prior) / (self.pool_seen + weight)

    def later(self, i: int, pool: float, weight: float) -> float:
        """Position i >= 1, given this drafter's pooled rate."""
        if i >= len(self.seen):
            return pool
        return (self.hit[i] + weight * pool) / (self.seen[i] + weight)


class AcceptanceModel:
    """Per-position conditional acceptance, per drafter (global) and per (drafter, slot).

    A request's own counts lean on the drafter's global counts as they were when the request first
    needed them: the global counts go on to take in the request's own observations, and leaning on
    those would count each of them twice (one early rejection would read as two)."""

    def __init__(self) -> None:
        self._global: dict[str, _Counts] = {}
        self._slot: dict[tuple[str, int], _Counts] = {}
        self._base: dict[tuple[str, int], _Counts | None] = {}  # the global counts at the request's start

    def _rates(self, drafter: str, slot: int) -> _Rates:
        key = (drafter, slot)
        if key not in self._base:
            glob = self._global.get(drafter)
            self._base[key] = None if glob is None else glob.copy()
        return _Rates(self._base[key], self._slot.get(key))

    def observe(self, drafter: str, slot: int, k: int, n_accepted: int) -> None:
        if k <= 0:
            return
        self._rates(drafter, slot)  # the request's base, taken before its first observation joins the global counts
        self._global.setdefault(drafter, _Counts()).observe(k, n_accepted)
        self._slot.setdefault((drafter, slot), _Counts()).observe(k, n_accepted)

    def forget_slot(self, slot: int) -> None:
        """A new request on the slot starts from the drafters' global estimates."""
        for table in (self._slot, self._base):
            for key in [key for key in table if key[1] == slot]:
                del table[key]

    def conditional(self, drafter: str, slot: int, i: int) -> float:
        rates = self._rates(drafter, slot)
        return rates.first if i == 0 else rates.later(i)

    def cumulative(self, drafter: str, slot: int, n: int, start: int = 0) -> list[float]:
        """[P(first 1 accepted), ..., P(first n accepted)] of a draft whose first token is at draft
        position `start` (> 0: the rest of a draft whose first `start` tokens were accepted)."""
        if n <= 0:
            return []
        rates = self._rates(drafter, slot)
        p = rates.first if start == 0 else rates.later(start)
        out = [p]
        for i in range(start + 1, start + n):
            p *= rates.later(i)
            out.append(p)
            if p < 1e-4:  # the rest is worth nothing: pad instead of computing
                out.extend([0.0] * (n - len(out)))
                break
        return out


class _Rates:
    """One (drafter, slot)'s conditional rates: the slot's counts over the drafter's global ones over
    the priors."""

    __slots__ = ("_glob", "_own", "_glob_pool", "_pool", "first")

    def __init__(self, glob: _Counts | None, own: _Counts | None) -> None:
        self._glob, self._own = glob, own
        first = glob.first(FIRST_PRIOR, PRIOR_WEIGHT) if glob is not None else FIRST_PRIOR
        self.first = own.first(first, PRIOR_WEIGHT) if own is not None else first
        self._glob_pool = glob.pool(LATER_PRIOR, PRIOR_WEIGHT) if glob is not None else LATER_PRIOR
        self._pool = own.pool(self._glob_pool, PRIOR_WEIGHT) if own is not None else self._glob_pool

    def later(self, i: int) -> float:
        glob, own = self._glob, self._own
        rate = glob.later(i, self._glob_pool, PRIOR_WEIGHT) if glob is not None else self._glob_pool
        if own is None:
            return rate
        # The slot's own position counts lean on the global position's rate, moved by as much as the
        # slot's pool differs from the drafter's: a slot in a copied span is better at every position.
        lean = rate * self._pool / self._glob_pool if self._glob_pool > 0 else rate
        return own.later(i, min(lean, 1.0), PRIOR_WEIGHT)
