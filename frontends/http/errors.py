"""HTTP errors in llama-server's shape: `{"error": {"code", "message", "type"}}` with the status, and in
Anthropic's (`{"type": "error", "error": {"type", "message"}}`) on its Messages API paths.

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
    "timeout_error": 408,
    "payload_too_large_error": 413,
    "server_error": 500,
    "not_supported_error": 501,
    "unavailable_error": 503,
    "exceed_context_size_error": 400,
}


# status -> Anthropic's error type (its API documents these names)
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
                   503: "overloaded_error"}


def anthropic_path(path: str) -> bool:
    """Anthropic's Messages API answers its errors in its own shape."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


class HttpError(Exception):
    def __init__(self, message: str, type_: str = "invalid_request_error", *, status: int | None = None,
                 extra: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.type = type_
        self.status = status if status is not None else STATUS[type_]
        self.extra = extra or {}

    def body(self, path: str = "") -> dict[str, Any]:
        """The error object for a request to `path` (Anthropic's shape on its paths)."""
        if anthropic_path(path):
            return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(self.status, "api_error"),
                                               "message": self.message}}
        return {"error": {"code": self.status, "message": self.message, "type": self.type, **self.extra}}

    def response(self, path: str = "") -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(path), status_code=self.status, headers=headers)


def from_rpc(exc: RpcError) -> HttpError:
    if exc.code == INVALID_PARAMS:
        return HttpError(exc.message)
    if exc.code == CONTEXT_OVERFLOW:
        data = exc.data if isinstance(exc.data, dict) else {}
        return HttpError(exc.message, "exceed_context_size_error", extra=dict(data))
    if exc.code == SHUTTING_DOWN:
        return HttpError(exc.message, "unavailable_error")
    return HttpError(exc.message, "server_error")
