"""Context shift over HTTP: `spekula serve --context-shift` on the tiny fixture with a 48-token slot.

With it a generation goes past the context (llama-server's `truncated` is true: the context shifted);
without it the same request stops when the context is full, with finish reason "length" and `truncated`.
n_keep and n_discard outside their ranges are the client's 400 naming the field, and the server goes on.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from http_helpers import HttpServer, start

from spekula.fixtures.tiny_gguf import tiny_model_path

MODEL = tiny_model_path("llama")
N_CTX = 48
SPEC = ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "2", "--spec-ngram-simple-size-m", "4")


def _server(tmp_path_factory: pytest.TempPathFactory, *extra: str) -> Iterator[HttpServer]:
    log = tmp_path_factory.mktemp("ctx-shift") / "server.log"
    srv = start(MODEL, "-np", "1", "-c", str(N_CTX), "--temp", "0", *extra, log=log)
    try:
        yield srv
    finally:
        assert srv.stop() == 0, log.read_text()


@pytest.fixture(scope="module")
def shifting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    yield from _server(tmp_path_factory, "--context-shift", "--keep", "2", *SPEC)


@pytest.fixture(scope="module")
def stopping(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    yield from _server(tmp_path_factory, "--no-context-shift")


def test_generation_goes_past_the_context_with_context_shift(shifting: HttpServer) -> None:
    status, body = shifting.post("/completion", {"prompt": "abc abc abc", "n_predict": 120, "ignore_eos": True})
    assert status == 200, body
    assert body["tokens_predicted"] == 120 and body["truncated"] is True and body["stop_type"] == "limit"
    assert body["generation_settings"]["n_keep"] == 2  # --keep is the requests' default
    # The same request with its own n_keep and n_discard (-1: the whole prompt stays).
    status, body = shifting.post("/completion", {"prompt": "abc abc abc", "n_predict": 100, "ignore_eos": True,
                                                 "n_keep": -1, "n_discard": 7})
    assert status == 200 and body["tokens_predicted"] == 100 and body["truncated"] is True
    assert body["generation_settings"]["n_keep"] == -1 and body["generation_settings"]["n_discard"] == 7
    # A generation that ends before the context fills is not truncated.
    status, body = shifting.post("/completion", {"prompt": "abc", "n_predict": 5, "ignore_eos": True})
    assert status == 200 and body["tokens_predicted"] == 5 and body["truncated"] is False


def test_generation_stops_at_the_context_without_it(stopping: HttpServer) -> None:
    status, tok = stopping.post("/tokenize", {"content": "abc abc abc"})
    n_prompt = len(tok["tokens"])
    status, body = stopping.post("/completion", {"prompt": "abc abc abc", "n_predict": 120, "ignore_eos": True})
    assert status == 200, body
    assert body["tokens_predicted"] == N_CTX - n_prompt and body["truncated"] is True and body["stop_type"] == "limit"
    status, body = stopping.post("/v1/completions", {"prompt": "abc abc abc", "max_tokens": 120, "ignore_eos": True})
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == N_CTX - n_prompt


@pytest.mark.parametrize(("fields", "name"), [
    ({"n_keep": N_CTX + 1}, "n_keep"),  # more than the whole context
    ({"n_keep": -2}, "n_keep"),  # negative other than -1
    ({"n_keep": 1.5}, "n_keep"),
    ({"n_discard": -1}, "n_discard"),
    ({"n_discard": N_CTX + 1}, "n_discard"),
    ({"n_discard": "4"}, "n_discard"),
])
def test_bad_n_keep_and_n_discard_are_400s_and_the_server_goes_on(shifting: HttpServer, fields: dict[str, object],
                                                                  name: str) -> None:
    for path in ("/completion", "/v1/completions"):
        status, body = shifting.post(path, {"prompt": "abc", "n_predict": 4, **fields})
        assert status == 400, body
        assert name in body["error"]["message"]
    status, body = shifting.post("/completion", {"prompt": "abc", "n_predict": 4, "n_keep": N_CTX, "n_discard": N_CTX})
    assert status == 200 and body["tokens_predicted"] >= 1
