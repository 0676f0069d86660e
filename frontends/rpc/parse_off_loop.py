"""Parsing a large request text in a worker thread, so that it never stalls the event loop.

A body of tens of megabytes (ten million token ids, a million logit_bias pairs) takes seconds of CPU
to decode with the hardened parser; on the event loop nothing else would be served meanwhile (the
hostile-client probe saw /health wait 16 s). Texts over PARSE_IN_THREAD_BYTES go to a thread, at most
PARSE_THREADS at once per server, so the loop keeps its turns (the parser gives up the GIL every few
milliseconds) and a flood of large bodies queues rather than taking every core. The check for text
that is not Unicode runs in the same place, since it walks the same value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
from anyio.lowlevel import RunVar

from spekula.frontends.rpc.protocol import parse_line
from spekula.frontends.schema.unicode_check import lone_surrogate_at, may_hold_surrogate
from spekula.frontends.thread_limits import per_loop_limiter

PARSE_IN_THREAD_BYTES = 64 * 1024
PARSE_THREADS = 2
_LIMITER: RunVar[anyio.CapacityLimiter] = RunVar("spekula_parse_limiter")


@dataclass(frozen=True, slots=True)
class Decoded:
    value: Any
    not_unicode_at: str | None  # where a lone surrogate is (see unicode_check), or None


def _decode(raw: bytes) -> Decoded:
    value = parse_line(raw)
    return Decoded(value, lone_surrogate_at(value) if may_hold_surrogate(raw) else None)


def parse_limiter() -> anyio.CapacityLimiter:
    """The worker threads that parse and check large requests: PARSE_THREADS per server."""
    return per_loop_limiter(_LIMITER, PARSE_THREADS)


async def decode_json(raw: bytes) -> Decoded:
    """`parse_line(raw)` (its RpcError -32700 on bad JSON), plus where text is not Unicode."""
    if len(raw) <= PARSE_IN_THREAD_BYTES:
        return _decode(raw)
    return await anyio.to_thread.run_sync(_decode, raw, limiter=parse_limiter())
