"""How often a model drafter's token is accepted, given how sure the drafter was of it.

A model drafter (a draft model, an EAGLE-3 / DFlash / MTP head) chooses each token with a
probability of its own: the softmax weight of the chosen token among its best candidates. That
number is the best single predictor of acceptance there is (on SmolLM2's held-out chats its shipped
EAGLE-3 head's first tokens are accepted about 10 % of the time at confidence 0.2-0.3 and over 80 %
at 0.9 and above, while their average is 0.3), but it is not a probability of acceptance as it stands:
it is a softmax over a few candidates of a small network. So it is calibrated against outcomes: per
drafter, decayed counts of tested and accepted tokens in confidence bins, each bin starting from its
own midpoint as prior. The planner values a draft token at the calibrated rate of its confidence,
instead of the drafter's average rate at that draft position (docs/semantics.md, adaptive lengths).

No torch here (the core never imports it).
"""

from __future__ import annotations

BINS = 10
# A bin's prior is its midpoint, worth PRIOR_WEIGHT observations; every observation in a bin first
# decays that bin's counts by DECAY, so a bin follows the drafter over its last ~1/(1 - DECAY) tokens
# there (the same head is right more often on code than on chat, and requests come and go).
PRIOR_WEIGHT = 2.0
DECAY = 0.98


def _bin(confidence: float) -> int:
    if not confidence > 0.0:  # also NaN
        return 0
    return min(int(confidence * BINS), BINS - 1)


class ConfidenceCalibration:
    """Per drafter: P(token accepted | the tokens before it accepted, its confidence bin)."""

    def __init__(self) -> None:
        self._hit: dict[str, list[float]] = {}
        self._seen: dict[str, list[float]] = {}

    def observe(self, drafter: str, confidence: list[float], n_accepted: int) -> None:
        """A verified draft with these confidences, of which the first n_accepted were accepted; the
        positions after the first rejection were not tested and teach nothing."""
        hit = self._hit.setdefault(drafter, [0.0] * BINS)
        seen = self._seen.setdefault(drafter, [0.0] * BINS)
        for i, c in enumerate(confidence[: n_accepted + 1]):
            b = _bin(c)
            hit[b] = hit[b] * DECAY + (1.0 if i < n_accepted else 0.0)
            seen[b] = seen[b] * DECAY + 1.0

    def rate(self, drafter: str, confidence: float) -> float:
        b = _bin(confidence)
        prior = ((b + 0.5) / BINS) ** 2
        seen = self._seen.get(drafter)
        if seen is None:
            return prior
        return (self._hit[drafter][b] + PRIOR_WEIGHT * prior) / (seen[b] + PRIOR_WEIGHT)

    def cumulative(self, drafter: str, confidence: list[float]) -> list[float]:
        """[P(first 1 accepted), ..., P(all accepted)] of a draft with these confidences."""
        out: list[float] = []
        p = 1.0
        for c in confidence:
            p *= self.rate(drafter, c)
            out.append(p)
        return out
