"""Native kernels, one block type at a time, against plain dequantize-then-matmul references.

Weights of every supported type are built here (gguf's quantizer for the 32-value types it writes, the
fixture quantizers for the K and IQ4 types) and decoded by gguf's own dequantizer, an implementation independent
of ours. Two references per type: float64 matmul with the *same* int8-quantized activations the
kernels use (tight: only float rounding differs), and with float32 activations (the int8 rounding of
activations, about 1 % of the output's scale). The SIMD and generic kernels are both checked, and
the property exact mode rests on: a row's result is bitwise the same whatever else is in the batch.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize
from hypothesis import example, given, settings
from hypothesis import strategies as st

from spekula.backends.native import lib as nl
from spekula.fixtures.tiny_gguf import quantize_fixture

QUANT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4", "Q3_K", "Q2_K")
FLOAT_TYPES = ("F32", "F16", "BF16")
KERNELS = nl.available_kernels()  # kernel set names, e.g. generic, avx2, avx512-vnni
SIMD = [k for k in KERNELS if k != "generic"]


def cap(kernel: str) -> str:
    """The kernel choice that selects the named set on this CPU (the best one is 'best')."""
    return "best" if kernel == nl.kernel_name() else kernel
SAME_ACT_TOL = 2e-6  # relative to the output's max |value|, float rounding only
# Types with a per-block minimum also use each activation block's sum, kept as float16 (as llama.cpp's
# q8_1 keeps it): that rounding (2^-11 relative) is not in the float64 reference.
ASYM_TYPES = ("Q4_1", "Q5_1", "Q4_K", "Q5_K", "Q2_K")
SAME_ACT_TOL_ASYM = 2e-3
F32_ACT_TOL = 2e-2  # int8 activations vs float32 activations


def make_weight(type_name: str, n: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(stored data as the GGUF holds it, its float32 values decoded by gguf)."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    if type_name == "F32":
        return w, w
    if type_name == "F16":
        h = w.astype(np.float16)
        return h, h.astype(np.float32)
    qtype = gguf.GGMLQuantizationType[type_name]
    raw = quantize_fixture(w, type_name)
    return np.ascontiguousarray(raw), dequantize(raw, qtype).reshape(n, k).astype(np.float32)


def quantized_activations(x: np.ndarray) -> np.ndarray:
    q, d, _, _ = nl.quantize_rows(x)
    k = x.shape[1]
    return q[:, :k].astype(np.float64) * np.repeat(d, 32, axis=1)[:, :k].astype(np.float64)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("type_name", QUANT_TYPES + FLOAT_TYPES)
def test_matmul_matches_dequantized_reference(type_name: str, kernel: str) -> None:
    n, k = 37, 512
    raw, wf = make_weight(type_name, n, k, seed=1)
    t = nl.tensor(raw, type_name, n, k)
    x = np.random.default_rng(2).standard_normal((9, k)).astype(np.float32)
    got = nl.matmul(t, x, kernels=cap(kernel))
    scale = float(np.abs(x @ wf.T).max())
    exact_act = type_name in FLOAT_TYPES
    same = (x.astype(np.float64) if exact_act else quantized_activations(x)) @ wf.T.astype(np.float64)
    tol = SAME_ACT_TOL_ASYM if type_name in ASYM_TYPES else SAME_ACT_TOL * (50 if kernel == "generic" else 1)
    assert np.abs(got - same).max() <= tol * scale
    assert np.abs(got - x @ wf.T).max() <= F32_ACT_TOL * scale


@pytest.mark.parametrize("type_name", QUANT_TYPES + FLOAT_TYPES)
def test_dequant_row_is_ggufs(type_name: str) -> None:
    raw, wf = make_weight(type_name, 5, 256, seed=3)
    t = nl.tensor(raw, type_name, 5, 256)
    for r in range(5):
        assert np.array_equal(nl.dequant_row(t, r), wf[r])


@pytest.mark.parametrize("type_name", QUANT_TYPES)
@pytest.mark.parametrize("n", [1, 16, 37])
def test_loading_packs_the_bytes_of_the_value_by_value_layout(type_name: str, n: int) -> None:
    """Q4_0, Q4_1, Q8_0, IQ4_NL, IQ4_XS and MXFP4 are packed by copying their stored bytes (sk_pack.c):
    bitwise the layout that moving every value one by one gives, ragged last column group included."""
    raw, _ = make_weight(type_name, n, 512, seed=n)
    t = nl.tensor(raw, type_name, n, 512)
    fast, reference = nl.packed(t), nl.packed(t, by_value=True)
    assert fast.size == reference.size > 0
    assert np.array_equal(fast, reference)


@pytest.mark.parametrize("kernel", KERNELS)
def test_mxfp4_scales_at_the_ends_of_their_range(kernel: str) -> None:
    """E8M0 exponents 0 and 1 are subnormal floats (float16 holds neither, nor 2^72): kept exactly. Products
    with the subnormal scales keep fewer bits (float32 has no more), hence the looser relative bound."""
    raw, _ = make_weight("MXFP4", 16, 64, seed=6)
    raw[:, 0::17] = np.array([0, 1, 2, 100, 127, 130, 170, 200], np.uint8).repeat(2).reshape(16, 1)
    wf = dequantize(raw, gguf.GGMLQuantizationType.MXFP4).reshape(16, 64)
    t = nl.tensor(raw, "MXFP4", 16, 64)
    for r in range(16):
        assert np.array_equal(nl.dequant_row(t, r), wf[r])
    x = np.random.default_rng(7).standard_normal((3, 64)).astype(np.float32)
    same = quantized_activations(x) @ wf.T.astype(np.float64)
    got = nl.matmul(t, x, kernels=cap(kernel))
    assert (np.abs(got - same) <= 1e-4 * np.abs(same).max(axis=0)).all()


@pytest.mark.parametrize("kernel", SIMD or ["generic"])
@settings(max_examples=30, deadline=None)
@given(x=st.lists(st.floats(-1e4, 1e4, width=32), min_size=1, max_size=200), m=st.integers(1, 3))
@example(x=[-8133.0, -9455.0, -9455.0, -9455.0, -9455.0, -9455.0, -9883.0], m=1)  # scaled sum past float16's range
@example(x=[3.7274539151040134e-43], m=1)  # a subnormal block: 1 / scale overflows (quantized to zeros)
def test_activation_quantization_is_the_same_on_every_kernel(kernel: str, x: list[float], m: int) -> None:
    arr = np.tile(np.array(x, np.float32), (m, 1))
    a, b = nl.quantize_rows(arr, kernels=cap(kernel)), nl.quantize_rows(arr, kernels="generic")
    for u, v in zip(a, b, strict=True):
        assert np.array_equal(u, v)
    q, d, s, qs16 = a
    k = len(x)
    assert np.array_equal(qs16, q.reshape(m, -1, 16).astype(np.int32).sum(axis=2))
    assert np.array_equal(d, d.astype(np.float16).astype(np.float32))  # float16 scales, as llama.cpp keeps them
    # s is the block sum times the float32 scale (as llama.cpp computes it), stored as float16 (kept
    # float32 where float16 would overflow, not infinite as llama.cpp's): a scale that underflows
    # float16 still leaves s its subnormal precision (2^-24)
    assert np.isfinite(s).all() and np.isfinite(d).all()
    padded = np.zeros((m, q.shape[1]), np.float32)
    padded[:, :k] = arr
    d32 = np.abs(padded).reshape(m, -1, 32).max(axis=2) / 127
    assert np.allclose(s, d32 * qs16.reshape(m, -1, 2).sum(axis=2), rtol=2e-3, atol=2**-24)
    # half a step, plus up to 127 steps' share of the scale's float16 rounding (2^-11, or half the
    # subnormal step 2^-25 when the scale is that small)
    assert np.abs(q[:, :k].astype(np.float32) * np.repeat(d, 32, axis=1)[:, :k] - arr).max() <= (
        np.abs(arr).max() / 127 * (0.5 + 127 / 2048) * 1.001 + 127 * 2**-25 + 1e-30)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("type_name", QUANT_TYPES + FLOAT_TYPES)
@settings(max_examples=8, deadline=None)
@given(m=st.integers(1, 70), seed=st.integers(0, 2**16))
def test_a_row_is_bitwise_the_same_in_any_batch(type_name: str, kernel: str, m: int, seed: int) -> None:
    n, k = 37, 256  # 37 columns: whole 16-column groups, an 8-column half and a ragged tail
    raw, _ = make_weight(type_name, n, k, seed=4)
    t = nl.tensor(raw, type_name, n, k)
    x = np.random.default_rng(seed).standard_normal((m, k)).astype(np.float32)
    batched = nl.matmul(t, x, kernels=cap(kernel))
    for r in {0, m // 2, m - 1}:
        assert np.array_equal(nl.matmul(t, x[r : r + 1], kernels=cap(kernel))[0], batched[r])


def test_the_simd_sets_compute_the_same_quantized_products() -> None:
    """Every SIMD set forms each block's exact integer dot product and then the same per-element float
    sequence, so their quantized matmuls agree bit for bit (AVX2 and AVX-512 where both run)."""
    if len(SIMD) < 2:
        pytest.skip(f"this CPU runs one SIMD kernel set ({', '.join(SIMD) or 'none'}): nothing to compare")
    x = np.random.default_rng(8).standard_normal((5, 512)).astype(np.float32)
    for type_name in QUANT_TYPES:
        raw, _ = make_weight(type_name, 40, 512, seed=9)
        t = nl.tensor(raw, type_name, 40, 512)
        outs = [nl.matmul(t, x, kernels=cap(k)) for k in SIMD]
        assert all(np.array_equal(o, outs[0]) for o in outs[1:]), type_name


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize(("n_q", "n_keys", "head_dim"), [(1, 1, 64), (3, 17, 64), (4, 300, 32), (5, 530, 48), (2, 9, 24)])
def test_attention_matches_a_float64_softmax(kernel: str, n_q: int, n_keys: int, head_dim: int) -> None:
    """Every key count around the 16-key blocks and the 256-key chunks, head counts around the heads
    handled per pass, and a head size the SIMD kernels hand to the portable one (24)."""
    rng = np.random.default_rng(n_keys)
    q = rng.standard_normal((n_q, head_dim)).astype(np.float32)
    keys = rng.standard_normal((n_keys, head_dim)).astype(np.float32)
    values = rng.standard_normal((n_keys, head_dim)).astype(np.float32)
    scale = 1 / np.sqrt(head_dim)
    got, _ = nl.attend(q, keys, values, scale, kernels=cap(kernel))
    k64, v64 = keys.astype(np.float16).astype(np.float64), values.astype(np.float16).astype(np.float64)
    scores = q.astype(np.float64) @ k64.T * scale
    w = np.exp(scores - scores.max(axis=1, keepdims=True))
    want = (w / w.sum(axis=1, keepdims=True)) @ v64
    assert np.abs(got - want).max() <= 1e-5 * max(1.0, float(np.abs(want).max()))


def test_unsupported_shape_is_refused() -> None:
    raw, _ = make_weight("Q8_0", 4, 96, seed=5)  # 96 columns: a whole number of blocks, not of 64-chunks
    t = nl.tensor(raw, "Q8_0", 4, 96)
    x = np.ones((2, 96), np.float32)
    _, wf = make_weight("Q8_0", 4, 96, seed=5)
    # falls back to the generic kernel, which reads any whole number of blocks
    assert np.abs(nl.matmul(t, x) - quantized_activations(x) @ wf.T.astype(np.float64)).max() < 1e-3
