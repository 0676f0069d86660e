"""ngram-cache: worked examples, the llama.cpp file format, dynamic-cache saving, invariants."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ngram_helpers import arr, ctx, request

from spekula.core.drafting.drafter import Drafter
from spekula.core.errors import SpekulaError
from spekula.drafters.draftless.ngram_cache import NgramCacheDrafter
from spekula.drafters.draftless.ngram_cache_file import (
    NgramCache,
    NgramCacheError,
    count_static_ngrams,
    load_cache,
    save_cache,
    update_cache,
)


@pytest.mark.parametrize("compat", [True, False])
def test_worked_examples(compat: bool) -> None:
    d = NgramCacheDrafter(llama_compat_update=compat)
    assert d.draft_one(0, arr([5, 6, 7, 8, 9, 5, 6]), 7) == [8, 9, 5, 6, 7, 8, 9, 5]
    d = NgramCacheDrafter(llama_compat_update=compat)
    assert d.draft_one(0, arr([5, 6, 7, 8]), 5) == []  # (5)->6 seen once < size-1 minimum of 2
    nxt = d.draft_one(0, arr([5, 6, 7, 8, 5, 6]), 7)
    if compat:
        assert nxt == [8, 5]  # llama.cpp never records the boundary 2-gram (8,5)
    else:
        assert nxt == [8, 5, 6, 7, 8, 5, 6, 7]  # spekula counts n-grams across rounds
    h = arr([4, 1, 2, 4, 1, 2, 4, 1, 3, 9, 4])
    assert NgramCacheDrafter(llama_compat_update=compat).draft_one(0, h, 1)[0] == 2
    with_static = NgramCacheDrafter(static={(4, 1, -1, -1): {3: 5}}, llama_compat_update=compat)
    assert with_static.draft_one(0, h, 1)[0] == 3  # static weight picks 3, the static fallback drafts it


def test_dynamic_cache_uses_strict_thresholds() -> None:
    dyn: NgramCache = {(7, -1, -1, -1): {8: 3}}  # 3 samples: below the strict size-1 minimum of 4
    assert NgramCacheDrafter(dynamic=dyn).draft_one(0, arr([1, 2]), 7) == []
    dyn[(7, -1, -1, -1)][8] = 4
    assert NgramCacheDrafter(dynamic=dyn).draft_one(0, arr([1, 2]), 7)[:1] == [8]


def test_draft_is_capped_at_8_and_n_max() -> None:
    h = arr([1, 2, 3] * 10)
    d = NgramCacheDrafter()
    assert len(d.draft_one(0, h, 1)) == 8
    assert d.draft([request(h, 1, n_max=3, slot=1)])[0].tokens == [2, 3, 1]


def test_begin_rewinds_to_the_shared_prefix() -> None:
    d = NgramCacheDrafter()
    d.begin(0, arr([1, 2, 3, 4, 5, 6, 7, 8, 9, 10]))
    d.draft_one(0, arr([1, 2, 3, 4, 5, 6, 7, 8, 9, 10]), 11)
    # A new, shorter request on the slot: llama.cpp would not count it until it outgrew 11 tokens.
    d.begin(0, arr([1, 2, 3, 40, 41, 42, 40, 41]))
    assert d.draft_one(0, arr([1, 2, 3, 40, 41, 42, 40, 41]), 42)[:3] == [40, 41, 42]


def make_cache(rng: np.random.Generator) -> NgramCache:
    cache: NgramCache = {}
    update_cache(cache, rng.integers(0, 30, 400).tolist(), 0)
    return cache


def test_file_round_trip_and_layout(tmp_path: Path) -> None:
    cache = make_cache(np.random.default_rng(1))
    path = tmp_path / "lookup.bin"
    save_cache(cache, path)
    assert load_cache(path) == cache
    assert not [p for p in tmp_path.iterdir() if p.name != "lookup.bin"]  # no temp file left
    path.chmod(0o640)
    save_cache(cache, path)
    assert path.stat().st_mode & 0o777 == 0o640  # rewriting keeps the file's permissions
    # Byte layout: 4 ids (-1 padded), ntok, then (token, count) pairs, native int32.
    raw = struct.pack("<7i", 5, 6, -1, -1, 1, 7, 3) + struct.pack("<9i", 9, -1, -1, -1, 2, 1, 4, 2, 1)
    (tmp_path / "hand.bin").write_bytes(raw)
    assert load_cache(tmp_path / "hand.bin") == {(5, 6, -1, -1): {7: 3}, (9, -1, -1, -1): {1: 4, 2: 1}}


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        (struct.pack("<5i", 1, 2, -1, -1, 1), "truncated"),
        (struct.pack("<3i", 1, 2, -1), "truncated record header"),
        (struct.pack("<5i", 1, 2, -1, -1, 0), "must be > 0"),
        (struct.pack("<7i", 1, 2, -1, -1, 1, 5, 0), "must be > 0"),
        (struct.pack("<7i", 1, 2, -1, -1, 1, 5, 1) + b"\x00\x01", "multiple of 4"),
    ],
)
def test_corrupt_files_are_clear_errors(tmp_path: Path, raw: bytes, problem: str) -> None:
    path = tmp_path / "bad.bin"
    path.write_bytes(raw)
    with pytest.raises(NgramCacheError, match=problem):
        load_cache(path)
    with pytest.raises(SpekulaError, match="bad.bin"):
        NgramCacheDrafter.create(ctx(**{"lookup-cache-static": str(path)}))


def test_missing_static_file_is_an_error_missing_dynamic_starts_empty(tmp_path: Path) -> None:
    with pytest.raises(SpekulaError, match="cannot read"):
        NgramCacheDrafter.create(ctx(**{"lookup-cache-static": str(tmp_path / "nope.bin")}))
    d = NgramCacheDrafter.create(ctx(**{"lookup-cache-dynamic": str(tmp_path / "new.bin")}))
    assert isinstance(d, Drafter) and d.dynamic == {}


def test_dynamic_cache_is_saved_at_end_and_reloaded(tmp_path: Path) -> None:
    path = tmp_path / "dyn.bin"
    d = NgramCacheDrafter.create(ctx(**{"lookup-cache-dynamic": str(path)}))
    prompt = arr([3, 1, 4, 1, 5, 9, 2, 6])
    d.begin(0, prompt)
    d.draft_one(0, prompt, 5)
    d.end(0)
    saved = load_cache(path)
    expected: NgramCache = {}
    update_cache(expected, [3, 1, 4, 1, 5, 9, 2, 6, 5], 0)
    assert saved == expected
    # A second request on another slot adds its own counts; nothing is counted twice.
    d.begin(1, arr([7, 7, 7, 7, 7]))
    d.draft_one(1, arr([7, 7, 7, 7, 7]), 7)
    d.end(1)
    update_cache(expected, [7] * 6, 0)
    assert load_cache(path) == expected
    # A new process drafts from the saved dynamic cache (strict size-2 test: (7,7)->7 seen 4 times).
    fresh = NgramCacheDrafter.create(ctx(**{"lookup-cache-dynamic": str(path)}))
    assert fresh.draft_one(0, arr([1, 7]), 7)[:1] == [7]


def test_static_counts_from_a_token_stream() -> None:
    tokens = np.array([1, 2, 3, 1, 2, 3, 1, 2, 4])
    assert count_static_ngrams(tokens) == {
        (1, 2, -1, -1): {3: 2, 4: 1},
        (2, 3, -1, -1): {1: 2},
        (3, 1, -1, -1): {2: 2},
    }


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_context_cache_equals_a_rebuild_and_drafts_are_bounded(data: st.DataObject) -> None:
    d = NgramCacheDrafter()
    hist = data.draw(st.lists(st.integers(0, 4), max_size=20))
    d.begin(0, arr(hist))
    for _ in range(data.draw(st.integers(1, 10))):
        x = data.draw(st.integers(0, 4))
        n_max = data.draw(st.integers(0, 10))
        got = d.draft([request(hist, x, n_max)])[0].tokens
        assert len(got) <= min(8, n_max)
        rebuilt: NgramCache = {}
        update_cache(rebuilt, hist + [x], 0)
        assert d._slots.get(0).context == rebuilt
        again = NgramCacheDrafter(static={}, dynamic={})
        again._slots = d._slots
        assert again.draft_one(0, arr(hist), x, n_max) == got  # deterministic for a given state
        hist = hist + [x] + got[: data.draw(st.integers(0, len(got)))]
