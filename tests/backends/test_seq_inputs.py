"""The forward-input checks every backend shares (backends/seq_inputs.py), including the one-token fast path."""

from __future__ import annotations

import numpy as np
import pytest

from spekula.backends.seq_inputs import check_inputs
from spekula.core.backend import Capture, SeqInput
from spekula.core.errors import ConfigError, ContextOverflowError

N_VOCAB, N_CTX = 100, 128


def check(*inputs: SeqInput, lengths: dict[int, int] | None = None) -> list:
    known = lengths or {0: 10, 1: 0}

    def seq_len(seq: int) -> int:
        if seq not in known:
            raise ConfigError(f"unknown sequence {seq}")
        return known[seq]

    return check_inputs(list(inputs), Capture(), n_layer=4, n_vocab=N_VOCAB, n_ctx=N_CTX, seq_len=seq_len)


@pytest.mark.parametrize("token", [-1, N_VOCAB, 2**40])
def test_one_token_out_of_range(token: int) -> None:
    with pytest.raises(ConfigError, match=r"token id out of range \[0, 100\)"):
        check(SeqInput(0, np.array([token], np.int64), 10))


@pytest.mark.parametrize("tokens", [[5, -1, 7], [5, N_VOCAB, 7]])
def test_several_tokens_out_of_range(tokens: list[int]) -> None:
    with pytest.raises(ConfigError, match="token id out of range"):
        check(SeqInput(0, np.array(tokens, np.int64), 10))


@pytest.mark.parametrize("tokens", [np.array([1.0]), np.array([1.0, 2.0]), np.array([True])])
def test_non_integer_tokens(tokens: np.ndarray) -> None:
    with pytest.raises(ConfigError, match="tokens must be integers"):
        check(SeqInput(0, tokens, 10))


def test_boundary_tokens_and_dtypes_pass() -> None:
    for dtype in (np.int32, np.int64, np.uint16, np.uint32):
        (c,) = check(SeqInput(0, np.array([0], dtype), 10))
        assert c.tokens.dtype == np.int64 and c.tokens.tolist() == [0]
        (c,) = check(SeqInput(0, np.array([N_VOCAB - 1], dtype), 10))
        assert c.tokens.tolist() == [N_VOCAB - 1]
    (c,) = check(SeqInput(0, [3, 4], 10))  # a list is accepted as tokens
    assert c.tokens.tolist() == [3, 4]


@pytest.mark.parametrize("n", [0, 1, 2, 63, 64, 100])
def test_default_logit_row_is_the_last(n: int) -> None:
    (c,) = check(SeqInput(1, np.zeros(n, np.int32), 0))
    assert c.logit_rows.tolist() == ([n - 1] if n else [])
    assert c.logit_rows.dtype == np.int64


def test_shared_default_rows_cannot_be_changed_by_a_caller() -> None:
    (c,) = check(SeqInput(0, np.array([1], np.int32), 10))
    with pytest.raises(ValueError):
        c.logit_rows[0] = 5
    (again,) = check(SeqInput(0, np.array([2], np.int32), 10))
    assert again.logit_rows.tolist() == [0]


def test_positions_rows_and_sequences() -> None:
    with pytest.raises(ConfigError, match="start 11 not in"):
        check(SeqInput(0, np.array([1], np.int32), 11))
    with pytest.raises(ContextOverflowError):
        check(SeqInput(0, np.zeros(N_CTX - 9, np.int32), 10))
    for rows in ([2], [-1], [0, 2], [-1, 1]):
        with pytest.raises(ConfigError, match="logit_rows out of range"):
            check(SeqInput(0, np.array([1, 2], np.int32), 10, np.array(rows)))
    (c,) = check(SeqInput(0, np.array([1, 2], np.int32), 10, np.array([1])))
    assert c.logit_rows.tolist() == [1]
    with pytest.raises(ConfigError, match="twice"):
        check(SeqInput(0, np.array([1], np.int32), 10), SeqInput(0, np.array([1], np.int32), 10))
    with pytest.raises(ConfigError, match="unknown sequence"):
        check(SeqInput(7, np.array([1], np.int32), 0))
    a, b = check(SeqInput(0, np.array([1, 2, 3], np.int32), 10, np.array([0, 2])), SeqInput(1, np.array([4], np.int32), 0))
    assert (a.start, a.logit_rows.tolist(), b.logit_rows.tolist()) == (10, [0, 2], [0])
