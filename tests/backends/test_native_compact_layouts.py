"""The compact packed layouts of IQ4_NL, IQ4_XS, MXFP4, Q3_K and Q2_K (4-bit codes through their table,
Q3_K's and Q2_K's own bit planes: about the file's bytes) against the wide ones they replaced (the codes'
table values as Q8_0 bytes, Q3_K as Q6_K, Q2_K in Q6_K's value planes).

The kernels form the same integer dot products and the same float sequence on both, so every output is
bitwise the same. The wide layouts are the kernels library as of WIDE_LAYOUT_COMMIT, built here from the
repository's history with the package's compiler flags; both libraries run the same inputs
(native_layout_outputs.py: matmuls in several shapes, a MoE model's prefill and decode logits) on every
SIMD kernel set this CPU runs. The generic kernels read GGUF blocks unpacked, so they are not involved.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from spekula.backends.native import lib as nl

WIDE_LAYOUT_COMMIT = "9fcb0b6df0234fb92480e3bd252a9f89fb94e40a"  # the last with the wide layouts
REPO = Path(__file__).resolve().parents[2]
CSRC = "backends/native/csrc"
HERE = Path(__file__).resolve().parent


def build_wide_library(folder: Path) -> Path:
    """The kernels library of WIDE_LAYOUT_COMMIT in `folder` (skips the test where it cannot be built)."""
    if shutil.which("git") is None or shutil.which("gcc") is None:
        pytest.skip("needs git and gcc to build the wide-layout kernels")
    have = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{WIDE_LAYOUT_COMMIT}^{{commit}}"], check=False)
    if have.returncode != 0:
        pytest.skip(f"commit {WIDE_LAYOUT_COMMIT[:12]} is not in this checkout's history")
    archive = subprocess.run(["git", "-C", str(REPO), "archive", WIDE_LAYOUT_COMMIT, CSRC], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    sources = sorted(str(p) for p in (folder / CSRC).glob("*.c"))
    library = folder / "_sk_wide.so"
    # setup.py's flags: -ffp-contract=off keeps the compiler from fusing a*b+c on its own
    subprocess.run(["gcc", "-O3", "-ffp-contract=off", "-fno-math-errno", "-pthread", "-std=gnu11", "-fPIC", "-shared",
                    *sources, "-lm", "-o", str(library)], check=True)
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
