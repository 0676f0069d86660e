"""Which pooling `--embedding` / `--pooling` / `--reranking` give, read from the model file before any
weights load, and the start-up refusals."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest

from spekula.core.embedding import Pooling
from spekula.core.errors import ConfigError
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


def test_an_encoder_model_is_refused_by_name(tmp_path: Path) -> None:
    from spekula.fixtures.tiny_gguf import write_gguf

    path = write_gguf(tmp_path / "bert.gguf", "bert", {"pooling_type": 2, "embedding_length": 8},
                      {"token_embd.weight": np.zeros((4, 8), np.float32)}, {})
    with pytest.raises(ConfigError, match="encoder architecture 'bert' is not supported"):
        serving_pooling(_args(embedding=True), GGUFFile(path))
