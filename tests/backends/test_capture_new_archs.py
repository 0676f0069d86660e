"""Hidden states an EAGLE-3 / DFlash head reads from gemma3 (post-norm blocks, sliding windows, scaled
embeddings), mistral3 (YaRN, query temperature) and gpt-oss (sinks, MoE, sliding windows) targets, on
native and torch, against transformers' own ``output_hidden_states`` (entry l: the residual entering block l,
the last one after the final norm) on a sequence past every window."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from spekula.core.backend import BackendOptions, Capture, SeqInput, load_backend

TARGETS = ("gemma3", "mistral3", "gpt-oss")
REL_TOL = {"torch": 1e-4, "native": 1e-2}  # of each state's largest magnitude; native keeps float16 keys/values


def _fixture(target: str) -> tuple[Path, Path]:
    """(float GGUF, checkpoint folder)."""
    if target == "gemma3":
        from spekula.fixtures.tiny_gemma3 import tiny_gemma3_gguf_path, tiny_gemma3_hf_path

        return tiny_gemma3_gguf_path(), tiny_gemma3_hf_path()
    if target == "mistral3":
        from spekula.fixtures.tiny_ministral3 import tiny_ministral3_gguf_path, tiny_ministral3_hf_path

        return tiny_ministral3_gguf_path(), tiny_ministral3_hf_path()
    from spekula.fixtures.tiny_gptoss import tiny_gptoss_gguf_path, tiny_gptoss_hf_path

    return tiny_gptoss_gguf_path("f32"), tiny_gptoss_hf_path()


TOKENS = np.random.default_rng(4).integers(3, 300, 150).astype(np.int32)  # past gpt-oss's 64-token window


@cache
def _hf_states(folder: Path) -> list[np.ndarray]:
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    model: Any = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                                   attn_implementation="eager").eval()
    with torch.no_grad():
        out = model(torch.as_tensor(TOKENS[None].astype(np.int64)), output_hidden_states=True)
    return [h[0].numpy() for h in out.hidden_states]


def _relative(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("target", TARGETS)
def test_captured_states_are_transformers_hidden_states(target: str, backend: str) -> None:
    gguf, folder = _fixture(target)
    b = load_backend(backend, str(gguf), BackendOptions(n_ctx=256, n_seq_max=1, threads=1))
    tokens = TOKENS
    n_layer = b.info.n_layer
    s = b.new_seq()
    out = b.forward([SeqInput(s, tokens, 0, np.arange(tokens.size))], Capture(frozenset(range(n_layer)), True))[0]
    want = _hf_states(folder)
    got: dict[str, tuple[np.ndarray, np.ndarray]] = {f"layer {i}": (out.layer_inputs[i], want[i]) for i in range(n_layer)}
    got["final norm"] = (out.hidden_final, want[n_layer])
    errors = {k: _relative(np.asarray(a).reshape(w.shape), w) for k, (a, w) in got.items()}
    assert max(errors.values()) <= REL_TOL[backend], errors
