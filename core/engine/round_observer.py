"""What a speculative round reports, and the recorder that turns it into statistics.

The planner and the scheduler only announce what happened (a drafter began, was called, had its
draft verified, a draft policy decided a length); `StatsRecorder` keeps llama.cpp's counters from
those announcements: per drafter and engine-wide (`EngineSpecStats`) and per request (the slot's
`SlotSpecStats`). Nothing else writes statistics.
"""

from __future__ import annotations

from typing import Protocol

from spekula.core.engine.slot import Slot
from spekula.core.policy.policy import Decision
from spekula.core.stats.spec_stats import EngineSpecStats


class RoundObserver(Protocol):
    def began(self, drafter: str, seconds: float) -> None:
        """A drafter's begin() for a request whose prompt is now processed."""

    def draft_called(self, drafter: str, lengths: list[int], seconds: float) -> None:
        """One call of a drafter; `lengths`: each asking slot's draft as verified (0 for none)."""

    def drafted(self, slot: Slot, k: int) -> None:
        """A slot asked for a draft this round and will verify k tokens."""

    def verified(self, slot: Slot, drafter: str, n_accepted: int, accept_seconds: float) -> None:
        """A non-empty draft of `drafter` was verified; its accept() took `accept_seconds`."""

    def adapted(self, decision: Decision, emitted: int, predicted_cost: float, measured_cost: float) -> None:
        """A draft policy decided a slot's draft length; costs are in units of a plain round."""

    def forwarded(self, n_seqs: int) -> None:
        """One target forward over `n_seqs` slots' rows ran."""

    def grammar_rejected(self, slot: Slot, drafter: str, n: int) -> None:
        """`n` tokens of a draft were dropped before verification: the request's grammar forbids them."""

    def finished(self, slot: Slot) -> None:
        """A request ended (its final event is about to be sent)."""

    def embedded(self, n_tokens: int, n_forwards: int, seconds: float) -> None:
        """An embedding or reranking sequence of `n_tokens` ran in `n_forwards` target forwards."""


class StatsRecorder:
    def __init__(self, stats: EngineSpecStats) -> None:
        self.stats = stats

    def began(self, drafter: str, seconds: float) -> None:
        self.stats.on_begin(drafter, seconds)

    def draft_called(self, drafter: str, lengths: list[int], seconds: float) -> None:
        self.stats.on_draft_call(drafter, lengths, seconds)

    def drafted(self, slot: Slot, k: int) -> None:
        slot.spec_stats.record_draft(k)

    def verified(self, slot: Slot, drafter: str, n_accepted: int, accept_seconds: float) -> None:
        slot.spec_stats.record_verification(n_accepted)
        self.stats.on_round(n_accepted)
        self.stats.on_accept(drafter, n_accepted, accept_seconds)

    def adapted(self, decision: Decision, emitted: int, predicted_cost: float, measured_cost: float) -> None:
        self.stats.on_adapted(decision.drafter, natural=decision.natural, kept=decision.kept,
                              expected=decision.expected, emitted=emitted,
                              predicted_cost=predicted_cost, measured_cost=measured_cost)

    def grammar_rejected(self, slot: Slot, drafter: str, n: int) -> None:
        slot.spec_stats.n_grammar_rejected += n
        self.stats.on_grammar_rejected(drafter, n)

    def forwarded(self, n_seqs: int) -> None:
        self.stats.n_forwards += 1
        self.stats.n_forward_seqs += n_seqs

    def embedded(self, n_tokens: int, n_forwards: int, seconds: float) -> None:
        # llama-server counts an embedding's prompt and decodes with the rest (it predicts no token)
        st = self.stats
        st.n_prompt_tokens += n_tokens
        st.t_prompt_ms += seconds * 1e3
        st.n_forwards += n_forwards
        st.n_forward_seqs += n_forwards

    def finished(self, slot: Slot) -> None:
        st, t = self.stats, slot.timings()
        st.n_requests += 1
        st.n_tokens_predicted += len(slot.generated)
        st.n_prompt_tokens += t["prompt_n"]
        st.n_cache_tokens += t["cache_n"]
        st.t_prompt_ms += t["prompt_ms"]
        st.t_predicted_ms += t["predicted_ms"]
        st.n_tokens_max = max(st.n_tokens_max, len(slot.prompt) + len(slot.generated))
