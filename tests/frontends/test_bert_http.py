"""A BERT encoder served over HTTP (the tiny BERT fixture, auto backend: torch): /v1/embeddings gives the
backend's pooled vector normalised, completions are refused as not supported, a text longer than the
position table is the caller's error; at start-up speculation on an encoder is refused."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import spekula_cmd
from http_helpers import HttpServer, running

from spekula.core.backend import BackendOptions, load_backend
from spekula.core.embedding import Pooling, normalize
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.tokenizer import Tokenizer
from spekula.fixtures.tiny_bert import N_POSITIONS

pytest.importorskip("torch")
TEXT = "the quick brown fox jumps over the lazy dog"


def _bert() -> Path:
    from spekula.fixtures.tiny_bert import tiny_bert_path

    return tiny_bert_path()


@pytest.fixture(scope="module")
def bert_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    log = tmp_path_factory.mktemp("bert") / "server.log"
    with running(_bert(), "--embedding", "-np", "2", "-c", "1024", "-b", "1024", "-t", "1", log=log) as server:
        yield server


def test_embeddings_are_the_backends_cls_vector_normalised(bert_server: HttpServer) -> None:
    ids = Tokenizer.from_gguf(GGUFFile(_bert())).encode(TEXT)
    status, body = bert_server.post("/v1/embeddings", {"input": [TEXT, TEXT]})
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] == 2 * len(ids)
    backend = load_backend("torch", str(_bert()), BackendOptions(n_ctx=128, n_seq_max=1, threads=1))
    want = normalize(backend.embed(backend.new_seq(), np.asarray(ids, np.int32), Pooling.CLS, 512), 2)
    for item in body["data"]:
        assert np.allclose(np.asarray(item["embedding"], np.float32), want, atol=1e-6)


def test_completions_are_not_supported(bert_server: HttpServer) -> None:
    for path, body in (("/completion", {"prompt": TEXT, "n_predict": 2}),
                       ("/v1/completions", {"prompt": TEXT, "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": TEXT}]})):
        status, reply = bert_server.post(path, body)
        assert status == 501, (path, reply)
        assert reply["error"]["type"] == "not_supported_error" and "encoder" in reply["error"]["message"]
    assert bert_server.post("/v1/embeddings", {"input": "still here"})[0] == 200


def test_longer_than_the_position_table(bert_server: HttpServer) -> None:
    n_words = N_POSITIONS  # with [CLS] and [SEP], two tokens more than the positions
    status, reply = bert_server.post("/v1/embeddings", {"input": "one " * n_words})
    assert status == 400 and "too large" in reply["error"]["message"]
    assert reply["error"]["n_prompt_tokens"] == n_words + 2 and reply["error"]["n_ctx"] == N_POSITIONS
    assert bert_server.post("/v1/embeddings", {"input": "still here"})[0] == 200


@pytest.mark.parametrize(("extra", "says"), [
    (("--embedding", "--spec-type", "ngram-simple"), "nothing to speculate on"),
    ((), "serve it with --embedding"),
    (("--embedding", "--backend", "native"), "encoder architecture 'bert' .* runs on the torch backend only"),
])
def test_start_up_refusals(extra: tuple[str, ...], says: str) -> None:
    res = subprocess.run([*spekula_cmd(), "serve", "-m", str(_bert()), "--port", "0", "-t", "1", *extra],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert re.search(says, res.stderr), res.stderr[-2000:]
    assert "Traceback" not in res.stderr
