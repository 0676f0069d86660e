"""The compact packed layouts of IQ4_NL, IQ4_XS, MXFP4, Q3_K and Q2_K (4-bit codes through their table,
Q3_K's and Q2_K's own bit planes: about the file's bytes) against the wide ones they replaced (the codes'
table values as Q8_0 bytes, Q3_K as Q6_K, Q2_K in Q6_K's value planes).

The kernels form the same integer dot products and the same float sequence on both, so every output is
bitwise the same. The wide layouts are this checkout's kernels library with the layout's files (the
packer and the SIMD matmuls: LAYOUT_FILES) as of WIDE_LAYOUT_COMMIT, taken from the repository's
history and built with the package's compiler flags; both libraries run the same inputs
(native_layout_outputs.py: matmuls in several shapes, a MoE model's prefill and decode logits) on every
SIMD kernel set this CPU runs. The generic kernels read GGUF blocks unpacked, so they are not involved.
Without that history, IQ4_NL, MXFP4, IQ4_XS and Q3_K are also checked against a twin type that holds
their integers in an unchanged layout (Q2_K has none).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from spekula.backends.native import lib as nl
from spekula.fixtures.tiny_gguf import quantize_fixture

WIDE_LAYOUT_COMMIT = "9fcb0b6df0234fb92480e3bd252a9f89fb94e40a"  # the last with the wide layouts
LAYOUT_FILES = ("sk_pack.h", "sk_pack.c", "sk_avx2_gemm.c", "sk_avx512_gemm.c")
REPO = Path(__file__).resolve().parents[2]
CSRC = "backends/native/csrc"
HERE = Path(__file__).resolve().parent


def build_wide_library(folder: Path) -> Path:
    """This checkout's kernels library with LAYOUT_FILES as of WIDE_LAYOUT_COMMIT, in `folder` (skips
    the test where it cannot be built)."""
    if shutil.which("git") is None or shutil.which("gcc") is None:
        pytest.skip("needs git and gcc to build the wide-layout kernels")
    have = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{WIDE_LAYOUT_COMMIT}^{{commit}}"], check=False)
    if have.returncode != 0:
        pytest.skip(f"commit {WIDE_LAYOUT_COMMIT[:12]} is not in this checkout's history")
    csrc = folder / "csrc"
    shutil.copytree(REPO / CSRC, csrc)
    for name in LAYOUT_FILES:
        old = subprocess.run(["git", "-C", str(REPO), "show", f"{WIDE_LAYOUT_COMMIT}:{CSRC}/{name}"], check=True,
                             capture_output=True)
        (csrc / name).write_bytes(old.stdout)
    library = folder / "_sk_wide.so"
    # setup.py's flags: -ffp-contract=off keeps the compiler from fusing a*b+c on its own
    subprocess.run(["gcc", "-O3", "-ffp-contract=off", "-fno-math-errno", "-pthread", "-std=gnu11", "-fPIC", "-shared",
                    *sorted(str(p) for p in csrc.glob("*.c")), "-lm", "-o", str(library)], check=True)
    return library


def outputs(library: Path, dst: Path) -> dict[str, np.ndarray]:
    subprocess.run([sys.executable, str(HERE / "native_layout_outputs.py"), str(library), str(dst)], check=True)
    with np.load(dst) as f:
        return dict(f)


@pytest.mark.skipif(nl.kernel_name("best") == "generic", reason="no SIMD kernel set on this CPU: nothing is packed")
def test_compact_layouts_give_the_wide_layouts_outputs_bitwise(tmp_path: Path) -> None:
    wide = outputs(build_wide_library(tmp_path), tmp_path / "wide.npz")
    compact = outputs(nl.library_path(), tmp_path / "compact.npz")
    assert wide.keys() == compact.keys()
    assert any(key.startswith("moe/") for key in wide)
    for key, value in wide.items():
        if key.startswith("packed_bytes/"):
            # the wide layouts took about twice the compact ones (Q2_K 2.7x)
            assert compact[key][0] < 0.6 * value[0], key
        else:
            assert np.isfinite(value).all(), key
            assert np.array_equal(compact[key], value), key


# ---- the same, without the repository's history: each compact type against an unchanged type holding
# its integers (what the wide layouts were), on every SIMD kernel set --------------------------------

IQ4NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)  # doubled E2M1


def codes(qs: np.ndarray) -> np.ndarray:
    """[..., 16] code bytes -> [..., 32] codes: low nibbles are values 0-15, high ones 16-31."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def q8_0_of(d16: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Q8_0 blocks [rows, blocks, 34] of float16 scale bytes [rows, blocks, 2] and int8 values [.., 32]."""
    return np.concatenate([d16, values.astype(np.int8).view(np.uint8)], axis=-1)


def q6_k_of(d16: np.ndarray, scales: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Q6_K super-blocks [rows, sb, 210] of d bytes, 16 int8 scales and 256 values -32..31 (ggml's order)."""
    q = (values.astype(np.int16) + 32).astype(np.uint8).reshape(*values.shape[:-1], 2, 4, 32)  # [.., half, quarter, l]
    ql = np.concatenate([(q[..., 0, :] & 15) | ((q[..., 2, :] & 15) << 4), (q[..., 1, :] & 15) | ((q[..., 3, :] & 15) << 4)], -1)
    qh = (q[..., 0, :] >> 4) | ((q[..., 1, :] >> 4) << 2) | ((q[..., 2, :] >> 4) << 4) | ((q[..., 3, :] >> 4) << 6)
    flat = values.shape[:-1]
    return np.concatenate([ql.reshape(*flat, 128), qh.reshape(*flat, 64), scales.astype(np.int8).view(np.uint8), d16], -1)


def q3_k_parts(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q3_K super-blocks [rows, sb, 110] -> (d bytes, 16 scales -32..31, 256 values -4..3)."""
    hmask, qs, sc, d16 = raw[..., :32], raw[..., 32:96], raw[..., 96:108], raw[..., 108:110]
    b = np.arange(8)
    low2 = (qs.reshape(*qs.shape[:-1], 2, 1, 32) >> (2 * np.arange(4)).reshape(1, 4, 1)) & 3  # [.., b / 4, b % 4, l]
    high = (hmask[..., None, :] >> b[:, None]) & 1  # [.., b, l]
    values = low2.reshape(*qs.shape[:-1], 8, 32).astype(np.int16) - 4 * (1 - high)
    s = np.arange(16)
    low4 = np.where(s < 8, sc[..., s % 8] & 15, sc[..., s % 8] >> 4)
    scales = (low4 | (((sc[..., 8 + s % 4] >> (2 * (s // 4))) & 3) << 4)).astype(np.int16) - 32
    return d16, scales, values.reshape(*qs.shape[:-1], 256)


def wide_twin(type_name: str, raw: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray, str]:
    """(the compact type's data, made exactly representable where needed, and its twin: the same
    integers and scales as Q8_0 or Q6_K or IQ4_NL, and the twin's type)."""
    if type_name == "IQ4_NL":
        blocks = raw.reshape(n, k // 32, 18)
        return raw, q8_0_of(blocks[..., :2], IQ4NL_VALUES[codes(blocks[..., 2:])]).reshape(n, -1), "Q8_0"
    if type_name == "MXFP4":  # exponents float16 holds (2^-24 .. 2^15 after the doubled values' halving)
        blocks = raw.reshape(n, k // 32, 17).copy()
        blocks[..., 0] = 110 + blocks[..., 0] % 30
        d16 = np.ldexp(1.0, blocks[..., 0].astype(np.int32) - 128).astype(np.float16).view(np.uint8).reshape(n, -1, 2)
        return blocks.reshape(n, -1), q8_0_of(d16, MXFP4_VALUES[codes(blocks[..., 1:])]).reshape(n, -1), "Q8_0"
    if type_name == "IQ4_XS":  # d a power of two, so d * scale is exact in float16 and IQ4_NL holds it
        sbs = raw.reshape(n, k // 256, 136).copy()
        sbs[..., :2] = np.array([2.0**-8], np.float16).view(np.uint8)
        scales_h = sbs[..., 2].astype(np.int32) | (sbs[..., 3].astype(np.int32) << 8)
        j = np.arange(8)
        sc = (((sbs[..., 4 + j // 2] >> (4 * (j % 2))) & 15) | (((scales_h[..., None] >> (2 * j)) & 3) << 4)) - 32
        d16 = (2.0**-8 * sc).astype(np.float16).view(np.uint8).reshape(n, -1, 8, 2)
        nl_blocks = np.concatenate([d16, sbs[..., 8:].reshape(n, -1, 8, 16)], axis=-1)
        return sbs.reshape(n, -1), nl_blocks.reshape(n, -1), "IQ4_NL"
    d16, scales, values = q3_k_parts(raw.reshape(n, k // 256, 110))  # Q3_K: Q6_K's integers, as it was packed
    return raw, q6_k_of(d16, scales, values).reshape(n, -1), "Q6_K"


@pytest.mark.parametrize("kernel", [k for k in nl.available_kernels() if k != "generic"] or
                         [pytest.param("generic", marks=pytest.mark.skip(reason="no SIMD kernel set on this CPU"))])
@pytest.mark.parametrize("type_name", ["IQ4_NL", "MXFP4", "IQ4_XS", "Q3_K"])
@pytest.mark.parametrize(("n", "k", "m"), [(37, 512, 1), (130, 1024, 7), (16, 256, 70)])
def test_compact_types_equal_a_twin_type_holding_their_integers(type_name: str, kernel: str, n: int, k: int, m: int) -> None:
    """IQ4_NL and MXFP4 against Q8_0 (their table's integers), Q3_K against Q6_K (its values + 32) and
    IQ4_XS against IQ4_NL (one float16 scale per block): bitwise, the integers and the float steps
    being the same. The twins' dequantized values (gguf's decoder) equal the compact ones'."""
    w = np.random.default_rng(n).standard_normal((n, k)).astype(np.float32)
    raw, twin, twin_type = wide_twin(type_name, quantize_fixture(w, type_name), n, k)
    raw, twin = np.ascontiguousarray(raw), np.ascontiguousarray(twin)
    assert np.array_equal(dequantize(raw, Q[type_name]), dequantize(twin, Q[twin_type]))
    x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
    kernels = "best" if kernel == nl.kernel_name() else kernel
    got = nl.matmul(nl.tensor(raw, type_name, n, k), x, kernels=kernels)
    assert np.array_equal(got, nl.matmul(nl.tensor(twin, twin_type, n, k), x, kernels=kernels))
