"""The HTTP half of bench/soak.py: valid and hostile HTTP clients and a /health prober, against the
same `spekula serve --port 0 --socket S` process the socket clients use.

Valid clients send greedy /completion requests (streamed or not) and check the tokens against the
reference. Hostile clients send the cases of issue #45: lone surrogates on every endpoint, an
over-limit tokenize, a body of a million token ids, malformed JSON, slowloris headers, a stalled body,
a burst of idle connections, a client that leaves mid-upload; on the socket, a lone surrogate, a
`cancel` with a list as id and pipelined tokenizes with pieces that are never read. Every error reply
must be JSON with the expected status (or code): anything else counts as a wrong answer. The prober
times GET /health on a fresh connection every quarter second.
"""

from __future__ import annotations

import http.client
import json
import random
import socket
import threading
import time
from typing import Any, Protocol

from spekula.frontends.rpc import protocol as p

LONE = "\ud800"


class Tally(Protocol):
    def add(self, **kw: Any) -> None: ...


def call(port: int, method: str, path: str, body: bytes | None = None, timeout: float = 300) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _tokens_of_stream(data: bytes) -> list[int]:
    out: list[int] = []
    for block in data.split(b"\n\n"):
        if block.startswith(b"data: ") and block != b"data: [DONE]":
            out += json.loads(block[6:]).get("tokens", [])
    return out


def valid_http_client(port: int, refs: dict[str, list[int]], prompts: list[str], deadline: float, tally: Tally,
                      seed: int, n: int) -> None:
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        prompt = rng.choice(prompts)
        stream = rng.random() < 0.5
        body = {"prompt": prompt, "n_predict": n, "return_tokens": True, "temperature": 0, "stream": stream,
                "speculative": rng.choice([{"type": "none"}, {"type": "ngram-mod"}])}
        try:
            status, data = call(port, "POST", "/completion", json.dumps(body).encode())
        except OSError as exc:
            tally.add(lost=[f"HTTP {type(exc).__name__}: {exc}"])
            continue
        if status != 200:
            tally.add(lost=[f"HTTP {status}: {data[:200]!r}"])
            continue
        tokens = _tokens_of_stream(data) if stream else json.loads(data)["tokens"]
        tally.add(served=1, mismatch=int(tokens != refs[prompt]))


def _json_error(status: int, data: bytes, want: set[int]) -> str:
    """'' when the reply is a JSON error with one of the wanted statuses, else what is wrong."""
    try:
        body = json.loads(data)
    except ValueError:
        return f"status {status}, not JSON: {data[:120]!r}"
    if status not in want or "error" not in body:
        return f"status {status} (wanted {sorted(want)}): {data[:120]!r}"
    return ""


_CHAT = [{"role": "user", "content": "a" + LONE}]
HOSTILE_REQUESTS: list[tuple[str, bytes, set[int]]] = [
    ("/completion", json.dumps({"prompt": LONE, "n_predict": 4}).encode(), {400}),
    ("/completion", json.dumps({"prompt": "hi", "n_predict": 4, "stop": [LONE]}).encode(), {400}),
    ("/v1/completions", json.dumps({"prompt": "hi", LONE: 1}).encode(), {400}),
    ("/v1/chat/completions", json.dumps({"messages": _CHAT, "max_tokens": 4}).encode(), {400}),
    ("/v1/messages", json.dumps({"model": "m", "max_tokens": 4, "messages": _CHAT}).encode(), {400}),
    ("/tokenize", json.dumps({"content": LONE}).encode(), {400}),
    ("/tokenize", b'{"content":"' + b"z" * (9 * 1024 * 1024) + b'"}', {413}),
    ("/completion", b'{"prompt":[' + b"1," * 1_000_000 + b'1],"n_predict":1}', {400}),
    ("/completion", b'{"prompt":"x","logit_bias":[' + b"[1,0.5]," * 300_000 + b'[1,0.5]]}', {400}),
    ("/completion", b'{"prompt": "x", "n_predict": ' + b"9" * 5000 + b"}", {400}),
    ("/completion", b"[" * 5000, {400}),
    ("/v1/chat/completions", b"\xff\xfe not json", {400}),
]


def _slowloris(port: int, seconds: float) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"GET /health HTTP/1.1\r\n")
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            time.sleep(0.5)
            s.sendall(b"X-Slow: 1\r\n")  # raises once the server has closed it


def _stalled_body(port: int, timeout: float) -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"prompt\":")
        data = b""
        while chunk := s.recv(1 << 16):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def _idle_burst(port: int, n: int, hold: float) -> None:
    conns = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(n)]
    time.sleep(hold)
    for c in conns:
        c.close()


def _leave_mid_upload(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n" + b"[" * 4000)


def _socket_lines(sock: str, lines: list[bytes], timeout: float = 30) -> list[dict[str, Any]]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(sock)
    try:
        s.sendall(b"".join(lines))
        s.shutdown(socket.SHUT_WR)
        buf = b""
        while chunk := s.recv(1 << 16):
            buf += chunk
        return [json.loads(line) for line in buf.splitlines()]
    finally:
        s.close()


def _pipelined_tokenizes_unread(sock: str) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(0.5)
    s.connect(sock)
    line = p.encode(p.request("tokenize", {"content": "hello world " * 4500, "with_pieces": True}, 1))
    try:
        for _ in range(300):
            s.sendall(line)
    except OSError:
        pass  # the server stopped reading this client: the backpressure
    time.sleep(1.0)
    s.close()


def hostile_http_client(port: int, sock: str, header_timeout: float, deadline: float, tally: Tally,
                        seed: int) -> None:
    rng = random.Random(seed)
    # First the largest bodies, twice, and the unread pipelined tokenizes: they set the allocator's
    # high-water mark (objects that outlive them pin the pages they freed), which the soak's warm-up
    # must see before its first RSS sample, as it sees the socket's oversized lines.
    big = [r for r in HOSTILE_REQUESTS if len(r[1]) > 1 << 20]
    first: list[tuple[int, tuple[str, bytes, set[int]] | None]] = [(0, r) for r in big * 2] + [(7, None)]
    while time.monotonic() < deadline:
        kind, request = first.pop(0) if first else (rng.randrange(8), None)
        wrong = ""
        try:
            if kind <= 1:
                path, body, want = request or rng.choice(HOSTILE_REQUESTS)
                status, data = call(port, "POST", path, body, timeout=120)
                wrong = _json_error(status, data, want)
            elif kind == 2:
                try:
                    _slowloris(port, header_timeout + 2)
                    wrong = f"slowloris connection still open after {header_timeout + 2:g} s"
                except OSError:
                    pass  # closed by the server: as it should be
            elif kind == 3:
                status, data = _stalled_body(port, timeout=60)
                wrong = _json_error(status, data, {408})
            elif kind == 4:
                _idle_burst(port, 20, 1.0)
            elif kind == 5:
                _leave_mid_upload(port)
            elif kind == 6:
                replies = _socket_lines(sock, [
                    p.encode(p.request("completion", {"prompt": "hi", "stop": [LONE]}, 1)),
                    p.encode(p.request("cancel", {"id": [1, 2]}, 2))])
                codes = [r.get("error", {}).get("code") for r in replies]
                if codes != [p.INVALID_PARAMS, p.INVALID_PARAMS]:
                    wrong = f"socket: surrogate / list id answered {codes}"
            else:
                _pipelined_tokenizes_unread(sock)
        except (OSError, ValueError) as exc:
            if kind in (0, 1, 3, 6):  # these expect a reply
                wrong = f"kind {kind}: {type(exc).__name__}: {exc}"
        if wrong:
            tally.add(bad_errors=[wrong])
        tally.add(hostile=1)
        time.sleep(rng.random() * 0.2)


def health_prober(port: int, deadline: float, latencies: list[float], failures: list[str]) -> None:
    while time.monotonic() < deadline:
        t0 = time.monotonic()
        try:
            status, _ = call(port, "GET", "/health", timeout=30)
            if status != 200:
                failures.append(f"status {status}")
        except OSError as exc:
            failures.append(f"{type(exc).__name__}: {exc}")
        latencies.append(time.monotonic() - t0)
        time.sleep(0.25)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def start_threads(port: int, sock: str, refs: dict[str, list[int]], prompts: list[str], deadline: float,
                  tally: Tally, *, valid: int, hostile: int, n: int, header_timeout: float,
                  latencies: list[float], failures: list[str]) -> list[threading.Thread]:
    threads = [threading.Thread(target=valid_http_client, args=(port, refs, prompts, deadline, tally, 500 + i, n))
               for i in range(valid)]
    threads += [threading.Thread(target=hostile_http_client, args=(port, sock, header_timeout, deadline, tally, 2000 + i))
                for i in range(hostile)]
    threads.append(threading.Thread(target=health_prober, args=(port, deadline, latencies, failures)))
    for t in threads:
        t.start()
    return threads
