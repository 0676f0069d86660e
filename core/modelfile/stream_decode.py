"""Incremental detokenization that never emits half a UTF-8 character.

A byte-level token can end in the middle of a multi-byte character (an emoji is often 2-4 tokens), so
text is only released once the bytes of a whole character are in. Invalid sequences become U+FFFD,
exactly as a whole-sequence ``bytes.decode("utf-8", "replace")`` would render them, so that streamed
text always equals the text decoded in one go.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Iterable


class StreamDecoder:
    """Push token ids as they are generated; get back only complete characters."""

    def __init__(self, piece_bytes: Callable[[int], bytes]) -> None:
        self._piece_bytes = piece_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids: int | Iterable[int]) -> str:
        """Add one id or several; return the text that is now complete (maybe "")."""
        if isinstance(ids, int):
            ids = (ids,)
        data = b"".join(self._piece_bytes(int(t)) for t in ids)
        return self._utf8.decode(data, final=False)

    def flush(self) -> str:
        """End of stream: a dangling partial character is rendered as U+FFFD."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text

    @property
    def pending(self) -> bool:
        """True while bytes of an unfinished character are held back."""
        buffered, _ = self._utf8.getstate()
        return bool(buffered)
