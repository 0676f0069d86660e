"""Reference check: the torch backend against Hugging Face transformers loading the same GGUF.

transformers dequantizes the GGUF itself and runs its own Llama/Qwen2/Qwen3 code (with HF's rope
layout, i.e. it un-permutes llama Q/K), so agreement checks our loader and forward independently.
"""

from __future__ import annotations

import warnings
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from backend_conformance import smollm2_path
from hf_greedy import hf_greedy

from spekula.backends.torch.backend import TorchBackend
from spekula.core.backend import BackendOptions, SeqInput
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.tokenizer import Tokenizer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LOGIT_TOL = 1e-3
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village,",
    "<|im_start|>user\nName three primary colors.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWhat is the boiling point of water in Celsius?<|im_end|>\n<|im_start|>assistant\n",
    "Photosynthesis is the process by which",
)


@cache
def hf_model(path: str) -> Any:
    from spekula.fixtures.tiny_gguf import hf_config_overrides

    transformers.logging.set_verbosity_error()
    p = Path(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(p.parent), gguf_file=p.name, dtype=torch.float32, **hf_config_overrides(p)
        )
    return model.eval()


@cache
def ours(path: str) -> TorchBackend:
    return TorchBackend(path, BackendOptions(n_ctx=512, n_seq_max=2, threads=1))


def our_logits(path: str, ids: list[int]) -> np.ndarray:
    b = ours(path)
    s = b.new_seq()
    try:
        return b.forward([SeqInput(s, np.array(ids, np.int32), 0, np.arange(len(ids)))])[0].logits
    finally:
        b.free_seq(s)


def hf_logits(path: str, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf_model(path)(torch.tensor([ids])).logits[0].float().numpy()


def our_greedy(path: str, ids: list[int], n_new: int) -> list[int]:
    b = ours(path)
    s = b.new_seq()
    try:
        out = b.forward([SeqInput(s, np.array(ids, np.int32), 0)])[0].logits[0]
        gen = [int(out.argmax())]
        for _ in range(n_new - 1):
            out = b.forward([SeqInput(s, np.array(gen[-1:], np.int32), b.seq_len(s))])[0].logits[0]
            gen.append(int(out.argmax()))
        return gen
    finally:
        b.free_seq(s)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_logits_match_transformers(arch: str) -> None:
    from spekula.fixtures.tiny_gguf import tiny_model_path

    path = str(tiny_model_path(arch))
    tok = Tokenizer.from_gguf(GGUFFile(path))
    for prompt in PROMPTS[:3]:
        ids = tok.encode(prompt)
        got, want = our_logits(path, ids), hf_logits(path, ids)
        assert got.shape == want.shape
        assert np.abs(got[-1] - want[-1]).max() < LOGIT_TOL, prompt
        assert np.abs(got - want).max() < LOGIT_TOL, prompt
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 320, 100).tolist()  # positions well past the prompts, every token id range
    assert np.abs(our_logits(path, ids) - hf_logits(path, ids)).max() < LOGIT_TOL


@pytest.mark.slow
def test_smollm2_last_row_logits_match_transformers() -> None:
    path = str(smollm2_path())
    tok = Tokenizer.from_gguf(GGUFFile(path))
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        diff = np.abs(our_logits(path, ids)[-1] - hf_logits(path, ids)[-1]).max()
        assert diff < LOGIT_TOL, (prompt, diff)


@pytest.mark.slow
def test_smollm2_greedy_continuations_match_transformers() -> None:
    path = str(smollm2_path())
    tok = Tokenizer.from_gguf(GGUFFile(path))
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        got, want = our_greedy(path, ids, 40), hf_greedy(hf_model(path), ids, 40)
        assert got == want, (prompt, tok.decode(got), tok.decode(want))
