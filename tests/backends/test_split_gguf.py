"""A model split over several files answers exactly as the one file: the same logits, bitwise, and the
same greedy tokens, on every backend (native, torch, ONNX) and on each family of architectures."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from backend_helpers import fresh_logits, open_backend, random_tokens

from spekula.core.backend import Backend, SeqInput
from spekula.fixtures.gguf_split_writer import make_split
from spekula.fixtures.tiny_gemma3 import tiny_gemma3_gguf_path
from spekula.fixtures.tiny_gguf import tiny_model_path
from spekula.fixtures.tiny_moe import tiny_moe_gguf_path
from spekula.fixtures.tiny_qwen35 import tiny_qwen35_gguf_path

pytestmark = pytest.mark.timeout(600)

MODELS: dict[str, Callable[[], Path]] = {
    "llama-Q4_K": lambda: tiny_model_path("llama", weight_type="Q4_K"),
    "qwen3-f32": lambda: tiny_model_path("qwen3"),
    "qwen35": lambda: tiny_qwen35_gguf_path(),
    "qwen3moe": lambda: tiny_moe_gguf_path("qwen3moe"),
    "gemma3": lambda: tiny_gemma3_gguf_path(),
}


def greedy(be: Backend, prompt: np.ndarray, n: int) -> list[int]:
    seq = be.new_seq()
    try:
        logits = be.forward([SeqInput(seq, prompt, 0, np.array([prompt.size - 1]))])[0].logits
        out: list[int] = []
        for pos in range(prompt.size, prompt.size + n):
            out.append(int(logits[-1].argmax()))
            logits = be.forward([SeqInput(seq, np.array(out[-1:], np.int32), pos, np.array([0]))])[0].logits
        return out
    finally:
        be.free_seq(seq)


# The ONNX backend exports the dense architectures; its cache key covers every shard (onnx/cache.py).
CASES = [(m, b) for m in MODELS for b in ("native", "torch")] + [("qwen3-f32", "onnx"), ("llama-Q4_K", "onnx")]


@pytest.mark.parametrize(("model", "backend"), CASES)
def test_split_answers_exactly_as_the_single_file(tmp_path: Path, model: str, backend: str) -> None:
    single = MODELS[model]()
    shards = make_split(single, tmp_path / "m", 6)
    assert len(shards) >= 3
    whole = open_backend(backend, single, threads=1)
    prompt = random_tokens(24, seed=3, high=whole.info.n_vocab)
    want_logits, want_tokens = fresh_logits(whole, prompt), greedy(whole, prompt, 12)
    for given in (shards[0], shards[-1]):
        split = open_backend(backend, given, threads=1)
        assert split.info.n_vocab == whole.info.n_vocab
        got = fresh_logits(split, prompt)
        assert got.dtype == want_logits.dtype and np.array_equal(got.view(np.uint8), want_logits.view(np.uint8))
        assert greedy(split, prompt, 12) == want_tokens


def test_onnx_cache_key_covers_every_shard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from spekula.backends.onnx import cache as onnx_cache

    monkeypatch.setenv("SPEKULA_CACHE_DIR", str(tmp_path / "cache"))
    shards = make_split(tiny_model_path("qwen3"), tmp_path / "m", 6)
    before = onnx_cache.model_sha256(shards)
    assert before != onnx_cache.gguf_sha256(shards[0])
    data = bytearray(shards[-1].read_bytes())
    data[-64] ^= 1  # a weight byte of the last shard's last tensor
    shards[-1].write_bytes(bytes(data))
    assert onnx_cache.model_sha256(shards) != before
