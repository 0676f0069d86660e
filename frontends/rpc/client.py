"""Python clients for `spekula serve`: blocking (`SpekulaClient`) and anyio (`AsyncSpekulaClient`).

    with SpekulaClient() as c:        # the default socket, in the user's private runtime directory
        print(c.completion("def fib(n):", n_predict=64, temperature=0)["content"])
    with SpekulaClient("/tmp/spekula.sock") as c:
        print(c.completion("def fib(n):", n_predict=64, temperature=0)["content"])
        for chunk in (s := c.stream_completion("Once", n_predict=32)):
            print(chunk["content"], end="")
        print(s.result["timings"])

Generation parameters use llama-server's names as keyword arguments; per-request speculation goes in
`speculative={"n_max": 8, "type": "ngram-mod"}`. Before sending anything both clients check that the
server process runs as `server_uid` (default: this user; None skips the check), so a socket another
user placed on the path never receives a prompt.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
from anyio.abc import ByteStream, SocketAttribute, TaskGroup
from anyio.streams.buffered import BufferedByteReceiveStream
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from spekula.core.errors import SpekulaError
from spekula.frontends.rpc import protocol as p
from spekula.frontends.rpc.socket_identity import SocketIdentityError, default_socket_path, verify_server

_MAX_REPLY_BYTES = 256 * 1024 * 1024
_OWN_UID = -1  # "the uid of this process", resolved at connect time


def _expected_uid(server_uid: int | None) -> int | None:
    return os.getuid() if server_uid == _OWN_UID else server_uid


class RpcCallError(SpekulaError):
    """The server answered a call with a JSON-RPC error."""

    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(f"{message} (code {code})")
        self.code = code
        self.message = message
        self.data = data


class ServerGoneError(SpekulaError):
    """The connection closed before the reply arrived."""


class ClientTimeout(SpekulaError, TimeoutError):
    """No reply within the client's `timeout` (still a TimeoutError for callers that catch that)."""


def _result(msg: dict[str, Any]) -> Any:
    if "error" in msg:
        err = msg["error"]
        raise RpcCallError(err.get("code", p.INTERNAL_ERROR), err.get("message", ""), err.get("data"))
    return msg.get("result")


def _completion_params(prompt: str | list[int], params: dict[str, Any]) -> dict[str, Any]:
    return {"prompt": prompt, **params}


# -- blocking client --------------------------------------------------------------------------


class SpekulaClient:
    """One connection; not thread-safe. Notifications and replies for other ids are queued, so a
    stream may be cancelled (`stream.cancel()`) from inside its own loop."""

    def __init__(self, socket_path: str | None = None, *, timeout: float | None = 300.0,
                 server_uid: int | None = _OWN_UID) -> None:
        socket_path = socket_path or default_socket_path()
        self.socket_path = socket_path
        self.timeout = timeout
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(socket_path)
        except OSError as exc:
            self._sock.close()
            raise ServerGoneError(f"cannot connect to {socket_path}: {exc}") from None
        try:
            self.server = verify_server(self._sock, socket_path, _expected_uid(server_uid))
        except SocketIdentityError:
            self._sock.close()
            raise
        self._buf = bytearray()
        self._ids = itertools.count(1)
        self._replies: dict[Any, dict[str, Any]] = {}
        self._notes: dict[Any, deque[dict[str, Any]]] = defaultdict(deque)

    def __enter__(self) -> SpekulaClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._sock.close()

    # plumbing
    def _io_error(self, exc: OSError, doing: str) -> SpekulaError:
        if isinstance(exc, TimeoutError):
            return ClientTimeout(f"{self.socket_path}: no progress {doing} within {self.timeout} s "
                                 "(a long generation needs a larger timeout: SpekulaClient(..., timeout=None))")
        return ServerGoneError(f"{self.socket_path}: connection failed {doing}: {exc}")

    def _send(self, message: Any) -> None:
        try:
            self._sock.sendall(p.encode(message))
        except OSError as exc:
            raise self._io_error(exc, "sending a request") from None

    def _read_message(self) -> Any:
        while (nl := self._buf.find(b"\n")) < 0:
            try:
                data = self._sock.recv(65536)
            except OSError as exc:
                raise self._io_error(exc, "waiting for a reply") from None
            if not data:
                raise ServerGoneError("server closed the connection")
            self._buf += data
        line = bytes(self._buf[:nl])
        del self._buf[: nl + 1]
        return json.loads(line)

    def _route(self, msg: Any) -> None:
        for m in msg if isinstance(msg, list) else [msg]:
            if "method" in m:
                self._notes[(m.get("params") or {}).get("id")].append(m["params"])
            else:
                self._replies[m.get("id")] = m

    def _wait(self, rid: Any) -> dict[str, Any]:
        while rid not in self._replies:
            self._route(self._read_message())
        return self._replies.pop(rid)

    def start(self, method: str, params: dict[str, Any] | None = None) -> int:
        rid = next(self._ids)
        self._send(p.request(method, params, rid))
        return rid

    def call(self, method: str, params: dict[str, Any] | None = None) -> Any:
        return _result(self._wait(self.start(method, params)))

    def batch(self, calls: list[tuple[str, dict[str, Any] | None]]) -> list[Any]:
        """Send calls as one JSON-RPC batch; each item is a result or an RpcCallError."""
        ids = [next(self._ids) for _ in calls]
        self._send([p.request(m, prm, rid) for (m, prm), rid in zip(calls, ids, strict=True)])
        out: list[Any] = []
        for rid in ids:
            try:
                out.append(_result(self._wait(rid)))
            except RpcCallError as exc:
                out.append(exc)
        return out

    # methods
    def completion(self, prompt: str | list[int], **params: Any) -> dict[str, Any]:
        return self.call("completion", _completion_params(prompt, params))

    def stream_completion(self, prompt: str | list[int], **params: Any) -> CompletionStream:
        return CompletionStream(self, "completion", _completion_params(prompt, {**params, "stream": True}))

    def chat(self, messages: list[dict[str, str]], **params: Any) -> dict[str, Any]:
        return self.call("chat.completion", {"messages": messages, **params})

    def stream_chat(self, messages: list[dict[str, str]], **params: Any) -> CompletionStream:
        return CompletionStream(self, "chat.completion", {"messages": messages, **params, "stream": True})

    def tokenize(self, content: str, **params: Any) -> list[Any]:
        return self.call("tokenize", {"content": content, **params})["tokens"]

    def detokenize(self, tokens: list[int]) -> str:
        return self.call("detokenize", {"tokens": tokens})["content"]

    def stats(self) -> dict[str, Any]:
        return self.call("stats")

    def slots(self) -> list[dict[str, Any]]:
        return self.call("slots")

    def health(self) -> dict[str, Any]:
        return self.call("health")

    def props(self) -> dict[str, Any]:
        return self.call("props")

    def cancel(self, request_id: str) -> bool:
        """Cancel any client's request by its engine id (the chunks' `request_id`)."""
        return bool(self.call("cancel", {"request_id": request_id})["cancelled"])


class CompletionStream:
    """Iterate for chunk dicts (`content`, `tokens`, `drafters`, `request_id`); then read `result`."""

    def __init__(self, client: SpekulaClient, method: str, params: dict[str, Any]) -> None:
        self._client = client
        self.id = client.start(method, params)
        self.result: dict[str, Any] | None = None
        self.request_id: str | None = None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        c = self._client
        while True:
            notes = c._notes.get(self.id)
            if notes:
                chunk = notes.popleft()
                self.request_id = chunk.get("request_id", self.request_id)
                yield chunk
                continue
            if self.id in c._replies:  # the server writes every chunk before the reply
                c._notes.pop(self.id, None)
                self.result = _result(c._replies.pop(self.id))
                return
            c._route(c._read_message())

    def cancel(self) -> bool:
        """Ask the server to stop; keep iterating to receive the partial result."""
        rid = self._client.start("cancel", {"id": self.id})
        return bool(_result(self._client._wait(rid))["cancelled"])


# -- async client -----------------------------------------------------------------------------


class AsyncSpekulaClient:
    """Concurrent calls over one connection: a reader task routes every message to its caller."""

    def __init__(self, stream: ByteStream, tg: TaskGroup) -> None:
        self._stream = stream
        self._tg = tg
        self._ids = itertools.count(1)
        self._pending: dict[Any, MemoryObjectSendStream[dict[str, Any]]] = {}
        self._lock = anyio.Lock()
        self.closed = False

    @classmethod
    @asynccontextmanager
    async def connect(cls, socket_path: str | None = None, *,
                      server_uid: int | None = _OWN_UID) -> AsyncIterator[AsyncSpekulaClient]:
        socket_path = socket_path or default_socket_path()
        try:
            stream = await anyio.connect_unix(socket_path)
        except OSError as exc:
            raise ServerGoneError(f"cannot connect to {socket_path}: {exc}") from None
        try:
            verify_server(stream.extra(SocketAttribute.raw_socket), socket_path, _expected_uid(server_uid))
        except SocketIdentityError:
            await stream.aclose()
            raise
        async with stream, anyio.create_task_group() as tg:
            client = cls(stream, tg)
            tg.start_soon(client._read_loop)
            try:
                yield client
            finally:
                tg.cancel_scope.cancel()

    async def _read_loop(self) -> None:
        reader = BufferedByteReceiveStream(self._stream)
        try:
            while True:
                msg = json.loads(await reader.receive_until(b"\n", _MAX_REPLY_BYTES))
                for m in msg if isinstance(msg, list) else [msg]:
                    key = (m.get("params") or {}).get("id") if "method" in m else m.get("id")
                    target = self._pending.get(key)
                    if target is None:
                        continue
                    try:
                        await target.send(m)
                    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                        # That caller stopped listening (cancelled); the connection is still fine.
                        self._pending.pop(key, None)
        except (anyio.IncompleteRead, anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass
        finally:
            self.closed = True
            for send in self._pending.values():
                send.close()

    async def _open(self, method: str, params: dict[str, Any] | None) -> tuple[int, MemoryObjectReceiveStream[dict[str, Any]]]:
        if self.closed:
            raise ServerGoneError("connection closed")
        rid = next(self._ids)
        send, receive = anyio.create_memory_object_stream[dict[str, Any]](256)
        self._pending[rid] = send
        async with self._lock:
            await self._stream.send(p.encode(p.request(method, params, rid)))
        return rid, receive

    async def call(self, method: str, params: dict[str, Any] | None = None) -> Any:
        rid, receive = await self._open(method, params)
        try:
            async with receive:
                async for msg in receive:
                    if "method" not in msg:
                        return _result(msg)
            raise ServerGoneError("server closed the connection")
        finally:
            self._pending.pop(rid, None)

    async def completion(self, prompt: str | list[int], **params: Any) -> dict[str, Any]:
        return await self.call("completion", _completion_params(prompt, params))

    def stream_completion(self, prompt: str | list[int], **params: Any) -> AsyncCompletionStream:
        return AsyncCompletionStream(self, "completion", _completion_params(prompt, {**params, "stream": True}))

    async def chat(self, messages: list[dict[str, str]], **params: Any) -> dict[str, Any]:
        return await self.call("chat.completion", {"messages": messages, **params})

    def stream_chat(self, messages: list[dict[str, str]], **params: Any) -> AsyncCompletionStream:
        return AsyncCompletionStream(self, "chat.completion", {"messages": messages, **params, "stream": True})

    async def tokenize(self, content: str, **params: Any) -> list[Any]:
        return (await self.call("tokenize", {"content": content, **params}))["tokens"]

    async def detokenize(self, tokens: list[int]) -> str:
        return (await self.call("detokenize", {"tokens": tokens}))["content"]

    async def stats(self) -> dict[str, Any]:
        return await self.call("stats")

    async def slots(self) -> list[dict[str, Any]]:
        return await self.call("slots")

    async def health(self) -> dict[str, Any]:
        return await self.call("health")

    async def props(self) -> dict[str, Any]:
        return await self.call("props")

    async def cancel(self, request_id: str) -> bool:
        return bool((await self.call("cancel", {"request_id": request_id}))["cancelled"])


class AsyncCompletionStream:
    """`async for chunk in stream`; afterwards `stream.result` holds the final response."""

    def __init__(self, client: AsyncSpekulaClient, method: str, params: dict[str, Any]) -> None:
        self._client = client
        self._method = method
        self._params = params
        self.id: int | None = None
        self.result: dict[str, Any] | None = None
        self.request_id: str | None = None

    async def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        rid, receive = await self._client._open(self._method, self._params)
        self.id = rid
        try:
            async with receive:
                async for msg in receive:
                    if "method" in msg:
                        self.request_id = msg["params"].get("request_id", self.request_id)
                        yield msg["params"]
                    else:
                        self.result = _result(msg)
                        return
            raise ServerGoneError("server closed the connection")
        finally:
            self._client._pending.pop(rid, None)

    async def cancel(self) -> bool:
        if self.id is None:
            return False
        return bool((await self._client.call("cancel", {"id": self.id}))["cancelled"])
