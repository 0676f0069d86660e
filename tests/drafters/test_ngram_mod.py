"""ngram-mod: hash, worked examples, the shared pool, resets, and a sequential reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ngram_helpers import arr, ctx, request

from spekula.core.drafting.drafter import Drafter
from spekula.core.errors import ConfigError
from spekula.drafters.draftless import ngram_mod
from spekula.drafters.draftless.ngram_mod import EMPTY, POOL_SIZE, NgramModDrafter, NgramPool


def full_hash(tokens: list[int]) -> int:
    """llama.cpp's 64-bit hash, computed with big ints, then reduced to the table size."""
    r = 0
    for t in tokens:
        r = (r * 6364136223846793005 + t) % 2**64
    return r % POOL_SIZE


def test_hash_example() -> None:
    pool = NgramPool(3)
    pool.add_range(arr([1, 2, 3, 4, 7]), 0, 2)  # (1, 2, 3) -> 4, then the rolled (2, 3, 4) -> 7
    assert full_hash([1, 2, 3]) == 3845190 and pool.entries[3845190] == 4
    assert pool.entries[full_hash([2, 3, 4])] == 7


@settings(max_examples=100, deadline=None)
@given(tokens=st.lists(st.integers(0, 200_000), min_size=1, max_size=40), n=st.integers(1, 8))
def test_rolling_index_and_walk_match_the_64_bit_hash(tokens: list[int], n: int) -> None:
    # add_range and the walk roll the hash along the text; both must agree with a fresh hash of
    # every window, also for token ids far above the table's 22 bits of arithmetic.
    pool = NgramPool(n)
    seq = tokens * (n // len(tokens) + 2)
    pool.add_range(arr(seq), 0, len(seq) - n)
    want: dict[int, int] = {}
    for i in range(len(seq) - n):
        want[full_hash(seq[i : i + n])] = seq[i + n]
    filled = np.flatnonzero(pool.entries != EMPTY)
    assert dict(zip(filled.tolist(), pool.entries[filled].tolist(), strict=True)) == want
    walked = pool.walk(arr(seq[:n]), 0, 3 * n)
    expect, window = [], list(seq[:n])
    while len(expect) < 3 * n and (t := want.get(full_hash(window[-n:]), EMPTY)) != EMPTY:
        expect.append(t)
        window.append(t)
    assert walked == expect


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(0, 50), min_size=2, max_size=60), n=st.integers(1, 6), last=st.integers(0, 50))
def test_walking_after_the_history_is_walking_its_window(tokens: list[int], n: int, last: int) -> None:
    pool = NgramPool(n)
    seq = tokens * (n // len(tokens) + 2)
    pool.add_range(arr(seq), 0, len(seq) - n)
    window = [*seq[len(seq) - n + 1 :], last]
    want = pool.walk(arr(window), 0, 3 * n)
    assert pool.walk_after(arr(seq), last, 0, 3 * n) == want
    # strided and int64 histories are converted, not misread
    assert pool.walk_after(np.asarray(seq, dtype=np.int64), last, 0, 3 * n) == want
    assert pool.walk_after(np.repeat(np.asarray(seq, dtype=np.int32), 2)[::2], last, 0, 3 * n) == want


def test_worked_examples() -> None:
    d = NgramModDrafter(3, 2, 4)
    h = arr([1, 2, 3, 4, 5, 6, 1, 2])
    d.begin(0, h)
    assert d._slots.get(0).i_last == 5
    assert d.draft_one(0, h, 3) == [4, 5, 6, 1]
    assert d.draft_one(0, h, 9) == []  # empty at i = 0 < n_min
    d8 = NgramModDrafter(3, 2, 8)
    d8.begin(0, h)
    assert d8.draft_one(0, h, 3) == [4, 5, 6, 1, 2]  # (6,1,2) missing at i = 5 >= n_min
    # n_min > n_max is not rejected (llama.cpp does not validate it): a full run of n_max tokens is
    # a draft, a walk that hits an empty entry first is none.
    inverted = NgramModDrafter(3, 5, 2)
    inverted.begin(0, h)
    assert inverted.draft_one(0, h, 3) == [4, 5]
    stops = NgramModDrafter(3, 5, 2)
    stops.begin(0, arr([1, 2, 3, 6]))  # only (1,2,3) -> 6 is indexed
    assert stops.draft_one(0, arr([5, 1, 2]), 3) == []  # (2,3,6) is empty at i = 1 < n_min
    one = NgramModDrafter(1, 2, 1)  # the shape hypothesis found: n = 1, n_min = 2, n_max = 1
    one.begin(0, arr([0, 0]))
    assert one.draft_one(0, arr([0, 0]), 0) == [0]
    over = NgramModDrafter(3, 1, 4)
    over.begin(0, arr([1, 2, 3, 4, 5, 1, 2, 3, 7]))  # (1,2,3) -> 4 then overwritten by -> 7
    assert over.draft_one(0, arr([5, 1, 2]), 3) == [7]


def test_pool_is_shared_across_slots() -> None:
    d = NgramModDrafter(3, 1, 4)
    d.begin(0, arr([10, 11, 12, 13, 14, 15, 16]))
    d.begin(1, arr([1, 2]))  # too short to index anything itself
    assert d.draft_one(1, arr([1, 10, 11]), 12) == [13, 14, 15, 16]


def test_new_history_is_indexed_in_chunks() -> None:
    d = NgramModDrafter(2, 1, 3)
    d.begin(0, arr([50, 51]))
    grown = list(range(100, 133)) + [100]
    assert d.draft_one(0, arr(grown[:32]), 0) == []  # i_last + 32 < L needs 33 tokens
    assert d._slots.get(0).i_last == 0
    assert d.draft_one(0, arr(grown), 101) == [102, 103, 104]
    assert d._slots.get(0).i_last == len(grown) - 2


def test_low_acceptance_wipes_the_pool_and_rewinds_every_slot() -> None:
    d = NgramModDrafter(2, 1, 4)
    h0 = arr([1, 2, 3, 4, 5, 6])
    h1 = arr([20, 21, 22, 23, 24, 25])
    d.begin(0, h0)
    d.begin(1, h1)
    for _ in range(4):
        assert d.draft_one(0, arr([9, 1]), 2) == [3, 4, 5, 6]
        d.accept(0, 0, True)  # 0/4 < 0.25
    assert d.pool.used > 0
    d.accept(1, 0, True)  # slot 1 drafted nothing: its accept changes nothing
    d.draft_one(0, arr([9, 1]), 2)
    d.accept(0, 1, True)  # 1/4 is not below 0.25: the streak restarts
    assert d._slots.get(0).n_low == 0
    for _ in range(5):
        d.draft_one(0, arr([9, 1]), 2)
        d.accept(0, 0, True)
    assert d.pool.used == 0 and int((d.pool.entries != EMPTY).sum()) == 0
    assert d._slots.get(0).i_last == 0 and d._slots.get(1).i_last == 0
    # Slot 1 re-adds its own history at its next draft (llama.cpp leaves it out of the pool).
    grown = arr(list(h1) + list(range(30, 60)) + [20])
    assert d.draft_one(1, grown, 21) == [22, 23, 24, 25]


def test_accept_of_other_drafter_is_ignored() -> None:
    d = NgramModDrafter(2, 1, 4)
    d.begin(0, arr([1, 2, 3, 4, 5, 6]))
    for _ in range(6):
        d.draft_one(0, arr([9, 1]), 2)
        d.accept(0, 0, False)
    assert d.pool.used > 0


def test_begin_wipe_keeps_the_new_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ngram_mod, "OCCUPANCY_RESET", 1e-7)  # any fill triggers the wipe
    d = NgramModDrafter(2, 1, 4)
    d.begin(0, arr([40, 41, 42, 43]))
    d.begin(1, arr([1, 2, 3, 4, 5, 6]))
    assert d.draft_one(1, arr([9, 1]), 2) == [3, 4, 5, 6]  # the prompt survived the wipe
    assert d.draft_one(0, arr([9, 40]), 41) == []  # the older text was wiped


def test_options_and_cap() -> None:
    d = NgramModDrafter.create(
        ctx(**{"spec-ngram-mod-n-match": 3, "spec-ngram-mod-n-min": 2, "spec-ngram-mod-n-max": 4})
    )
    assert isinstance(d, Drafter) and (d.n_match, d.n_min, d.n_max) == (3, 2, 4)
    default = NgramModDrafter.create(ctx())
    assert (default.n_match, default.n_min, default.n_max) == (24, 48, 64)
    assert default.pool.entries.nbytes == 16 * 1024 * 1024
    h = arr([1, 2, 3, 4, 5, 6, 1, 2])
    d.begin(0, h)
    assert d.draft([request(h, 3, n_max=3)])[0].tokens == [4, 5, 6]
    assert d._slots.get(0).n_draft_last == 4  # the pre-cap length drives the low-acceptance rule
    for name, bad in (
        ("spec-ngram-mod-n-match", 0),
        ("spec-ngram-mod-n-min", -1),
        ("spec-ngram-mod-n-max", 1025),
    ):
        with pytest.raises(ConfigError, match=name):
            NgramModDrafter.create(ctx(**{name: bad}))


class RefPool:
    """Sequential add/get with big-int hashes (llama.cpp's loop), as a dict."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.entries: dict[int, int] = {}

    def add_all(self, h: list[int], lo: int, hi: int) -> None:
        for i in range(lo, hi):
            self.entries[full_hash(h[i : i + self.n])] = h[i + self.n]


@settings(max_examples=80, deadline=None)
@given(data=st.data(), n=st.integers(1, 4), n_min=st.integers(0, 3), n_max=st.integers(0, 6))
def test_incremental_pool_matches_a_rebuild_and_drafts_follow_the_table(
    data: st.DataObject, n: int, n_min: int, n_max: int
) -> None:
    d = NgramModDrafter(n, n_min, n_max)
    hist = data.draw(st.lists(st.integers(0, 5), max_size=40))
    d.begin(0, arr(hist))
    for _ in range(data.draw(st.integers(1, 12))):
        x = data.draw(st.integers(0, 5))
        got = d.draft_one(0, arr(hist), x)
        if len(hist) >= n:
            # Each drafted token is the table successor of the n tokens before it (invariant 11).
            seq = hist + [x] + got
            for k, t in enumerate(got):
                start = len(hist) + 1 + k - n
                assert d.pool.entries[full_hash(seq[start : start + n])] == t
            # A draft is empty, or stopped at an empty entry at i >= n_min, or a full run of n_max
            # tokens. llama.cpp does not validate n_min <= n_max (docs/semantics.md §2.3), so with n_min > n_max the full
            # run is a draft shorter than n_min (this test used to demand n_min <= len, wrongly).
            assert len(got) <= n_max
            if 0 < len(got) < n_max:
                assert len(got) >= n_min
                assert d.pool.entries[full_hash(seq[len(seq) - n :])] == EMPTY  # why the walk stopped
        else:
            assert got == []
        hist = (
            hist
            + [x]
            + got[: data.draw(st.integers(0, len(got)))]
            + data.draw(st.lists(st.integers(0, 5), max_size=40))
        )
    info = d._slots.get(0)
    if len(hist) >= n:
        rebuilt = RefPool(n)
        rebuilt.add_all(hist, 0, info.i_last)
        filled = np.flatnonzero(d.pool.entries != EMPTY)
        assert dict(zip(filled.tolist(), d.pool.entries[filled].tolist(), strict=True)) == rebuilt.entries
        assert d.pool.used == len(rebuilt.entries)
