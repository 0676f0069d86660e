"""InThread: one call in its own thread, its value or its exception handed back to the caller."""

from __future__ import annotations

import threading
import time

import pytest

from spekula.core.backend import BackendOptions
from spekula.frontends.cli.in_thread import (
    WAIT_FOR_TOKENIZER_MIN_VOCAB,
    BackendLoad,
    InThread,
    TokenizerFailed,
    head_waits_for_tokenizer,
)


def test_result_is_the_value_made_in_another_thread() -> None:
    made_in: list[threading.Thread] = []
    job = InThread(lambda: made_in.append(threading.current_thread()) or 42, name="t")
    assert job.result() == 42
    assert made_in[0] is not threading.current_thread()


def test_result_raises_the_exception_of_the_call() -> None:
    def fail() -> int:
        raise ValueError("bad file")

    with pytest.raises(ValueError, match="bad file"):
        InThread(fail, name="t").result()


def test_discard_closes_what_was_made_and_drops_a_failure() -> None:
    closed: list[str] = []
    InThread(lambda: "backend", name="t").discard(closed.append)
    assert closed == ["backend"]

    def fail() -> str:
        raise RuntimeError("also broken")

    InThread(fail, name="t").discard(closed.append)  # the caller's own error is the one reported
    assert closed == ["backend"]


def test_only_a_large_vocabulary_makes_the_head_wait_for_the_tokenizer() -> None:
    n = WAIT_FOR_TOKENIZER_MIN_VOCAB
    assert head_waits_for_tokenizer({"tokenizer.ggml.tokens": ["t"] * n})
    assert not head_waits_for_tokenizer({"tokenizer.ggml.tokens": ["t"] * (n - 1)})
    assert not head_waits_for_tokenizer({})


LARGE = {"tokenizer.ggml.tokens": ["t"] * WAIT_FOR_TOKENIZER_MIN_VOCAB}


class FakeLoad:
    """A backend's load as the native one calls its options: setup, then (if asked) the wait before the head."""

    def __init__(self) -> None:
        self.steps: list[str] = []
        self.go = threading.Event()

    def __call__(self, options: BackendOptions) -> str:
        self.go.wait(10)  # the test's cue: the setup is still running until then
        self.steps.append("setup")
        if options.on_setup_done is not None:
            options.on_setup_done()
        if options.before_head is not None:
            options.before_head()
            self.steps.append("head")
        return "backend"


def test_the_caller_waits_for_the_setup_and_a_large_vocabularys_head_for_the_tokenizer() -> None:
    make = FakeLoad()
    load = BackendLoad(make, BackendOptions(), LARGE, "t")
    waiter = InThread(load.wait_setup, name="w")
    assert not make.steps
    make.go.set()
    waiter.result()
    assert make.steps == ["setup"]
    time.sleep(0.1)
    assert make.steps == ["setup"], "the head was packed before the tokenizer was built"
    load.tokenizer_done(True)
    assert load.result() == "backend" and make.steps == ["setup", "head"]


def test_a_large_vocabularys_load_stops_when_the_tokenizer_fails() -> None:
    make = FakeLoad()
    make.go.set()
    load = BackendLoad(make, BackendOptions(), LARGE, "t")
    load.wait_setup()
    load.tokenizer_done(False)
    with pytest.raises(TokenizerFailed):
        load.result()
    assert make.steps == ["setup"]


def test_a_small_vocabularys_load_does_not_wait_for_the_tokenizer() -> None:
    make = FakeLoad()
    make.go.set()
    load = BackendLoad(make, BackendOptions(), {}, "t")
    assert load.result() == "backend"  # no tokenizer_done yet
    load.tokenizer_done(True)


def test_a_load_that_fails_in_its_setup_lets_the_caller_go() -> None:
    def fail(options: BackendOptions) -> str:
        raise ValueError("bad file")

    load = BackendLoad(fail, BackendOptions(), LARGE, "t")
    load.wait_setup()  # returns: the load ended
    load.tokenizer_done(True)
    with pytest.raises(ValueError, match="bad file"):
        load.result()


def test_beside_builds_after_the_setup_and_tells_the_load_how_it_ended() -> None:
    make = FakeLoad()
    make.go.set()
    load = BackendLoad(make, BackendOptions(), LARGE, "t")
    assert load.beside(lambda: make.steps.copy()) == ["setup"]  # built once the setup was done
    assert load.result() == "backend" and make.steps == ["setup", "head"]

    def fail() -> str:
        raise ValueError("bad vocabulary")

    make = FakeLoad()
    make.go.set()
    load = BackendLoad(make, BackendOptions(), LARGE, "t")
    with pytest.raises(ValueError, match="bad vocabulary"):
        load.beside(fail)
    with pytest.raises(TokenizerFailed):
        load.result()
