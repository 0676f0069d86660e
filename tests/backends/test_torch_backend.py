"""Torch backend: exact-mode batch invariance (bitwise), KV truncation, capture, bad input.

Runs on the tiny GGUF fixtures (fast). The invariance properties are the ones speculative decoding's
greedy losslessness rests on: a row's logits must not depend on what else is in the forward.
"""

from __future__ import annotations

from functools import cache
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spekula.backends.torch.backend import KEY_GRANULE, TorchBackend
from spekula.backends.torch.exact_probe import packed_is_invariant, padded_align
from spekula.core.backend import BackendOptions, Capture, SeqInput, SeqOutput
from spekula.core.errors import ConfigError, ContextOverflowError, ModelFileError
from spekula.fixtures.tiny_gguf import tiny_model_path

ARCHS = ("llama", "qwen2", "qwen3")
N_CTX = 256
HYP = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@cache
def backend(arch: str, exact: bool = True, onednn: bool = True) -> TorchBackend:
    """``onednn=False`` forces the fallback exact path (MKL GEMMs on rows padded to the probed multiple)."""
    opts = BackendOptions(n_ctx=N_CTX, n_seq_max=6, threads=1, exact=exact)
    with mock.patch("spekula.backends.torch.backend.onednn_packing_available", return_value=onednn):
        b = TorchBackend(str(tiny_model_path(arch)), opts)
    if not onednn:
        assert not b.packed
    return b


def fresh_logits(b: TorchBackend, tokens: np.ndarray, capture: Capture | None = None) -> SeqOutput:
    """All rows' outputs of `tokens` fed in one forward to a new sequence."""
    capture = capture or Capture()
    s = b.new_seq()
    try:
        rows = np.arange(tokens.size)
        return b.forward([SeqInput(s, tokens.astype(np.int32), 0, rows)], capture)[0]
    finally:
        b.free_seq(s)


tokens_st = st.lists(st.integers(0, 319), min_size=1, max_size=90).map(lambda x: np.array(x, np.int32))


@pytest.mark.parametrize("arch", ARCHS)
@HYP
@given(tokens=tokens_st, data=st.data())
def test_chunking_is_bitwise_invariant(arch: str, tokens: np.ndarray, data: st.DataObject) -> None:
    b = backend(arch)
    ref = fresh_logits(b, tokens).logits
    s = b.new_seq()
    try:
        got = []
        pos = 0
        while pos < tokens.size:
            n = data.draw(st.integers(1, tokens.size - pos), label="chunk")
            out = b.forward([SeqInput(s, tokens[pos : pos + n], pos, np.arange(n))])[0]
            got.append(out.logits)
            pos += n
        assert np.array_equal(np.concatenate(got), ref)
    finally:
        b.free_seq(s)


@pytest.mark.parametrize("arch", ARCHS)
@HYP
@given(tokens=tokens_st, junk=tokens_st, data=st.data())
def test_truncate_then_continue_equals_fresh(arch: str, tokens: np.ndarray, junk: np.ndarray, data: st.DataObject) -> None:
    b = backend(arch)
    keep = data.draw(st.integers(0, tokens.size - 1), label="keep")
    ref = fresh_logits(b, tokens).logits
    s = b.new_seq()
    try:
        # A rejected draft: junk written after the kept prefix, then rolled back.
        b.forward([SeqInput(s, np.concatenate([tokens[:keep], junk]), 0, np.array([], np.int64))])
        b.truncate(s, keep)
        assert b.seq_len(s) == keep
        rest = tokens[keep:]
        out = b.forward([SeqInput(s, rest, keep, np.arange(rest.size))])[0]
        assert np.array_equal(out.logits, ref[keep:])
    finally:
        b.free_seq(s)


@pytest.mark.parametrize("arch", ARCHS)
@HYP
@given(seqs=st.lists(tokens_st, min_size=2, max_size=5))
def test_batched_sequences_equal_each_alone(arch: str, seqs: list[np.ndarray]) -> None:
    b = backend(arch)
    alone = [fresh_logits(b, t).logits for t in seqs]
    ids = [b.new_seq() for _ in seqs]
    try:
        outs = b.forward([SeqInput(i, t, 0, np.arange(t.size)) for i, t in zip(ids, seqs, strict=True)])
        for o, ref in zip(outs, alone, strict=True):
            assert np.array_equal(o.logits, ref)
    finally:
        for i in ids:
            b.free_seq(i)


@pytest.mark.parametrize("onednn", [True, False], ids=["onednn", "mkl-padded"])
@pytest.mark.parametrize("arch", ARCHS)
def test_verification_rows_match_single_token_decode(arch: str, onednn: bool) -> None:
    """A k+1-row verification chunk next to another sequence's prompt equals token-by-token decode."""
    b = backend(arch, onednn=onednn)
    rng = np.random.default_rng(1)
    prompt, draft, other = rng.integers(0, 320, 70), rng.integers(0, 320, 5), rng.integers(0, 320, 40)
    s, o = b.new_seq(), b.new_seq()
    try:
        b.forward([SeqInput(s, prompt.astype(np.int32), 0)])
        singles = [b.forward([SeqInput(s, draft[i : i + 1], 70 + i)])[0].logits[0] for i in range(5)]
        b.truncate(s, 70)
        outs = b.forward([SeqInput(o, other.astype(np.int32), 0), SeqInput(s, draft.astype(np.int32), 70, np.arange(5))])
        assert np.array_equal(outs[1].logits, np.stack(singles))
    finally:
        b.free_seq(s)
        b.free_seq(o)


@pytest.mark.parametrize("arch", ARCHS)
def test_capture_matches_across_batching_and_shapes(arch: str) -> None:
    b = backend(arch)
    n_layer = b.info.n_layer
    cap = Capture(frozenset({0, 2, n_layer}), final_norm=True)
    tokens = np.random.default_rng(2).integers(0, 320, 33).astype(np.int32)
    ref = fresh_logits(b, tokens, cap)
    assert set(ref.layer_inputs) == {0, 2, n_layer}
    assert ref.hidden_final is not None and ref.hidden_final.shape == (33, b.info.n_embd)
    for arr in ref.layer_inputs.values():
        assert arr.shape == (33, b.info.n_embd) and np.isfinite(arr).all()
    s = b.new_seq()
    try:
        parts = [b.forward([SeqInput(s, tokens[a:z], a)], cap)[0] for a, z in ((0, 20), (20, 33))]
        for layer in ref.layer_inputs:
            assert np.array_equal(np.concatenate([p.layer_inputs[layer] for p in parts]), ref.layer_inputs[layer])
        assert np.array_equal(np.concatenate([p.hidden_final for p in parts]), ref.hidden_final)
    finally:
        b.free_seq(s)
    # Layer 0 input is the token embedding; the final norm feeds the logits.
    emb = ref.layer_inputs[0]
    assert np.array_equal(emb[3], emb[np.nonzero(tokens == tokens[3])[0][-1]])


def test_logit_rows_selection_and_default_last_row() -> None:
    b = backend("llama")
    tokens = np.arange(10, 30, dtype=np.int32)
    full = fresh_logits(b, tokens).logits
    s = b.new_seq()
    try:
        last = b.forward([SeqInput(s, tokens, 0)])[0]
        assert last.logits.shape == (1, 320) and np.array_equal(last.logits[0], full[-1])
        b.truncate(s, 0)
        picked = b.forward([SeqInput(s, tokens, 0, np.array([5, 0, 5]))])[0]
        assert np.array_equal(picked.logits, full[[5, 0, 5]])
        none = b.forward([SeqInput(s, tokens[:1], 20, np.array([], np.int64))])[0]
        assert none.logits.shape == (0, 320) and b.seq_len(s) == 21
    finally:
        b.free_seq(s)


def test_long_sequence_crosses_key_buckets_and_cache_growth() -> None:
    b = backend("qwen3")
    tokens = np.random.default_rng(3).integers(0, 320, 3 * KEY_GRANULE + 7).astype(np.int32)
    ref = fresh_logits(b, tokens).logits
    s = b.new_seq()
    try:
        got = [b.forward([SeqInput(s, tokens[i : i + 1], i)])[0].logits[0] for i in range(tokens.size)]
        assert np.array_equal(np.stack(got), ref)
    finally:
        b.free_seq(s)


@HYP
@given(tokens=tokens_st, data=st.data())
def test_fallback_padded_path_is_chunking_invariant(tokens: np.ndarray, data: st.DataObject) -> None:
    b = backend("llama", onednn=False)
    ref = fresh_logits(b, tokens).logits
    assert np.abs(ref - fresh_logits(backend("llama"), tokens).logits).max() < 1e-3
    s = b.new_seq()
    try:
        pos, got = 0, []
        while pos < tokens.size:
            n = data.draw(st.integers(1, tokens.size - pos), label="chunk")
            got.append(b.forward([SeqInput(s, tokens[pos : pos + n], pos, np.arange(n))])[0].logits)
            pos += n
        assert np.array_equal(np.concatenate(got), ref)
    finally:
        b.free_seq(s)


def test_non_exact_mode_is_close_to_exact() -> None:
    tokens = np.random.default_rng(4).integers(0, 320, 50).astype(np.int32)
    exact = fresh_logits(backend("qwen2"), tokens).logits
    fast = fresh_logits(backend("qwen2", exact=False), tokens).logits
    assert np.abs(exact - fast).max() < 1e-3


def test_bad_inputs_give_clear_errors() -> None:
    b = backend("llama")
    s = b.new_seq()
    try:
        with pytest.raises(ConfigError, match="out of range"):
            b.forward([SeqInput(s, np.array([320], np.int32), 0)])
        with pytest.raises(ConfigError, match="start"):
            b.forward([SeqInput(s, np.array([1], np.int32), 5)])
        with pytest.raises(ContextOverflowError):
            b.forward([SeqInput(s, np.zeros(N_CTX + 1, np.int32), 0)])
        with pytest.raises(ConfigError, match="unknown sequence"):
            b.forward([SeqInput(999, np.array([1], np.int32), 0)])
        with pytest.raises(ConfigError, match="twice"):
            b.forward([SeqInput(s, np.array([1], np.int32), 0), SeqInput(s, np.array([1], np.int32), 0)])
        with pytest.raises(ConfigError, match="capture"):
            b.forward([SeqInput(s, np.array([1], np.int32), 0)], Capture(frozenset({99})))
        assert b.seq_len(s) == 0  # failed calls change nothing
    finally:
        b.free_seq(s)


def test_too_many_sequences_and_bad_options() -> None:
    b = backend("llama")
    ids = [b.new_seq() for _ in range(6)]
    try:
        with pytest.raises(ConfigError, match="n_seq_max"):
            b.new_seq()
    finally:
        for i in ids:
            b.free_seq(i)
    path = str(tiny_model_path("llama"))
    with pytest.raises(ConfigError, match="dtype"):
        TorchBackend(path, BackendOptions(dtype="f8"))
    with pytest.raises(ConfigError, match="device"):
        TorchBackend(path, BackendOptions(device="tpu"))


def test_cuda_requested_without_cuda_is_a_config_error() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA present: the missing-device error cannot be provoked")
    with pytest.raises(ConfigError, match="CUDA is not available"):
        TorchBackend(str(tiny_model_path("llama")), BackendOptions(device="cuda"))


def test_bf16_option_runs_and_stays_near_fp32() -> None:
    path = str(tiny_model_path("qwen3"))
    tokens = np.random.default_rng(5).integers(0, 320, 12).astype(np.int32)
    ref = fresh_logits(backend("qwen3"), tokens).logits
    b16 = TorchBackend(path, BackendOptions(dtype="bf16", n_ctx=64, threads=1))
    got = fresh_logits(b16, tokens).logits
    assert got.dtype == np.float32 and np.isfinite(got).all()
    assert np.abs(got - ref).max() < 0.1 * max(1.0, np.abs(ref).max())


def test_unusable_files_give_model_file_error(tmp_path: object) -> None:
    import pathlib

    d = pathlib.Path(str(tmp_path))
    src = tiny_model_path("llama").read_bytes()
    cut = d / "cut.gguf"
    cut.write_bytes(src[: len(src) // 2])
    with pytest.raises(ModelFileError, match="cut.gguf"):
        TorchBackend(str(cut), BackendOptions())
    with pytest.raises(ModelFileError, match="no such file"):
        TorchBackend(str(d / "missing.gguf"), BackendOptions())


@pytest.mark.parametrize("shape", [(3072, 576), (576, 1536), (960, 576), (49152, 576)])
def test_probe_verdicts_hold_on_fresh_rows(shape: tuple[int, int]) -> None:
    """The load-time probe picks the exact GEMM path per shape; its verdict must hold on rows and
    weights it never saw, at SmolLM2's shapes (the head on its probed width)."""
    n, k = min(shape[0], 4096), shape[1]
    g = torch.Generator().manual_seed(99)
    w, x = torch.randn(n, k, generator=g), torch.randn(130, k, generator=g)
    if packed_is_invariant(*shape):
        from spekula.backends.torch.model import Lin

        lin = Lin(w, None, packed=True)
        alone = torch.cat([lin(x[i : i + 1]) for i in range(x.shape[0])])
        for m in (1, 2, 3, 5, 8, 17, 64, 130):
            assert torch.equal(lin(x[:m]), alone[:m]), m
        assert (lin(x) - x @ w.T).abs().max() < 1e-3
    align = padded_align(*shape)
    assert align is not None, "no padded alignment is row-invariant: exact mode would refuse to load"

    def padded(rows: torch.Tensor) -> torch.Tensor:
        m = rows.shape[0]
        extra = -(-m // align) * align - m
        return torch.nn.functional.linear(torch.cat([rows, rows[-1:].expand(extra, -1)]) if extra else rows, w)[:m]

    alone = torch.cat([padded(x[i : i + 1]) for i in range(x.shape[0])])
    for m in (1, 2, 3, 5, 8, 17, 64, 130):
        assert torch.equal(padded(x[:m]), alone[:m]), m


def test_rope_tables_grow_lazily_without_changing_bits() -> None:
    """A huge context allocates rope tables on demand; growing them changes no existing entry."""
    b = TorchBackend(str(tiny_model_path("llama")), BackendOptions(n_ctx=1_000_000, n_seq_max=1))
    first = b.model.rope.cos.shape[0]
    assert first <= 4096
    head_cos, head_sin = b.model.rope.cos[:first].clone(), b.model.rope.sin[:first].clone()
    s = b.new_seq()
    b.forward([SeqInput(s, np.array([5, 6, 7], dtype=np.int32), start=0)])
    b.truncate(s, 0)
    out_far = b.forward([SeqInput(s, np.array([5], dtype=np.int32), start=0)])[0].logits
    b.model.rope.ensure(3 * first)
    assert b.model.rope.cos.shape[0] >= 3 * first
    assert torch.equal(b.model.rope.cos[:first], head_cos) and torch.equal(b.model.rope.sin[:first], head_sin)
    b.truncate(s, 0)
    assert np.array_equal(b.forward([SeqInput(s, np.array([5], dtype=np.int32), start=0)])[0].logits, out_far)
