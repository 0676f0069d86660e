"""Which pooling a server with `--embedding` / `--reranking` runs, decided from its options and the
model file before any weights load.

As in llama-server: an explicit `--pooling` wins, else the file's `{arch}.pooling_type`, else none (a
vector per token, which the OpenAI endpoint refuses); `--reranking` is `--embedding --pooling rank`.
Rank pooling needs a reranker file (backends/gguf/classifier.py) and is refused otherwise. An encoder
(``bert``, backends/gguf/encoder.py) computes embeddings only: it needs --embedding, has no rank pooling
here, and llama.cpp's other encoder architectures are refused by name.
"""

from __future__ import annotations

import argparse

from spekula.backends.gguf.classifier import read_classifier_head
from spekula.backends.gguf.encoder import is_encoder, read_encoder_hparams
from spekula.core.embedding import Pooling, parse_pooling, pooling_from_gguf_id
from spekula.core.errors import ConfigError
from spekula.core.modelfile.gguf_file import GGUFFile


def serving_pooling(args: argparse.Namespace, model_file: GGUFFile) -> Pooling | None:
    """The engine's pooling, or None when the server serves no embeddings."""
    embedding = bool(getattr(args, "embedding", False))
    reranking = bool(getattr(args, "reranking", False))
    asked = getattr(args, "pooling", None)
    arch = model_file.architecture
    encoder = is_encoder(model_file)
    if encoder:
        read_encoder_hparams(model_file)  # an encoder spekula does not build is refused by name, here
    if not (embedding or reranking):
        if asked is not None:
            raise ConfigError("--pooling needs --embedding (or --reranking)")
        if encoder:
            raise ConfigError(f"{model_file.path}: {arch!r} is an encoder model, which computes embeddings only: "
                              "serve it with --embedding")
        return None
    pooling = parse_pooling(asked) if asked is not None else None
    if encoder and (reranking or pooling is Pooling.RANK):
        raise ConfigError(f"rank pooling (--reranking) is not supported on {arch!r} encoders")
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
