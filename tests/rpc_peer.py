"""The client end of an in-memory JSON-RPC connection to a real RpcConnection, for the RPC tests."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
from anyio.streams.buffered import BufferedByteReceiveStream

from spekula.frontends.rpc import protocol as p
from spekula.frontends.rpc.dispatch import RpcConnection
from spekula.frontends.rpc.framing import LineReader, LineWriter
from spekula.frontends.rpc.methods import SpekulaMethods


class Peer:
    """The client end of an in-memory connection."""

    def __init__(self, send: Any, receive: Any) -> None:
        self._send = send
        self._recv = BufferedByteReceiveStream(receive)
        self.notes: list[dict[str, Any]] = []

    async def raw(self, data: bytes) -> None:
        await self._send.send(data)

    async def send(self, obj: Any) -> None:
        await self.raw(json.dumps(obj).encode() + b"\n")

    async def recv(self) -> Any:
        return json.loads(await self._recv.receive_until(b"\n", 1 << 24))

    async def reply(self) -> Any:
        """Next non-notification message; notifications are kept in `notes`."""
        while True:
            msg = await self.recv()
            if isinstance(msg, dict) and "method" in msg:
                self.notes.append(msg)
                continue
            return msg

    async def call(self, method: str, params: Any = None, rid: Any = 1) -> Any:
        await self.send(p.request(method, params, rid))
        return await self.reply()


@asynccontextmanager
async def connected(engine: Any, *, max_bytes: int = 1 << 20) -> AsyncIterator[Peer]:
    c2s_send, c2s_recv = anyio.create_memory_object_stream[bytes](100)
    s2c_send, s2c_recv = anyio.create_memory_object_stream[bytes](100)
    conn = RpcConnection(LineReader(c2s_recv, max_bytes), LineWriter(s2c_send), SpekulaMethods(engine).table())
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        tg.start_soon(conn.serve)
        yield Peer(c2s_send, s2c_recv)
        tg.cancel_scope.cancel()


def run(test: Callable[[], Awaitable[None]], timeout: float = 10) -> None:
    async def main() -> None:
        with anyio.fail_after(timeout):
            await test()

    anyio.run(main)
