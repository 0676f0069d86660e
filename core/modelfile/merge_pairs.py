"""A BPE merge list as the token ids of its two parts, handed to the `tokenizers` library pair by pair.

A 262k vocabulary has about 500k merges (ggml-vocab-gemma-4: 514,906). As a list of (str, str) tuples
they are 37 MB of tuples, and as the two lists of ints the header cache used to keep, 1M int objects
(32 MB) more, all alive while the library copies them into its own vector and map. Here the ids are two
4-byte arrays (plain `bytes` in the header cache, file_cache.py), and iterating makes each pair's tuple
only when the library asks for it: its texts are the vocabulary's own strings, so a pair costs nothing
once the library has copied it. `models.BPE(merges=...)` takes any `Sequence` and iterates it once.
The ids index a list of only the tokens some merge names (a few hundred in a vocabulary padded with
tokens no merge makes), so the vocabulary's whole list of texts can go before the library copies it.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from typing import overload

# 4-byte ids: 'I' is a C unsigned int, 4 bytes wherever CPython runs.
_ID_CODE = "I"


class MergePairs(Sequence[tuple[str, str]]):
    """Merge i is (texts[firsts[i]], texts[seconds[i]]); `texts` holds the named tokens' texts only."""

    __slots__ = ("_texts", "_firsts", "_seconds", "_token_ids")

    def __init__(self, texts: Sequence[str], firsts: array, seconds: array, token_ids: array) -> None:
        """`token_ids[k]`: the vocabulary id of `texts[k]`."""
        if any(a.typecode != _ID_CODE for a in (firsts, seconds, token_ids)) or len(firsts) != len(seconds):
            raise ValueError("merge ids are not two id arrays of one length")
        if len(texts) != len(token_ids) or (firsts and max(firsts) >= len(texts)) or (
                seconds and max(seconds) >= len(texts)):
            raise ValueError("a merge names a token outside the vocabulary")
        self._texts, self._firsts, self._seconds, self._token_ids = texts, firsts, seconds, token_ids

    @classmethod
    def from_texts(cls, vocab_texts: Sequence[str], pairs: Sequence[tuple[str, str]],
                   ids: dict[str, int]) -> MergePairs:
        """The merges `pairs` (both parts tokens of `ids`, the text -> id map of `vocab_texts`) as ids."""
        named = sorted({ids[t] for pair in pairs for t in pair})
        index = {token: k for k, token in enumerate(named)}
        return cls([vocab_texts[t] for t in named], array(_ID_CODE, [index[ids[a]] for a, _ in pairs]),
                   array(_ID_CODE, [index[ids[b]] for _, b in pairs]), array(_ID_CODE, named))

    @classmethod
    def from_cache(cls, vocab_texts: Sequence[str], token_ids: bytes, firsts: bytes, seconds: bytes) -> MergePairs:
        """The merges from `to_cache`'s buffers (ValueError when they do not fit `vocab_texts`)."""
        named, first_ids, second_ids = array(_ID_CODE), array(_ID_CODE), array(_ID_CODE)
        named.frombytes(token_ids)
        first_ids.frombytes(firsts)
        second_ids.frombytes(seconds)
        if named and max(named) >= len(vocab_texts):
            raise ValueError("a merge names a token outside the vocabulary")
        return cls(list(map(vocab_texts.__getitem__, named)), first_ids, second_ids, named)

    def to_cache(self) -> tuple[bytes, bytes, bytes]:
        return self._token_ids.tobytes(), self._firsts.tobytes(), self._seconds.tobytes()

    def __len__(self) -> int:
        return len(self._firsts)

    @overload
    def __getitem__(self, index: int) -> tuple[str, str]: ...
    @overload
    def __getitem__(self, index: slice) -> list[tuple[str, str]]: ...
    def __getitem__(self, index: int | slice) -> tuple[str, str] | list[tuple[str, str]]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return self._texts[self._firsts[index]], self._texts[self._seconds[index]]

    def __iter__(self) -> Iterator[tuple[str, str]]:
        text = self._texts.__getitem__
        return zip(map(text, self._firsts), map(text, self._seconds), strict=True)
