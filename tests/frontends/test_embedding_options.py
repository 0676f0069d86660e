"""Which pooling `--embedding` / `--pooling` / `--reranking` give, read from the model file before any
weights load, and the start-up refusals."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest

from spekula.core.embedding import Pooling
from spekula.core.errors import ConfigError, ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.frontends.cli.embedding_options import serving_pooling


def _args(embedding: bool = False, reranking: bool = False, pooling: str | None = None) -> argparse.Namespace:
    return argparse.Namespace(embedding=embedding, reranking=reranking, pooling=pooling)


def _llama() -> GGUFFile:
    from spekula.fixtures.tiny_gguf import tiny_model_path

    return GGUFFile(tiny_model_path("llama"))


def _reranker() -> GGUFFile:
    from spekula.fixtures.tiny_reranker import tiny_qwen3_reranker_path

    return GGUFFile(tiny_qwen3_reranker_path())


def test_no_embeddings_without_the_option() -> None:
    assert serving_pooling(_args(), _llama()) is None
    with pytest.raises(ConfigError, match="--pooling needs --embedding"):
        serving_pooling(_args(pooling="mean"), _llama())


def test_the_option_then_the_file_then_none() -> None:
    assert serving_pooling(_args(embedding=True), _llama()) is Pooling.NONE  # the file declares no pooling
    assert serving_pooling(_args(embedding=True, pooling="last"), _llama()) is Pooling.LAST
    assert serving_pooling(_args(embedding=True), _reranker()) is Pooling.RANK  # the file's qwen3.pooling_type
    assert serving_pooling(_args(embedding=True, pooling="mean"), _reranker()) is Pooling.MEAN
    assert serving_pooling(_args(reranking=True), _reranker()) is Pooling.RANK


def test_reranking_needs_a_reranker() -> None:
    with pytest.raises(ConfigError, match=r"classifier head \(cls.output.weight\)"):
        serving_pooling(_args(reranking=True), _llama())
    with pytest.raises(ConfigError, match="contradicts"):
        serving_pooling(_args(reranking=True, pooling="mean"), _reranker())
    with pytest.raises(ConfigError, match="--pooling must be one of"):
        serving_pooling(_args(embedding=True, pooling="max"), _llama())


def _bert() -> GGUFFile:
    from spekula.fixtures.tiny_bert import tiny_bert_path

    return GGUFFile(tiny_bert_path())


def test_a_bert_encoder_serves_embeddings_only() -> None:
    assert serving_pooling(_args(embedding=True), _bert()) is Pooling.CLS  # the file's bert.pooling_type
    assert serving_pooling(_args(embedding=True, pooling="mean"), _bert()) is Pooling.MEAN
    with pytest.raises(ConfigError, match="'bert' is an encoder model, which computes embeddings only: serve it "
                                          "with --embedding"):
        serving_pooling(_args(), _bert())
    with pytest.raises(ConfigError, match="rank pooling .* not supported on 'bert' encoders"):
        serving_pooling(_args(reranking=True), _bert())


def test_other_encoder_models_are_refused_by_name(tmp_path: Path) -> None:
    from spekula.fixtures.tiny_gguf import write_gguf

    path = write_gguf(tmp_path / "nomic.gguf", "nomic-bert", {"pooling_type": 1, "embedding_length": 8},
                      {"token_embd.weight": np.zeros((4, 8), np.float32)}, {})
    for args in (_args(embedding=True), _args()):
        with pytest.raises(ModelFileError, match="encoder architecture 'nomic-bert' is not supported"):
            serving_pooling(args, GGUFFile(path))
