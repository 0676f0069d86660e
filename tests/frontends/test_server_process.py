"""End to end: a real `spekula serve` process on the tiny llama fixture, over a real Unix socket."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_helpers import N_CTX, N_SLOTS, start_server, stop, wait_ready

from spekula.frontends.rpc import protocol as p
from spekula.frontends.rpc.client import RpcCallError, SpekulaClient

pytestmark = pytest.mark.timeout(300)

PROMPTS = [
    "the cat sat on the mat. the cat sat on",
    "once upon a time there was",
    "def add(a, b): return a + b\ndef",
    "hello world hello world hello",
    "a b c d e f g a b c d",
    "spekula drafts, the target verifies",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    d = tmp_path_factory.mktemp("srv")
    sock, log = str(d / "spekula.sock"), d / "server.log"
    proc = start_server(sock, "--max-line-bytes", "65536", log=log)
    try:
        wait_ready(proc, sock, log)
        yield sock
    finally:
        assert stop(proc) == 0, log.read_text()
        assert not os.path.exists(sock), "SIGTERM must remove the socket file"


@pytest.fixture(scope="module")
def references(server: str) -> dict[str, list[int]]:
    """Greedy reference per prompt: no speculation, one request at a time."""
    with SpekulaClient(server) as c:
        return {pr: c.completion(pr, n_predict=40, ignore_eos=True, return_tokens=True,
                                 speculative={"type": "none"})["tokens"] for pr in PROMPTS}


def test_socket_is_0600(server: str) -> None:
    mode = os.stat(server).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600


def test_stream_equals_non_stream(server: str) -> None:
    with SpekulaClient(server) as c:
        full = c.completion(PROMPTS[0], n_predict=40, return_tokens=True)
        stream = c.stream_completion(PROMPTS[0], n_predict=40, return_tokens=True)
        chunks = list(stream)
    assert stream.result is not None
    assert [t for ch in chunks for t in ch["tokens"]] == stream.result["tokens"] == full["tokens"]
    assert "".join(ch["content"] for ch in chunks) == stream.result["content"] == full["content"]
    assert all(len(ch["drafters"]) == len(ch["tokens"]) for ch in chunks)
    assert full["timings"]["predicted_n"] == len(full["tokens"])


def test_concurrent_clients_get_their_greedy_reference(server: str, references: dict[str, list[int]]) -> None:
    results: dict[int, Any] = {}

    def client(i: int) -> None:
        try:
            with SpekulaClient(server) as c:
                pr = PROMPTS[i % len(PROMPTS)]
                if i % 2:
                    stream = c.stream_completion(pr, n_predict=40, ignore_eos=True, return_tokens=True)
                    list(stream)
                    results[i] = stream.result
                else:
                    results[i] = c.completion(pr, n_predict=40, ignore_eos=True, return_tokens=True)
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=client, args=(i,)) for i in range(2 * len(PROMPTS))]
    for t in threads:
        t.start()
    with SpekulaClient(server) as probe:
        busy = max(probe.health()["slots_busy"] for _ in range(20))
    for t in threads:
        t.join(120)
    for i, res in results.items():
        assert not isinstance(res, Exception), res
        assert res["tokens"] == references[PROMPTS[i % len(PROMPTS)]], i
    assert len(results) == len(threads) and busy >= 1


def test_full_server_queues(server: str) -> None:
    with SpekulaClient(server) as c:
        ids = [c.start("completion", {"prompt": pr, "n_predict": 60, "ignore_eos": True}) for pr in PROMPTS]
        queued = c.call("health")["queued"]
        results = [c._wait(rid) for rid in ids]
    assert queued > 0  # 6 requests on 3 slots
    assert all(r["result"]["tokens_predicted"] == 60 for r in results)


def test_cancel_by_id_and_by_request_id(server: str) -> None:
    with SpekulaClient(server) as c:
        stream = c.stream_completion(PROMPTS[1], n_predict=200, ignore_eos=True)
        for i, _ in enumerate(stream):
            if i == 0:
                assert stream.cancel()
        assert stream.result is not None and stream.result["stop_type"] == "cancel"
        assert stream.result["tokens_predicted"] < 200
        stream = c.stream_completion(PROMPTS[2], n_predict=200, ignore_eos=True)
        it = iter(stream)
        next(it)
        with SpekulaClient(server) as other:  # another connection cannot cancel it ...
            assert not other.cancel(stream.request_id)
        assert c.cancel(stream.request_id)  # ... the one that started it can, by its engine id
        list(it)
        assert stream.result["stop_type"] == "cancel"
        assert c.completion(PROMPTS[0], n_predict=4)["tokens_predicted"] == 4


def raw_exchange(sock_path: str, payload: bytes) -> dict[str, Any]:
    s = socket.socket(socket.AF_UNIX)
    s.connect(sock_path)
    s.sendall(payload)
    s.sendall(p.encode(p.request("health", None, "after")))
    f = s.makefile("rb")
    first = json.loads(f.readline())
    after = json.loads(f.readline())
    s.close()
    assert after["id"] == "after" and after["result"]["status"] == "ok", "connection must stay usable"
    return first


def test_every_error_case_then_next_request_succeeds(server: str) -> None:
    assert raw_exchange(server, b"{oops\n")["error"]["code"] == p.PARSE_ERROR
    assert raw_exchange(server, b'{"jsonrpc":"2.0","id":1}\n')["error"]["code"] == p.INVALID_REQUEST
    assert raw_exchange(server, b'{"jsonrpc":"2.0","id":1,"method":"nope"}\n')["error"]["code"] == p.METHOD_NOT_FOUND
    err = raw_exchange(server, b'{"jsonrpc":"2.0","id":1,"method":"completion","params":{"prompt":"x","n_predict":"lots"}}\n')
    assert err["error"]["code"] == p.INVALID_PARAMS and "n_predict" in err["error"]["message"]
    big = b'{"jsonrpc":"2.0","id":1,"method":"completion","params":{"prompt":"' + b"a" * 200_000 + b'"}}\n'
    err = raw_exchange(server, big)
    assert err["error"]["code"] == p.INVALID_REQUEST and "65536" in err["error"]["message"]
    with SpekulaClient(server) as c:
        with pytest.raises(RpcCallError) as info:
            c.completion([5] * (N_CTX + 10), n_predict=4)
        assert info.value.code == p.CONTEXT_OVERFLOW
        assert c.completion(PROMPTS[0], n_predict=3)["tokens_predicted"] == 3


def test_prompt_overflow_leaves_other_slots_alone(server: str, references: dict[str, list[int]]) -> None:
    with SpekulaClient(server) as c:
        ok = c.start("completion", {"prompt": PROMPTS[3], "n_predict": 40, "ignore_eos": True, "return_tokens": True})
        bad = c.start("completion", {"prompt": "word " * 400})
        assert c._wait(bad)["error"]["code"] == p.CONTEXT_OVERFLOW
        assert c._wait(ok)["result"]["tokens"] == references[PROMPTS[3]]


def test_disconnect_mid_stream_frees_slot(server: str) -> None:
    c = SpekulaClient(server)
    next(iter(c.stream_completion(PROMPTS[4], n_predict=200, ignore_eos=True)))
    c.close()
    with SpekulaClient(server) as probe:
        deadline = time.monotonic() + 10
        while probe.health()["slots_busy"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert probe.health()["slots_busy"] == 0


def test_batch_and_introspection(server: str) -> None:
    with SpekulaClient(server) as c:
        res = c.batch([("tokenize", {"content": "the cat"}), ("slots", None), ("nope", None), ("props", None)])
        assert c.detokenize(res[0]["tokens"]) == "the cat"
        assert len(res[1]) == N_SLOTS and isinstance(res[2], RpcCallError)
        assert res[3]["n_slots"] == N_SLOTS
        stats = c.stats()
        assert "ngram-simple" in stats["drafters"] and isinstance(stats["histogram"], list)


def test_live_socket_refused_stale_replaced_sigterm_drains(server: str, tmp_path: Path) -> None:
    log = tmp_path / "second.log"
    refused = start_server(server, log=log)
    assert refused.wait(timeout=120) == 1
    assert "already listening" in log.read_text()
    stale = str(tmp_path / "stale.sock")
    s = socket.socket(socket.AF_UNIX)
    s.bind(stale)  # what a killed server leaves behind: a socket file nobody listens on
    s.close()
    log2 = tmp_path / "stale.log"
    proc = start_server(stale, log=log2)
    try:
        wait_ready(proc, stale, log2)
        c = SpekulaClient(stale)
        stream = c.stream_completion(PROMPTS[0], n_predict=60, ignore_eos=True)
        it = iter(stream)
        next(it)
        proc.send_signal(signal.SIGTERM)  # drain: the in-flight request still completes
        list(it)
        assert stream.result is not None and stream.result["tokens_predicted"] == 60
        c.close()
        assert proc.wait(timeout=60) == 0, log2.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not os.path.exists(stale)
    assert "draining 1 in-flight request" in log2.read_text()
