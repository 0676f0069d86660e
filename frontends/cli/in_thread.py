"""One call run in a thread of its own while the caller goes on with other work.

`build_engine` loads the target's backend this way while it builds the tokenizer: the native backend
spends most of its load repacking weights in C with the GIL released, so on a machine with a core to
spare the two overlap instead of adding up (tens of milliseconds of `spekula generate`'s start-up). A
large vocabulary's tokenizer goes first instead (WAIT_FOR_TOKENIZER_MIN_VOCAB says why).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

T = TypeVar("T")

# The tokenizer's construction holds about 100 bytes a token more, for a moment, than it keeps (a Python
# list and dict of the vocabulary beside the tokenizers library's own maps: +84 MB at its peak, +56 MB kept,
# for 262k tokens). A backend loading meanwhile interleaves its own allocations with that moment's, and the
# freed pages stay pinned under them: on Gemma 3 270M the process's floor rose 4-9 MB, by a different amount
# each run. From this many tokens on, the backend loads only once the tokenizer is built (peak 363 MB every
# run against 367-376 beside it; start-up the same there, +30-60 ms on Ministral 3 3B and gpt-oss 20b). Below,
# the overlap's start-up time is worth more (SmolLM2, 49k tokens: the two loads take ~50 and ~65 ms).
WAIT_FOR_TOKENIZER_MIN_VOCAB = 100_000


def load_waits_for_tokenizer(metadata: Mapping[str, Any]) -> bool:
    """Whether the backend should load only once the tokenizer is built (a large vocabulary)."""
    tokens = metadata.get("tokenizer.ggml.tokens")
    return tokens is not None and len(tokens) >= WAIT_FOR_TOKENIZER_MIN_VOCAB


class TokenizerFailed(Exception):
    """A load that waited for the tokenizer skipped, because the tokenizer could not be built."""


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


def load_beside_tokenizer(make: Callable[[], T], metadata: Mapping[str, Any],
                          name: str) -> tuple[InThread[T], Callable[[bool], None]]:
    """`make()` started in a thread while the caller builds the tokenizer, and the call that tells it the
    tokenizer is done (True: built; False: it failed). Make that call whatever happens: with a large
    vocabulary (load_waits_for_tokenizer) `make()` starts only then, and not at all after a failure (the
    load then ends in TokenizerFailed, which `discard` drops)."""
    if not load_waits_for_tokenizer(metadata):
        return InThread(make, name=name), lambda built: None
    done = threading.Event()
    outcome: list[bool] = []

    def after_tokenizer() -> T:
        done.wait()
        if not outcome[0]:
            raise TokenizerFailed("the backend was not loaded: the tokenizer failed")
        return make()

    def tokenizer_done(built: bool) -> None:
        outcome.append(built)
        done.set()

    return InThread(after_tokenizer, name=name), tokenizer_done
