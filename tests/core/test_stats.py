"""Statistics: llama.cpp's line formats, round-trips, and the docs/semantics.md §8 properties under random round sequences."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spekula.core.errors import SpekulaError
from spekula.core.stats.stats import DrafterStats, SlotSpecStats


def test_format_line_exact() -> None:
    st_ = DrafterStats()
    st_.record_begin(1.5)
    st_.record_draft([3, 0], 2.25)
    st_.record_draft([2], 0.5)
    st_.record_accept(2, 0.125)
    st_.record_accept(0, 0.125)
    assert st_.format_line("ngram-mod", prefix=True) == (
        "spec common_specu: statistics        ngram-mod: #calls(b,g,a) =    1      2      2, "
        "#gen drafts =      2, #acc drafts =     1, #gen tokens =      5, #acc tokens =     2, "
        "#mean acc len = 2.00, #acc rate/pos = (0.500, 0.500), dur(b,g,a) = 1.500, 2.750, 0.250 ms"
    )


def test_format_line_without_accepts_has_no_rates() -> None:
    line = DrafterStats().format_line("draft-simple")
    assert line == (
        "statistics     draft-simple: #calls(b,g,a) =    0      0      0, #gen drafts =      0, "
        "#acc drafts =     0, #gen tokens =      0, #acc tokens =     0, dur(b,g,a) = 0.000, 0.000, 0.000 ms"
    )
    name, parsed = DrafterStats.parse_line(line)
    assert name == "draft-simple" and parsed == DrafterStats()


def test_parse_rejects_other_lines() -> None:
    with pytest.raises(SpekulaError):
        DrafterStats.parse_line("slot print_timing: id  0 | task 1 | draft acceptance = 0.5")


rounds = st.lists(
    st.tuples(st.lists(st.integers(0, 8), min_size=1, max_size=3), st.integers(0, 8)), max_size=60
)


def simulate(plan: list[tuple[list[int], int]]) -> tuple[DrafterStats, SlotSpecStats]:
    """Drive the counters like the engine: each round drafts for some slots, then verifies slot 0's draft."""
    d, s = DrafterStats(), SlotSpecStats(n_max=8)
    d.record_begin(0.01)
    for lengths, acc in plan:
        d.record_draft(lengths, 0.3)
        s.record_draft(lengths[0])
        if lengths[0] > 0:
            n_acc = min(acc, lengths[0])
            d.record_accept(n_acc, 0.02)
            s.record_verification(n_acc)
    return d, s


@settings(max_examples=100, deadline=None)
@given(rounds)
def test_invariants_and_round_trip(plan: list[tuple[list[int], int]]) -> None:
    d, s = simulate(plan)
    assert d.n_acc_tokens <= d.n_gen_tokens
    assert d.n_acc_drafts <= d.n_call_accept <= d.n_gen_drafts
    assert all(a >= b for a, b in zip(d.acc_per_pos, d.acc_per_pos[1:], strict=False))
    assert sum(d.acc_per_pos) == d.n_acc_tokens
    assert all(a >= b for a, b in zip(s.accepted_per_pos, s.accepted_per_pos[1:], strict=False))
    assert 0 <= s.n_draft_accepted <= s.n_draft_tokens
    assert s.mean_len >= 1.0 and 0.0 <= s.acceptance <= 1.0
    assert sum(s.histogram) == s.n_verif_steps
    assert sum(j * c for j, c in enumerate(s.histogram)) == s.n_draft_accepted

    line = d.format_line("ngram-simple", prefix=bool(len(plan) % 2))
    name, back = DrafterStats.parse_line(line)
    assert name == "ngram-simple"
    assert back.format_line("ngram-simple", prefix=bool(len(plan) % 2)) == line
    counters = ("n_call_begin", "n_call_draft", "n_call_accept", "n_gen_drafts", "n_acc_drafts")
    for f in (*counters, "n_gen_tokens", "n_acc_tokens", "acc_per_pos"):
        assert getattr(back, f) == getattr(d, f), f
    assert back.t_draft_ms == pytest.approx(d.t_draft_ms, abs=5e-4)


def test_per_pos_round_trip_is_exact_up_to_1000_accepts() -> None:
    d = DrafterStats()
    for i in range(997):
        d.record_accept(i % 4)
    _, back = DrafterStats.parse_line(d.format_line("x"))
    assert back.acc_per_pos == d.acc_per_pos


def test_slot_lines_and_timings() -> None:
    s = SlotSpecStats(n_max=3)
    assert s.timings_fields() == {}
    s.record_draft(0)
    assert s.timings_fields() == {}  # an attempt that drafted nothing adds no fields
    s.record_draft(3)
    s.record_verification(2)
    s.record_draft(3)
    s.record_verification(0)
    assert s.timings_fields() == {"draft_n": 6, "draft_n_accepted": 2}
    assert s.format_line(0, 17) == (
        "slot print_timing: id  0 | task 17 | draft acceptance = 0.33333 (    2 accepted /     6 generated), "
        "mean len =  2.00"
    )
    assert s.format_per_pos_line(0, 17) == "slot print_timing: id  0 | task 17 |      acc per pos = (0.500, 0.500, 0.000)"
    assert s.histogram == [1, 0, 1]
    assert s.to_dict()["mean_len"] == pytest.approx(2.0)
