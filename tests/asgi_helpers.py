"""One HTTP request through an ASGI app, without a socket (tests of the HTTP frontend in-process)."""

from __future__ import annotations

from typing import Any

import anyio


async def asgi(app: Any, method: str, path: str, body: bytes = b"",
               headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """One request through an ASGI app; returns status, headers and the whole body."""
    sent = False
    out: dict[str, Any] = {"status": 0, "headers": {}, "body": b""}

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await anyio.sleep_forever()
        raise AssertionError

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            out["status"] = message["status"]
            out["headers"] = {k.decode().lower(): v.decode() for k, v in message.get("headers", [])}
        elif message["type"] == "http.response.body":
            out["body"] += message.get("body", b"")

    raw_headers = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    scope = {"type": "http", "method": method, "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": raw_headers, "http_version": "1.1", "scheme": "http", "server": ("t", 80),
             "client": ("c", 1), "root_path": ""}
    await app(scope, receive, send)
    return out["status"], out["headers"], out["body"]
