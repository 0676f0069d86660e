"""One call run in a thread of its own while the caller goes on with other work.

`build_engine` loads the target's backend this way while it builds the tokenizer: the native backend
spends most of its load repacking weights in C with the GIL released, so on a machine with a core to
spare the two overlap instead of adding up (tens of milliseconds of `spekula generate`'s start-up;
BackendLoad says how they are ordered).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from spekula.frontends.malloc_tuning import release_free_memory

if TYPE_CHECKING:
    from spekula.core.backend import BackendOptions

T = TypeVar("T")
U = TypeVar("U")

# The tokenizer's construction holds about 100 bytes a token more, for a moment, than it keeps (a Python
# list and dict of the vocabulary beside the tokenizers library's own maps: +84 MB at its peak, +56 MB kept,
# for 262k tokens). From this many tokens on, that moment beside a fully loaded backend is worth ordering
# away: the backend packs its output head after it. Below, the overlap's start-up time is worth more.
WAIT_FOR_TOKENIZER_MIN_VOCAB = 100_000


def head_waits_for_tokenizer(metadata: Mapping[str, Any]) -> bool:
    """Whether the backend's load should pack its output head only once the tokenizer is built."""
    tokens = metadata.get("tokenizer.ggml.tokens")
    return tokens is not None and len(tokens) >= WAIT_FOR_TOKENIZER_MIN_VOCAB


class TokenizerFailed(Exception):
    """A load that waited for the tokenizer stopped, because the tokenizer could not be built."""


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


class BackendLoad(Generic[T]):
    """`make(options)` loading a backend in its own thread while the caller builds the tokenizer.

    The caller builds the tokenizer with `beside`, which starts it once the load's setup is done
    (`wait_setup`: the native backend's Python work; what follows packs weights without the GIL) and says
    when it is done (`tokenizer_done`, whatever happens). With a large vocabulary the load packs its output head only then,
    and not at all after a failure (TokenizerFailed, which `discard` drops). Against the two loads started
    together, on Gemma 3 270M: peak RSS 364 MB every run instead of 366-374 (the backend's setup no longer
    interleaves its objects with the tokenizer's short-lived ones, pinning some of their pages), and the
    load 0.30-0.34 s instead of 0.37-0.44 (the two no longer take turns holding the GIL)."""

    def __init__(self, make: Callable[[BackendOptions], T], options: BackendOptions,
                 metadata: Mapping[str, Any], name: str) -> None:
        self._setup_done = threading.Event()
        self._tokenizer = threading.Event()
        self._tokenizer_built = False
        gated = replace(options, on_setup_done=self._setup_done.set,
                        before_head=self._before_head if head_waits_for_tokenizer(metadata) else None)

        def load() -> T:
            try:
                return make(gated)
            finally:
                self._setup_done.set()  # a load that failed first, or that never says so, lets the caller go

        self._job = InThread(load, name=name)

    def _before_head(self) -> None:
        self._tokenizer.wait()
        if not self._tokenizer_built:
            raise TokenizerFailed("the backend's load stopped: the tokenizer failed")

    def beside(self, build: Callable[[], U]) -> U:
        """`build()` (the tokenizer) once the load's setup is done, telling the load how it ended."""
        built = False
        try:
            self.wait_setup()
            value = build()
            built = True
            return value
        finally:
            self.tokenizer_done(built)

    def wait_setup(self) -> None:
        """Return once the caller should start the tokenizer (the load's setup is done, or it ended)."""
        self._setup_done.wait()

    def tokenizer_done(self, built: bool) -> None:
        """The tokenizer is built (True) or failed (False). Its construction's freed pages go back to the
        system first: when the vocabulary's derived tables were not in the header cache yet (the first
        open of a file) they stay in the heap otherwise, 8.5 MB on Gemma 3 270M."""
        release_free_memory()
        self._tokenizer_built = built
        self._tokenizer.set()

    def result(self) -> T:
        """Wait for the load; the backend, or the load's exception raised here."""
        return self._job.result()

    def discard(self, close: Callable[[T], None]) -> None:
        """Wait for the load and close what it made (InThread.discard)."""
        self._job.discard(close)
