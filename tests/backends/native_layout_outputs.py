"""Outputs of the native kernels that the compact packed layouts must leave bitwise unchanged, computed
through a given build of the kernels library: `python native_layout_outputs.py LIBRARY OUT.npz`.

Run as a script (tests/backends/test_native_compact_layouts.py runs it once per library), as one process
holds one copy of the library. Matmuls of every codebook and low-bit K type in several shapes (whole,
half and ragged 16-column groups; 1 to 70 rows), and logits of a MoE model (quantized experts, dense
attention and FFN) with every matrix in each type, on every SIMD kernel set this CPU runs; and the
bytes the MoE model's packed weights take (`packed_bytes/...`: they differ between the layouts).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import numpy as np

COMPACT_TYPES = ("IQ4_NL", "IQ4_XS", "MXFP4", "Q3_K", "Q2_K")
# (columns, inputs, rows): groups of 16 whole, half and ragged; one row (decode) up to a prefill
SHAPES = ((37, 512, 1), (37, 512, 9), (64, 256, 5), (130, 1024, 3), (16, 768, 70))
MOE_ARCH = "glm4moe"  # block 0 dense, routed and shared experts


def matmul_outputs(nl: object, kernel_sets: list[str]) -> dict[str, np.ndarray]:
    from test_native_kernels import make_weight

    out = {}
    for kernels in kernel_sets:
        for type_name in COMPACT_TYPES:
            for n, k, m in SHAPES:
                raw, _ = make_weight(type_name, n, k, seed=n + k)
                x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
                out[f"{kernels}/{type_name}/{n}x{k}x{m}"] = nl.matmul(nl.tensor(raw, type_name, n, k), x, kernels=kernels)
    return out


def moe_outputs(kernel_sets: list[str], folder: Path) -> dict[str, np.ndarray]:
    from backend_helpers import fresh_logits

    from spekula.backends.native.backend import NativeBackend
    from spekula.core.backend import BackendOptions
    from spekula.fixtures.tiny_moe_quant import requantize, write_wide_moe

    src = write_wide_moe(MOE_ARCH, folder / "wide-f32.gguf")
    tokens = np.random.default_rng(3).integers(0, 320, 12).astype(np.int32)
    out = {}
    for type_name in COMPACT_TYPES:
        path = requantize(src, folder / f"wide-{type_name}.gguf", type_name)
        for kernels in kernel_sets:
            os.environ["SPEKULA_NATIVE_KERNELS"] = kernels
            backend = NativeBackend(str(path), BackendOptions(n_ctx=64, n_seq_max=1, threads=2))
            out[f"moe/{kernels}/{type_name}"] = fresh_logits(backend, tokens, [9, 1, 1, 1])  # prefill, then decode
            out[f"packed_bytes/{kernels}/{type_name}"] = np.array([backend._lib.sk_ctx_packed_bytes(backend._ctx)])
            backend.close()
    return out


def main(library: str, dst: str) -> None:
    sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]
    from spekula.backends.native import lib as nl

    nl.library_path = lambda: Path(library)  # before the first lib() call loads it
    kernel_sets = [k for k in ("avx2", "best") if nl.kernel_name(k) != "generic"]
    kernel_sets = [k for i, k in enumerate(kernel_sets) if nl.kernel_name(k) not in map(nl.kernel_name, kernel_sets[:i])]
    with tempfile.TemporaryDirectory() as folder:
        outputs = matmul_outputs(nl, kernel_sets) | moe_outputs(kernel_sets, Path(folder))
    np.savez(dst, **outputs)


if __name__ == "__main__":
    main(*sys.argv[1:])
