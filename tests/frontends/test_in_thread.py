"""InThread: one call in its own thread, its value or its exception handed back to the caller."""

from __future__ import annotations

import threading

import pytest

from spekula.frontends.cli.in_thread import (
    WAIT_FOR_TOKENIZER_MIN_VOCAB,
    InThread,
    TokenizerFailed,
    load_beside_tokenizer,
    load_waits_for_tokenizer,
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


def test_only_a_large_vocabulary_makes_the_load_wait_for_the_tokenizer() -> None:
    n = WAIT_FOR_TOKENIZER_MIN_VOCAB
    assert load_waits_for_tokenizer({"tokenizer.ggml.tokens": ["t"] * n})
    assert not load_waits_for_tokenizer({"tokenizer.ggml.tokens": ["t"] * (n - 1)})
    assert not load_waits_for_tokenizer({})


LARGE = {"tokenizer.ggml.tokens": ["t"] * WAIT_FOR_TOKENIZER_MIN_VOCAB}


def test_a_large_vocabularys_load_starts_once_the_tokenizer_is_built() -> None:
    started = threading.Event()
    loading, tokenizer_done = load_beside_tokenizer(lambda: started.set() or "backend", LARGE, "t")
    assert not started.wait(0.2), "the load started before the tokenizer was built"
    tokenizer_done(True)
    assert loading.result() == "backend"


def test_a_large_vocabularys_load_is_skipped_when_the_tokenizer_fails() -> None:
    made: list[int] = []
    loading, tokenizer_done = load_beside_tokenizer(lambda: made.append(1), LARGE, "t")
    tokenizer_done(False)
    with pytest.raises(TokenizerFailed):
        loading.result()
    loading, tokenizer_done = load_beside_tokenizer(lambda: made.append(1), LARGE, "t")
    tokenizer_done(False)
    loading.discard(lambda _: made.append(2))  # the caller's own error is the one reported
    assert made == []


def test_a_small_vocabularys_load_runs_beside_the_tokenizer() -> None:
    started = threading.Event()
    loading, tokenizer_done = load_beside_tokenizer(lambda: started.set() or "backend", {}, "t")
    assert started.wait(10), "the load waited for the tokenizer"
    tokenizer_done(True)
    assert loading.result() == "backend"
