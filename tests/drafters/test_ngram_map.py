"""ngram-map-k / ngram-map-k4v: worked examples, a loop-by-loop reference, invariants, options."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ngram_helpers import arr, ctx, request

from spekula.core.drafting.drafter import Drafter
from spekula.core.errors import ConfigError
from spekula.drafters.draftless.ngram_map import (
    KEY_MAP_SIZE,
    NgramMapK4vDrafter,
    NgramMapKDrafter,
    key_hash,
)


class RefMap:
    """Plain loops over the definition of docs/semantics.md §2.2 (no vectorisation, no dicts).

    spekula's documented differences are built in: min_hits applies to key-only maps too, begin()
    also cleans up from n+m tokens before the first token that differs from the previous history,
    and the second scan range starts right above the first (llama.cpp skips starts in [S-n-m, S]).
    """

    def __init__(self, n: int, m: int, min_hits: int, key_only: bool) -> None:
        self.n, self.m, self.min_hits, self.key_only = n, m, min_hits, key_only
        self.key_map: dict[int, int] = {}
        self.last_idx = 0
        self.size_last_begin = 0
        self.idx_last_check = 0
        self.keys: list[dict] = []
        self.last: dict | None = None
        self.seen: list[int] = []

    def begin(self, h: list[int]) -> None:
        s = len(h)
        c = self.size_last_begin
        if c > s:
            c = s - self.n - self.m if s > self.n + self.m else 0
        first_diff = next((i for i, (a, b) in enumerate(zip(self.seen, h, strict=False)) if a != b), None)
        if first_diff is not None:
            c = min(c, max(first_diff - self.n - self.m, 0))
        if s < self.idx_last_check or first_diff is not None:
            self.key_map = {b: v for b, v in self.key_map.items() if v < c}
            self.last_idx = max(c - 1, 0)
            kept = []
            for key in self.keys:
                if key["idx"] >= c:
                    continue
                if not self.key_only:
                    live = [v for v in key["values"] if v["idx"] != 0 and v["idx"] < c]
                    if not live:
                        continue
                    key["values"] = live + [{"idx": 0, "num": 0, "acc": self.m} for _ in range(4 - len(live))]
                kept.append(key)
            self.keys = kept
        self.idx_last_check = self.size_last_begin = s
        self.seen = list(h)

    def draft(self, h: list[int], x: int) -> list[int]:
        n, m = self.n, self.m
        self.last = None
        length = len(h)
        if length < 2 * n + m:
            return []
        assert length >= self.idx_last_check
        self.idx_last_check = length
        self.seen = list(h)
        key = h[length - n + 1 :] + [x]
        top = length - n - m - 1
        p = 0
        hashed = self.key_map.get(key_hash(key) % KEY_MAP_SIZE, 0)
        if hashed != 0 and hashed < top and h[hashed : hashed + n] == key:
            p = hashed
        ranges = []
        if self.size_last_begin > n + m + 1:
            ranges.append(range(self.size_last_begin - n - m - 1, self.last_idx, -1))
        ranges.append(
            [j for j in range(top, 0, -1) if j > self.size_last_begin - n - m - 1 and j > self.last_idx]
        )
        for r in ranges:
            for j in r:
                if p == 0 and h[j : j + n] == key:
                    p = j
        for r in ranges:
            for j in r:
                b = key_hash(h[j : j + n]) % KEY_MAP_SIZE
                self.key_map.setdefault(b, j)
        self.last_idx = max(top, self.last_idx)
        if p == 0:
            return []
        rec = next((k for k in self.keys if k["tokens"] == key), None)
        if rec is None:
            rec = {
                "idx": p,
                "tokens": key,
                "stat": 0,
                "num": 0,
                "values": [{"idx": 0, "num": 0, "acc": m} for _ in range(4)],
            }
            self.keys.append(rec)
        rec["num"] = min(rec["num"] + 1, 16380)
        if rec["num"] < self.min_hits:
            return []
        if self.key_only:
            best = rec["values"][0]
        else:
            for i in range(rec["stat"], p + 1):
                if h[i : i + n] != key:
                    continue
                for v in rec["values"]:
                    if v["idx"] == 0:
                        v.update(idx=i + n, num=0, acc=m)
                    elif h[i + n : i + n + m] != h[v["idx"] : v["idx"] + m]:
                        continue
                    v["num"] = min(v["num"] + 1, 16380)
                    break
            rec["stat"] = p
            best = rec["values"][0]
            for v in rec["values"]:
                if v["num"] > best["num"]:
                    best = v
            others = sum(v["num"] for v in rec["values"]) - best["num"]
            if others > 0 and best["num"] < 2 * others:
                return []
        self.last = best
        return h[p + n : p + n + min(m, best["acc"])]

    def accept(self, n_accepted: int) -> None:
        if self.last is not None:
            self.last["acc"] = n_accepted


def test_hash_example() -> None:
    assert key_hash([1, 2]) == 2654435763
    assert key_hash([1, 2]) % KEY_MAP_SIZE == 227763


def test_map_k_worked_example() -> None:
    # llama.cpp ignores min_hits for map-k, so its example (min_hits=5) equals ours with min_hits=1.
    d = NgramMapKDrafter(2, 3, 1)
    h = arr([5, 1, 2, 3, 4, 9, 9, 1])
    d.begin(0, h)
    assert d.draft_one(0, h, 2) == [3, 4, 9]
    d.accept(0, 1, True)
    assert d.draft_one(0, h, 2) == [3]
    d.accept(0, 0, True)
    assert d.draft_one(0, h, 2) == []


def test_map_k_min_hits_is_honoured() -> None:
    # The fixed behaviour of the same example with min_hits=5: the 5th successful lookup drafts.
    d = NgramMapKDrafter(2, 3, 5)
    h = arr([5, 1, 2, 3, 4, 9, 9, 1])
    d.begin(0, h)
    assert [d.draft_one(0, h, 2) for _ in range(5)] == [[], [], [], [], [3, 4, 9]]


def test_other_drafters_accept_is_ignored() -> None:
    d = NgramMapKDrafter(2, 3, 1)
    h = arr([5, 1, 2, 3, 4, 9, 9, 1])
    d.begin(0, h)
    assert d.draft_one(0, h, 2) == [3, 4, 9]
    d.accept(0, 0, False)
    assert d.draft_one(0, h, 2) == [3, 4, 9]


def test_k4v_worked_examples() -> None:
    d = NgramMapK4vDrafter(1, 2, 1)
    h = arr([9, 1, 2, 3, 1, 2, 3, 1, 2, 4, 9, 9])
    d.begin(0, h)
    assert d.draft_one(0, h, 1) == [2, 4]  # slot 0 ([2,3]) wins 2 >= 2*1, draft is the tokens at p
    assert d.draft_one(0, h, 1) == []  # the occurrence at p is counted again: 2 < 2*2

    d = NgramMapK4vDrafter(1, 2, 2)
    h = arr([9, 1, 2, 3, 1, 2, 3, 9, 9, 9])
    d.begin(0, h)
    assert d.draft_one(0, h, 1) == []  # key_num 1 < min_hits 2
    assert d.draft_one(0, h, 1) == [2, 3]


def test_begin_after_shrink_cleans_up_and_slots_are_independent() -> None:
    d = NgramMapKDrafter(2, 2, 1)
    long = arr([7, 1, 2, 3, 4, 8, 8, 8, 8, 1, 2, 5, 6, 9, 9, 9, 1])
    d.begin(0, long[:12])
    d.draft_one(0, long, 2)
    d.begin(0, long[:8])  # a new request with a shorter history on slot 0
    st0 = d._slots.get(0)
    assert all(k.key_idx < st0.size_last_begin for k in st0.keys)
    assert all(int(j) < 8 for j in st0.key_map[st0.key_map != 0])
    short = arr([7, 1, 2, 3, 4, 8, 8, 8, 6, 6, 1])
    assert d.draft_one(0, short, 2) == [3, 4]
    assert 1 not in d._slots  # slot 1 untouched


def test_a_new_different_prompt_on_the_slot_is_indexed() -> None:
    """After a longer request, llama.cpp never indexes the first S-n-m positions of a new prompt."""
    d = NgramMapKDrafter(2, 3, 1)
    first = arr(list(range(100, 160)))
    d.begin(0, first)
    d.draft_one(0, first, 160)
    second = arr([9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9, 9, 9, 9, 1])
    d.begin(0, second)
    assert d.draft_one(0, second, 2) == [3, 4, 5]


def test_starts_just_below_the_prompt_end_are_indexed() -> None:
    # S = 12, n = 2, m = 3: llama.cpp never looks at starts 7..12 until the next begin().
    d = NgramMapKDrafter(2, 3, 1)
    prompt = arr([0, 0, 0, 0, 0, 0, 0, 0, 7, 8, 1, 2])
    d.begin(0, prompt)
    hist = arr([0, 0, 0, 0, 0, 0, 0, 0, 7, 8, 1, 2, 3, 4, 5, 6, 7])
    assert d.draft_one(0, hist, 8) == [1, 2, 3]


def test_context_shift_without_begin_does_not_abort() -> None:
    # llama.cpp aborts when the history shrinks between drafts; here it cleans up and carries on.
    d = NgramMapKDrafter(2, 2, 1)
    h = arr([7, 1, 2, 3, 4, 8, 8, 8, 8, 8, 8, 8, 1])
    d.begin(0, h)
    assert d.draft_one(0, h, 2) == [3, 4]
    shifted = arr([3, 1, 2, 6, 5, 8, 8, 1])
    assert d.draft_one(0, shifted, 2) == [6, 5]


def test_round_cap_and_options() -> None:
    d = NgramMapKDrafter.create(ctx(**{"spec-ngram-map-k-size-n": 2, "spec-ngram-map-k-size-m": 3}))
    assert isinstance(d, Drafter) and (d.n, d.m, d.min_hits) == (2, 3, 1)
    h = arr([5, 1, 2, 3, 4, 9, 9, 1])
    d.begin(0, h)
    assert d.draft([request(h, 2, n_max=2)])[0].tokens == [3, 4]
    k4v = NgramMapK4vDrafter.create(ctx(**{"spec-ngram-map-k4v-min-hits": 3}))
    assert isinstance(k4v, Drafter) and (k4v.n, k4v.m, k4v.min_hits) == (12, 48, 3)
    with pytest.raises(ConfigError, match="spec-ngram-map-k4v-size-m"):
        NgramMapK4vDrafter.create(ctx(**{"spec-ngram-map-k4v-size-m": 0}))
    with pytest.raises(ConfigError, match="spec-ngram-map-k-min-hits"):
        NgramMapKDrafter.create(ctx(**{"spec-ngram-map-k-min-hits": -1}))


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    key_only=st.booleans(),
    n=st.integers(1, 3),
    m=st.integers(1, 4),
    min_hits=st.integers(1, 2),
)
def test_matches_reference_over_a_growing_history(
    data: st.DataObject, key_only: bool, n: int, m: int, min_hits: int
) -> None:
    """Drafts, accepts and begins on a growing (and sometimes restarted) history match the loops."""
    ours = (NgramMapKDrafter if key_only else NgramMapK4vDrafter)(n, m, min_hits)
    ref = RefMap(n, m, min_hits, key_only)
    hist = data.draw(st.lists(st.integers(0, 3), min_size=0, max_size=30))
    ours.begin(0, arr(hist))
    ref.begin(hist)
    for _ in range(data.draw(st.integers(1, 25))):
        action = data.draw(st.sampled_from(["round", "round", "round", "restart"]))
        if action == "restart":
            hist = hist[: data.draw(st.integers(0, len(hist)))] + data.draw(
                st.lists(st.integers(0, 3), max_size=8)
            )
            ours.begin(0, arr(hist))
            ref.begin(hist)
            continue
        x = data.draw(st.integers(0, 3))
        got = ours.draft_one(0, arr(hist), x)
        assert got == ref.draft(hist, x)
        assert len(got) <= m
        if got:  # invariant 9: the slice right after an earlier occurrence of the key
            key = hist[len(hist) - n + 1 :] + [x]
            assert any(
                hist[p : p + n] == key and hist[p + n : p + n + len(got)] == got for p in range(1, len(hist))
            )
        accepted = data.draw(st.integers(0, len(got)))
        ours.accept(0, accepted, True)
        ref.accept(accepted)
        hist = hist + [x] + got[:accepted]
        key_map = ours._slots.get(0).key_map
        nonzero = np.flatnonzero(key_map)
        assert dict(zip(nonzero.tolist(), key_map[nonzero].tolist(), strict=True)) == ref.key_map
