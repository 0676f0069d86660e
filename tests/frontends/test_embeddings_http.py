"""Embeddings and reranking over HTTP on a real `spekula serve` process (tiny fixtures): the native
and OpenAI shapes, base64, normalisation, the input forms, rerank's Jina and TEI shapes, and the
refusals, each a 4xx after which the server goes on serving."""

from __future__ import annotations

import base64
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from http_helpers import HttpServer, running

from spekula.core.backend import BackendOptions, load_backend
from spekula.core.embedding import Pooling, normalize
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.tokenizer import Tokenizer

TEXT = "the quick brown fox jumps over the lazy dog"


def _tiny() -> Path:
    from spekula.fixtures.tiny_gguf import tiny_model_path

    return tiny_model_path("llama")


def _reference(path: Path, ids: list[int], pooling: Pooling) -> np.ndarray:
    b = load_backend("native", str(path), BackendOptions(n_ctx=128, n_seq_max=1, threads=1))
    try:
        seq = b.new_seq()
        return b.embed(seq, np.asarray(ids, np.int32), pooling, 512)
    finally:
        b.close()


def _ids(path: Path, text: str) -> list[int]:
    return Tokenizer.from_gguf(GGUFFile(str(path))).encode(text)


@pytest.fixture(scope="module")
def mean_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    log = tmp_path_factory.mktemp("embd") / "server.log"
    with running(_tiny(), "--embedding", "--pooling", "mean", "-np", "2", "-c", "64", "-t", "1", "--metrics",
                 log=log) as server:
        yield server


def _still_serves(server: HttpServer) -> None:
    status, body = server.post("/v1/embeddings", {"input": "still here"})
    assert status == 200 and len(body["data"]) == 1


def test_openai_shape_usage_and_values(mean_server: HttpServer) -> None:
    status, body = mean_server.post("/v1/embeddings", {"input": TEXT, "model": "m"})
    assert status == 200, body
    ids = _ids(_tiny(), TEXT)
    assert body["object"] == "list" and body["model"] == "m"
    assert body["usage"] == {"prompt_tokens": len(ids), "total_tokens": len(ids)}
    (item,) = body["data"]
    assert item["object"] == "embedding" and item["index"] == 0
    vec = np.asarray(item["embedding"], np.float32)
    assert abs(float(vec @ vec) - 1.0) < 1e-5  # euclidean normalisation by default
    want = normalize(_reference(_tiny(), ids, Pooling.MEAN), 2)
    assert np.array_equal(vec, want)  # the native kernels are batch-invariant: the same bits


def test_base64_round_trip(mean_server: HttpServer) -> None:
    _, floats = mean_server.post("/v1/embeddings", {"input": TEXT})
    status, body = mean_server.post("/v1/embeddings", {"input": TEXT, "encoding_format": "base64"})
    assert status == 200
    item = body["data"][0]
    assert item["encoding_format"] == "base64" and isinstance(item["embedding"], str)
    raw = base64.b64decode(item["embedding"])
    decoded = struct.unpack(f"<{len(raw) // 4}f", raw)
    assert list(decoded) == floats["data"][0]["embedding"]


def test_input_forms_give_one_vector_each(mean_server: HttpServer) -> None:
    ids = _ids(_tiny(), TEXT)
    cases: list[tuple[Any, int]] = [
        ([TEXT, "another text"], 2), (ids, 1), ([ids, ids], 2), ([TEXT, ids], 2),
        ({"prompt_string": TEXT}, 1), ([ids[:3] + ["fox"] + ids[3:5]], 1),
        ([TEXT, {"content": [{"type": "text", "text": "the quick "}, {"type": "text", "text": "brown fox"}]}], 2),
    ]
    for value, n in cases:
        status, body = mean_server.post("/v1/embeddings", {"input": value})
        assert status == 200, (value, body)
        assert [d["index"] for d in body["data"]] == list(range(n))
    _, body = mean_server.post("/v1/embeddings", {"input": [TEXT, ids]})
    assert body["data"][0]["embedding"] == body["data"][1]["embedding"]  # text and its tokens agree
    _, parts = mean_server.post("/v1/embeddings", {"input": [
        "the quick brown fox", {"content": [{"type": "text", "text": "the quick "}, {"type": "text", "text": "brown fox"}]}]})
    assert parts["data"][0]["embedding"] == parts["data"][1]["embedding"]


def test_native_shape_and_embd_normalize(mean_server: HttpServer) -> None:
    ids = _ids(_tiny(), TEXT)
    raw = _reference(_tiny(), ids, Pooling.MEAN)
    for path in ("/embedding", "/embeddings"):
        status, body = mean_server.post(path, {"content": TEXT, "embd_normalize": -1})
        assert status == 200, body
        assert isinstance(body, list) and body[0]["index"] == 0
        assert np.array_equal(np.asarray(body[0]["embedding"], np.float32), raw[None])
    _, body = mean_server.post("/v1/embeddings", {"content": TEXT, "embd_normalize": 1})  # `content`: the native shape
    assert abs(float(np.abs(np.asarray(body[0]["embedding"][0])).sum()) - 1.0) < 1e-5
    _, body = mean_server.post("/embeddings", {"input": TEXT, "embd_normalize": 0})
    assert abs(float(np.abs(np.asarray(body[0]["embedding"][0])).max()) - 32760.0) < 1e-2


@pytest.mark.parametrize("body,word", [
    ({"input": []}, "must not be empty"),
    ({"input": ""}, "cannot be empty"),
    ({"input": True}, "'input'"),
    ({"input": [TEXT, 5.5]}, "prompt"),  # a list holding a number is one prompt of text and token ids
    ({"input": {"content": "string"}}, "content parts"),
    ({"input": {"content": [{"type": "unknown"}]}}, "unsupported content part"),
    ({"input": {"content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}}, "Multimodal"),
    ({"input": "hello", "encoding_format": 1}, "float or base64"),
    ({"input": "hello", "embd_normalize": "2"}, "embd_normalize"),
    ({"input": "hello", "dimensions": 3}, "dimensions"),
    ({"input": "hello", "temperature": 1}, "unknown field"),
    ({"input": [[99999]]}, "vocabulary"),
    ({}, '"input" or "content"'),
])
def test_bad_input_is_a_400_and_the_server_goes_on(mean_server: HttpServer, body: dict[str, Any], word: str) -> None:
    status, reply = mean_server.post("/v1/embeddings", body)
    assert status == 400, reply
    assert reply["error"]["type"] == "invalid_request_error" and word in reply["error"]["message"]
    _still_serves(mean_server)


def test_too_many_tokens_for_the_context(mean_server: HttpServer) -> None:
    status, reply = mean_server.post("/v1/embeddings", {"input": [list(range(3, 70))]})
    assert status == 400 and "too large" in reply["error"]["message"]
    assert reply["error"]["type"] == "exceed_context_size_error"
    assert reply["error"]["n_prompt_tokens"] == 67 and reply["error"]["n_ctx"] == 64
    status, reply = mean_server.post("/v1/embeddings", {"input": [TEXT, list(range(3, 70)), TEXT]})
    assert status == 400 and "too large" in reply["error"]["message"]  # one bad input fails the request
    _still_serves(mean_server)


def _metric(server: HttpServer, name: str) -> float:
    status, text = server.get("/metrics")
    assert status == 200
    return float(next(ln.split()[-1] for ln in text.splitlines() if ln.startswith(f"llamacpp:{name} ")))


def test_embedding_prompts_are_counted_in_metrics(mean_server: HttpServer) -> None:
    before = {k: _metric(mean_server, k) for k in ("prompt_tokens_total", "n_decode_total", "tokens_predicted_total")}
    ids = _ids(_tiny(), TEXT)
    assert mean_server.post("/v1/embeddings", {"input": [TEXT, TEXT]})[0] == 200
    assert _metric(mean_server, "prompt_tokens_total") == before["prompt_tokens_total"] + 2 * len(ids)
    assert _metric(mean_server, "n_decode_total") == before["n_decode_total"] + 2
    assert _metric(mean_server, "tokens_predicted_total") == before["tokens_predicted_total"]


def test_completions_and_reranking_on_an_embedding_server(mean_server: HttpServer) -> None:
    status, body = mean_server.post("/completion", {"prompt": TEXT, "n_predict": 4, "temperature": 0})
    assert status == 200 and body["tokens_predicted"] == 4
    status, body = mean_server.post("/rerank", {"query": "q", "documents": ["a"]})
    assert status == 501 and "--reranking" in body["error"]["message"]


def test_pooling_none_gives_a_vector_per_token(tmp_path: Path) -> None:
    ids = _ids(_tiny(), TEXT)
    with running(_tiny(), "--embedding", "--pooling", "none", "-c", "64", "-t", "1", log=tmp_path / "log") as server:
        status, body = server.post("/embeddings", {"input": TEXT})
        assert status == 200
        rows = np.asarray(body[0]["embedding"], np.float32)
        assert rows.shape == (len(ids), 64)
        assert np.array_equal(rows, _reference(_tiny(), ids, Pooling.NONE))  # not normalised
        status, body = server.post("/v1/embeddings", {"input": TEXT})
        assert status == 400 and "not OAI compatible" in body["error"]["message"]


def test_a_server_without_embedding_refuses_them(tmp_path: Path) -> None:
    with running(_tiny(), "-c", "64", "-t", "1", log=tmp_path / "log") as server:
        for path in ("/v1/embeddings", "/embeddings", "/embedding"):
            status, body = server.post(path, {"input": "x"})
            assert status == 501 and "--embeddings" in body["error"]["message"]
        status, body = server.post("/v1/rerank", {"query": "q", "documents": ["a"]})
        assert status == 501
        status, body = server.post("/completion", {"prompt": "x", "n_predict": 2})
        assert status == 200


@pytest.fixture(scope="module")
def rerank_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    from spekula.fixtures.tiny_reranker import tiny_qwen3_reranker_path

    log = tmp_path_factory.mktemp("rerank") / "server.log"
    with running(tiny_qwen3_reranker_path(), "--reranking", "-c", "128", "-t", "1", log=log) as server:
        yield server


DOCS = ["the cat sat on the mat", "a dog ran in the park", "hello world", "the fox"]


def _scores() -> list[float]:
    """Each document's P(yes) from the backend directly, over llama-server's pair layout for a vocabulary
    adding neither BOS nor EOS: the query's tokens, then the document's."""
    from spekula.fixtures.tiny_reranker import tiny_qwen3_reranker_path

    path = tiny_qwen3_reranker_path()
    tok = Tokenizer.from_gguf(GGUFFile(str(path)))
    assert not tok.add_bos and not tok.add_eos
    b = load_backend("native", str(path), BackendOptions(n_ctx=128, n_seq_max=1, threads=1))
    try:
        seq = b.new_seq()
        return [float(b.embed(seq, np.asarray(tok.encode("the fox", add_special=False)
                                              + tok.encode(d, add_special=False), np.int32), Pooling.RANK, 512)[0])
                for d in DOCS]
    finally:
        b.close()


def test_rerank_jina_shape_sorted_and_top_n(rerank_server: HttpServer) -> None:
    want = _scores()
    for path in ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking"):
        status, body = rerank_server.post(path, {"query": "the fox", "documents": DOCS})
        assert status == 200, body
        assert body["object"] == "list" and body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
        got = {r["index"]: r["relevance_score"] for r in body["results"]}
        assert [r["index"] for r in body["results"]] == sorted(range(4), key=lambda i: -want[i])
        assert all(abs(got[i] - want[i]) < 1e-6 for i in range(4))
    _, body = rerank_server.post("/rerank", {"query": "the fox", "documents": DOCS, "top_n": 2})
    assert len(body["results"]) == 2
    _, body = rerank_server.post("/rerank", {"query": "the fox", "documents": DOCS, "top_n": 99})
    assert len(body["results"]) == 4


def test_rerank_tei_shape_with_text(rerank_server: HttpServer) -> None:
    status, body = rerank_server.post("/rerank", {"query": "the fox", "texts": DOCS, "return_text": True})
    assert status == 200 and isinstance(body, list) and len(body) == 4
    assert all(DOCS[r["index"]] == r["text"] and "score" in r for r in body)


@pytest.mark.parametrize("body,word", [
    ({"query": "q"}, "documents"), ({"query": "q", "documents": []}, "documents"),
    ({"query": "q", "documents": [1, 2, 3]}, "documents"), ({"query": "q", "documents": 123}, "documents"),
    ({"documents": ["a"]}, '"query" must be provided'), ({"query": 5, "documents": ["a"]}, "string"),
    ({"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
])
def test_bad_rerank_requests_are_400(rerank_server: HttpServer, body: dict[str, Any], word: str) -> None:
    status, reply = rerank_server.post("/rerank", body)
    assert status == 400 and word in reply["error"]["message"], reply
    status, _ = rerank_server.post("/rerank", {"query": "q", "documents": ["a"]})
    assert status == 200


def test_embeddings_on_a_reranking_server_are_refused(rerank_server: HttpServer) -> None:
    status, body = rerank_server.post("/v1/embeddings", {"input": "x"})
    assert status == 501 and "--reranking" in body["error"]["message"]
