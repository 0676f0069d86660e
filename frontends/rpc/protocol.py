"""JSON-RPC 2.0 message shapes and error codes (no I/O here).

Everything that turns wire JSON into a validated request, or a Python outcome into a wire reply,
lives in this module so the dispatcher and the client agree on one vocabulary.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

JSONRPC = "2.0"

# Standard codes (JSON-RPC 2.0's error codes).
PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
# Server-defined codes live in -32000..-32099.
ENGINE_ERROR = -32000
CONTEXT_OVERFLOW = -32001
SHUTTING_DOWN = -32002
DUPLICATE_ID = -32003
SERVER_BUSY = -32004  # connection limit reached

RequestId = str | int | None


class RpcError(Exception):
    """An error that becomes a JSON-RPC error object; raised by handlers and by validation."""

    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data

    def to_wire(self) -> dict[str, Any]:
        err: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.data is not None:
            err["data"] = self.data
        return err


def invalid_params(message: str) -> RpcError:
    return RpcError(INVALID_PARAMS, message)


@dataclass(frozen=True, slots=True)
class Request:
    """A validated inbound call. `is_notification` requests get no reply (JSON-RPC 2.0 notifications)."""

    method: str
    params: dict[str, Any] | list[Any] | None
    id: RequestId
    is_notification: bool


# Limits checked while parsing, so hostile input fails as one -32700 reply: JSON nests no deeper than
# MAX_DEPTH arrays/objects, a number has at most MAX_NUMBER_CHARS characters (a 5000-digit integer
# would otherwise raise from int() and a huge exponent become infinity), and NaN / Infinity, which
# Python's json accepts, are refused as the JSON they are not.
MAX_DEPTH = 64
MAX_NUMBER_CHARS = 64


def _parse_int(text: str) -> int:
    if len(text) > MAX_NUMBER_CHARS:
        raise RpcError(PARSE_ERROR, f"parse error: number with {len(text)} characters (at most {MAX_NUMBER_CHARS})")
    return int(text)


def _parse_float(text: str) -> float:
    if len(text) > MAX_NUMBER_CHARS:
        raise RpcError(PARSE_ERROR, f"parse error: number with {len(text)} characters (at most {MAX_NUMBER_CHARS})")
    value = float(text)
    if not math.isfinite(value):
        raise RpcError(PARSE_ERROR, f"parse error: number {text[:32]} is out of range")
    return value


def _refuse_constant(name: str) -> Any:
    raise RpcError(PARSE_ERROR, f"parse error: {name} is not valid JSON")


_DECODER = json.JSONDecoder(parse_int=_parse_int, parse_float=_parse_float, parse_constant=_refuse_constant)


def nesting_depth_exceeds(value: Any, limit: int) -> bool:
    """Whether arrays/objects nest deeper than `limit` (iterative: no recursion on hostile input)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return False


def parse_line(line: bytes) -> Any:
    """Decode one framed line; any failure (bad UTF-8 or JSON, too deep, a number too long, NaN) is
    a -32700 parse error and nothing else."""
    try:
        value = _DECODER.decode(line.decode("utf-8"))
    except RpcError:
        raise
    except RecursionError:
        raise RpcError(PARSE_ERROR, f"parse error: nested deeper than {MAX_DEPTH} levels") from None
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as exc:
        raise RpcError(PARSE_ERROR, f"parse error: {str(exc)[:200]}") from None
    if isinstance(value, dict | list) and nesting_depth_exceeds(value, MAX_DEPTH):
        raise RpcError(PARSE_ERROR, f"parse error: nested deeper than {MAX_DEPTH} levels")
    return value


def _valid_id(value: Any) -> bool:
    # bool is an int subclass but not a legal id; floats are allowed by the spec yet discouraged.
    return value is None or (isinstance(value, str | int | float) and not isinstance(value, bool))


def validate_request(obj: Any) -> Request:
    """Check one request object; raises RpcError(-32600) with the id when it could be recovered."""
    if not isinstance(obj, dict):
        raise RpcError(INVALID_REQUEST, "invalid request: expected a JSON object")
    rid = obj.get("id")
    if not _valid_id(rid):
        raise RpcError(INVALID_REQUEST, "invalid request: 'id' must be a string, number or null")
    if obj.get("jsonrpc") != JSONRPC:
        raise _with_id(RpcError(INVALID_REQUEST, "invalid request: 'jsonrpc' must be \"2.0\""), rid)
    method = obj.get("method")
    if not isinstance(method, str) or not method:
        raise _with_id(RpcError(INVALID_REQUEST, "invalid request: 'method' must be a non-empty string"), rid)
    params = obj.get("params")
    if params is not None and not isinstance(params, dict | list):
        raise _with_id(RpcError(INVALID_REQUEST, "invalid request: 'params' must be an object or array"), rid)
    return Request(method=method, params=params, id=rid, is_notification="id" not in obj)


class _IdCarrier(RpcError):
    """An RpcError that remembers the request id it belongs to (for the reply)."""

    request_id: RequestId


def _with_id(err: RpcError, rid: RequestId) -> RpcError:
    carrier = _IdCarrier(err.code, err.message, err.data)
    carrier.request_id = rid
    return carrier


def error_id(err: RpcError) -> RequestId:
    return err.request_id if isinstance(err, _IdCarrier) else None


def response(rid: RequestId, result: Any) -> dict[str, Any]:
    return {"jsonrpc": JSONRPC, "id": rid, "result": result}


def error_response(rid: RequestId, err: RpcError) -> dict[str, Any]:
    return {"jsonrpc": JSONRPC, "id": rid, "error": err.to_wire()}


def notification(method: str, params: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": JSONRPC, "method": method, "params": params}


def request(method: str, params: dict[str, Any] | None, rid: RequestId) -> dict[str, Any]:
    msg: dict[str, Any] = {"jsonrpc": JSONRPC, "method": method, "id": rid}
    if params is not None:
        msg["params"] = params
    return msg


@dataclass(frozen=True, slots=True)
class EncodedResult:
    """A handler's result already encoded as JSON by `dumps` (a large reply built in a worker thread,
    so that its millions of small objects never exist at once on the event loop or in a queue)."""

    json: bytes


def dumps(value: Any) -> bytes:
    """JSON as it goes on the wire. ensure_ascii keeps every frame free of raw newlines and odd
    encodings; allow_nan=False makes a NaN or infinity a ValueError here rather than invalid JSON."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")


def _dumps_message(message: Any) -> bytes:
    if isinstance(message, list):
        return b"[" + b",".join(_dumps_message(m) for m in message) + b"]"
    if isinstance(message, dict) and isinstance(message.get("result"), EncodedResult):
        head = dumps({k: v for k, v in message.items() if k != "result"})
        return head[:-1] + b',"result":' + message["result"].json + b"}"
    return dumps(message)


def encode(message: Any) -> bytes:
    """One framed line (see `dumps`)."""
    return _dumps_message(message) + b"\n"
