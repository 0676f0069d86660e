"""Worker-thread limiters for request work taken off the event loop, one per event loop (per server).

Each thread that allocates gets a glibc arena of its own and keeps its pages, so request work runs on a
few threads rather than anyio's default forty (see frontends/schema/tokenize_limits.py).
"""

from __future__ import annotations

import anyio
from anyio.lowlevel import RunVar


def per_loop_limiter(var: RunVar[anyio.CapacityLimiter], tokens: int) -> anyio.CapacityLimiter:
    """The limiter `var` holds in the running event loop, made with `tokens` on first use."""
    try:
        return var.get()
    except LookupError:
        limiter = anyio.CapacityLimiter(tokens)
        var.set(limiter)
        return limiter
