"""Speculation statistics with llama.cpp's counters and log lines (docs/semantics.md §4).

`DrafterStats` is per drafter, server-wide and cumulative (never reset). `SlotSpecStats` is per
request. Mean acceptance length = emitted tokens / verification rounds = 1 + accepted / rounds.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from spekula.core.errors import SpekulaError

_SPEC_PREFIX = "spec common_specu: "  # llama.cpp's "spec %12.*s: " with the function name cut to 12


def _rates(counts: list[int], denom: int) -> str:
    return ", ".join(f"{c / denom:.3f}" for c in counts)


@dataclass(slots=True)
class DrafterStats:
    n_call_begin: int = 0
    n_call_draft: int = 0
    n_call_accept: int = 0
    n_gen_drafts: int = 0
    n_acc_drafts: int = 0
    n_gen_tokens: int = 0
    n_acc_tokens: int = 0
    # acc_per_pos[i]: accepts whose n_accepted > i; grows to the longest acceptance seen.
    acc_per_pos: list[int] = field(default_factory=list)
    t_begin_ms: float = 0.0
    t_draft_ms: float = 0.0
    t_accept_ms: float = 0.0
    adaptive: AdaptiveStats | None = None  # only once the cost model decided one of its rounds
    # Draft tokens dropped before verification because the request's grammar forbids them.
    n_grammar_rejected: int = 0

    def record_begin(self, ms: float = 0.0) -> None:
        self.n_call_begin += 1
        self.t_begin_ms += ms

    def record_draft(self, lengths: Iterable[int], ms: float = 0.0) -> None:
        """One orchestrator call that reached this drafter; `lengths`: each asking slot's k after the cut."""
        self.n_call_draft += 1
        self.t_draft_ms += ms
        for k in lengths:
            if k > 0:
                self.n_gen_drafts += 1
                self.n_gen_tokens += k

    def record_accept(self, n_accepted: int, ms: float = 0.0) -> None:
        """Verification of one of this drafter's drafts (also when nothing was accepted)."""
        if n_accepted < 0:
            raise ValueError(f"n_accepted must be >= 0; got {n_accepted}")
        self.n_call_accept += 1
        self.t_accept_ms += ms
        if n_accepted > 0:
            self.n_acc_drafts += 1  # a partial acceptance counts: one token suffices
            self.n_acc_tokens += n_accepted
            if len(self.acc_per_pos) < n_accepted:
                self.acc_per_pos.extend([0] * (n_accepted - len(self.acc_per_pos)))
            for i in range(n_accepted):
                self.acc_per_pos[i] += 1

    @property
    def mean_acc_len(self) -> float:
        return 1.0 + self.n_acc_tokens / self.n_call_accept if self.n_call_accept else 1.0

    def record_adapted(self, *, natural: int, kept: int, expected: float, emitted: int,
                       predicted_cost: float, measured_cost: float) -> None:
        if self.adaptive is None:
            self.adaptive = AdaptiveStats()
        self.adaptive.record(natural=natural, kept=kept, expected=expected, emitted=emitted,
                             predicted_cost=predicted_cost, measured_cost=measured_cost)

    def format_line(self, name: str, *, prefix: bool = False) -> str:
        """llama.cpp's `statistics ...` trace line (with `spec common_specu: ` in front if `prefix`)."""
        stats = ""
        if self.n_call_accept > 0:
            stats = (
                f", #mean acc len = {self.mean_acc_len:.2f}"
                f", #acc rate/pos = ({_rates(self.acc_per_pos, self.n_call_accept)})"
            )
        perf = f", dur(b,g,a) = {self.t_begin_ms:.3f}, {self.t_draft_ms:.3f}, {self.t_accept_ms:.3f} ms"
        adapt = self.adaptive.format_field() if self.adaptive is not None else ""
        grammar = f", #grammar rejected = {self.n_grammar_rejected}" if self.n_grammar_rejected else ""
        line = (
            f"statistics {name:>16}: #calls(b,g,a) = {self.n_call_begin:4d} {self.n_call_draft:6d} "
            f"{self.n_call_accept:6d}, #gen drafts = {self.n_gen_drafts:6d}, #acc drafts = {self.n_acc_drafts:5d}, "
            f"#gen tokens = {self.n_gen_tokens:6d}, #acc tokens = {self.n_acc_tokens:5d}{stats}{perf}{adapt}{grammar}"
        )
        return _SPEC_PREFIX + line if prefix else line

    @classmethod
    def parse_line(cls, line: str) -> tuple[str, DrafterStats]:
        """Inverse of format_line. Per-position counts come back as round(rate * calls_a), which is
        exact up to 1000 accepts and always re-formats to the same line; durations keep 3 decimals."""
        m = _LINE.match(line.strip())
        if m is None:
            raise SpekulaError(f"not a llama.cpp speculative statistics line: {line.strip()!r}")
        g = m.groupdict()
        st = cls(
            n_call_begin=int(g["b"]),
            n_call_draft=int(g["g"]),
            n_call_accept=int(g["a"]),
            n_gen_drafts=int(g["gen_drafts"]),
            n_acc_drafts=int(g["acc_drafts"]),
            n_gen_tokens=int(g["gen_tokens"]),
            n_acc_tokens=int(g["acc_tokens"]),
            n_grammar_rejected=int(g["grammar"] or 0),
        )
        if g["rates"]:
            st.acc_per_pos = [round(float(r) * st.n_call_accept) for r in g["rates"].split(",")]
        if g["tb"] is not None:
            st.t_begin_ms, st.t_draft_ms, st.t_accept_ms = float(g["tb"]), float(g["tg"]), float(g["ta"])
        if g["ad_rounds"] is not None:
            st.adaptive = AdaptiveStats.from_field(g)
        return g["name"], st

    def to_dict(self) -> dict[str, Any]:
        return {
            "calls_begin": self.n_call_begin,
            "calls_draft": self.n_call_draft,
            "calls_accept": self.n_call_accept,
            "gen_drafts": self.n_gen_drafts,
            "acc_drafts": self.n_acc_drafts,
            "gen_tokens": self.n_gen_tokens,
            "acc_tokens": self.n_acc_tokens,
            "mean_acc_len": self.mean_acc_len,
            "acc_per_pos": list(self.acc_per_pos),
            "dur_begin_ms": self.t_begin_ms,
            "dur_draft_ms": self.t_draft_ms,
            "dur_accept_ms": self.t_accept_ms,
            **({"grammar_rejected": self.n_grammar_rejected} if self.n_grammar_rejected else {}),
            **({"adaptive": self.adaptive.to_dict()} if self.adaptive is not None else {}),
        }


_LINE = re.compile(
    r"^(?:spec common_specu: )?statistics\s*(?P<name>\S+): "
    r"#calls\(b,g,a\) = \s*(?P<b>\d+)\s+(?P<g>\d+)\s+(?P<a>\d+), "
    r"#gen drafts = \s*(?P<gen_drafts>\d+), #acc drafts = \s*(?P<acc_drafts>\d+), "
    r"#gen tokens = \s*(?P<gen_tokens>\d+), #acc tokens = \s*(?P<acc_tokens>\d+)"
    r"(?:, #mean acc len = [\d.]+, #acc rate/pos = \((?P<rates>[^)]*)\))?"
    r"(?:, dur\(b,g,a\) = (?P<tb>[\d.]+), (?P<tg>[\d.]+), (?P<ta>[\d.]+) ms)?"
    r"(?:, #adapt\(rounds,short,skip\) = (?P<ad_rounds>\d+) (?P<ad_short>\d+) (?P<ad_skip>\d+), "
    r"gain\(pred,meas\) = (?P<ad_pred>[\d.]+)x (?P<ad_meas>[\d.]+)x)?"
    r"(?:, #grammar rejected = (?P<grammar>\d+))?$"
)


@dataclass(slots=True)
class AdaptiveStats:
    """What the cost model decided for one drafter's rounds, and what it gained.

    A round's gain is emitted tokens per time, in units of what a plain decoding round (one token)
    costs on the same batch: predicted from the cost and acceptance models when the length was
    chosen, measured from the tokens the round actually emitted and the time it actually took."""

    n_rounds: int = 0
    n_shortened: int = 0  # verified fewer tokens than a fixed policy would have
    n_skipped: int = 0  # verified none where a fixed policy would have drafted (or not asked at all)
    predicted_tokens: float = 0.0
    predicted_cost: float = 0.0
    measured_tokens: float = 0.0
    measured_cost: float = 0.0

    def record(self, *, natural: int, kept: int, expected: float, emitted: int,
               predicted_cost: float, measured_cost: float) -> None:
        self.n_rounds += 1
        if kept == 0:
            self.n_skipped += 1
        elif kept < natural:
            self.n_shortened += 1
        self.predicted_tokens += expected
        self.predicted_cost += predicted_cost
        self.measured_tokens += emitted
        self.measured_cost += measured_cost

    @property
    def predicted_gain(self) -> float:
        return self.predicted_tokens / self.predicted_cost if self.predicted_cost > 0 else 0.0

    @property
    def measured_gain(self) -> float:
        return self.measured_tokens / self.measured_cost if self.measured_cost > 0 else 0.0

    def format_field(self) -> str:
        return (f", #adapt(rounds,short,skip) = {self.n_rounds} {self.n_shortened} {self.n_skipped}, "
                f"gain(pred,meas) = {self.predicted_gain:.2f}x {self.measured_gain:.2f}x")

    @classmethod
    def from_field(cls, g: dict[str, Any]) -> AdaptiveStats:
        """The counters back from a formatted line; the gains come back as 1 round's worth of cost."""
        st = cls(n_rounds=int(g["ad_rounds"]), n_shortened=int(g["ad_short"]), n_skipped=int(g["ad_skip"]))
        st.predicted_tokens, st.predicted_cost = float(g["ad_pred"]), 1.0
        st.measured_tokens, st.measured_cost = float(g["ad_meas"]), 1.0
        return st

    def to_dict(self) -> dict[str, Any]:
        return {"rounds": self.n_rounds, "shortened": self.n_shortened, "skipped": self.n_skipped,
                "predicted_gain": self.predicted_gain, "measured_gain": self.measured_gain}


@dataclass(slots=True)
class SlotSpecStats:
    """One request's speculation counters (llama-server's slot statistics)."""

    n_max: int = 0  # per-position table size (the effective n_max); 0: grow as needed
    n_draft_tokens: int = 0
    n_draft_accepted: int = 0
    n_verif_steps: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    # histogram[j]: verification rounds that accepted exactly j draft tokens (gpt-fast's accept_counts).
    histogram: list[int] = field(default_factory=list)
    n_grammar_rejected: int = 0  # draft tokens the request's grammar forbade (never verified)

    def record_draft(self, k: int) -> None:
        """A drafting attempt for this slot (k after the cut; 0 counts as an attempt but adds nothing)."""
        self.n_draft_tokens += k

    def record_verification(self, n_accepted: int) -> None:
        if n_accepted < 0:
            raise ValueError(f"n_accepted must be >= 0; got {n_accepted}")
        self.n_draft_accepted += n_accepted
        self.n_verif_steps += 1
        if not self.accepted_per_pos and self.n_max > 0:
            self.accepted_per_pos = [0] * self.n_max
        if self.n_max <= 0 and len(self.accepted_per_pos) < n_accepted:
            self.accepted_per_pos.extend([0] * (n_accepted - len(self.accepted_per_pos)))
        for i in range(min(n_accepted, len(self.accepted_per_pos))):
            self.accepted_per_pos[i] += 1
        if len(self.histogram) <= n_accepted:
            self.histogram.extend([0] * (n_accepted + 1 - len(self.histogram)))
        self.histogram[n_accepted] += 1

    @property
    def acceptance(self) -> float:
        """Accepted / drafted tokens, in [0, 1]."""
        return self.n_draft_accepted / self.n_draft_tokens if self.n_draft_tokens else 0.0

    @property
    def mean_len(self) -> float:
        """Emitted tokens per verification round = 1 + accepted / rounds."""
        return 1.0 + self.n_draft_accepted / self.n_verif_steps if self.n_verif_steps else 1.0

    def format_line(self, slot_id: int, task_id: int) -> str:
        """llama-server's end-of-request INFO line (printed only when draft tokens were produced)."""
        return (
            f"slot print_timing: id {slot_id:2d} | task {task_id} | draft acceptance = {self.acceptance:0.5f} "
            f"({self.n_draft_accepted:5d} accepted / {self.n_draft_tokens:5d} generated), "
            f"mean len = {self.mean_len:5.2f}"
        )

    def format_per_pos_line(self, slot_id: int, task_id: int) -> str:
        """The trace-level line that follows format_line."""
        rates = _rates(self.accepted_per_pos, self.n_verif_steps) if self.n_verif_steps else ""
        return f"slot print_timing: id {slot_id:2d} | task {task_id} |      acc per pos = ({rates})"

    def timings_fields(self) -> dict[str, int]:
        """`draft_n` and `draft_n_accepted` for the response's timings, only when something was drafted."""
        out: dict[str, int] = {}
        if self.n_draft_tokens > 0:
            out.update(draft_n=self.n_draft_tokens, draft_n_accepted=self.n_draft_accepted)
        if self.n_grammar_rejected:
            out["draft_n_grammar_rejected"] = self.n_grammar_rejected
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "draft_n": self.n_draft_tokens,
            "draft_n_accepted": self.n_draft_accepted,
            "verif_steps": self.n_verif_steps,
            "acceptance": self.acceptance,
            "mean_len": self.mean_len,
            "accepted_per_pos": list(self.accepted_per_pos),
            "histogram": list(self.histogram),
        }
