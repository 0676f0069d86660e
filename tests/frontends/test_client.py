"""Client library behaviour that the server tests do not reach: abandoned streams, errors, dead servers."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import pytest
import rpc_fakes as fakes

from spekula.core.errors import SpekulaError
from spekula.frontends.rpc import protocol as p
from spekula.frontends.rpc.client import (
    AsyncSpekulaClient,
    ClientTimeout,
    RpcCallError,
    ServerGoneError,
    SpekulaClient,
)
from spekula.frontends.rpc.methods import SpekulaMethods
from spekula.frontends.rpc.server import RpcServer, ServerConfig


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, Any]]:
    engine = fakes.FakeEngine(round_delay=0.02)
    sock = str(tmp_path / "c.sock")
    server = RpcServer(engine, ServerConfig(sock, handle_signals=False),
                       lambda srv: SpekulaMethods(engine, server_state=srv.state).table())
    with anyio.from_thread.start_blocking_portal() as portal:
        future, _ = portal.start_task(server.serve)
        try:
            yield sock, engine
        finally:
            portal.call(server.shutdown)
            future.result(timeout=10)


def test_abandoned_async_stream_keeps_connection_usable(served: tuple[str, Any]) -> None:
    sock, engine = served

    async def body() -> None:
        with anyio.fail_after(10):
            async with AsyncSpekulaClient.connect(sock) as c:
                stream = c.stream_completion("abc", n_predict=100_000)
                with anyio.move_on_after(0.2):
                    async for _ in stream:
                        pass
                # The server keeps sending chunks for the abandoned stream; they must be dropped
                # without closing the connection for everyone else.
                assert stream.request_id is not None
                assert await c.cancel(stream.request_id)
                res = await c.completion("xyz", n_predict=5)
                assert res["content"] == fakes.expected_text("xyz", 5)
                with pytest.raises(RpcCallError) as info:
                    await c.call("nope")
                assert info.value.code == p.METHOD_NOT_FOUND

    anyio.run(body)
    assert engine.finished[0].stop_type == "cancel"


def test_async_stream_cancel_returns_partial_result(served: tuple[str, Any]) -> None:
    sock, _ = served

    async def body() -> None:
        with anyio.fail_after(10):
            async with AsyncSpekulaClient.connect(sock) as c:
                stream = c.stream_completion("abc", n_predict=100_000)
                n = 0
                async for _ in stream:
                    n += 1
                    if n == 2:
                        assert await stream.cancel()
                assert stream.result is not None and stream.result["stop_type"] == "cancel"

    anyio.run(body)


def test_missing_server_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ServerGoneError, match="cannot connect"):
        SpekulaClient(str(tmp_path / "none.sock"))

    async def body() -> None:
        async with AsyncSpekulaClient.connect(str(tmp_path / "none.sock")):
            pass

    with pytest.raises(ServerGoneError, match="cannot connect"):
        anyio.run(body)


def test_silent_server_times_out_with_a_clear_error(tmp_path: Path) -> None:
    """A server that accepts but never answers: a SpekulaError naming the socket and the timeout."""
    path = str(tmp_path / "mute.sock")
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(path)
        listener.listen(1)
        with SpekulaClient(path, timeout=0.2) as c, pytest.raises(ClientTimeout) as info:
            c.health()
    assert isinstance(info.value, SpekulaError) and isinstance(info.value, TimeoutError)
    assert path in str(info.value) and "0.2 s" in str(info.value)


def test_sync_client_error_carries_code_and_data(served: tuple[str, Any]) -> None:
    sock, _ = served
    with SpekulaClient(sock) as c:
        with pytest.raises(RpcCallError) as info:
            c.completion("x" * 300)  # the fake engine's context is 256 tokens
        assert info.value.code == p.CONTEXT_OVERFLOW and info.value.data == {"n_prompt_tokens": 300, "n_ctx": 256}
        assert c.completion("ok", n_predict=2)["content"] == "ok"
