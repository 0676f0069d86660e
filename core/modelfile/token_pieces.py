"""The bytes every token stands for, in one buffer: a 262k-token vocabulary as 262k `bytes` objects
took 12 MB of a server's fixed memory, as one buffer and its offsets about 2.5 MB.

`PieceTable[t]` is token t's bytes (a new `bytes` object, sliced out of the buffer); `concat(ids)` is
the bytes of a token sequence. Slicing costs about a microsecond a token where a list of `bytes`
took a few tens of nanoseconds: nothing beside a forward for a streamed token, and long sequences
are gathered with numpy instead. The buffer and the offsets are plain `bytes`, which is what the header
cache (modelfile/file_cache.py) stores and reads back without rebuilding a list.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

import numpy as np

# 4-byte offsets: 'I' is a C unsigned int, 4 bytes wherever CPython runs.
_OFFSET_CODE = "I"
# From this many ids on, `concat` gathers with numpy (about 6x a slice per id on 50k ids).
_GATHER_MIN_IDS = 256


class PieceTable:
    """Token id -> bytes, over one buffer: piece t is blob[offsets[t] : offsets[t + 1]]."""

    __slots__ = ("_blob", "_offsets")

    def __init__(self, blob: bytes, offsets: array) -> None:
        if offsets.typecode != _OFFSET_CODE or len(offsets) < 1 or offsets[-1] != len(blob):
            raise ValueError("piece offsets do not describe the buffer")
        self._blob, self._offsets = blob, offsets

    @classmethod
    def from_pieces(cls, pieces: Iterable[bytes]) -> PieceTable:
        offsets = array(_OFFSET_CODE, [0])
        parts: list[bytes] = []
        end = 0
        for piece in pieces:
            parts.append(piece)
            end += len(piece)
            offsets.append(end)
        return cls(b"".join(parts), offsets)

    @classmethod
    def from_cache(cls, blob: bytes, offsets: bytes) -> PieceTable:
        """A table from `to_cache`'s two buffers (ValueError when they do not fit together)."""
        table = array(_OFFSET_CODE)
        table.frombytes(offsets)
        return cls(blob, table)

    def to_cache(self) -> tuple[bytes, bytes]:
        return self._blob, self._offsets.tobytes()

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, token: int) -> bytes:
        o = self._offsets
        return self._blob[o[token] : o[token + 1]]

    def concat(self, ids: Sequence[int], skip: bytes | None = None) -> bytes:
        """The bytes of `ids` one after the other; ids for which `skip[id]` is non-zero add nothing.
        Ids must be in range (the tokenizer checks them first)."""
        blob, o = self._blob, self._offsets
        if len(ids) < _GATHER_MIN_IDS:
            if skip is None:
                return b"".join([blob[o[t] : o[t + 1]] for t in ids])
            return b"".join([b"" if skip[t] else blob[o[t] : o[t + 1]] for t in ids])
        # Long sequences (a /detokenize body): one gather over the buffer instead of a slice per id.
        idx = np.asarray(ids, dtype=np.int64)
        offsets = np.frombuffer(o, dtype=np.uint32).astype(np.int64)
        first = offsets[idx]
        lengths = offsets[idx + 1] - first
        if skip is not None:
            lengths[np.frombuffer(skip, dtype=np.uint8)[idx] != 0] = 0
        out_starts = np.cumsum(lengths) - lengths
        positions = np.repeat(first - out_starts, lengths) + np.arange(int(lengths.sum()))
        return np.frombuffer(blob, dtype=np.uint8)[positions].tobytes()
