"""Issue #47's architecture x tensor-type matrix: each architecture's wide fixture (fixtures/wide_archs.py)
with every matrix in IQ4_NL, IQ4_XS, Q3_K, Q2_K or MXFP4 (fixtures/quant_routes.py: llama-quantize --pure
where it is installed, else the fixtures' own block writers) through the conformance suite, bitwise on
the native backend, and its logits within a stated tolerance of the float file's.

By default one type per architecture runs, rotating through the types so each is covered (:data:`SAMPLE`);
``pytest -m quant_matrix`` runs the whole matrix (pyproject.toml deselects the marker by default).
"""

from __future__ import annotations

import numpy as np
import pytest
from backend_conformance import (
    CHECKS,
    HYBRID_CHECKS,
    available_backends,
    matrix_model,
    run_fresh,
    wide_f32_path_or_skip,
)

from spekula.fixtures.quant_routes import ROUTES, TYPES, llama_quantize_available, quantized_path
from spekula.fixtures.wide_archs import ARCHS

NATIVE = [b for b in available_backends() if b.startswith("native")]
HYBRID = ("qwen35", "qwen35moe")  # gated delta-net blocks: the recurrent-state checks too
# Each architecture's default type: the types in turn, so the default run covers every type once.
SAMPLE = {arch: TYPES[i % len(TYPES)] for i, arch in enumerate(ARCHS)}
FULL = pytest.mark.quant_matrix
# Native logits on the quantized file against torch's on the float file, as a fraction of the largest float
# logit: the median row within TOL[type], nine rows in ten within twice it. Measured on both routes' files
# (median row): IQ4 types 0.02-0.12 and up to 0.19 on gpt-oss, MXFP4 up to 0.26 (gpt-oss), Q3_K up to 0.35,
# Q2_K up to 0.67 (gpt-oss: its routing moves with the rounding; the others stay within 0.45). The lm
# head's own rounding sets the floor where logits are O(1). gemma4's logits are soft-capped at 30, so its
# largest logit is the cap while its tied head's rounding moves the others as much as gemma3's (largest
# logit ~270, Q2_K 0.09): IQ4 0.19, MXFP4 0.28, Q3_K 0.37, Q2_K 0.65 (llama-quantize) and 0.72 (writers).
TOL = {"IQ4_NL": 0.2, "IQ4_XS": 0.2, "MXFP4": 0.3, "Q3_K": 0.4, "Q2_K": 0.75}


def matrix_params() -> list[object]:
    return [pytest.param(arch, t, marks=() if SAMPLE[arch] == t else FULL, id=matrix_model(arch, t))
            for arch in ARCHS for t in TYPES]


@pytest.mark.parametrize("check", sorted(CHECKS))
@pytest.mark.parametrize(("arch", "type_name"), matrix_params())
@pytest.mark.parametrize("backend", NATIVE)
def test_conformance(backend: str, arch: str, type_name: str, check: str) -> None:
    CHECKS[check](backend, matrix_model(arch, type_name))


@pytest.mark.parametrize("check", sorted(HYBRID_CHECKS))
@pytest.mark.parametrize(("arch", "type_name"), [p for p in matrix_params() if p.values[0] in HYBRID])  # type: ignore[attr-defined]
@pytest.mark.parametrize("backend", NATIVE)
def test_recurrent_state_conformance(backend: str, arch: str, type_name: str, check: str) -> None:
    HYBRID_CHECKS[check](backend, matrix_model(arch, type_name))


@pytest.mark.parametrize(("arch", "type_name"), matrix_params())
def test_logits_near_the_float_file(arch: str, type_name: str) -> None:
    """Both routes' files where llama-quantize is installed (the writers' alone elsewhere), on native."""
    from spekula.core.backend import BackendOptions, load_backend

    src = wide_f32_path_or_skip(arch)
    opts = BackendOptions(n_ctx=64, n_seq_max=1, threads=1, exact=True)
    float_ref = load_backend("torch", str(src), opts)
    tokens = np.random.default_rng(10).integers(0, float_ref.info.n_vocab, 37).astype(np.int32)
    want = run_fresh(float_ref, tokens).logits
    tol = TOL[type_name]
    for route in ROUTES if llama_quantize_available() else ("writers",):
        got = run_fresh(load_backend("native", str(quantized_path(src, type_name, route)), opts), tokens).logits
        row = np.abs(got - want).max(axis=1) / float(np.abs(want).max())
        assert np.median(row) <= tol and np.quantile(row, 0.9) <= 2 * tol, (
            f"{arch} {type_name} by {route}: median row {np.median(row):.3f}, 90th percentile "
            f"{np.quantile(row, 0.9):.3f} of the largest logit (allowed {tol}, {2 * tol})")
