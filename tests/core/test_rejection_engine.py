"""Rejection-sampling verification through the whole engine keeps the target's distribution.

The verifier alone is checked exactly by enumeration (tests/test_verifier.py); this checks the
engine end to end on a tiny model: a drafter with real, non-uniform draft probabilities q, rejection
mode at temperature 1, many seeded requests, and the empirical distribution of the two tokens the
first verification round emits against the target's exact distribution (chi-square, deterministic seeds).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import ClassVar

import anyio
import numpy as np
import pytest
from toy_backend import GarbageDrafter, ToyBackend, ToyTokenizer, fix_cost, make_engine, run_requests

from spekula.core.backend import SeqInput
from spekula.core.drafting.drafter import Draft, DraftRequest
from spekula.core.params import CompletionRequest, SamplingParams, SpecParams
from spekula.core.verify.sampling import Sampler

V = 4
PROMPT = [1, 3, 0, 2, 1]
SAMPLING = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
# Chi-square critical value for 15 degrees of freedom at p = 0.001: a correct engine exceeds it
# with probability 1/1000, and the seeds are fixed, so the test is deterministic.
CHI2_CRIT_DF15 = 37.70


class FixedQDrafter(GarbageDrafter):
    """Drafts two tokens sampled from a fixed, deliberately wrong distribution q, and reports q."""

    model_based: ClassVar[bool] = True
    name: ClassVar[str] = "fixed-q"
    Q = np.array([0.55, 0.05, 0.1, 0.3], dtype=np.float32)

    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        out = []
        for r in requests:
            k = min(2, r.n_max)
            toks = [int(t) for t in self._rng.choice(V, size=k, p=self.Q)]
            out.append(Draft(toks, np.tile(self.Q, (k, 1))))
        return out


def target_distribution(backend: ToyBackend) -> dict[tuple[int, int], float]:
    """Exact P(t2, t3 | prompt) under the sampling chain, marginalised over t1, from the backend's logits.

    t1 comes from the prompt's forward (no draft can precede it); t2 and t3 are what the first
    verification round emits, so they are the tokens rejection sampling decides.
    """
    seq = backend.new_seq()
    n0 = len(PROMPT)

    def next_dist(prefix: list[int]) -> np.ndarray:
        backend.truncate(seq, 0)
        (out,) = backend.forward([SeqInput(seq, np.array(PROMPT + prefix, np.int32), 0)])
        return _dist(out.logits[-1])

    assert n0 > 0
    dist: dict[tuple[int, int], float] = dict.fromkeys(((a, b) for a in range(V) for b in range(V)), 0.0)
    p1 = next_dist([])
    for t1 in range(V):
        p2 = next_dist([t1])
        for t2 in range(V):
            p3 = next_dist([t1, t2])
            for t3 in range(V):
                dist[(t2, t3)] += p1[t1] * p2[t2] * p3[t3]
    backend.free_seq(seq)
    return dist


def _dist(logits: np.ndarray) -> np.ndarray:
    ids, probs = Sampler(SAMPLING, V, 0).distribution(logits)
    p = np.zeros(V)
    p[np.asarray(ids)] = probs
    return p


@pytest.mark.parametrize("lengths", ["fixed", "adaptive", "adaptive-dear-rows"])
def test_rejection_mode_preserves_the_target_distribution_through_the_engine(lengths: str) -> None:
    """Also when the cost model cuts drafts: with dear rows most second tokens are not verified."""
    backend = ToyBackend(n_vocab=V)
    exact = target_distribution(backend)
    n = 1500
    spec = SpecParams(types=("fixed-q",), draft_sampling="probabilistic", adaptive=lengths != "fixed")
    engine = make_engine(backend, ToyTokenizer(n_vocab=V), n_slots=8, spec=spec, drafters=[FixedQDrafter(V)])
    if lengths == "adaptive-dear-rows":
        fix_cost(engine, 1.0, 0.1)  # a token pays only above ~0.44 expected acceptance
    requests = [CompletionRequest(PROMPT, n_predict=3, sampling=SAMPLING.with_(seed=1000 + i), ignore_eos=True)
                for i in range(n)]
    finals = anyio.run(run_requests, engine, requests, 300.0)
    counts = Counter(tuple(f.tokens[1:3]) for f in finals)
    assert sum(counts.values()) == n and all(len(f.tokens) == 3 for f in finals)
    # the drafter really drafted and rejection really both accepted and rejected
    drafted = sum(f.timings.get("draft_n", 0) for f in finals)
    accepted = sum(f.timings.get("draft_n_accepted", 0) for f in finals)
    assert drafted > 0 and 0 < accepted < drafted
    chi2 = sum((counts.get(cell, 0) - n * p) ** 2 / (n * p) for cell, p in exact.items())
    assert chi2 < CHI2_CRIT_DF15, (chi2, counts, exact)
    if lengths == "adaptive-dear-rows":
        decided = engine.stats()["drafters"]["fixed-q"]["adaptive"]
        assert decided["shortened"] + decided["skipped"] > 0


def test_the_check_detects_a_biased_sampler() -> None:
    """The same statistic rejects the draft distribution q itself (what a verifier that always
    accepted would emit), so the test above is able to fail."""
    backend = ToyBackend(n_vocab=V)
    exact = target_distribution(backend)
    rng = np.random.default_rng(7)
    n = 1500
    q = FixedQDrafter.Q.astype(np.float64)
    draws = Counter(tuple(int(t) for t in rng.choice(V, size=2, p=q / q.sum())) for _ in range(n))
    chi2 = sum((draws.get(cell, 0) - n * p) ** 2 / (n * p) for cell, p in exact.items())
    assert chi2 > CHI2_CRIT_DF15
