"""n-gram count caches and llama.cpp's lookup-cache file format (docs/semantics.md §2.4).

A cache maps an n-gram (4 token ids, padded with -1) to a table of next-token counts. The file is
a sequence of records of native (little-endian) int32 values: the 4 ids, ntok > 0, then ntok
(token, count > 0) pairs; llama.cpp's `llama-lookup-create` and `-lcs/-lcd` use the same layout.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from spekula.core.errors import SpekulaError

NGRAM_MIN = 1
NGRAM_MAX = 4
NGRAM_STATIC = 2
PAD = -1

Ngram = tuple[int, int, int, int]
NgramCache = dict[Ngram, dict[int, int]]


class NgramCacheError(SpekulaError):
    """A lookup-cache file cannot be read or written."""

    def __init__(self, path: object, problem: str) -> None:
        super().__init__(f"ngram cache {path}: {problem}")
        self.path = str(path)
        self.problem = problem


def ngram_key(tokens: Sequence[int]) -> Ngram:
    """The padded 4-slot key of an n-gram of 1..4 tokens."""
    t = [int(x) for x in tokens] + [PAD] * (NGRAM_MAX - len(tokens))
    return (t[0], t[1], t[2], t[3])


def update_cache(
    cache: NgramCache,
    tokens: Sequence[int],
    start: int,
    *,
    ngram_min: int = NGRAM_MIN,
    ngram_max: int = NGRAM_MAX,
    context_from: int = 0,
) -> None:
    """Count n-gram -> next token for every next-token position i in [start, len(tokens)).

    An n-gram of size s counts only if it begins at or after `context_from`. 0 (the default)
    counts n-grams that reach back into older tokens; `context_from=start` reproduces llama.cpp's
    server, which counts only n-grams lying wholly inside the new tokens.
    """
    n_tok = len(tokens)
    for s in range(ngram_min, ngram_max + 1):
        pad = (PAD,) * (NGRAM_MAX - s)
        for i in range(max(start, context_from + s), n_tok):
            key: Ngram = tuple(tokens[i - s : i]) + pad  # type: ignore[assignment]
            nxt = tokens[i]
            part = cache.get(key)
            if part is None:
                cache[key] = {nxt: 1}
            else:
                part[nxt] = part.get(nxt, 0) + 1


def merge_cache(target: NgramCache, add: NgramCache) -> None:
    """Add every count of `add` into `target` (llama.cpp's common_ngram_cache_merge)."""
    for key, part in add.items():
        dst = target.get(key)
        if dst is None:
            target[key] = dict(part)
            continue
        for tok, cnt in part.items():
            dst[tok] = dst.get(tok, 0) + cnt


def count_static_ngrams(tokens: np.ndarray) -> NgramCache:
    """A static cache (2-gram -> next-token counts) from one token sequence, vectorised."""
    tokens = np.asarray(tokens, dtype=np.int64)
    cache: NgramCache = {}
    if len(tokens) <= NGRAM_STATIC:
        return cache
    triples = np.stack([tokens[:-2], tokens[1:-1], tokens[2:]], axis=1)
    uniq, counts = np.unique(triples, axis=0, return_counts=True)
    for (a, b, c), cnt in zip(uniq.tolist(), counts.tolist(), strict=True):
        cache.setdefault((a, b, PAD, PAD), {})[c] = cnt
    return cache


def encode_cache(cache: NgramCache) -> np.ndarray:
    """The file image of a cache as a flat int32 array."""
    flat: list[int] = []
    for key, part in cache.items():
        items = [(t, c) for t, c in part.items() if c > 0]
        if not items:
            continue
        flat.extend(key)
        flat.append(len(items))
        for t, c in items:
            flat.append(t)
            flat.append(min(c, 2**31 - 1))
    return np.asarray(flat, dtype="<i4")


def decode_cache(data: np.ndarray, path: object = "<memory>") -> NgramCache:
    """Parse a file image; a truncated or invalid record raises NgramCacheError."""
    values = data.tolist()
    cache: NgramCache = {}
    pos, end = 0, len(values)
    while pos < end:
        if pos + 5 > end:
            raise NgramCacheError(path, f"truncated record header at byte {4 * pos}")
        key: Ngram = (values[pos], values[pos + 1], values[pos + 2], values[pos + 3])
        ntok = values[pos + 4]
        if ntok <= 0:
            raise NgramCacheError(path, f"record at byte {4 * pos} has {ntok} tokens (must be > 0)")
        body = pos + 5
        if body + 2 * ntok > end:
            raise NgramCacheError(path, f"record at byte {4 * pos} is truncated")
        part: dict[int, int] = {}
        for j in range(body, body + 2 * ntok, 2):
            cnt = values[j + 1]
            if cnt <= 0:
                raise NgramCacheError(path, f"count {cnt} at byte {4 * (j + 1)} (must be > 0)")
            part.setdefault(values[j], cnt)  # llama.cpp's emplace keeps the first entry
        cache.setdefault(key, part)
        pos = body + 2 * ntok
    return cache


def load_cache(path: str | os.PathLike[str]) -> NgramCache:
    """Read a lookup-cache file. Any problem (missing, unreadable, corrupt) is an NgramCacheError."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise NgramCacheError(p, f"cannot read: {exc.strerror or exc}") from exc
    if len(raw) % 4:
        raise NgramCacheError(
            p, f"size {len(raw)} is not a multiple of 4 bytes (truncated or not a cache file)"
        )
    data = np.frombuffer(raw, dtype="<i4")
    if sys.byteorder != "little":  # the format is native int32; llama.cpp runs little-endian
        data = data.astype(np.int32)
    return decode_cache(data, p)


def save_cache(cache: NgramCache, path: str | os.PathLike[str]) -> None:
    """Write a lookup-cache file atomically (a reader never sees a half-written file)."""
    p = Path(path)
    data = encode_cache(cache)
    directory = p.parent if str(p.parent) else Path(".")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=directory)
    except OSError as exc:
        raise NgramCacheError(p, f"cannot write: {exc.strerror or exc}") from exc
    try:
        os.chmod(tmp, _file_mode(p))  # mkstemp creates 0600; give the file ordinary permissions
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.tobytes())
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, p)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise NgramCacheError(p, f"cannot write: {exc.strerror or exc}") from exc


def check_writable(path: str | os.PathLike[str]) -> None:
    """Refuse at start-up a cache path that could not be saved later (missing directory, a directory
    in its place, no write permission), so the failure is one clear error instead of a lost save."""
    p = Path(path)
    directory = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        raise NgramCacheError(p, "is a directory, not a cache file")
    if not directory.is_dir():
        raise NgramCacheError(p, f"cannot be saved: directory {directory} does not exist")
    if not os.access(directory, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise NgramCacheError(p, "cannot be saved: no write permission")


def _file_mode(path: Path) -> int:
    """The existing file's permissions, else 0666 minus the umask (what open() would give)."""
    try:
        return path.stat().st_mode & 0o777
    except OSError:
        mask = os.umask(0)
        os.umask(mask)
        return 0o666 & ~mask


def cache_size(cache: NgramCache) -> tuple[int, int]:
    """(number of n-grams, total count) — what the CLI reports."""
    return len(cache), sum(sum(part.values()) for part in cache.values())
