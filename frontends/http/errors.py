"""HTTP errors in llama-server's shape: `{"error": {"code", "message", "type"}}` with the status.

The request schema is shared with the socket (frontends/schema/completion.py), whose errors are JSON-RPC
codes; `from_rpc` maps each to the status and type a llama-server or OpenAI client expects.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from spekula.frontends.rpc.protocol import CONTEXT_OVERFLOW, INVALID_PARAMS, SHUTTING_DOWN, RpcError

# error type -> HTTP status, as llama-server pairs them
STATUS = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "permission_error": 403,
    "not_found_error": 404,
    "payload_too_large_error": 413,
    "server_error": 500,
    "not_supported_error": 501,
    "unavailable_error": 503,
    "exceed_context_size_error": 400,
}


class HttpError(Exception):
    def __init__(self, message: str, type_: str = "invalid_request_error", *, status: int | None = None,
                 extra: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.type = type_
        self.status = status if status is not None else STATUS[type_]
        self.extra = extra or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"code": self.status, "message": self.message, "type": self.type, **self.extra}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def from_rpc(exc: RpcError) -> HttpError:
    if exc.code == INVALID_PARAMS:
        return HttpError(exc.message)
    if exc.code == CONTEXT_OVERFLOW:
        data = exc.data if isinstance(exc.data, dict) else {}
        return HttpError(exc.message, "exceed_context_size_error", extra=dict(data))
    if exc.code == SHUTTING_DOWN:
        return HttpError(exc.message, "unavailable_error")
    return HttpError(exc.message, "server_error")
