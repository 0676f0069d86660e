"""What a model file's header yields, kept on disk between processes, keyed by the file's identity.

Reading a GGUF's vocabulary and rebuilding the tokenizer from it are a third of `spekula generate`'s
start-up; both depend only on the file's bytes and on the code that reads them. So their results are
written once, with `marshal` (plain values only: str, bytes, int, float, bool, None, tuples, lists,
dicts), under ``<cache dir>/headers/``, and read back by the next process that opens the same file.

An entry is found by the file's resolved path, size, inode and change times and a digest of the
source of the code that made it, and holds them again: an edited model file or an edited reader
misses and is rebuilt, and two versions of the code (two checkouts) keep an entry each. Entries are written to a temporary name and renamed, so concurrent processes
never read half of one; an unreadable entry is a miss. The directory keeps the `MAX_ENTRIES` most
recently written entries. Cache dir: $SPEKULA_CACHE_DIR, else $XDG_CACHE_HOME/spekula, else
~/.cache/spekula (as for the default model); when it cannot be written, nothing is cached. Entries
are trusted as the user's own files, like the models beside them (marshal checks no more than that).
"""

from __future__ import annotations

import hashlib
import marshal
import os
import sys
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

MAX_ENTRIES = 16
_SUFFIX = ".marshal"


def cache_root() -> Path:
    if explicit := os.environ.get("SPEKULA_CACHE_DIR"):
        return Path(explicit).expanduser() / "headers"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "spekula" / "headers"


@cache
def source_digest(module_file: str) -> str:
    """A digest of the source of the module that makes an entry (and of this Python's marshal format)."""
    h = hashlib.sha256(f"{sys.version_info[:2]} {marshal.version}".encode())
    try:
        h.update(Path(module_file).read_bytes())
    except OSError:  # no source beside the module (a zipped install): its path and mtime stand in
        h.update(module_file.encode())
    return h.hexdigest()[:16]


Identity = tuple[str, int, int, int, int]


def file_identity(path: str | os.PathLike[str]) -> Identity | None:
    """(resolved path, size, inode, mtime and ctime in ns) of a file, or None when it cannot be stat'ed.
    The inode tells a file replaced by a rename; ctime, one rewritten and then given its old mtime."""
    try:
        p = Path(path).resolve()
        st = p.stat()
    except OSError:
        return None
    return str(p), st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns


def _entry_path(kind: str, identity: Identity, code: str) -> Path:
    # The code's digest is in the name too: checkouts of different versions opening the same model (a
    # benchmark against the installed release, several worktrees) keep an entry each instead of
    # replacing each other's at every run.
    name = hashlib.sha256(repr((identity, code)).encode()).hexdigest()[:24]
    return cache_root() / f"{kind}-{name}{_SUFFIX}"


def load(kind: str, identity: Identity | None, code: str) -> Any:
    """The value stored for (kind, identity, code), or None on a miss."""
    if identity is None:
        return None
    try:
        with open(_entry_path(kind, identity, code), "rb") as fh:
            stored = marshal.loads(fh.read())  # marshal.load(fh) reads in small pieces: several times slower
    except (OSError, EOFError, ValueError, TypeError):
        return None
    if not (isinstance(stored, tuple) and len(stored) == 3 and stored[0] == list(identity) and stored[1] == code):
        return None
    return stored[2]


def store(kind: str, identity: Identity | None, code: str, value: Any) -> None:
    """Keep `value` for (kind, identity, code); best effort: a full or read-only disk caches nothing."""
    if identity is None:
        return
    target = _entry_path(kind, identity, code)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        data = marshal.dumps((list(identity), code, value))
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-", suffix=_SUFFIX)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        _evict(target.parent)
    except (OSError, ValueError):
        return


def _evict(root: Path) -> None:
    entries = []
    for p in root.glob(f"*{_SUFFIX}"):
        if p.name.startswith(".tmp-"):  # another process's entry, not renamed yet
            continue
        try:
            entries.append((p.stat().st_mtime_ns, p))
        except OSError:
            continue
    entries.sort(reverse=True)
    for _, p in entries[MAX_ENTRIES:]:
        p.unlink(missing_ok=True)
