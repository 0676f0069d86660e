"""Merges as token-id arrays (core/modelfile/merge_pairs.py): the same pairs as the list they come from,
through the header cache's buffers, and accepted by the tokenizers library as a merge list."""

from __future__ import annotations

from array import array

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from spekula.core.modelfile.merge_pairs import MergePairs

TEXTS = ["a", "b", "c", "ab", "abc", "b"]  # a later duplicate ("b", id 5) wins, as in the vocabulary dict
IDS = {t: i for i, t in enumerate(TEXTS)}
PAIRS = [("a", "b"), ("ab", "c")]


def test_pairs_round_trip_through_the_cache_buffers() -> None:
    pairs = MergePairs.from_texts(TEXTS, PAIRS, IDS)
    assert list(pairs) == PAIRS and len(pairs) == 2 and pairs[1] == ("ab", "c") and pairs[:] == PAIRS
    restored = MergePairs.from_cache(TEXTS, *pairs.to_cache())
    assert list(restored) == PAIRS
    # the ids index the named tokens only: a, c, ab and the later "b" (vocabulary ids 0, 2, 3, 5)
    assert restored.to_cache() == (array("I", [0, 2, 3, 5]).tobytes(), array("I", [0, 2]).tobytes(),
                                   array("I", [3, 1]).tobytes())


def test_buffers_that_do_not_fit_the_vocabulary_are_refused() -> None:
    named, firsts, seconds = MergePairs.from_texts(TEXTS, PAIRS, IDS).to_cache()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        MergePairs.from_cache(TEXTS[:4], named, firsts, seconds)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        MergePairs.from_cache(TEXTS, named[:8], firsts, seconds)  # merge index 2 past the two named texts
    with pytest.raises(ValueError, match="one length"):
        MergePairs.from_cache(TEXTS, named, firsts, seconds[:4])
    with pytest.raises(ValueError):
        MergePairs.from_cache(TEXTS, named, firsts[:3], seconds)  # not a whole number of ids


def test_the_library_takes_them_as_its_merge_list() -> None:
    vocab = {"a": 0, "b": 1, "c": 2, "ab": 3, "abc": 4}
    pairs = MergePairs.from_texts(list(vocab), PAIRS, vocab)
    lazy = HFTokenizer(models.BPE(vocab=vocab, merges=pairs))
    eager = HFTokenizer(models.BPE(vocab=vocab, merges=PAIRS))
    for text in ("abc", "ab", "cab", "abcabc", "ba"):
        assert lazy.encode(text).ids == eager.encode(text).ids
    assert lazy.encode("abc").ids == [4]
