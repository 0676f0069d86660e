"""The tiny gpt-oss fixture (fixtures/tiny_gptoss.py) for tests: its GGUF files and backends on them."""

from __future__ import annotations

import pytest

from spekula.core.backend import Backend, BackendOptions, load_backend
from spekula.fixtures.llamacpp_convert import LlamaCppUnavailable
from spekula.fixtures.llamacpp_quantize import LlamaQuantizeUnavailable
from spekula.fixtures.tiny_gptoss import SLIDING_WINDOW, tiny_gptoss_gguf_path

WINDOW = SLIDING_WINDOW
N_CTX = 4 * WINDOW  # room for sequences well past the window
BACKENDS = ("native", "torch")  # the ONNX backend refuses gpt-oss by name


def gptoss_path(variant: str = "f32") -> str:
    """The fixture's GGUF ("f32" or "mxfp4": llama-quantize's MXFP4_MOE, or the fixtures' writers' where the
    tool is missing); skips, saying why, where llama.cpp's converter is missing."""
    try:
        return str(tiny_gptoss_gguf_path(variant))
    except (LlamaCppUnavailable, LlamaQuantizeUnavailable) as exc:
        pytest.skip(str(exc))


def load_gptoss(name: str, variant: str = "f32", **options: object) -> Backend:
    """Backend `name` on the fixture; `options` are BackendOptions fields (n_ctx defaults to N_CTX)."""
    return load_backend(name, gptoss_path(variant),
                        BackendOptions(**{"n_ctx": N_CTX, "n_seq_max": 4, **options}))  # type: ignore[arg-type]
