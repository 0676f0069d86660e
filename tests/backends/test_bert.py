"""The `bert` encoder (backends/gguf/encoder.py, backends/torch/encoder.py) against transformers' BertModel
on the tiny BERT fixture (fixtures/tiny_bert.py, converted by llama.cpp's converter): the tokenizer's ids,
the pooled and normalised embeddings (CLS and mean), and the refusals (generation, the native backend,
sequences longer than the position table or the batch, other encoder architectures)."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from spekula.core.backend import Backend, BackendOptions, SeqInput, load_backend
from spekula.core.embedding import Pooling, normalize
from spekula.core.errors import ConfigError, ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.tokenizer import Tokenizer
from spekula.fixtures.tiny_bert import N_POSITIONS

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TEXTS = ["The quick brown fox jumps over the lazy dog.", "What is two plus two? Four!",
         "Once upon a time, a small robot counted the stars: one, two, three.", "Naïve CAFÉ-owners' résumés"]
# Per component of the pooled, normalised vectors (their largest components are about 0.4): measured 3e-6.
# transformers' BERT uses GELU's erf form, llama.cpp's graph (and ours) its tanh form, float32 both.
TOL = 1e-4


@cache
def _path(pooling: str) -> Path:
    from spekula.fixtures.tiny_bert import tiny_bert_path

    return tiny_bert_path(pooling)


@cache
def _hf(pooling: str) -> tuple[Any, Any]:
    from spekula.fixtures.tiny_bert import tiny_bert_hf_dir

    transformers.logging.set_verbosity_error()
    hf_dir = tiny_bert_hf_dir(pooling)
    model = transformers.BertModel.from_pretrained(str(hf_dir), add_pooling_layer=False, dtype=torch.float32).eval()
    return model, transformers.BertTokenizer.from_pretrained(str(hf_dir))


@cache
def _backend(pooling: str) -> Backend:
    return load_backend("torch", str(_path(pooling)), BackendOptions(n_ctx=128, n_seq_max=2, threads=1))


def _tokenizer(pooling: str = "cls") -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(_path(pooling)))


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_transformers(text: str) -> None:
    _, hf_tok = _hf("cls")
    assert _tokenizer().encode(text) == hf_tok(text)["input_ids"]


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_pooling_is_read_from_the_file(pooling: str) -> None:
    assert GGUFFile(_path(pooling)).get("bert.pooling_type") == {"cls": 2, "mean": 1}[pooling]


@pytest.mark.parametrize("pooling", ["cls", "mean"])
@pytest.mark.parametrize("text", TEXTS)
def test_embeddings_match_transformers(pooling: str, text: str) -> None:
    model, _ = _hf(pooling)
    ids = _tokenizer(pooling).encode(text)
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0].double().numpy()
    want = normalize(hidden[0] if pooling == "cls" else hidden.mean(axis=0), 2)
    b = _backend(pooling)
    seq = b.new_seq()
    try:
        got = normalize(b.embed(seq, np.asarray(ids, np.int32), Pooling(pooling), 512), 2)
        per_token = b.embed(seq, np.asarray(ids, np.int32), Pooling.NONE, 512)
    finally:
        b.free_seq(seq)
    assert np.abs(got - want).max() < TOL
    assert np.abs(per_token - hidden).max() < TOL * np.abs(hidden).max()  # every token, unnormalised (measured 1e-5)
    assert not np.allclose(got, normalize(hidden[-1], 2), atol=TOL)  # the pooling matters on this fixture


def test_encoder_refuses_generation_and_long_inputs() -> None:
    b = _backend("cls")
    seq = b.new_seq()
    try:
        with pytest.raises(ConfigError, match="encoder"):
            b.forward([SeqInput(seq, np.array([101, 102], np.int32), 0)])
        too_long = np.full(N_POSITIONS + 1, 150, np.int32)
        with pytest.raises(ValueError, match=rf"input \({N_POSITIONS + 1} tokens\) is longer than the model's position "
                                             rf"table \({N_POSITIONS} positions"):
            b.embed(seq, too_long, Pooling.CLS, 1024)
        with pytest.raises(ValueError, match="increase the physical batch size"):
            b.embed(seq, too_long[:20], Pooling.CLS, 16)  # non-causal: one sequence is one batch
        with pytest.raises(ConfigError, match="rank pooling"):
            b.embed(seq, too_long[:4], Pooling.RANK, 512)
    finally:
        b.free_seq(seq)


def test_native_refuses_bert_by_name() -> None:
    with pytest.raises(ModelFileError, match="encoder architecture 'bert'.*--backend torch"):
        load_backend("native", str(_path("cls")), BackendOptions(n_ctx=64, n_seq_max=1, threads=1))


def test_other_encoder_architectures_are_refused_by_name(tmp_path: Path) -> None:
    from spekula.backends.gguf.encoder import read_encoder_hparams
    from spekula.fixtures.tiny_gguf import write_gguf

    path = write_gguf(tmp_path / "nomic.gguf", "nomic-bert", {"embedding_length": 8}, {}, {})
    with pytest.raises(ModelFileError, match="encoder architecture 'nomic-bert' is not supported"):
        read_encoder_hparams(GGUFFile(path))
