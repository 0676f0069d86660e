"""Slot files: one idle slot's cached tokens and its sequence's backend state, on disk (POST /slots?action=save).

A file is a fixed preamble, a JSON header and the payload, then a SHA-256 of everything before it:

    b"SPEKSLOT"  magic (8 bytes)
    u32 LE      format version (FORMAT_VERSION)
    u32 LE      header length H
    H bytes     JSON: the model's identity (architecture, name, vocabulary, layers, the GGUF's SHA-256), the
                backend's state format (Backend.seq_state_format), the slot's n_ctx, the token count and
                every array's name, dtype and shape in payload order
    payload     the tokens (int32 LE), then each array's bytes (C order, little-endian): the sequence's
                state (``seq/NAME``), then each drafter's saved slot state (``drafter/TYPE/NAME``)
    32 bytes    SHA-256 of all of the above

Reading checks all of it before anything is used: a wrong magic, another version, a bad header, a file
shorter or longer than its header says, a checksum that does not match (corrupt), another model or
another backend format (foreign) are each a SlotFileError saying which. Writing goes to a temporary file
in the same directory, fsynced, then renamed over the target (and the directory fsynced), so a reader
never sees half a file and a failed write (a full disk) leaves none.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import secrets
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from spekula.core.backend import ModelInfo, SeqState
from spekula.core.errors import SpekulaError

MAGIC = b"SPEKSLOT"
FORMAT_VERSION = 1
MAX_FILENAME_BYTES = 255  # one path component on common filesystems
_PREAMBLE = struct.Struct("<8sII")
_DIGEST = 32
_MAX_HEADER = 1 << 20


class SlotFileError(SpekulaError):
    """A slot file (or its name) that cannot be used; the message says why. Nothing was changed."""


def slot_path(directory: str | Path, filename: object) -> Path:
    """The file `filename` names inside `directory`: a plain name only (no separator, no `..`, no NUL,
    not empty, not absolute, at most MAX_FILENAME_BYTES bytes), else SlotFileError."""
    if not isinstance(filename, str) or not filename:
        raise SlotFileError("Invalid filename: a non-empty string is required")
    bad = ("/" in filename or "\\" in filename or "\0" in filename or filename in (".", "..") or ".." in filename
           or filename.startswith(".") or os.path.isabs(filename) or filename != filename.strip()
           or any(ord(ch) < 32 for ch in filename))
    if bad or len(filename.encode("utf-8", "surrogatepass")) > MAX_FILENAME_BYTES:
        raise SlotFileError(f"Invalid filename {filename!r}: a plain file name inside --slot-save-path is required "
                            f"(no path separators, '..', leading dot or control characters; at most "
                            f"{MAX_FILENAME_BYTES} bytes)")
    return Path(directory) / filename


_digests: dict[tuple[str, int, int], str] = {}


def model_digest(path: str) -> str:
    """SHA-256 of the model file, computed once per (path, size, mtime)."""
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    if key not in _digests:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            if st.st_size:
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                    for i in range(0, st.st_size, 1 << 24):
                        h.update(m[i : i + (1 << 24)])
        _digests[key] = h.hexdigest()
    return _digests[key]


def model_identity(info: ModelInfo) -> dict[str, Any]:
    """What a file must match to be restored into this model."""
    return {"arch": info.arch, "name": info.name, "n_vocab": info.n_vocab, "n_embd": info.n_embd,
            "n_layer": info.n_layer, "sha256": model_digest(info.path)}


@dataclass(frozen=True, slots=True)
class SlotImage:
    """What a slot file holds: the tokens naming the KV and the sequence's state at their length."""

    tokens: np.ndarray  # int32
    state: SeqState
    drafters: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # type -> its save_slot arrays


def _named_arrays(image: SlotImage) -> list[tuple[str, np.ndarray]]:
    named = [(f"seq/{n}", a) for n, a in image.state.arrays.items()]
    for drafter, arrays in image.drafters.items():
        named += [(f"drafter/{drafter}/{n}", a) for n, a in arrays.items()]
    return [(n, np.ascontiguousarray(a, a.dtype.newbyteorder("<"))) for n, a in named]


def write_slot_file(path: Path, image: SlotImage, *, model: dict[str, Any], state_format: str, n_ctx: int) -> int:
    """Write `image` to `path` atomically; the bytes written. OSError (e.g. a full disk) leaves no file behind."""
    arrays = _named_arrays(image)
    header = json.dumps({
        "model": model, "state_format": state_format, "n_ctx": int(n_ctx), "n_tokens": int(image.tokens.size),
        "length": int(image.state.length),
        "arrays": [{"name": n, "dtype": a.dtype.str, "shape": list(a.shape)} for n, a in arrays],
    }).encode()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")  # writers never share one
    h = hashlib.sha256()
    n = 0
    try:
        with open(tmp, "wb") as f:
            payload = (memoryview(a.reshape(-1).view(np.uint8)) for _, a in arrays)  # no copies of the KV
            for chunk in (_PREAMBLE.pack(MAGIC, FORMAT_VERSION, len(header)), header,
                          np.ascontiguousarray(image.tokens, "<i4").tobytes(), *payload):
                h.update(chunk)
                f.write(chunk)
                n += len(chunk)
            f.write(h.digest())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return n + _DIGEST


def _fsync_dir(directory: Path) -> None:
    """Make the rename durable (where the platform can open a directory)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_slot_file(path: Path, *, model: dict[str, Any], state_format: str, n_ctx: int) -> tuple[SlotImage, int]:
    """The image in `path` and the bytes read, after every check in the module's docstring; SlotFileError else."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise SlotFileError(f"no slot file {path.name!r} in --slot-save-path") from None
    except OSError as exc:
        raise SlotFileError(f"cannot read slot file {path.name!r}: {exc.strerror or exc}") from None
    if len(data) < _PREAMBLE.size + _DIGEST:
        raise SlotFileError(f"{path.name!r} is not a spekula slot file (too short)")
    magic, version, n_header = _PREAMBLE.unpack_from(data)
    if magic != MAGIC:
        raise SlotFileError(f"{path.name!r} is not a spekula slot file (no {MAGIC.decode()} magic)")
    if version != FORMAT_VERSION:
        raise SlotFileError(f"{path.name!r} is slot file version {version}; this spekula reads version {FORMAT_VERSION}")
    body = memoryview(data)[: len(data) - _DIGEST]
    if n_header > _MAX_HEADER or _PREAMBLE.size + n_header > len(body):
        raise SlotFileError(f"{path.name!r} is truncated or corrupt (its header runs past the end)")
    if hashlib.sha256(body).digest() != data[-_DIGEST:]:
        raise SlotFileError(f"{path.name!r} is corrupt or truncated (its checksum does not match)")
    try:
        header = json.loads(bytes(body[_PREAMBLE.size : _PREAMBLE.size + n_header]))
        saved_model, saved_format = header["model"], header["state_format"]
        n_tokens, length = int(header["n_tokens"]), int(header["length"])
        specs = [(str(a["name"]), np.dtype(a["dtype"]), tuple(int(d) for d in a["shape"])) for a in header["arrays"]]
        if not isinstance(saved_model, dict) or not isinstance(saved_format, str):
            raise TypeError("its model or state format is not what a slot file holds")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SlotFileError(f"{path.name!r} has a bad header: {exc}") from None
    for name, dt, shape in specs:  # plain numbers only: nothing in a file may make objects
        if dt.kind not in "biuf" or dt.hasobject or any(d < 0 for d in shape):
            raise SlotFileError(f"{path.name!r} has a bad header: array {name!r} is {dt} {shape}")
    if saved_model != model:
        diff = sorted(k for k in set(model) | set(saved_model) if model.get(k) != saved_model.get(k))
        raise SlotFileError(f"{path.name!r} was saved from another model (differs in {', '.join(diff)}: "
                            f"{saved_model.get('name')!r}, {saved_model.get('arch')})")
    if saved_format != state_format:
        raise SlotFileError(f"{path.name!r} holds a state of another backend or dtype ({saved_format!r}; this server's "
                            f"is {state_format!r})")
    if not 0 <= length == n_tokens <= n_ctx:
        raise SlotFileError(f"{path.name!r} holds {n_tokens} tokens at length {length}; this server's slots hold "
                            f"up to {n_ctx}")
    o = _PREAMBLE.size + n_header
    sizes = [n_tokens * 4] + [dt.itemsize * math.prod(shape) for _, dt, shape in specs]
    if o + sum(sizes) != len(body):
        raise SlotFileError(f"{path.name!r} is truncated or corrupt (its payload is not the size its header says)")
    tokens = np.frombuffer(body, "<i4", n_tokens, o).astype(np.int32)
    o += sizes[0]
    arrays: dict[str, np.ndarray] = {}
    drafters: dict[str, dict[str, np.ndarray]] = {}
    for (name, dt, shape), size in zip(specs, sizes[1:], strict=True):
        arr = np.frombuffer(body, dt, size // dt.itemsize, o).reshape(shape).astype(dt.newbyteorder("="))
        o += size
        part, _, rest = name.partition("/")
        if part == "seq" and rest:
            arrays[rest] = arr
        elif part == "drafter" and rest.count("/") == 1 and "" not in rest.split("/"):
            drafter, key = rest.split("/")
            drafters.setdefault(drafter, {})[key] = arr
        else:
            raise SlotFileError(f"{path.name!r} has a bad header: an array named {name!r}")
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= int(model["n_vocab"])):
        raise SlotFileError(f"{path.name!r} holds token ids outside the vocabulary")
    return SlotImage(tokens, SeqState(length, arrays), drafters), len(data)
