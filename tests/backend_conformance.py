"""One conformance suite for every Backend implementation (torch, onnx, ...).

``available_backends()`` lists every name in ``core.backend.BACKEND_NAMES`` whose module exists, so a
new backend is picked up without touching the tests. Each check compares a backend with a fresh
forward of itself and with the torch backend's exact mode as reference. Torch in exact mode must be
bitwise equal to itself (``same_backend_tol`` = 0); other backends get a small tolerance.

``HYBRID_CHECKS`` are the recurrent-state contract's (core/backend.py: checkpoint, snapshot, restorable,
exact truncate) on the hybrid fixtures (``HYBRID_MODELS``); any backend that runs hybrid models is
passed by name, like the checks above.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from spekula.core.backend import (
    BACKEND_NAMES,
    Backend,
    BackendOptions,
    Capture,
    SeqInput,
    SeqOutput,
    load_backend,
)

REF_TOL = 1e-3  # |logits - torch reference| in fp32
# Hidden states grow to ~100 in deep residual streams; compare them relative to their scale.
HIDDEN_REL_TOL = 1e-3
# The native backend quantizes activations to int8 per 32 values before each quantized matmul (as
# llama.cpp does) and keeps a float16 KV cache, so it is compared with the fp32 reference relative to
# the values' scale. Measured: logits within 4-6 % of max |logit| (rms 2.5-5 % of their spread) on the
# fixtures and SmolLM2, hidden states within 2-6 %.
NATIVE_REL_TOL = 0.1
HYBRID_QUANT_REL_TOL = 0.3  # a quantized hybrid on the native kernels (see check_logits_match_reference)
N_CTX = 256


def available_backends() -> list[str]:
    """Installed backends; on a CPU whose best native kernels are not AVX2 (AVX-512), also
    ``native-avx2``: the native backend pinned to its AVX2 kernels, so that path passes every check too."""
    from backend_helpers import native_simd_choices

    names = [n for n in BACKEND_NAMES if importlib.util.find_spec(f"spekula.backends.{n}") is not None]
    if "native" in names and "avx2" in native_simd_choices():
        names.append("native-avx2")
    return names


def base_backend(name: str) -> str:
    return "native" if name == "native-avx2" else name


def smollm2_path() -> Path:
    """The default model through the product's own fetcher (it honours $SPEKULA_CACHE_DIR), else skip saying why."""
    reason = ""
    try:
        from spekula.backends.gguf.default_model import ensure_default_model

        return ensure_default_model(quiet=True)
    except Exception as exc:  # any failure to fetch: fall back, then skip with the reason
        reason = f"{type(exc).__name__}: {exc}"
    pytest.skip(f"SmolLM2 unavailable: ensure_default_model failed ({reason})")


# The tiny Qwen3.5 fixtures: float32, with every matrix in Q8_0 (spekula convert --outtype q8_0), and
# their wide variants (rows of whole K-quant super-blocks) in Q4_K_M by llama-quantize.
HYBRID_MODELS = ("qwen35", "qwen35moe", "qwen35-q8_0", "qwen35moe-q8_0", "qwen35-q4_k_m", "qwen35moe-q4_k_m")
HYBRID_QUANTIZED = ("q8_0", "q4_k_m")


# The tiny Gemma 3 (sliding-window and global blocks, llama.cpp's converter): float32 and Q8_0.
SWA_MODELS = ("gemma3", "gemma3-Q8_0")

# The tiny gpt-oss (sinks, biased swiglu_oai experts, sliding windows, YaRN; llama.cpp's converter): float32,
# and llama-quantize's MXFP4_MOE (experts in MXFP4 blocks, other matrices Q8_0).
GPTOSS_MODELS = ("gpt-oss", "gpt-oss-mxfp4")

# The tiny Gemma 4 (per-block head sizes, shared KV, per-layer inputs; llama.cpp's converter), float32 and Q8_0,
# and its mixture-of-experts variant in float32. Not the MoE's Q8_0 file: there the router is Q8_0 too, and the
# native kernels' int8 activations swap a near-tied second choice of some rows (seen: probabilities 0.284 and
# 0.279), which the torch reference does not; tests/backends/test_gemma4.py checks that file against its F32 one.
# gemma4kv: the dense variant whose global blocks take their values from the keys (no attn_v); gemma4dw: the
# one whose KV-sharing blocks have double-wide FFNs (per-block feed_forward_length); gemma4g1: the one whose
# global blocks have 1 KV head beside the sliding blocks' 2 (per-block head_count_kv); all float32.
GEMMA4_MODELS = ("gemma4", "gemma4-Q8_0", "gemma4moe", "gemma4kv", "gemma4dw", "gemma4g1")

# The tiny Ministral 3 (YaRN rope, queries' temperature by position; llama.cpp's converter): float32 and Q8_0.
SCALED_MODELS = ("ministral3", "ministral3-q8_0")


def matrix_model(arch: str, type_name: str) -> str:
    """The conformance name of `arch`'s wide fixture with its matrices in `type_name` (fixtures/quant_routes.py)."""
    return f"{arch}@{type_name}"


def wide_f32_path_or_skip(arch: str) -> Path:
    """fixtures/wide_archs.py's float file of `arch`; skips, saying why, where llama.cpp's converter is missing."""
    from spekula.fixtures.llamacpp_convert import LlamaCppUnavailable
    from spekula.fixtures.wide_archs import wide_f32_path

    try:
        return wide_f32_path(arch)
    except LlamaCppUnavailable as exc:
        pytest.skip(str(exc))


def model_path(model: str) -> str:
    if model == "smollm2":
        return str(smollm2_path())
    if "@" in model:  # the architecture x tensor-type matrix: llama-quantize's file, else the fixtures' writers'
        from spekula.fixtures.quant_routes import quantized_path

        arch, _, type_name = model.partition("@")
        return str(quantized_path(wide_f32_path_or_skip(arch), type_name))
    if model in GPTOSS_MODELS:
        from gptoss_helpers import gptoss_path

        return gptoss_path(model.removeprefix("gpt-oss").removeprefix("-") or "f32")
    if model in SWA_MODELS:
        from spekula.fixtures.tiny_gemma3 import tiny_gemma3_gguf_path

        return str(tiny_gemma3_gguf_path(type_name=model.partition("-")[2] or "F32"))
    if model in GEMMA4_MODELS:
        from spekula.fixtures.tiny_gemma4 import tiny_gemma4_gguf_path

        arch, _, type_name = model.partition("-")
        return str(tiny_gemma4_gguf_path(type_name=type_name or "F32", moe=arch == "gemma4moe", k_eq_v=arch == "gemma4kv",
                                         double_wide=arch == "gemma4dw", global_kv_heads=1 if arch == "gemma4g1" else 0))
    if model in SCALED_MODELS:
        from spekula.fixtures.tiny_ministral3 import tiny_ministral3_gguf_path

        return str(tiny_ministral3_gguf_path(type_name=model.partition("-")[2] or "f32"))
    if model in HYBRID_MODELS:
        from spekula.fixtures.tiny_qwen35 import tiny_qwen35_gguf_path

        arch, _, outtype = model.partition("-")
        if outtype == "q4_k_m":
            from spekula.fixtures.tiny_qwen35_quant import LlamaQuantizeMissing, qwen35_q4_k_m_path

            try:
                return str(qwen35_q4_k_m_path(moe=arch == "qwen35moe"))
            except LlamaQuantizeMissing as exc:
                pytest.skip(str(exc))
        return str(tiny_qwen35_gguf_path(moe=arch == "qwen35moe", outtype=outtype or "f32"))
    from spekula.fixtures.tiny_moe import MOE_ARCHS, tiny_moe_gguf_path

    if model in MOE_ARCHS:
        return str(tiny_moe_gguf_path(model))
    from spekula.fixtures.tiny_gguf import tiny_model_path

    arch, _, weight_type = model.partition("-")  # "llama-IQ4_NL": every matrix in that block type
    return str(tiny_model_path(arch, weight_type=weight_type or None))


@cache
def get_backend(name: str, model: str) -> Backend:
    from backend_helpers import native_kernels

    opts = BackendOptions(n_ctx=N_CTX, n_seq_max=4, threads=1, exact=True)
    with native_kernels("avx2" if name == "native-avx2" else "best"):
        return load_backend(base_backend(name), model_path(model), opts)


def same_backend_tol(name: str) -> float:
    """How far a backend may drift from itself across batching/chunking: the exact ones not at all."""
    return 0.0 if base_backend(name) in ("torch", "native") else 1e-4


def ref_tol(name: str, want: np.ndarray, absolute: float) -> float:
    """Allowed |difference| from the torch fp32 reference for values `want`."""
    if base_backend(name) == "native":
        return NATIVE_REL_TOL * max(1.0, float(np.abs(want).max()))
    return absolute


def run_fresh(b: Backend, tokens: np.ndarray, capture: Capture | None = None) -> SeqOutput:
    s = b.new_seq()
    try:
        return b.forward([SeqInput(s, tokens.astype(np.int32), 0, np.arange(tokens.size))], capture or Capture())[0]
    finally:
        b.free_seq(s)


def assert_close(got: np.ndarray, want: np.ndarray, tol: float, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    if tol == 0.0:
        assert np.array_equal(got, want), f"{what}: not bitwise equal (max diff {np.abs(got - want).max():.3g})"
    else:
        diff = float(np.abs(got - want).max()) if got.size else 0.0
        assert diff <= tol, f"{what}: max abs diff {diff:.3g} > {tol}"


def random_tokens(b: Backend, n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, b.info.n_vocab, n).astype(np.int32)


# ---- the checks ----------------------------------------------------------------------------------


def check_logits_match_reference(name: str, model: str) -> None:
    b, ref = get_backend(name, model), get_backend("torch", model)
    assert b.info.n_vocab == ref.info.n_vocab and b.info.n_layer == ref.info.n_layer
    tokens = random_tokens(b, 37, seed=10)
    want = run_fresh(ref, tokens).logits
    got = run_fresh(b, tokens).logits
    tol = ref_tol(name, want, REF_TOL)
    if b.info.recurrent and (model.endswith(HYBRID_QUANTIZED) or "@" in model) and base_backend(name) == "native":
        # The delta-net blocks normalise per head (L2 norms of q and k, the RMS norm of the rule's output):
        # where a head's output is small they magnify the int8 rounding of the activations a quantized
        # matmul reads (here up to ~20 % of the largest logit in one row of the random fixture).
        tol = HYBRID_QUANT_REL_TOL * max(1.0, float(np.abs(want).max()))
        agree = float(np.mean(got.argmax(axis=1) == want.argmax(axis=1)))
        assert agree >= 0.9, f"{name} vs torch: greedy choice agrees on {agree:.0%} of rows"
    if model.startswith("gpt-oss") and model != "gpt-oss" and base_backend(name) == "native":
        # A row whose second and third router logits nearly tie may swap those experts when the int8
        # rounding of the activations moves them (measured: the only two rows beyond the tolerance, out of
        # 37, have gaps of 0.009 and 0.022 there while the others' are 0.06 to 1.6): the rest must match.
        within = np.abs(got - want).max(axis=1) <= tol
        agree = float(np.mean(got.argmax(axis=1) == want.argmax(axis=1)))
        assert within.mean() >= 0.9 and agree >= 0.9, (f"{name} vs torch: {within.mean():.0%} of rows within "
                                                        f"{tol:.3g}, greedy choice agrees on {agree:.0%}")
        return
    assert_close(got, want, tol, f"{name} vs torch logits")


def check_truncate_then_continue(name: str, model: str) -> None:
    b = get_backend(name, model)
    tokens, junk = random_tokens(b, 30, seed=11), random_tokens(b, 9, seed=12)
    want = run_fresh(b, tokens).logits
    s = b.new_seq()
    try:
        none = np.array([], np.int64)
        if b.info.recurrent:  # a recurrent state comes back only to a checkpoint's length or later
            b.forward([SeqInput(s, tokens[:21], 0, none)])
            b.checkpoint(s)
            b.forward([SeqInput(s, junk, 21, none)])
        else:
            b.forward([SeqInput(s, np.concatenate([tokens[:21], junk]), 0, none)])
        b.truncate(s, 21)
        assert b.seq_len(s) == 21
        got = b.forward([SeqInput(s, tokens[21:], 21, np.arange(9))])[0].logits
        assert_close(got, want[21:], same_backend_tol(name), f"{name} truncate-then-continue")
        # and one token at a time, the plain decoding path
        b.truncate(s, 21)
        singles = [b.forward([SeqInput(s, tokens[i : i + 1], i)])[0].logits[0] for i in range(21, 30)]
        assert_close(np.stack(singles), want[21:], same_backend_tol(name), f"{name} single-token decode")
    finally:
        b.free_seq(s)


def check_batched_equals_alone(name: str, model: str) -> None:
    b = get_backend(name, model)
    seqs = [random_tokens(b, n, seed=20 + n) for n in (5, 23, 1)]
    alone = [run_fresh(b, t).logits for t in seqs]
    ids = [b.new_seq() for _ in seqs]
    try:
        outs = b.forward([SeqInput(i, t, 0, np.arange(t.size)) for i, t in zip(ids, seqs, strict=True)])
        for k, (o, want) in enumerate(zip(outs, alone, strict=True)):
            assert_close(o.logits, want, same_backend_tol(name), f"{name} sequence {k} batched vs alone")
    finally:
        for i in ids:
            b.free_seq(i)


def check_capture(name: str, model: str) -> None:
    b, ref = get_backend(name, model), get_backend("torch", model)
    n_layer = b.info.n_layer
    cap = Capture(frozenset({0, 1, n_layer // 2, n_layer}), final_norm=True)
    tokens = random_tokens(b, 19, seed=30)
    got, want = run_fresh(b, tokens, cap), run_fresh(ref, tokens, cap)
    assert set(got.layer_inputs) == set(cap.layers)
    assert got.hidden_final is not None and want.hidden_final is not None
    for layer in cap.layers:
        w = want.layer_inputs[layer]
        tol = ref_tol(name, w, HIDDEN_REL_TOL * max(1.0, float(np.abs(w).max())))
        assert_close(got.layer_inputs[layer], w, tol, f"{name} layer input {layer}")
    tol = ref_tol(name, want.hidden_final, HIDDEN_REL_TOL * max(1.0, float(np.abs(want.hidden_final).max())))
    assert_close(got.hidden_final, want.hidden_final, tol, f"{name} final hidden")
    # the same capture split over two forwards
    s = b.new_seq()
    try:
        parts = [b.forward([SeqInput(s, tokens[a:z], a)], cap)[0] for a, z in ((0, 8), (8, 19))]
        for layer in cap.layers:
            joined = np.concatenate([p.layer_inputs[layer] for p in parts])
            assert_close(joined, got.layer_inputs[layer], same_backend_tol(name), f"{name} chunked layer {layer}")
        joined = np.concatenate([p.hidden_final for p in parts if p.hidden_final is not None])
        assert_close(joined, got.hidden_final, same_backend_tol(name), f"{name} chunked final hidden")
    finally:
        b.free_seq(s)


# ---- the recurrent-state contract (hybrid models) ------------------------------------------------


def _decode(b: Backend, s: int, tokens: np.ndarray, start: int) -> np.ndarray:
    """Plain decoding: one token per forward from `start`, every row's logits [n, n_vocab]."""
    return np.stack([b.forward([SeqInput(s, tokens[i : i + 1], start + i)])[0].logits[0] for i in range(tokens.size)])


def check_rollback_is_exact(name: str, model: str) -> None:
    """A partly rejected draft: checkpoint, forward x and k-1 draft rows (the first j of them the plain
    continuation), truncate to j+1 rows; decoding on gives plain decoding's logits bit for bit."""
    b = get_backend(name, model)
    prompt, cont = random_tokens(b, 13, seed=40), random_tokens(b, 10, seed=41)
    L, k = prompt.size, 6
    s = b.new_seq()
    try:
        b.forward([SeqInput(s, prompt, 0)])
        want = _decode(b, s, cont, L)  # plain decoding of the continuation
        for j in range(k):
            b.truncate(s, 0)
            b.forward([SeqInput(s, prompt, 0)])
            b.checkpoint(s)
            draft = np.concatenate([cont[: j + 1], random_tokens(b, k - j - 1, seed=50 + j)])
            rows = b.forward([SeqInput(s, draft, L, np.arange(k))])[0].logits
            assert_close(rows[: j + 1], want[: j + 1], same_backend_tol(name), f"{name} verification rows (j={j})")
            assert b.restorable(s, L + j + 1) == L + j + 1
            b.truncate(s, L + j + 1)
            rest = _decode(b, s, cont[j + 1 :], L + j + 1)
            assert_close(rest, want[j + 1 :], same_backend_tol(name), f"{name} decoding after rollback to {L + j + 1}")
    finally:
        b.free_seq(s)


def check_restorable_and_snapshots(name: str, model: str) -> None:
    """Which lengths a truncate reaches: 0, the current one, a checkpoint's on, snapshots; else ConfigError."""
    from spekula.core.errors import ConfigError

    b = get_backend(name, model)
    tokens = random_tokens(b, 40, seed=60)
    want = run_fresh(b, tokens).logits
    none = np.array([], np.int64)
    s = b.new_seq()
    try:
        b.forward([SeqInput(s, tokens[:10], 0, none)])
        assert [b.restorable(s, n) for n in (0, 5, 10, 20)] == [0, 0, 10, 10]
        with pytest.raises(ConfigError, match="truncate to 5"):
            b.truncate(s, 5)
        assert b.seq_len(s) == 10  # a refused truncate changes nothing
        b.snapshot(s)
        b.forward([SeqInput(s, tokens[10:16], 10, none)])
        b.checkpoint(s)
        b.forward([SeqInput(s, tokens[16:20], 16, none)])
        assert [b.restorable(s, n) for n in (9, 10, 15, 16, 18, 20, 30)] == [0, 10, 10, 16, 18, 20, 20]
        with pytest.raises(ConfigError):
            b.forward([SeqInput(s, tokens[12:14], 12)])  # a forward from an unreachable length is refused too
        b.truncate(s, 10)  # the snapshot; the checkpoint (at 16) is gone with the rows it followed
        got = b.forward([SeqInput(s, tokens[10:20], 10, np.arange(10))])[0].logits
        assert_close(got, want[10:20], same_backend_tol(name), f"{name} continued from a snapshot")
        assert b.restorable(s, 18) == 10
        b.truncate(s, 0)  # always reachable: the zero state
        assert b.restorable(s, 30) == 0 and b.seq_len(s) == 0
        got = b.forward([SeqInput(s, tokens, 0, np.arange(tokens.size))])[0].logits
        assert_close(got, want, same_backend_tol(name), f"{name} after truncate to 0")
        _check_snapshot_cap(b, s, tokens)
    finally:
        b.free_seq(s)


def _check_snapshot_cap(b: Backend, s: int, tokens: np.ndarray) -> None:
    """Three snapshots: the oldest is dropped (two are kept per sequence)."""
    b.truncate(s, 0)
    for n in (8, 16, 24):
        b.forward([SeqInput(s, tokens[n - 8 : n], n - 8, np.array([], np.int64))])
        b.snapshot(s)
    b.forward([SeqInput(s, tokens[24:30], 24, np.array([], np.int64))])
    assert [b.restorable(s, n) for n in (10, 20, 26)] == [0, 16, 24]


CHECKS: dict[str, Callable[[str, str], None]] = {
    "logits_match_reference": check_logits_match_reference,
    "truncate_then_continue": check_truncate_then_continue,
    "batched_equals_alone": check_batched_equals_alone,
    "capture": check_capture,
}

HYBRID_CHECKS: dict[str, Callable[[str, str], None]] = {
    "rollback_is_exact": check_rollback_is_exact,
    "restorable_and_snapshots": check_restorable_and_snapshots,
}
