"""Backend.embed against transformers: the hidden state after the final norm (transformers' last
`hidden_states` entry) pooled each way, on the tiny fixtures through the native and torch backends;
rank pooling through a tiny Qwen3 reranker's classifier head; the refusals. The ONNX backend runs the same
Backend.embed over its own forward and is checked the same way."""

from __future__ import annotations

import warnings
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from spekula.core.backend import Backend, BackendOptions, load_backend
from spekula.core.embedding import Pooling
from spekula.core.errors import ConfigError, ModelFileError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOKENS = np.random.default_rng(11).integers(3, 300, 37).astype(np.int32)
REL_TOL = {"torch": 1e-4, "onnx": 1e-4, "native": 1e-2}  # of the reference's largest magnitude; native keeps float16 keys/values


@pytest.fixture(scope="module")
def float_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The tiny llama and qwen3 with every matrix in float32 (the native kernels then multiply in float,
    so the comparison is tight)."""
    from spekula.fixtures.tiny_gguf import build

    where = tmp_path_factory.mktemp("float-fixtures")
    return {arch: str(build(arch, where / f"{arch}.gguf", quantize=False)) for arch in ("llama", "qwen3")}


@cache
def _hf_final_hidden(path: str) -> np.ndarray:
    """transformers' hidden state after the final norm, one row per token of TOKENS."""
    from spekula.fixtures.tiny_gguf import hf_config_overrides

    transformers.logging.set_verbosity_error()
    p = Path(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model: Any = transformers.AutoModelForCausalLM.from_pretrained(
            str(p.parent), gguf_file=p.name, dtype=torch.float32, **hf_config_overrides(p)).eval()
    with torch.no_grad():
        out = model(torch.as_tensor(TOKENS[None].astype(np.int64)), output_hidden_states=True)
    return out.hidden_states[-1][0].double().numpy()


def _reference(hidden: np.ndarray, pooling: Pooling) -> np.ndarray:
    return {Pooling.NONE: hidden, Pooling.MEAN: hidden.mean(axis=0), Pooling.CLS: hidden[0],
            Pooling.LAST: hidden[-1]}[pooling]


@cache
def _backend(name: str, path: str) -> Backend:
    return load_backend(name, path, BackendOptions(n_ctx=128, n_seq_max=1, threads=1))


def _embed(name: str, path: str, pooling: Pooling, n_batch: int) -> np.ndarray:
    b = _backend(name, path)
    seq = b.new_seq()
    try:
        return b.embed(seq, TOKENS, pooling, n_batch)
    finally:
        b.free_seq(seq)


@pytest.mark.parametrize("pooling", [Pooling.NONE, Pooling.MEAN, Pooling.CLS, Pooling.LAST])
@pytest.mark.parametrize("backend", ["native", "torch", "onnx"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_pooled_embeddings_are_transformers_final_hidden_states(arch: str, backend: str, pooling: Pooling,
                                                                 float_models: dict[str, str]) -> None:
    path = float_models[arch]
    want = _reference(_hf_final_hidden(path), pooling)
    got = _embed(backend, path, pooling, n_batch=8)  # in five forwards: chunking must not matter
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= REL_TOL[backend] * np.abs(want).max()
    whole = _embed(backend, path, pooling, n_batch=64)
    assert np.array_equal(got, whole) if backend == "native" else np.allclose(got, whole, atol=1e-5)


@pytest.mark.parametrize("backend", ["native", "torch", "onnx"])
def test_rank_pooling_scores_the_last_token_through_the_classifier_head(backend: str) -> None:
    from spekula.backends.gguf.weights import dequantize
    from spekula.core.modelfile.gguf_file import GGUFFile
    from spekula.fixtures.tiny_reranker import NO_ID, YES_ID, tiny_qwen3_reranker_path

    path = str(tiny_qwen3_reranker_path())
    hidden = _hf_final_hidden(path)
    head = _backend(backend, path).classifier_head()
    assert head is not None and head.labels == ("yes", "no") and head.softmax
    f = GGUFFile(path)  # the head is the output rows of "yes" and "no", as llama.cpp's converter makes it
    out = dequantize(f.tensor("output.weight" if f.has_tensor("output.weight") else "token_embd.weight"))
    assert np.array_equal(head.out_weight, out[[YES_ID, NO_ID]])
    z = out[[YES_ID, NO_ID]].astype(np.float64) @ hidden[-1]
    want = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    got = _embed(backend, path, Pooling.RANK, n_batch=16)
    assert got.shape == (2,)
    assert abs(float(got.sum()) - 1.0) < 1e-5
    assert np.abs(got - want).max() <= 10 * REL_TOL[backend]


def test_rank_pooling_without_a_classifier_head_is_refused() -> None:
    from spekula.fixtures.tiny_gguf import tiny_model_path

    b = _backend("native", str(tiny_model_path("llama")))
    assert b.classifier_head() is None
    seq = b.new_seq()
    try:
        with pytest.raises(ConfigError, match="classifier head"):
            b.embed(seq, TOKENS, Pooling.RANK, 16)
    finally:
        b.free_seq(seq)


def test_a_classifier_head_on_another_architecture_is_refused_by_name(tmp_path: Path) -> None:
    from spekula.backends.gguf.classifier import read_classifier_head
    from spekula.core.modelfile.gguf_file import GGUFFile
    from spekula.fixtures.tiny_gguf import build, write_gguf

    base = GGUFFile(build("llama", tmp_path / "base.gguf", quantize=False))
    tensors = {e.name: np.array(e.data) for e in base.tensors()}
    tensors["cls.output.weight"] = np.ones((2, 64), np.float32)
    meta = {k: v for k, v in base.metadata.items() if k != "general.architecture"}
    path = write_gguf(tmp_path / "llama-cls.gguf", "llama", {}, tensors, meta)
    with pytest.raises(ModelFileError, match="rank pooling is not supported for architecture 'llama'"):
        read_classifier_head(str(path))


def test_an_empty_sequence_is_refused() -> None:
    from spekula.fixtures.tiny_gguf import tiny_model_path

    b = _backend("native", str(tiny_model_path("llama")))
    seq = b.new_seq()
    try:
        with pytest.raises(ValueError, match="empty"):
            b.embed(seq, np.zeros(0, np.int32), Pooling.MEAN, 16)
    finally:
        b.free_seq(seq)


def _family_fixture(family: str) -> tuple[Path, Path]:
    """(float GGUF, transformers checkpoint) of a tiny model of each other family spekula runs."""
    if family == "gemma3":
        from spekula.fixtures.tiny_gemma3 import tiny_gemma3_gguf_path, tiny_gemma3_hf_path

        return tiny_gemma3_gguf_path(), tiny_gemma3_hf_path()
    if family == "gemma4":
        from spekula.fixtures.tiny_gemma4 import tiny_gemma4_gguf_path, tiny_gemma4_hf_path

        return tiny_gemma4_gguf_path(), tiny_gemma4_hf_path()
    if family == "gpt-oss":
        from spekula.fixtures.tiny_gptoss import tiny_gptoss_gguf_path, tiny_gptoss_hf_path

        return tiny_gptoss_gguf_path("f32"), tiny_gptoss_hf_path()
    if family == "mistral3":
        from spekula.fixtures.tiny_ministral3 import tiny_ministral3_gguf_path, tiny_ministral3_hf_path

        return tiny_ministral3_gguf_path(), tiny_ministral3_hf_path()
    if family == "qwen35":
        from spekula.fixtures.tiny_qwen35 import tiny_qwen35_gguf_path, tiny_qwen35_hf_path

        return tiny_qwen35_gguf_path(), tiny_qwen35_hf_path()
    from spekula.fixtures.tiny_moe import tiny_moe_gguf_path, tiny_moe_hf_path

    return tiny_moe_gguf_path(family), tiny_moe_hf_path(family)


LONG = np.random.default_rng(4).integers(3, 300, 150).astype(np.int32)  # past gpt-oss's 64-token window


@cache
def _hf_family_hidden(folder: Path) -> np.ndarray:
    transformers.logging.set_verbosity_error()
    model: Any = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                                   attn_implementation="eager").eval()
    with torch.no_grad():
        out = model(torch.as_tensor(LONG[None].astype(np.int64)), output_hidden_states=True)
    return out.hidden_states[-1][0].double().numpy()


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("family", ["gemma3", "gemma4", "gpt-oss", "mistral3", "qwen35", "glm4moe", "qwen3moe"])
def test_every_family_embeds_as_transformers(family: str, backend: str) -> None:
    """Sliding-window rings, a recurrent state (qwen35) and experts, prefilled in chunks of 16."""
    gguf, folder = _family_fixture(family)
    want = _hf_family_hidden(folder)
    b = load_backend(backend, str(gguf), BackendOptions(n_ctx=256, n_seq_max=1, threads=1))
    try:
        seq = b.new_seq()
        got = b.embed(seq, LONG, Pooling.NONE, 16)
        assert np.abs(got - want).max() <= REL_TOL[backend] * np.abs(want).max()
        mean = b.embed(seq, LONG, Pooling.MEAN, 16)
        assert np.abs(mean - want.mean(axis=0)).max() <= REL_TOL[backend] * np.abs(want).max()
    finally:
        b.close()
