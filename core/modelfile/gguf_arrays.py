"""Large arrays of a GGUF header (vocabularies, their scores and types, merge lists) kept compact.

A 262k-token vocabulary as a list of Python strings holds about 18 MB for the whole life of a server,
its scores as a list of floats 8 MB, while after start-up they are read only an item at a time (a
token's text) or once whole (building a tokenizer, comparing a draft's vocabulary).

* `StringArray` keeps the bytes of every string, without the file's 8-byte length before each, in one
  buffer with 4-byte offsets (about 3 MB for that vocabulary) and decodes an item when it is read, with
  the parser's own rule (invalid UTF-8 replaced).
* `NumberArray` keeps a numeric array as the numpy array of the file's element type and gives Python
  ints and floats back.

Both are read-only `Sequence`s equal to the lists they stand for; the header cache stores them as
tagged tuples of bytes (`cache_form`, `from_cache_form`: marshal stores no classes).
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np

# Arrays with at least this many items are kept compact; shorter ones as lists.
LAZY_MIN_ITEMS = 4096
_OFFSET_CODE = "I"  # 4-byte offsets: a header's string bytes are far below 4 GiB
_U64 = struct.Struct("<Q")
CACHE_TAG = "gguf-strings-v2"  # marks a StringArray in a header-cache entry
NUMBERS_TAG = "gguf-numbers-v1"  # marks a NumberArray


class StringArray(Sequence[str]):
    """GGUF strings' bytes one after the other in one buffer: item i is blob[starts[i] : starts[i + 1]],
    decoded on access (the last start is len(blob))."""

    __slots__ = ("_blob", "_starts")

    def __init__(self, blob: bytes, starts: array) -> None:
        if starts.typecode != _OFFSET_CODE or len(starts) < 1 or starts[-1] != len(blob):
            raise ValueError("string offsets do not describe the buffer")
        self._blob, self._starts = blob, starts

    @classmethod
    def from_cache(cls, entry: Any) -> StringArray:
        """The array from `to_cache`'s tuple; ValueError when it is not one."""
        tag, blob, raw = entry
        if tag != CACHE_TAG or not isinstance(blob, bytes) or not isinstance(raw, bytes):
            raise ValueError("not a cached string array")
        starts = array(_OFFSET_CODE)
        starts.frombytes(raw)
        return cls(blob, starts)

    def to_cache(self) -> tuple[str, bytes, bytes]:
        return CACHE_TAG, self._blob, self._starts.tobytes()

    def __len__(self) -> int:
        return len(self._starts) - 1

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> list[str]: ...
    def __getitem__(self, index: int | slice) -> str | list[str]:
        s = self._starts
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(s) - 1))]
        if index < 0:
            index += len(s) - 1
            if index < 0:
                raise IndexError("string array index out of range")
        # index == len: s[index + 1] raises IndexError, as a list would
        return self._blob[s[index] : s[index + 1]].decode("utf-8", errors="replace")

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_list())

    def to_list(self) -> list[str]:
        """Every string, decoded in one pass (a list comprehension: several times a generator's speed)."""
        blob, s = self._blob, self._starts
        return [blob[a:b].decode("utf-8", errors="replace") for a, b in zip(s, s[1:], strict=False)]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StringArray):
            return self._blob == other._blob and self._starts == other._starts
        if isinstance(other, list | tuple):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable-looking sequence semantics, as list

    def __repr__(self) -> str:
        return f"StringArray({len(self)} strings)"


def read_strings(buf: Any, pos: int, count: int) -> tuple[StringArray, int] | None:
    """`count` GGUF strings starting at `pos` of `buf`, as a StringArray, and the position after them;
    None when they run past the buffer (the caller reports where). One copy of the region less the
    lengths (2 MB of a 262k vocabulary), no object per string."""
    end = len(buf)
    first = pos
    starts = array(_OFFSET_CODE)
    length = _U64.unpack_from
    for _ in range(count):
        if pos + 8 > end:
            return None
        (n,) = length(buf, pos)
        pos += 8
        if n > end - pos:
            return None
        starts.append(pos - first)
        pos += n
    if pos - first >= 2**32:
        raise ValueError("string array over 4 GiB")
    at = np.frombuffer(starts, dtype=np.uint32).astype(np.int64)  # each string's bytes in the region
    region = np.frombuffer(buf, dtype=np.uint8, count=pos - first, offset=first)
    edges = np.zeros(region.size + 1, dtype=np.int8)  # +1 where a u64 length starts, -1 where it ends
    edges[at - 8] = 1
    edges[at] -= 1
    keep = np.cumsum(edges[:-1], dtype=np.int8) == 0
    offsets = array(_OFFSET_CODE)
    offsets.frombytes((at - 8 * np.arange(1, count + 1)).astype(np.uint32).tobytes())
    blob = region[keep].tobytes()
    offsets.append(len(blob))
    return StringArray(blob, offsets), pos


class NumberArray(Sequence[Any]):
    """A numeric GGUF array as a read-only numpy array; items come back as Python ints or floats."""

    __slots__ = ("_values",)

    def __init__(self, values: np.ndarray) -> None:
        if values.ndim != 1 or values.dtype.kind not in "iuf":
            raise ValueError("a number array is one-dimensional ints or floats")
        values.flags.writeable = False
        self._values = values

    @property
    def values(self) -> np.ndarray:
        """The numbers as a read-only numpy array (no copy)."""
        return self._values

    def __len__(self) -> int:
        return len(self._values)

    @overload
    def __getitem__(self, index: int) -> Any: ...
    @overload
    def __getitem__(self, index: slice) -> list[Any]: ...
    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return self._values[index].tolist()
        return self._values[index].item()

    def __iter__(self) -> Iterator[Any]:
        return iter(self._values.tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, NumberArray):
            return bool(np.array_equal(self._values, other._values))
        if isinstance(other, list | tuple):
            return len(other) == len(self) and self._values.tolist() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"NumberArray({len(self)} x {self._values.dtype})"


def cache_form(value: Any) -> Any:
    """A metadata value as the header cache stores it (the compact arrays as tagged bytes)."""
    if isinstance(value, StringArray):
        return value.to_cache()
    if isinstance(value, NumberArray):
        return NUMBERS_TAG, value.values.dtype.str, value.values.tobytes()
    return value


def from_cache_form(value: Any) -> Any:
    """`cache_form` undone; ValueError (or TypeError) for a tagged entry that is damaged."""
    if isinstance(value, tuple) and len(value) == 3 and value[0] == CACHE_TAG:
        return StringArray.from_cache(value)
    if isinstance(value, tuple) and len(value) == 3 and value[0] == NUMBERS_TAG:
        return NumberArray(np.frombuffer(value[2], dtype=np.dtype(value[1])))
    return value
