"""How much one tokenize call may ask for, on the socket and over HTTP.

Tokenizing is the one call whose reply grows with its input without a context to bound it: twenty
megabytes of text took 4 GB at its peak (token lists, pieces, the JSON reply) and a reply of 29 MB.
The text is capped at the socket's default request line (no longer text reaches the socket anyway),
a reply with pieces (about 30 bytes of JSON per token) at MAX_TOKENIZE_PIECES tokens. Tokenizing in
worker threads is bounded too: texts over BIG_TOKENIZE_CHARS one at a time per server, others
TOKENIZE_THREADS at a time. Each thread that allocates gets its own glibc arena, and the arenas keep
their pages: 26 tokenizes of 54 KB pipelined by one client ran in 26 threads and left the server
~100 MB larger, where two threads leave it as it was.
"""

from __future__ import annotations

import anyio
from anyio.lowlevel import RunVar

from spekula.frontends.schema.errors import ParamError
from spekula.frontends.thread_limits import per_loop_limiter

MAX_TOKENIZE_CHARS = 8 * 1024 * 1024
MAX_TOKENIZE_PIECES = 262_144
BIG_TOKENIZE_CHARS = 1024 * 1024
TOKENIZE_THREADS = 2
_BIG: RunVar[anyio.CapacityLimiter] = RunVar("spekula_big_tokenize")
_SMALL: RunVar[anyio.CapacityLimiter] = RunVar("spekula_tokenize")


class TokenizeTooLarge(ParamError):
    """A tokenize call over a size limit: -32602 on the socket, 413 over HTTP."""


def check_content(content: str) -> None:
    if len(content) > MAX_TOKENIZE_CHARS:
        raise TokenizeTooLarge("content", f"'content' has {len(content)} characters (at most {MAX_TOKENIZE_CHARS})")


def check_pieces(n_tokens: int) -> None:
    if n_tokens > MAX_TOKENIZE_PIECES:
        raise TokenizeTooLarge("with_pieces", f"'with_pieces': the text has {n_tokens} tokens, over the "
                               f"{MAX_TOKENIZE_PIECES} a reply with pieces may hold; ask without pieces")


def tokenize_limiter(n_chars: int) -> anyio.CapacityLimiter:
    """The worker-thread limiter for tokenizing `n_chars` characters (or building a reply of as many
    tokens): one at a time for big texts, TOKENIZE_THREADS for the others."""
    var, tokens = (_BIG, 1) if n_chars > BIG_TOKENIZE_CHARS else (_SMALL, TOKENIZE_THREADS)
    return per_loop_limiter(var, tokens)
