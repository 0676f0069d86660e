"""Hostile HTTP clients against a real `spekula serve --port 0 --socket S` process (and the app in-process
where a failure has to be staged): nothing a client sends, and no way it holds a connection, may stall,
bloat or crash the server, and every error it gets is JSON in the API's own shape.

The cases are those of issue #45's probe: a lone UTF-16 surrogate anywhere in a request, a tokenize of
tens of megabytes, a body that takes seconds to parse, slowloris headers, stalled bodies, idle
connections past the cap, a client that leaves mid-upload, and on the socket a surrogate, a `cancel`
with a list as id and pipelined tokenizes that are never read. The server starts with short timeouts
and a small connection cap so every case stays quick; the last test checks that the greedy answer
taken first is unchanged.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import pytest
from http_helpers import HttpServer, start
from server_helpers import rss_mb

from spekula.core.events import FinalEvent, PieceEvent
from spekula.fixtures.tiny_gguf import tiny_model_path
from spekula.frontends.http.app import build_app
from spekula.frontends.http.fields import HttpOptions
from spekula.frontends.http.generation import EventStream, Generation
from spekula.frontends.http.state import HttpState
from spekula.frontends.rpc import protocol as p
from spekula.frontends.rpc.client import RpcCallError, SpekulaClient
from spekula.frontends.schema.tokenize_limits import MAX_TOKENIZE_CHARS, MAX_TOKENIZE_PIECES

pytestmark = pytest.mark.timeout(300)
GREEDY = {"prompt": "The quick brown fox", "n_predict": 12, "temperature": 0}
LONE = "\ud800"


class Served:
    def __init__(self, http: HttpServer, sock: str) -> None:
        self.http, self.sock = http, sock
        self.reference = ""

    def alive(self) -> bool:
        if self.http.proc.poll() is not None:
            return False
        with SpekulaClient(self.sock, timeout=30) as c:
            ok = c.health()["status"] == "ok"
        return ok and self.http.get("/health", timeout=30) == (200, {"status": "ok"})


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("hostile_http")
    sock = str(tmp / "s.sock")
    http = start(tiny_model_path("llama"), "-np", "2", "-c", "256", "--temp", "0", "--socket", sock,
                 "--header-timeout", "1", "--body-timeout", "1", "--max-connections", "12", "--write-timeout", "5",
                 log=tmp / "server.log")
    srv = Served(http, sock)
    try:
        status, out = http.post("/completion", GREEDY)
        assert status == 200, out
        srv.reference = out["content"]
        yield srv
    finally:
        assert http.stop() == 0, http.log.read_text()
        assert "Traceback" not in http.log.read_text(), http.log.read_text()


def raw_http(port: int, data: bytes, *, timeout: float = 10) -> bytes:
    """Send raw bytes, read until the server closes or `timeout`."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(1 << 16):
                out += chunk
        except TimeoutError:
            pass
        return out


def status_and_json(reply: bytes) -> tuple[int, Any]:
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


# -- text that is not Unicode ------------------------------------------------------------------------


def _chat(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


@pytest.mark.parametrize("path, body, field", [
    ("/completion", {"prompt": LONE, "n_predict": 2}, "'prompt'"),
    ("/completion", {"prompt": "hi", "n_predict": 2, "stop": ["ok", "x" + LONE]}, "'stop[1]'"),
    ("/completion", {"prompt": "hi", LONE: 1}, "a field name"),
    ("/v1/completions", {"prompt": ["a", LONE], "max_tokens": 2}, "'prompt[1]'"),
    ("/v1/chat/completions", {"messages": _chat("a" + LONE), "max_tokens": 2}, "'messages[0].content'"),
    ("/v1/chat/completions", {"messages": _chat("hi"), "max_tokens": 2, "stop": LONE}, "'stop'"),
    ("/tokenize", {"content": LONE}, "'content'"),
    ("/detokenize", {"tokens": [1], "x": {LONE: 1}}, "a field name in 'x'"),
])
def test_lone_surrogates_are_400_naming_the_field(served: Served, path: str, body: dict[str, Any], field: str) -> None:
    status, err = served.http.post(path, body)
    assert status == 400 and err["error"]["type"] == "invalid_request_error", err
    assert field in err["error"]["message"] and "Unicode" in err["error"]["message"]


@pytest.mark.parametrize("body", [
    {"model": "m", "max_tokens": 2, "messages": _chat(LONE)},
    {"model": "m", "max_tokens": 2, "messages": _chat("hi"), "stop_sequences": [LONE], "stream": True},
])
def test_lone_surrogates_on_anthropic_paths_are_anthropic_errors(served: Served, body: dict[str, Any]) -> None:
    status, err = served.http.post("/v1/messages", body)
    assert status == 400 and err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
    assert "Unicode" in err["error"]["message"]


def test_a_paired_surrogate_escape_is_ordinary_text(served: Served) -> None:
    status, out = served.http.post("/tokenize", {"content": "smile \U0001f600"})  # json.dumps escapes it as a pair
    assert status == 200 and out["tokens"]


def test_socket_refuses_lone_surrogates_and_bad_cancel_ids_as_invalid_params(served: Served) -> None:
    with SpekulaClient(served.sock, timeout=30) as c:
        for method, params, field in [("completion", {"prompt": "hi", "stop": [LONE]}, "params.stop[0]"),
                                      ("tokenize", {"content": LONE}, "params.content"),
                                      ("chat.completion", {"messages": _chat(LONE)}, "params.messages[0].content")]:
            with pytest.raises(RpcCallError) as err:
                c.call(method, params)
            assert err.value.code == p.INVALID_PARAMS and field in err.value.message
        with pytest.raises(RpcCallError) as err:
            c.call("cancel", {"id": [1, 2]})
        assert err.value.code == p.INVALID_PARAMS and "'id'" in err.value.message


# -- sizes ------------------------------------------------------------------------------------------


def test_tokenize_over_its_limits_is_413_and_memory_returns(served: Served) -> None:
    pid = served.http.proc.pid
    before = rss_mb(pid)
    status, err = served.http.post("/tokenize", {"content": "z" * (MAX_TOKENIZE_CHARS + 1)})
    assert status == 413 and err["error"]["type"] == "payload_too_large_error" and "'content'" in err["error"]["message"]
    status, err = served.http.post("/tokenize", {"content": "a b " * (MAX_TOKENIZE_PIECES // 2 + 10),
                                                 "with_pieces": True})
    assert status == 413 and "with_pieces" in err["error"]["message"], err
    status, out = served.http.post("/tokenize", {"content": "word " * 400_000})  # 2 MB: served
    assert status == 200 and len(out["tokens"]) >= 400_000
    del out
    time.sleep(1.5)  # one trim per second at most: the last request's may have been skipped
    served.http.post("/tokenize", {"content": "x" * 2_000_000})
    grown = rss_mb(pid) - before
    assert grown < 100, f"the server stayed {grown:.0f} MB above its floor after large tokenizes"


@pytest.mark.parametrize("raw", [b"GARBAGE\r\n\r\n", b"GET / HTTP/1.1\r\nBad Header\r\n\r\n",
                                 b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n"])
def test_requests_http_cannot_parse_are_a_json_400(served: Served, raw: bytes) -> None:
    status, err = status_and_json(raw_http(served.http.port, raw))
    assert status == 400 and err["error"]["type"] == "invalid_request_error"


def test_a_body_over_the_limit_is_413(served: Served) -> None:
    head = (b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 99999999999\r\n\r\n")
    status, err = status_and_json(raw_http(served.http.port, head + b"{"))
    assert status == 413 and err["error"]["type"] == "payload_too_large_error"


def test_pipelined_tokenizes_never_read_do_not_grow_the_socket_server(served: Served) -> None:
    pid = served.http.proc.pid
    before = rss_mb(pid)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(served.sock)
    s.settimeout(0.5)
    text = "hello world " * 4500  # 54 KB
    sent = 0
    try:
        for i in range(300):
            s.sendall(p.encode(p.request("tokenize", {"content": text, "with_pieces": True}, i + 1)))
            sent += 1
    except (TimeoutError, BlockingIOError, OSError):
        pass  # the server stopped reading us
    time.sleep(3.0)
    grown = rss_mb(pid) - before
    s.close()
    assert grown < 120, f"a client pipelining {sent} tokenizes grew the server by {grown:.0f} MB"
    assert served.alive()


# -- the event loop stays free ----------------------------------------------------------------------


def test_a_body_that_takes_seconds_to_parse_does_not_stall_health(served: Served) -> None:
    body = b'{"prompt": [' + b"1," * 3_000_000 + b'1], "n_predict": 1}'
    done: dict[str, Any] = {}

    def big() -> None:
        done["reply"] = served.http.post("/completion", None, raw=body)

    t = threading.Thread(target=big)
    t.start()
    worst = 0.0
    time.sleep(0.2)
    while t.is_alive():
        t0 = time.monotonic()
        assert served.http.get("/health", timeout=30)[0] == 200
        worst = max(worst, time.monotonic() - t0)
        time.sleep(0.05)
    t.join()
    status, err = done["reply"]
    assert status == 400 and err["error"]["type"] == "exceed_context_size_error", err
    assert worst < 0.5, f"/health waited {worst:.2f} s behind a large body"


# -- slow and numerous clients ----------------------------------------------------------------------


def test_slowloris_headers_are_cut_off(served: Served) -> None:
    s = socket.create_connection(("127.0.0.1", served.http.port), timeout=5)
    t0 = time.monotonic()
    closed = False
    try:
        s.sendall(b"GET /health HTTP/1.1\r\n")
        for i in range(30):  # a header line every 0.2 s: never a complete head
            time.sleep(0.2)
            s.sendall(b"X-%d: y\r\n" % i)
    except OSError:
        closed = True
    if not closed:
        closed = s.recv(1024) == b""
    s.close()
    assert closed and time.monotonic() - t0 < 4


def test_a_stalled_body_is_408_in_json(served: Served) -> None:
    head = b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    t0 = time.monotonic()
    status, err = status_and_json(raw_http(served.http.port, head + b'{"prompt":', timeout=5))
    assert status == 408 and err["error"]["type"] == "timeout_error"
    assert time.monotonic() - t0 < 4


def test_a_stalled_anthropic_body_is_an_anthropic_408(served: Served) -> None:
    head = b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    status, err = status_and_json(raw_http(served.http.port, head + b"{", timeout=5))
    assert status == 408 and err == {"type": "error", "error": {"type": "timeout_error", "message": err["error"]["message"]}}


def test_connections_over_the_cap_get_503_and_are_closed(served: Served) -> None:
    idle = [socket.create_connection(("127.0.0.1", served.http.port), timeout=5) for _ in range(12)]
    try:
        time.sleep(0.2)
        status, err = status_and_json(raw_http(served.http.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"))
        assert status == 503 and "too many connections" in err["error"]["message"]
    finally:
        for s in idle:
            s.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the closed ones are gone at once, the rest within a second
        try:
            if served.http.get("/health", timeout=5)[0] == 200:
                break
        except OSError:
            pass
        time.sleep(0.1)
    assert served.alive()


def test_a_client_that_leaves_mid_upload_is_one_info_line(served: Served) -> None:
    start_at = len(served.http.log.read_text())
    for _ in range(3):
        s = socket.create_connection(("127.0.0.1", served.http.port), timeout=5)
        s.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n" + b"{" * 5000)
        s.close()
    time.sleep(0.5)
    assert served.alive()
    new = served.http.log.read_text()[start_at:]
    assert "Traceback" not in new and "ERROR" not in new, new


# -- failures the server must still answer in JSON (staged in-process) ------------------------------


async def _asgi(app: Any, method: str, path: str, body: bytes | None) -> tuple[int, bytes]:
    out: dict[str, Any] = {"status": 0, "body": b""}
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent and body is not None:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await anyio.sleep_forever()  # a body that never comes (body is None), or no disconnect
        raise AssertionError

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            out["status"] = message["status"]
        elif message["type"] == "http.response.body":
            out["body"] += message.get("body", b"")

    scope = {"type": "http", "method": method, "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": [(b"content-type", b"application/json")], "http_version": "1.1", "scheme": "http",
             "server": ("t", 80), "client": ("c", 1), "root_path": ""}
    await app(scope, receive, send)
    return out["status"], out["body"]


class _Broken:
    """An engine every use of which fails: what an internal error looks like to the routes."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"broken engine: {name}")


@pytest.mark.anyio
async def test_internal_errors_are_json_in_the_apis_shape() -> None:
    state = HttpState()
    state.attach(_Broken(), None)  # type: ignore[arg-type]
    app = build_app(state)
    status, body = await _asgi(app, "GET", "/props", b"")
    assert status == 500 and json.loads(body) == {"error": {"code": 500, "message": "internal server error",
                                                            "type": "server_error"}}
    status, body = await _asgi(app, "POST", "/v1/messages", b'{"model": "m", "max_tokens": 1, "messages": []}')
    assert status == 500 and json.loads(body) == {"type": "error", "error": {"type": "api_error",
                                                                             "message": "internal server error"}}


@pytest.mark.anyio
async def test_a_body_that_never_comes_is_408() -> None:
    state = HttpState(body_timeout=0.2)
    state.attach(_Broken(), None)  # type: ignore[arg-type]
    status, body = await _asgi(build_app(state), "POST", "/tokenize", None)
    assert status == 408 and json.loads(body)["error"]["type"] == "timeout_error"


class _Handle:
    async def _events(self) -> AsyncIterator[Any]:
        yield PieceEvent(request_id="r", tokens=[1], text="a", drafters=[None], slot=0)
        yield FinalEvent(request_id="r", content="a", tokens=[1, 2], stop_type="limit")

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._events()

    def cancel(self) -> None:
        pass


class _Service:
    write_timeout = 5.0

    def __init__(self) -> None:
        self.engine = self

    def submit(self, request: object, session: object = None) -> _Handle:
        return _Handle()

    def checked(self, gen: object, final: FinalEvent) -> FinalEvent:
        return final


@pytest.mark.anyio
@pytest.mark.parametrize("path, last", [
    ("/completion", b'data: {"error":{"code":500,"message":"internal server error","type":"server_error"}}\n\n'),
    ("/v1/messages", b'event: error\ndata: {"type":"error","error":{"type":"api_error",'
                     b'"message":"internal server error"}}\n\n'),
])
async def test_a_failure_inside_a_stream_ends_it_with_an_error_event(path: str, last: bytes) -> None:
    def shape(event: Any) -> list[Any]:
        if isinstance(event, FinalEvent):
            raise ValueError("the final chunk cannot be shaped")
        return [{"content": event.text}]

    gen = Generation(request=None, options=HttpOptions(), prompt_text=None)  # type: ignore[arg-type]
    stream = EventStream(_Service(), gen, shape, done_marker=True)  # type: ignore[arg-type]
    status, body = await _asgi(stream, "POST", path, b"")
    assert status == 200 and body.startswith(b'data: {"content":"a"}\n\n') and body.endswith(last), body
    assert b"[DONE]" not in body


def test_running_out_of_descriptors_while_accepting_is_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    """asyncio pauses accepting for a second on EMFILE (as the socket server does); it is one line."""
    import asyncio
    import errno
    import logging

    from spekula.frontends.loop_errors import quiet_late_socket_wakeups

    async def main() -> None:
        quiet_late_socket_wakeups()
        asyncio.get_running_loop().call_exception_handler({
            "message": "socket.accept() out of system resource",
            "exception": OSError(errno.EMFILE, "Too many open files")})

    with caplog.at_level(logging.DEBUG):
        asyncio.run(main())
    assert [(r.levelno, r.getMessage()) for r in caplog.records if r.levelno >= logging.WARNING] == [
        (logging.WARNING, "accept paused 1 s: Too many open files")]


def test_a_pre_encoded_result_frames_as_the_same_json() -> None:
    result = {"tokens": [{"id": 1, "piece": "a\u00e9"}]}
    pre = p.EncodedResult(p.dumps(result))
    assert json.loads(p.encode(p.response(7, pre))) == p.response(7, result)
    assert json.loads(p.encode([p.response(1, pre), p.response(2, 3)])) == [p.response(1, result), p.response(2, 3)]


# -- last: nothing above changed what the server computes ------------------------------------------


def test_greedy_answer_unchanged_after_everything(served: Served) -> None:
    assert served.alive()
    status, out = served.http.post("/completion", GREEDY)
    assert status == 200 and out["content"] == served.reference
    with SpekulaClient(served.sock, timeout=60) as c:
        assert c.completion(GREEDY["prompt"], n_predict=12, temperature=0)["content"] == served.reference
