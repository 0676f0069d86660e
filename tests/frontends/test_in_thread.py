"""InThread: one call in its own thread, its value or its exception handed back to the caller."""

from __future__ import annotations

import threading

import pytest

from spekula.frontends.cli.in_thread import WAIT_FOR_TOKENIZER_MIN_VOCAB, InThread, head_waits_for_tokenizer


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
