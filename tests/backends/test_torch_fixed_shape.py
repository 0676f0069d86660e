"""The torch backend's exact mode on CUDA: every GEMM on exactly TILE_ROWS rows.

On a GPU, cuBLAS chooses kernels by shape, so exact mode pads every tile, attention group and expert
GEMM to the full TILE_ROWS rows instead of measuring the library at load as it does on the CPU. The
same code runs here on the CPU (the device set patched to include it; MKL is row-invariant at 64 rows),
so the padding logic is proven on every machine; bench/cuda_check.py checks the same bitwise
properties on a GPU.
"""

from __future__ import annotations

from functools import cache
from unittest import mock

import numpy as np
import pytest
from backend_conformance import model_path
from backend_helpers import fresh_logits
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spekula.backends.torch.backend import TILE_ROWS, TorchBackend
from spekula.core.backend import BackendOptions, SeqInput

MODELS = ("llama", "qwen2", "qwen3moe", "glm4moe")
HYP = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@cache
def fixed_shape_backend(model: str) -> TorchBackend:
    opts = BackendOptions(n_ctx=256, n_seq_max=6, threads=1, exact=True)
    with mock.patch("spekula.backends.torch.backend.FIXED_SHAPE_DEVICES", {"cpu", "cuda"}):
        return TorchBackend(model_path(model), opts)


def test_every_gemm_runs_on_a_full_tile() -> None:
    b = fixed_shape_backend("llama")
    assert (b._align, b._attn_align, b._gemm_align) == (TILE_ROWS, TILE_ROWS, TILE_ROWS)
    assert not b.gemm_plan  # nothing measured: the shapes are fixed instead


tokens_st = st.lists(st.integers(0, 319), min_size=1, max_size=150).map(lambda x: np.array(x, np.int32))


@pytest.mark.parametrize("model", MODELS)
@HYP
@given(tokens=tokens_st, data=st.data())
def test_chunking_is_bitwise_invariant(model: str, tokens: np.ndarray, data: st.DataObject) -> None:
    b = fixed_shape_backend(model)
    sizes: list[int] = []
    while sum(sizes) < tokens.size:
        sizes.append(data.draw(st.integers(1, tokens.size - sum(sizes)), label="chunk"))
    assert np.array_equal(fresh_logits(b, tokens, sizes), fresh_logits(b, tokens))


@pytest.mark.parametrize("model", MODELS)
def test_verification_next_to_other_sequences_equals_single_token_decode(model: str) -> None:
    b = fixed_shape_backend(model)
    rng = np.random.default_rng(3)
    prompt, draft = rng.integers(0, 320, 70).astype(np.int32), rng.integers(0, 320, 6).astype(np.int32)
    others = [rng.integers(0, 320, n).astype(np.int32) for n in (40, 3)]
    s = b.new_seq()
    ids = [b.new_seq() for _ in others]
    try:
        b.forward([SeqInput(s, prompt, 0)])
        singles = [b.forward([SeqInput(s, draft[i : i + 1], 70 + i)])[0].logits[0] for i in range(draft.size)]
        b.truncate(s, 70)
        outs = b.forward([*(SeqInput(i, t, 0) for i, t in zip(ids, others, strict=True)),
                          SeqInput(s, draft, 70, np.arange(draft.size))])
        assert np.array_equal(outs[-1].logits, np.stack(singles))
    finally:
        for i in (s, *ids):
            b.free_seq(i)


def test_fixed_shapes_stay_close_to_the_measured_plan() -> None:
    measured = TorchBackend(model_path("llama"), BackendOptions(n_ctx=256, n_seq_max=1, threads=1, exact=True))
    tokens = np.random.default_rng(4).integers(0, 320, 50).astype(np.int32)
    diff = np.abs(fresh_logits(fixed_shape_backend("llama"), tokens) - fresh_logits(measured, tokens)).max()
    assert diff < 1e-3
