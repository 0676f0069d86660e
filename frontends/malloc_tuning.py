"""Keep a long-running server's memory floor flat under large transient requests (glibc only).

glibc serves large allocations with mmap and gives them back on free, but the threshold for "large"
moves: each time a mmapped block is freed, the threshold rises to that block's size (up to 32 MiB).
After a client sends one near-limit request line (up to 8 MiB by default, read into growing buffers),
every later buffer of that size comes from the heap instead, and the heap keeps the pages once the
buffer is freed between other live allocations. Under hostile clients the server's resident floor then
steps up by tens of megabytes and stays there (bench/soak.py measured +12 % in one minute). Pinning the
threshold switches that adjustment off: blocks of at least THRESHOLD_BYTES are always mmapped and
returned when freed. It is set below the request-line limit and above what one decoding step of the
torch backend allocates for a small model (a few verification rows of logits), so per-step tensors
keep coming from the heap.

A user's own MALLOC_MMAP_THRESHOLD_ in the environment wins (glibc has already applied it).

Below that threshold, a large request still leaves its many small objects (a parsed list of millions
of token ids, a tokenize reply's pieces) spread over the heap's arenas; once they are freed,
`release_free_memory` hands the free pages back (malloc_trim), so the floor returns near where it was.
The servers call it after a request that moved more than TRIM_AFTER_BYTES, at most once per
TRIM_INTERVAL_S, in a worker thread (a trim walks every arena).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import threading
import time
from functools import cache
from typing import Any

import structlog

THRESHOLD_BYTES = 4 * 1024 * 1024
TRIM_AFTER_BYTES = 1024 * 1024
TRIM_INTERVAL_S = 1.0
_M_MMAP_THRESHOLD = -3  # mallopt parameter number in glibc's malloc.h

log = structlog.get_logger("spekula.malloc")


def pin_mmap_threshold(nbytes: int = THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at ``nbytes``; False where this is not glibc or the user set it."""
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt  # absent from musl and other C libraries
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    applied = mallopt(_M_MMAP_THRESHOLD, nbytes) == 1
    log.debug("malloc_mmap_threshold", bytes=nbytes, applied=applied)
    return applied


@cache
def _malloc_trim() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim  # glibc only
    except (OSError, AttributeError):
        return None
    trim.argtypes = (ctypes.c_size_t,)
    trim.restype = ctypes.c_int
    return trim


_last_trim = [0.0]
_trailing: list[threading.Timer | None] = [None]
_trim_lock = threading.Lock()


def release_free_memory() -> bool:
    """Give the heap's free pages back to the system (glibc's malloc_trim); False where this is not
    glibc, or where a trim ran less than TRIM_INTERVAL_S ago: a client sending large requests back to
    back must not make the server spend its time trimming. A call that is skipped leaves one trim due
    at the end of the interval, so the last of a burst of large requests is trimmed after too."""
    trim = _malloc_trim()
    if trim is None:
        return False
    with _trim_lock:
        wait = _last_trim[0] + TRIM_INTERVAL_S - time.monotonic()
        if wait > 0:
            if _trailing[0] is None:
                timer = threading.Timer(wait, _trailing_trim)
                timer.daemon = True
                _trailing[0] = timer
                timer.start()
            return False
        _last_trim[0] = time.monotonic()
    return bool(trim(0))


def _trailing_trim() -> None:
    with _trim_lock:
        _trailing[0] = None
    release_free_memory()
