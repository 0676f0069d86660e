"""Output files of `convert` and `truncate-model`: checked before the work, published atomically.

Both commands spend seconds to minutes before they write, so a path that cannot become a file (a
directory, a path below a regular file) is refused up front. The data goes to a temporary file beside
the target (same filesystem, so the final rename is atomic and a failed run leaves nothing behind).
That file is created with mode 0666 minus the umask, as any file the user writes (0644 typically),
and removing it after a failure never raises over the error that caused the failure.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

from spekula.core.errors import ConfigError


def _why(exc: OSError) -> str:
    return exc.strerror or str(exc)


def check_output_path(path: Path, option: str) -> None:
    """ConfigError when `path` cannot become a regular file; missing parent folders are fine (created later)."""
    if path.is_dir():
        raise ConfigError(f"{option} {path} is a directory; give the path of the file to write")
    # The nearest existing ancestor decides: a regular file there means the path can never exist.
    for parent in path.parents:
        if parent.is_dir():
            if not os.access(parent, os.W_OK | os.X_OK):
                raise ConfigError(f"cannot write {option} {path}: no permission to write in {parent}")
            return
        if parent.exists() or parent.is_symlink():
            raise ConfigError(f"cannot write {option} {path}: {parent} is not a directory")


def _new_temp_beside(path: Path, option: str) -> Path:
    """Create an empty, uniquely named file next to `path`, creating missing parent folders."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            # The name keeps the target's name as its prefix so that a leftover (after a kill -9)
            # is recognisable and globs like "out.gguf*" find it.
            tmp = path.with_name(f"{path.name}.{secrets.token_hex(4)}.part")
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # umask applies
            except FileExistsError:
                continue
            os.close(fd)
            return tmp
    except OSError as exc:
        raise ConfigError(f"cannot write {option} {path}: {_why(exc)}") from exc


def discard(tmp: Path) -> None:
    """Remove a temporary file if it is there; never raises, so the original error stays the one shown."""
    with contextlib.suppress(OSError):
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_output(path: Path, option: str) -> Iterator[Path]:
    """Yield a temporary path to write; on success it replaces `path`, on any failure it is removed.

    An OSError while writing (disk full, permissions changed meanwhile) becomes one ConfigError that
    names the option and the path. Only the writing belongs inside the block: an OSError from reading
    an input there would be reported as a write failure.
    """
    check_output_path(path, option)
    tmp = _new_temp_beside(path, option)
    try:
        yield tmp
        os.replace(tmp, path)
    except OSError as exc:
        discard(tmp)
        raise ConfigError(f"cannot write {option} {path}: {_why(exc)}") from exc
    except BaseException:
        discard(tmp)
        raise
