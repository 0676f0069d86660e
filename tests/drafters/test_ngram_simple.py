"""ngram-simple: llama.cpp's worked examples, a naive reference, caps and options."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ngram_helpers import arr, ctx, request

from spekula.core.drafting.drafter import Drafter
from spekula.core.errors import ConfigError
from spekula.drafters.draftless.ngram_simple import NgramSimpleDrafter, ngram_simple_draft


def naive_draft(hist: list[int], last: int, n: int, m: int, min_hits: int = 1) -> list[int]:
    """A literal transcription of the definition (docs/semantics.md §2.1) plus min-hits."""
    length = len(hist)
    if length <= n + m + 1:
        return []
    pattern = hist[length - n + 1 :] + [last]
    hits = [j for j in range(length - n - 1, 0, -1) if hist[j : j + n] == pattern]
    if len(hits) < min_hits:
        return []
    j = hits[0]
    copy = min(m, length - j - n)
    return hist[j + n : j + n + copy] if copy >= n else []


@pytest.mark.parametrize(
    ("hist", "last", "expected"),
    [
        ([5, 1, 2, 3, 4, 9, 9, 1], 2, [3, 4, 9]),  # [1,2] at j=1, copy 3
        ([9, 2, 7, 7, 7, 7, 2, 9], 2, []),  # [9,2] only at index 0, never tested
        ([7, 7, 7, 7, 7, 9, 2, 9], 2, []),  # match at j=5 but copy 1 < N
    ],
)
def test_worked_examples(hist: list[int], last: int, expected: list[int]) -> None:
    assert ngram_simple_draft(arr(hist), last, 2, 3) == expected
    assert NgramSimpleDrafter(2, 3).draft([request(hist, last)])[0].tokens == expected


def test_too_short_history_gives_no_draft() -> None:
    # L must exceed N+M+1: with N=2, M=3 seven tokens are not enough even with a match.
    assert ngram_simple_draft(arr([1, 2, 3, 4, 5, 1, 1]), 2, 2, 3) == []


def test_latest_occurrence_wins() -> None:
    hist = [0, 1, 2, 10, 11, 12, 1, 2, 20, 21, 22, 30, 31, 1]
    assert ngram_simple_draft(arr(hist), 2, 2, 3) == [20, 21, 22]


def test_min_hits_counts_earlier_occurrences() -> None:
    once = [0, 1, 2, 10, 11, 12, 13, 14, 15, 16, 1]
    twice = [0, 1, 2, 10, 11, 12, 1, 2, 20, 21, 22, 23, 1]
    assert ngram_simple_draft(arr(once), 2, 2, 3, min_hits=2) == []
    assert ngram_simple_draft(arr(once), 2, 2, 3, min_hits=1) == [10, 11, 12]
    assert ngram_simple_draft(arr(twice), 2, 2, 3, min_hits=2) == [20, 21, 22]
    assert ngram_simple_draft(arr(twice), 2, 2, 3, min_hits=3) == []


def test_round_cap_truncates() -> None:
    d = NgramSimpleDrafter(2, 3)
    assert d.draft([request([5, 1, 2, 3, 4, 9, 9, 1], 2, n_max=2)])[0].tokens == [3, 4]
    assert d.draft([request([5, 1, 2, 3, 4, 9, 9, 1], 2, n_max=0)])[0].tokens == []


def test_create_reads_llama_option_names() -> None:
    d = NgramSimpleDrafter.create(
        ctx(
            **{
                "spec-ngram-simple-size-n": 3,
                "spec-ngram-simple-size-m": "5",
                "spec-ngram-simple-min-hits": 2,
            }
        )
    )
    assert isinstance(d, Drafter)
    assert (d.size_n, d.size_m, d.min_hits) == (3, 5, 2)
    default = NgramSimpleDrafter.create(ctx())
    assert (default.size_n, default.size_m, default.min_hits) == (12, 48, 1)
    assert NgramSimpleDrafter.name == "ngram-simple" and not NgramSimpleDrafter.model_based


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("spec-ngram-simple-size-n", 0),
        ("spec-ngram-simple-size-m", 1025),
        ("spec-ngram-simple-min-hits", 0),
        ("spec-ngram-simple-size-n", "twelve"),
    ],
)
def test_bad_options_are_config_errors(name: str, value: object) -> None:
    with pytest.raises(ConfigError, match=name):
        NgramSimpleDrafter.create(ctx(**{name: value}))


@settings(max_examples=300, deadline=None)
@given(
    hist=st.lists(st.integers(0, 3), min_size=0, max_size=90),
    last=st.integers(0, 3),
    n=st.integers(1, 4),
    m=st.integers(1, 6),
    min_hits=st.integers(1, 3),
    n_max=st.integers(0, 8),
)
def test_matches_naive_reference(
    hist: list[int], last: int, n: int, m: int, min_hits: int, n_max: int
) -> None:
    expected = naive_draft(hist, last, n, m, min_hits)
    got = ngram_simple_draft(arr(hist), last, n, m, min_hits)
    assert got == expected
    assert got == [] or n <= len(got) <= m
    capped = NgramSimpleDrafter(n, m, min_hits).draft([request(hist, last, n_max=n_max)])[0].tokens
    assert capped == expected[:n_max]


def test_long_history_window_search_matches_naive() -> None:
    # The backward search runs in growing windows: matches far back must still be found.
    rng = np.random.default_rng(7)
    hist = rng.integers(0, 1000, 5000).tolist()
    hist[100:112] = list(range(2000, 2012))
    hist[-11:] = list(range(2000, 2011))
    assert ngram_simple_draft(arr(hist), 2011, 12, 48) == naive_draft(hist, 2011, 12, 48) == hist[112:160]


def test_lookups_convert_what_is_not_a_contiguous_int32_array() -> None:
    hist = [1, 2, 3, 9, 9, 1, 2, 3, 7, 7, 1, 2]
    want = ngram_simple_draft(arr(hist), 3, 3, 3)
    assert want == [7, 7, 1]
    assert ngram_simple_draft(np.asarray(hist, dtype=np.int64), 3, 3, 3) == want
    assert ngram_simple_draft(np.repeat(arr(hist), 2)[::2], 3, 3, 3) == want  # a strided view
    assert ngram_simple_draft(hist, 3, 3, 3) == want  # a list
    with pytest.raises(ValueError, match="sizes"):
        ngram_simple_draft(arr(hist), 3, 0, 2)
