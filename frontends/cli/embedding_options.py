"""Which pooling a server with `--embedding` / `--reranking` runs, decided from its options and the
model file before any weights load.

As in llama-server: an explicit `--pooling` wins, else the file's `{arch}.pooling_type`, else none (a
vector per token, which the OpenAI endpoint refuses); `--reranking` is `--embedding --pooling rank`.
Rank pooling needs a reranker file (backends/gguf/classifier.py) and is refused otherwise. Encoder
architectures (BERT and its kin) are not built: their files are refused by name.
"""

from __future__ import annotations

import argparse

from spekula.backends.gguf.classifier import read_classifier_head
from spekula.core.embedding import Pooling, parse_pooling, pooling_from_gguf_id
from spekula.core.errors import ConfigError
from spekula.core.modelfile.gguf_file import GGUFFile

# llama.cpp's encoder-only embedding architectures; spekula runs decoders only
ENCODER_ARCHS = ("bert", "nomic-bert", "nomic-bert-moe", "jina-bert-v2", "jina-bert-v3", "modern-bert",
                 "neo-bert", "eurobert", "t5encoder")


def serving_pooling(args: argparse.Namespace, model_file: GGUFFile) -> Pooling | None:
    """The engine's pooling, or None when the server serves no embeddings."""
    embedding = bool(getattr(args, "embedding", False))
    reranking = bool(getattr(args, "reranking", False))
    asked = getattr(args, "pooling", None)
    if not (embedding or reranking):
        if asked is not None:
            raise ConfigError("--pooling needs --embedding (or --reranking)")
        return None
    arch = model_file.architecture
    if arch in ENCODER_ARCHS:
        raise ConfigError(f"{model_file.path}: encoder architecture {arch!r} is not supported "
                          "(embeddings come from decoder models only)")
    pooling = parse_pooling(asked) if asked is not None else None
    if reranking:
        if pooling not in (None, Pooling.RANK):
            raise ConfigError(f"--reranking is rank pooling; --pooling {asked} contradicts it")
        pooling = Pooling.RANK
    if pooling is None:
        pooling = pooling_from_gguf_id(model_file.get(f"{arch}.pooling_type")) or Pooling.NONE
    if pooling is Pooling.RANK and read_classifier_head(str(model_file.path)) is None:
        raise ConfigError(f"rank pooling (--reranking) needs a reranker GGUF with a classifier head "
                          f"(cls.output.weight); {model_file.path} has none")
    return pooling
