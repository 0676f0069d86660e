"""The socket server in-process (fake engine, real Unix socket): file lifecycle, drain, clients.

End-to-end tests against a real `spekula serve` process live in test_server_process.py.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import pytest
import rpc_fakes as fakes

from spekula.frontends.rpc import protocol as p
from spekula.frontends.rpc.client import AsyncSpekulaClient, RpcCallError, SpekulaClient
from spekula.frontends.rpc.methods import SpekulaMethods
from spekula.frontends.rpc.server import RpcServer, ServerConfig, SocketInUseError, prepare_socket_path


@contextmanager
def running_server(path: str, engine: Any = None, **cfg: Any) -> Iterator[RpcServer]:
    engine = engine or fakes.FakeEngine()
    server = RpcServer(engine, ServerConfig(path, handle_signals=False, **cfg),
                       lambda srv: SpekulaMethods(engine, server_state=srv.state).table())
    with anyio.from_thread.start_blocking_portal() as portal:
        future, _ = portal.start_task(server.serve)
        try:
            yield server
        finally:
            portal.call(server.shutdown)
            future.result(timeout=10)


@pytest.fixture
def sock_path(tmp_path: Path) -> str:
    return str(tmp_path / "s.sock")


def test_socket_is_owner_only_and_removed_on_shutdown(sock_path: str) -> None:
    with running_server(sock_path):
        mode = os.stat(sock_path).st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
        with SpekulaClient(sock_path) as c:
            assert c.health()["status"] == "ok"
    assert not os.path.exists(sock_path)


def test_stale_socket_replaced_live_refused_other_file_kept(sock_path: str, tmp_path: Path) -> None:
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(sock_path)  # bound but never listening, then closed: what a killed server leaves
    stale.close()
    with running_server(sock_path), SpekulaClient(sock_path) as c:
        assert c.health()["status"] == "ok"
        with pytest.raises(SocketInUseError, match="already listening"):
            prepare_socket_path(sock_path)
    regular = tmp_path / "not-a-socket"
    regular.write_text("keep me")
    with pytest.raises(SocketInUseError, match="not a socket"):
        prepare_socket_path(str(regular))
    assert regular.read_text() == "keep me"


def test_socket_file_appears_only_once_it_listens(sock_path: str, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Clients wait for the file, then connect: the file must never exist before listen() (anyio binds in
    a worker thread and listens later, a window a loaded machine widens), and a file that another server
    put there meanwhile is neither replaced nor removed."""
    from spekula.frontends.rpc import server as server_mod

    real = anyio.create_unix_listener
    seen: list[bool] = []

    async def listening_then_check(path: str, **kw: Any) -> Any:
        listener = await real(path, **kw)
        seen.append(os.path.exists(sock_path))
        return listener

    monkeypatch.setattr(server_mod.anyio, "create_unix_listener", listening_then_check)
    with running_server(sock_path), SpekulaClient(sock_path) as c:
        assert c.health()["status"] == "ok"
        assert stat.S_IMODE(os.stat(sock_path).st_mode) == 0o600
    assert seen == [False]
    assert sorted(os.listdir(tmp_path)) == []  # no staging name left behind

    async def another_server_meanwhile(path: str, **kw: Any) -> Any:
        listener = await real(path, **kw)
        Path(sock_path).write_text("someone else's")
        return listener

    monkeypatch.setattr(server_mod.anyio, "create_unix_listener", another_server_meanwhile)
    with pytest.raises(SocketInUseError, match="appeared while"):
        anyio.run(server_mod.create_listener, sock_path)
    assert Path(sock_path).read_text() == "someone else's"
    assert os.listdir(tmp_path) == ["s.sock"]


def test_sync_client_methods_stream_cancel_and_errors(sock_path: str) -> None:
    with running_server(sock_path, fakes.FakeEngine(round_delay=0.02)), SpekulaClient(sock_path) as c:
        full = c.completion("hello", n_predict=12, return_tokens=True)
        assert full["content"] == fakes.expected_text("hello", 12)
        stream = c.stream_completion("hello", n_predict=12)
        chunks = list(stream)
        assert "".join(ch["content"] for ch in chunks) == full["content"] == stream.result["content"]
        chat = c.chat([{"role": "user", "content": "x"}], n_predict=3)
        assert chat["message"]["content"] == chat["content"]
        assert c.detokenize(c.tokenize("abc")) == "abc"
        assert {"drafters", "server"} <= set(c.stats())
        assert len(c.slots()) == 2 and "model" in c.props()
        with pytest.raises(RpcCallError) as info:
            c.completion("x", top_k=1.5)
        assert info.value.code == p.INVALID_PARAMS and "top_k" in info.value.message
        long = c.stream_completion("abc", n_predict=100_000)
        for i, _chunk in enumerate(long):
            if i == 2:
                assert long.cancel()
        assert long.result["stop_type"] == "cancel"
        results = c.batch([("health", None), ("nope", None)])
        assert results[0]["status"] == "ok" and isinstance(results[1], RpcCallError)


def test_oversized_line_over_socket_then_next_request_works(sock_path: str) -> None:
    with running_server(sock_path, max_line_bytes=64 * 1024):
        s = socket.socket(socket.AF_UNIX)
        s.connect(sock_path)
        s.sendall(b'{"jsonrpc":"2.0","id":1,"method":"health","params":{"x":"' + b"y" * 500_000 + b'"}}\n')
        s.sendall(p.encode(p.request("health", None, 2)))
        f = s.makefile("rb")
        first, second = json.loads(f.readline()), json.loads(f.readline())
        assert first["error"]["code"] == p.INVALID_REQUEST and first["id"] is None
        assert second["id"] == 2 and second["result"]["status"] == "ok"
        s.close()


def test_oversized_line_is_answered_to_a_peer_that_half_closed(sock_path: str) -> None:
    # A half-closed peer gets every pending reply; the oversized line's error was once left unanswered
    # when the end of the stream came before it was written.
    with running_server(sock_path, max_line_bytes=64 * 1024):
        for _ in range(3):
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(30)
            s.connect(sock_path)
            s.sendall(b'{"x":"' + b"y" * 500_000 + b'"}\n')
            s.shutdown(socket.SHUT_WR)
            reply = json.loads(s.makefile("rb").readline())
            assert reply["error"]["code"] == p.INVALID_REQUEST and reply["id"] is None
            s.close()


def test_async_client_concurrent_requests_on_all_slots_and_queue(sock_path: str) -> None:
    engine = fakes.FakeEngine(round_delay=0.01)
    prompts = [f"prompt number {i}" for i in range(6)]

    async def body() -> None:
        async with AsyncSpekulaClient.connect(sock_path) as c:
            results: dict[int, dict[str, Any]] = {}
            saw_queue: list[int] = []

            async def one(i: int) -> None:
                if i % 2:
                    results[i] = await c.completion(prompts[i], n_predict=40)
                else:
                    stream = c.stream_completion(prompts[i], n_predict=40)
                    text = "".join([ch["content"] async for ch in stream])
                    assert stream.result is not None and text == stream.result["content"]
                    results[i] = stream.result

            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
                await anyio.sleep(0.05)
                saw_queue.append((await c.health())["queued"])
            assert {i: r["content"] for i, r in results.items()} == {
                i: fakes.expected_text(pr, 40) for i, pr in enumerate(prompts)}
            assert saw_queue[0] > 0  # 6 requests on 2 slots: some waited

    with running_server(sock_path, engine):
        anyio.run(body)


def test_disconnect_mid_stream_frees_the_slot(sock_path: str) -> None:
    engine = fakes.FakeEngine(round_delay=0.02)
    with running_server(sock_path, engine):
        c = SpekulaClient(sock_path)
        next(iter(c.stream_completion("abc", n_predict=100_000)))
        c.close()
        with SpekulaClient(sock_path) as probe:
            for _ in range(100):
                if probe.health()["slots_busy"] == 0:
                    break
                threading.Event().wait(0.02)
            assert probe.health()["slots_busy"] == 0
        assert engine.finished[-1].stop_type == "cancel"


def test_shutdown_drains_in_flight_requests(sock_path: str) -> None:
    engine = fakes.FakeEngine(round_delay=0.02)
    server_cm = running_server(sock_path, engine)
    server = server_cm.__enter__()
    c = SpekulaClient(sock_path)
    stream = c.stream_completion("drain", n_predict=60)
    it = iter(stream)
    next(it)
    # The main thread has no portal handle here; setting the Event from the loop thread is done by
    # the context manager's exit, so run it in a helper thread while we keep reading.
    closer = threading.Thread(target=server_cm.__exit__, args=(None, None, None))
    closer.start()
    rest = list(it)
    closer.join(10)
    assert stream.result is not None and stream.result["stop_type"] == "limit"
    assert len(stream.result["content"]) == 60 and rest
    assert not os.path.exists(sock_path) and server.tracker.in_flight == 0
    c.close()


def test_unusable_socket_paths_are_clear_errors(tmp_path: Path) -> None:
    from spekula.core.errors import ConfigError
    from spekula.frontends.rpc.server import check_socket_path

    with pytest.raises(ConfigError, match="longer than 107"):
        check_socket_path(str(tmp_path / ("x" * 120)))
    with pytest.raises(SocketInUseError, match="does not exist"):
        check_socket_path(str(tmp_path / "missing" / "s.sock"))


def test_half_closed_client_gets_its_replies_full_close_cancels(sock_path: str) -> None:
    """`nc -N` / socat shut down their write side after sending and still read the answers."""
    engine = fakes.FakeEngine(round_delay=0.01)
    with running_server(sock_path, engine):
        s = socket.socket(socket.AF_UNIX)
        s.connect(sock_path)
        s.sendall(p.encode(p.request("completion", {"prompt": "half", "n_predict": 30}, 1)))
        s.shutdown(socket.SHUT_WR)
        reply = json.loads(s.makefile("rb").readline())
        assert reply["result"]["content"] == fakes.expected_text("half", 30)
        s.close()
        # A full close while a (non-streaming) request runs frees its slot without waiting for it.
        s = socket.socket(socket.AF_UNIX)
        s.connect(sock_path)
        s.sendall(p.encode(p.request("completion", {"prompt": "gone", "n_predict": 100_000}, 2)))
        threading.Event().wait(0.1)
        s.close()
        for _ in range(100):
            if len(engine.finished) == 2:
                break
            threading.Event().wait(0.02)
        assert engine.finished[-1].stop_type == "cancel"
