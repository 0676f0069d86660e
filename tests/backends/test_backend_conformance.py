"""Runs tests/backend_conformance.py over every installed backend and model."""

from __future__ import annotations

import numpy as np
import pytest
from backend_conformance import (
    CHECKS,
    GEMMA4_MODELS,
    GPTOSS_MODELS,
    HYBRID_CHECKS,
    HYBRID_MODELS,
    HYBRID_QUANT_REL_TOL,
    SCALED_MODELS,
    SWA_MODELS,
    available_backends,
    get_backend,
    random_tokens,
    run_fresh,
)

from spekula.core.backend import BackendOptions, load_backend

TINY = ("llama", "qwen2", "qwen3", "qwen3moe", "glm4moe")
# Every matrix in one block type, the embedding and the head included, on every backend (the older types:
# test_native_backend.py). Not qwen2: its fixture magnifies the weights' rounding most when every matrix is
# quantized (native vs torch logits measured 21 % apart for Q4_0, 11-16 % for MXFP4, beyond the suite's 10 %).
TYPED = ("qwen3-IQ4_NL", "llama-IQ4_XS", "qwen3-MXFP4", "llama-Q3_K", "qwen3-Q2_K")
BACKENDS = available_backends()
# Backends that run hybrid (gated delta-net) and sliding-window models; the others refuse them by name.
HYBRID_BACKENDS = [b for b in BACKENDS if b == "torch" or b.startswith("native")]


def test_torch_backend_is_available() -> None:
    assert "torch" in BACKENDS


@pytest.mark.parametrize("check", sorted(CHECKS))
@pytest.mark.parametrize("model", TINY + TYPED)
@pytest.mark.parametrize("backend", BACKENDS)
def test_conformance_tiny(backend: str, model: str, check: str) -> None:
    CHECKS[check](backend, model)


@pytest.mark.parametrize("check", sorted(CHECKS | HYBRID_CHECKS))
@pytest.mark.parametrize("model", HYBRID_MODELS)
@pytest.mark.parametrize("backend", HYBRID_BACKENDS)
def test_conformance_hybrid(backend: str, model: str, check: str) -> None:
    (CHECKS | HYBRID_CHECKS)[check](backend, model)


@pytest.mark.parametrize("check", sorted(CHECKS))
@pytest.mark.parametrize("model", SWA_MODELS)
@pytest.mark.parametrize("backend", HYBRID_BACKENDS)  # the ones that run sliding-window blocks too
def test_conformance_sliding_window(backend: str, model: str, check: str) -> None:
    CHECKS[check](backend, model)


@pytest.mark.parametrize("check", sorted(CHECKS))
@pytest.mark.parametrize("model", GEMMA4_MODELS)
@pytest.mark.parametrize("backend", HYBRID_BACKENDS)  # the ones that run sliding-window blocks
def test_conformance_gemma4(backend: str, model: str, check: str) -> None:
    CHECKS[check](backend, model)


@pytest.mark.parametrize("check", sorted(CHECKS))
@pytest.mark.parametrize("model", SCALED_MODELS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_conformance_scaled(backend: str, model: str, check: str) -> None:
    CHECKS[check](backend, model)


# gpt-oss (sinks, biased swiglu_oai experts, sliding windows, YaRN) on the backends that run it (onnx refuses).
@pytest.mark.parametrize("check", sorted(CHECKS))
@pytest.mark.parametrize("model", GPTOSS_MODELS)
@pytest.mark.parametrize("backend", HYBRID_BACKENDS)
def test_conformance_gptoss(backend: str, model: str, check: str) -> None:
    CHECKS[check](backend, model)


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_q4_k_m_hybrid_stays_near_its_float_file(arch: str) -> None:
    """llama-quantize's Q4_K_M of the wide hybrid fixture, on the native kernels, against torch's fp32
    forward of the float file it was made from: within the quantized hybrid tolerance, mostly the same
    greedy choice (measured 0.09-0.15 of the largest logit, 78-92 % of rows agreeing)."""
    from spekula.fixtures.tiny_qwen35 import tiny_qwen35_gguf_path

    quantized = get_backend("native", f"{arch}-q4_k_m")
    float_file = tiny_qwen35_gguf_path(moe=arch == "qwen35moe", variant="no_mtp", wide=True)
    ref = load_backend("torch", str(float_file), BackendOptions(n_ctx=64, n_seq_max=1, threads=1, exact=True))
    tokens = random_tokens(quantized, 37, seed=10)
    got, want = run_fresh(quantized, tokens).logits, run_fresh(ref, tokens).logits
    diff = float(np.abs(got - want).max())
    assert diff <= HYBRID_QUANT_REL_TOL * float(np.abs(want).max()), diff
    assert float(np.mean(got.argmax(axis=1) == want.argmax(axis=1))) >= 0.75


@pytest.mark.slow
@pytest.mark.parametrize("check", sorted(CHECKS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_conformance_smollm2(backend: str, check: str) -> None:
    CHECKS[check](backend, "smollm2")
