"""The bytes every token stands for, in one buffer: a 262k-token vocabulary as 262k `bytes` objects
took 12 MB of a server's fixed memory, as one buffer and its offsets about 2.5 MB.

`PieceTable[t]` is token t's bytes (a new `bytes` object, sliced out of the buffer); `join(ids)` is
the bytes of a token sequence. The buffer and the offsets are plain `bytes`, which is what the header
cache (modelfile/file_cache.py) stores and reads back without rebuilding a list.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

# 4-byte offsets: 'I' is a C unsigned int, 4 bytes wherever CPython runs.
_OFFSET_CODE = "I"


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

    def join(self, ids: Sequence[int], skip: Sequence[int] | None = None) -> list[bytes]:
        """The pieces of `ids`, in order; ids for which `skip[id]` is true give b""."""
        blob, o = self._blob, self._offsets
        if skip is None:
            return [blob[o[t] : o[t + 1]] for t in ids]
        return [b"" if skip[t] else blob[o[t] : o[t + 1]] for t in ids]
