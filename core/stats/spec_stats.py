"""Engine-wide speculation statistics: per-drafter counters (docs/semantics.md §4.1) and the acceptance histogram.

The scheduler's worker thread updates these between forwards; the event loop only reads them
(`snapshot`), and every read is of plain ints/floats, so a snapshot taken mid-step is at worst one
round stale.
"""

from __future__ import annotations

from typing import Any

from spekula.core.stats.stats import AdaptiveStats, DrafterStats


class EngineSpecStats:
    def __init__(self) -> None:
        self.drafters: dict[str, DrafterStats] = {}
        # histogram[n] = verification rounds that accepted exactly n draft tokens (gpt-fast's accept_counts)
        self.histogram: list[int] = []
        self.n_requests = 0
        self.n_tokens_predicted = 0
        # Served-request totals (llama-server's /metrics): evaluated prompt tokens (the reused
        # prefix not counted), the prefix tokens reused, and the time spent on each phase.
        self.n_prompt_tokens = 0
        self.n_cache_tokens = 0
        self.t_prompt_ms = 0.0
        self.t_predicted_ms = 0.0
        self.n_forwards = 0
        self.n_forward_seqs = 0  # sequences summed over forwards (busy slots per forward, on average)
        self.n_tokens_max = 0  # the longest sequence (prompt + generated) a request reached
        self.adaptive: AdaptiveStats | None = None  # all drafters together

    def _get(self, name: str) -> DrafterStats:
        stats = self.drafters.get(name)
        if stats is None:
            stats = self.drafters[name] = DrafterStats()
        return stats

    def register(self, name: str) -> None:
        """List a created drafter in snapshots even before it is first called."""
        self._get(name)

    def on_begin(self, name: str, seconds: float) -> None:
        self._get(name).record_begin(seconds * 1e3)

    def on_draft_call(self, name: str, lengths: list[int], seconds: float) -> None:
        self._get(name).record_draft(lengths, seconds * 1e3)

    def on_accept(self, name: str, n_accepted: int, seconds: float) -> None:
        self._get(name).record_accept(n_accepted, seconds * 1e3)

    def on_adapted(self, name: str, **decision: Any) -> None:
        self._get(name).record_adapted(**decision)
        if self.adaptive is None:
            self.adaptive = AdaptiveStats()
        self.adaptive.record(**decision)

    def on_grammar_rejected(self, name: str, n: int) -> None:
        self._get(name).n_grammar_rejected += n

    def on_round(self, n_accepted: int) -> None:
        if len(self.histogram) <= n_accepted:
            self.histogram.extend([0] * (n_accepted + 1 - len(self.histogram)))
        self.histogram[n_accepted] += 1

    def snapshot(self) -> dict[str, Any]:
        acc_per_pos: list[int] = []
        for st in self.drafters.values():
            for i, v in enumerate(st.acc_per_pos):
                if i >= len(acc_per_pos):
                    acc_per_pos.append(0)
                acc_per_pos[i] += v
        rounds = sum(self.histogram)
        accepted = sum(n * c for n, c in enumerate(self.histogram))
        return {
            "drafters": {name: st.to_dict() for name, st in self.drafters.items()},
            "histogram": list(self.histogram),
            "acc_per_pos": acc_per_pos,
            "n_rounds": rounds,
            "mean_acc_len": 1.0 + accepted / rounds if rounds else 0.0,
            "n_requests": self.n_requests,
            "n_tokens_predicted": self.n_tokens_predicted,
            "n_prompt_tokens": self.n_prompt_tokens,
            "n_cache_tokens": self.n_cache_tokens,
            "t_prompt_ms": self.t_prompt_ms,
            "t_predicted_ms": self.t_predicted_ms,
            "n_forwards": self.n_forwards,
            "n_forward_seqs": self.n_forward_seqs,
            "n_tokens_max": self.n_tokens_max,
            "adaptive": self.adaptive.to_dict() if self.adaptive is not None else None,
        }

    def lines(self, *, prefix: bool = False) -> list[str]:
        """llama.cpp's `statistics <type>: ...` line for every drafter that was used."""
        return [st.format_line(name, prefix=prefix) for name, st in self.drafters.items()]
