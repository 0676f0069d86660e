"""One call run in a thread of its own while the caller goes on with other work.

`build_engine` loads the target's backend this way while it builds the tokenizer: the native backend
spends most of its load repacking weights in C with the GIL released, so on a machine with a core to
spare the two overlap instead of adding up (tens of milliseconds of `spekula generate`'s start-up).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from spekula.core.backend import BackendOptions

T = TypeVar("T")

# The tokenizer's construction holds about 100 bytes a token more, for a moment, than it keeps (a Python
# dict of the vocabulary beside the tokenizers library's own maps: +80 MB at its peak, +52 MB kept, for 262k
# tokens). From this many tokens on, that moment beside a fully loaded backend is worth ordering away: the
# backend packs its output head after it (Gemma 3 270M: 373 -> 350 MB; start-up +55 ms). Below, the overlap's
# start-up time is worth more (SmolLM2, 49k tokens: +8-16 ms for ~5 MB).
WAIT_FOR_TOKENIZER_MIN_VOCAB = 100_000


def head_waits_for_tokenizer(metadata: Mapping[str, Any]) -> bool:
    """Whether the backend's load should pack its output head only once the tokenizer is built."""
    tokens = metadata.get("tokenizer.ggml.tokens")
    return tokens is not None and len(tokens) >= WAIT_FOR_TOKENIZER_MIN_VOCAB


class InThread(Generic[T]):
    """`make()` running in its own (non-daemon) thread from construction on."""

    def __init__(self, make: Callable[[], T], name: str) -> None:
        self._make = make
        self._value: T | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._value = self._make()
        except BaseException as exc:  # handed to whoever asks for the result
            self._error = exc

    def result(self) -> T:
        """Wait for `make()`; its value, or its exception raised here."""
        self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self._value  # type: ignore[return-value]

    def discard(self, close: Callable[[T], None]) -> None:
        """Wait for `make()` and `close` what it made, for a caller whose own work failed: its error is the
        one to report, so `make()`'s is dropped."""
        self._thread.join()
        if self._error is None and self._value is not None:
            close(self._value)
        self._value = self._error = None


def load_beside_tokenizer(make: Callable[[BackendOptions], T], options: BackendOptions,
                          metadata: Mapping[str, Any], name: str) -> tuple[InThread[T], Callable[[], None]]:
    """`make(options)` started in a thread while the caller builds the tokenizer, and the call that tells
    it the tokenizer is done (make it once built or failed): with a large vocabulary (head_waits_for_tokenizer)
    the load packs its output head only then."""
    built = threading.Event()
    if head_waits_for_tokenizer(metadata):
        options = replace(options, before_head=built.wait)
    return InThread(lambda: make(options), name=name), built.set
