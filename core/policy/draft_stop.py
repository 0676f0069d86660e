"""Where a model drafter's draft stops being worth drafting on: the break-even acceptance per position.

A model drafter drafts token by token, and each step costs a forward of its head. The cut after
drafting (core/policy/cost_model.py) keeps a prefix whose expected tokens beat the engine's rate over
the rows' time, valuing token i at P(tokens 1..i accepted), from the drafter's calibrated confidence
(core/policy/confidence.py). That probability never grows along a draft, so once it is low enough
that no longer prefix could pay for its rows and its further steps, every further step is thrown
away by the cut: the head can stop there. With k tokens drafted at cumulative probability p, the
tokens k+1..j are worth at most (j - k) * p, and cost rate * ((j - k) * step + time(j) - time(k));
drafting on can pay only if p reaches the least of these costs per token over j = k+1..n, the
break-even probability at k. It comes from the measured costs of a row and of a head step, so a
head that loses (chat, about one token in four accepted at its first position) stops after a token
or two, and one that pays (sure of its tokens, as on code) drafts on. No torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def break_even(round_time: Callable[[int], float], n: int, rate: float, step_seconds: float) -> list[float]:
    """For k = 0..n-1 tokens drafted: the least P(all k accepted) at which drafting token k+1 (and
    perhaps more, up to n) could pay. `round_time(extra)`: the round's time with `extra` draft rows;
    `rate`: the tokens per second a draft token must beat; `step_seconds`: one more head step."""
    times = [round_time(j) for j in range(n + 1)]
    return [min(rate * (step_seconds + (times[j] - times[k]) / (j - k)) for j in range(k + 1, n + 1))
            for k in range(n)]


class DraftStop:
    """The rule a drafter follows while it drafts: go on while the draft so far, valued by `cumulative`
    (confidences -> P(first i accepted) for each i), is at or above the break-even of its length."""

    def __init__(self, thresholds: Sequence[float], cumulative: Callable[[Sequence[float]], list[float]]) -> None:
        self.thresholds = list(thresholds)
        self.cumulative = cumulative

    def __call__(self, confidence: Sequence[float]) -> bool:
        k = len(confidence)
        if k == 0:
            return True
        if k >= len(self.thresholds):
            return False  # at the planned length: nothing further could be verified
        return self.cumulative(confidence)[-1] >= self.thresholds[k]
