"""A native forward longer than its row cap runs in rounds (backends/row_rounds.py) and gives the bits one
forward would: logits of every wanted row in the caller's order, captured layers and the final norm."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from spekula.backends.native.backend import FORWARD_ROW_CAP, NativeBackend
from spekula.backends.row_rounds import plan_rounds
from spekula.core.backend import BackendOptions, Capture, SeqInput
from spekula.fixtures.tiny_gemma3 import tiny_gemma3_gguf_path
from spekula.fixtures.tiny_ministral3 import tiny_ministral3_gguf_path


def test_rounds_keep_each_input_in_order_within_both_caps() -> None:
    rounds = plan_rounds([5, 1, 9], cap=4, total_cap=6)
    assert rounds == [[(0, 0, 4), (1, 0, 1), (2, 0, 1)], [(0, 4, 5), (2, 1, 5)], [(2, 5, 9)]]
    assert plan_rounds([3, 2], cap=8) == [[(0, 0, 3), (1, 0, 2)]]  # no total cap: one round
    assert plan_rounds([0, 2], cap=1, total_cap=1) == [[(1, 0, 1)], [(1, 1, 2)]]
    for sizes, cap, total in (([7, 3, 12], 5, 4), ([1] * 9, 9, 2), ([300, 40], 128, 128)):
        rows: dict[int, list[int]] = {i: [] for i in range(len(sizes))}
        for pieces in plan_rounds(sizes, cap, total):
            assert sum(b - a for _, a, b in pieces) <= total
            for i, a, b in pieces:
                assert 0 < b - a <= cap
                rows[i].extend(range(a, b))
        assert all(rows[i] == list(range(n)) for i, n in enumerate(sizes))


MODELS: dict[str, Callable[[], Path]] = {"gemma3": tiny_gemma3_gguf_path, "ministral3": tiny_ministral3_gguf_path}


@pytest.mark.parametrize("model", sorted(MODELS))
def test_a_forward_cut_into_rounds_is_bitwise_one_forward(model: str) -> None:
    path = str(MODELS[model]())
    capture = Capture(layers=frozenset({0, 1}), final_norm=True)
    rng = np.random.default_rng(3)

    def run(row_cap: int | None) -> list[tuple[np.ndarray, ...]]:
        backend = NativeBackend(path, BackendOptions(n_ctx=256, n_seq_max=2, threads=2))
        backend.forward_row_cap = row_cap
        a, b = backend.new_seq(), backend.new_seq()
        toks = rng.integers(3, backend.info.n_vocab, 70).astype(np.int32)
        # 40 + 30 rows at a cap of 16: both sequences cut, one round holding the end of one and the start of
        # the other; logit rows out of order and repeated, as a verifier may ask for them.
        inputs = [SeqInput(a, toks[:40], 0, np.array([39, 0, 17, 16, 15, 39], np.int32)),
                  SeqInput(b, toks[40:], 0, np.array([29, 3], np.int32))]
        outs = backend.forward(inputs, capture)
        nxt = backend.forward([SeqInput(a, toks[:1], 40, np.array([0], np.int32))])  # the cache the rounds left
        backend.close()
        return [(o.logits, o.layer_inputs[0], o.layer_inputs[1], o.hidden_final) for o in outs] + [(nxt[0].logits,)]

    whole = run(None)
    rng = np.random.default_rng(3)
    cut = run(16)
    for got, want in zip(cut, whole, strict=True):
        for g, w in zip(got, want, strict=True):
            assert g is not None and w is not None and g.shape == w.shape
            assert np.array_equal(g, w)


def test_the_cap_is_off_for_recurrent_models_only() -> None:
    from spekula.fixtures.tiny_qwen35 import tiny_qwen35_gguf_path

    assert NativeBackend(str(tiny_gemma3_gguf_path()), BackendOptions(n_ctx=64)).forward_row_cap == FORWARD_ROW_CAP
    assert NativeBackend(str(tiny_qwen35_gguf_path()), BackendOptions(n_ctx=64)).forward_row_cap is None
