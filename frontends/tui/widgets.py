"""The TUI's display widgets. Each keeps its data in a reactive and draws only in `watch_*`."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.reactive import reactive
from textual.widgets import DataTable, Sparkline, Static

from spekula.core.drafting.registry import builtin_spec_types

TARGET_STYLE = "bold white"
# One colour per drafter type, fixed by the priority order so a drafter keeps its colour across runs.
_PALETTE = ("green", "cyan", "magenta", "yellow", "bright_blue", "bright_red", "bright_green",
            "bright_magenta", "orange1", "turquoise2", "plum2", "gold1")


def drafter_style(name: str | None) -> str:
    if name is None:
        return TARGET_STYLE
    builtin = builtin_spec_types()
    if name in builtin:
        return _PALETTE[builtin.index(name) % len(_PALETTE)]
    return _PALETTE[sum(map(ord, name)) % len(_PALETTE)]  # a plugin drafter: stable, if not unique


def split_pieces(content: str, pieces: list[str], drafters: list[str | None]) -> list[tuple[str, str | None]]:
    """(text, drafter) runs for one chunk. Exact when the pieces spell the content; otherwise (a held-back
    stop-string prefix or a split UTF-8 character) the whole chunk gets its last token's origin."""
    if pieces and len(pieces) == len(drafters) and "".join(pieces) == content:
        return [(piece, d) for piece, d in zip(pieces, drafters, strict=True) if piece]
    return [(content, drafters[-1] if drafters else None)] if content else []


class AnswerView(Static):
    """The streaming answer, every token coloured by how it arrived."""

    def __init__(self, **kw: Any) -> None:
        super().__init__("", **kw)
        self.text = Text()
        self.counts: dict[str | None, int] = {}

    def clear(self) -> None:
        self.text = Text()
        self.counts = {}
        self.update(self.text)

    def append(self, content: str, pieces: list[str], drafters: list[str | None]) -> None:
        for piece, d in split_pieces(content, pieces, drafters):
            self.text.append(piece, style=drafter_style(d))
        for d in drafters:
            self.counts[d] = self.counts.get(d, 0) + 1
        self.update(self.text)


class Legend(Static):
    drafters: reactive[tuple[str, ...]] = reactive(tuple)
    counts: reactive[dict[str | None, int]] = reactive(dict, always_update=True)

    def watch_drafters(self) -> None:
        self._draw()

    def watch_counts(self) -> None:
        self._draw()

    def _draw(self) -> None:
        text = Text()
        names: list[str | None] = [None, *self.drafters]
        names += [d for d in self.counts if d not in names]
        for d in names:
            label = "target" if d is None else d
            n = self.counts.get(d, 0)
            text.append(f" ■ {label} {n} ", style=drafter_style(d))
        self.update(text)


class DrafterTable(DataTable):
    """Per-drafter counters (docs/semantics.md §4.1), cumulative since the engine started."""

    stats: reactive[dict[str, Any]] = reactive(dict, always_update=True)
    # #gen/#acc drafts, #gen/#acc tokens, acceptance rate (acc tok / gen tok), mean acceptance length;
    # then what the cost model decided (docs/semantics.md §9): rounds shortened and skipped, and the
    # predicted and measured gain over plain decoding (narrow: the panel is half the screen).
    COLUMNS = ("drafter", "gen dr", "acc dr", "gen tok", "acc tok", "rate", "len", "cut/skip", "gain p/m")

    def on_mount(self) -> None:
        self.cursor_type = "none"
        self.add_columns(*self.COLUMNS)

    def watch_stats(self, stats: dict[str, Any]) -> None:
        self.clear()
        for name, d in sorted(stats.items()):
            gen, acc = d.get("gen_tokens", 0), d.get("acc_tokens", 0)
            rate = f"{acc / gen:.3f}" if gen else "-"
            mean = f"{d.get('mean_acc_len', 0.0):.2f}" if d.get("calls_accept") else "-"
            self.add_row(Text(name, style=drafter_style(name)), str(d.get("gen_drafts", 0)),
                         str(d.get("acc_drafts", 0)), str(gen), str(acc), rate, mean, *adaptive_cells(d))


def adaptive_cells(d: dict[str, Any]) -> tuple[str, str]:
    """The cost model's columns for one drafter's counters ("-" while it decided nothing)."""
    a = d.get("adaptive")
    if not a or not a.get("rounds"):
        return "-", "-"
    return f"{a['shortened']}/{a['skipped']}", f"{a['predicted_gain']:.1f}/{a['measured_gain']:.1f}"


class SlotsTable(DataTable):
    slots: reactive[list[dict[str, Any]]] = reactive(list, always_update=True)

    def on_mount(self) -> None:
        self.cursor_type = "none"
        self.add_columns("slot", "state", "request", "n_past", "drafted", "accepted")

    def watch_slots(self, slots: list[dict[str, Any]]) -> None:
        self.clear()
        for s in slots:
            state = str(s.get("state", "?"))
            style = {"idle": "dim", "prompt": "yellow", "generating": "green"}.get(state, "")
            self.add_row(str(s.get("id", "?")), Text(state, style=style), str(s.get("request_id") or "-"),
                         str(s.get("n_past", 0)), str(s.get("draft_n", 0)), str(s.get("draft_n_accepted", 0)))


class AcceptanceHistogram(Static):
    """Per-position acceptance: the share of verified drafts whose i-th token was accepted, plus the
    distribution of accepted lengths per round."""

    stats: reactive[dict[str, Any]] = reactive(dict, always_update=True)
    BAR = 24

    def watch_stats(self, stats: dict[str, Any]) -> None:
        drafters = stats.get("drafters", {})
        verified = sum(d.get("calls_accept", 0) for d in drafters.values())
        per_pos = stats.get("acc_per_pos", [])
        text = Text("acceptance by draft position\n", style="bold")
        if not verified or not per_pos:
            text.append("no drafts verified yet\n", style="dim")
        for i, n in enumerate(per_pos[:16]):
            rate = n / verified if verified else 0.0
            fill = round(rate * self.BAR)
            text.append(f"{i:>3} ")
            text.append("█" * fill, style="green")
            text.append("░" * (self.BAR - fill), style="dim")
            text.append(f" {rate:6.1%}\n")
        hist = stats.get("histogram", [])
        if hist:
            total = sum(hist) or 1
            text.append("accepted per round: ", style="bold")
            text.append("  ".join(f"{n}:{c / total:.0%}" for n, c in enumerate(hist) if c))
        self.update(text)


class Throughput(Static):
    """tokens/s now and over time (the sparkline lives next to it in the layout)."""

    rate: reactive[float] = reactive(0.0)
    final: reactive[str] = reactive("")

    def watch_rate(self) -> None:
        self._draw()

    def watch_final(self) -> None:
        self._draw()

    def _draw(self) -> None:
        text = Text(f"{self.rate:7.1f} tok/s", style="bold")
        if self.final:
            text.append(f"   {self.final}", style="dim")
        self.update(text)


class RateSparkline(Sparkline):
    """Keeps the last `KEEP` samples."""

    KEEP = 120

    def push(self, value: float) -> None:
        self.data = [*(self.data or [])[-(self.KEEP - 1):], value]
