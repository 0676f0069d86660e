"""Where exported ONNX graphs live, and how a cached export is trusted or rejected.

Layout under ``<cache dir>/onnx/`` (cache dir: $SPEKULA_CACHE_DIR, else $XDG_CACHE_HOME/spekula, else
~/.cache/spekula, as for the default model):

  gguf-hashes.json                    sha256 of each GGUF seen, keyed by path, with size + mtime_ns
  <gguf sha256>-v<N>-<variant>.onnx   the graph (small; weights are external)
  <...>.onnx.data                     the weights, page-aligned so ORT can map them
  <...>.json                          manifest: size, mtime_ns and sha256 of both files, written last

A manifest is written only after both files are complete, so a crash mid-export leaves no manifest
and the export is redone. On load the files must match the manifest's sizes; if their mtimes moved
(someone touched or rewrote them) the sha256 is recomputed and compared, so a corrupt file is caught
without rehashing hundreds of MB on every start.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger("spekula.onnx")

_CHUNK = 1 << 22


def cache_dir() -> Path:
    # Same rule as backends/gguf/default_model.py (not imported: backends do not depend on frontends).
    if env := os.environ.get("SPEKULA_CACHE_DIR"):
        return Path(env).expanduser()
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg).expanduser() / "spekula"
    return Path.home() / ".cache" / "spekula"


def onnx_dir() -> Path:
    return cache_dir() / "onnx"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _stamp(path: Path) -> dict[str, int]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


def gguf_sha256(model_path: str | os.PathLike[str]) -> str:
    """The GGUF's content hash, memoized by (path, size, mtime) so a 100 MB file is hashed once."""
    path = Path(model_path).resolve()
    memo_path = onnx_dir() / "gguf-hashes.json"
    memo = _read_json(memo_path) or {}
    stamp = _stamp(path)
    entry = memo.get(str(path))
    if isinstance(entry, dict) and all(entry.get(k) == v for k, v in stamp.items()) and "sha256" in entry:
        return str(entry["sha256"])
    digest = sha256_file(path)
    memo[str(path)] = {**stamp, "sha256": digest}
    if isinstance(entry, dict) and entry.get("sha256") not in (None, digest):
        _drop_orphans(str(entry["sha256"]), memo)
    with contextlib.suppress(OSError):  # a read-only cache only costs a rehash next time
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(memo_path, memo)
    return digest


def model_sha256(shard_paths: list[Path]) -> str:
    """The content hash of a model: its file's, or for a split model one over every shard's, so that
    an edit to any shard misses the cache."""
    digests = [gguf_sha256(p) for p in shard_paths]
    if len(digests) == 1:
        return digests[0]
    return hashlib.sha256(" ".join(digests).encode()).hexdigest()


def _drop_orphans(old_digest: str, memo: dict[str, Any]) -> None:
    """The file at a known path changed: its old exports are garbage unless another path has that content."""
    if any(isinstance(e, dict) and e.get("sha256") == old_digest for e in memo.values()):
        return
    for graph in onnx_dir().glob(f"{old_digest}-v*.onnx"):
        remove_export(graph)


def manifest_path(onnx_path: Path) -> Path:
    return onnx_path.with_suffix(".json")


def write_manifest(onnx_path: Path, members: list[Path], meta: dict[str, Any]) -> None:
    """Record `members` (files in onnx_path's folder) as the export's content; written last."""
    files = {p.name: {**_stamp(p), "sha256": sha256_file(p)} for p in members}
    write_json_atomic(manifest_path(onnx_path), {**meta, "files": files})


def verify_export(onnx_path: Path, meta: dict[str, Any]) -> str | None:
    """None when the cached export can be used, else why not (logged by the caller)."""
    manifest = _read_json(manifest_path(onnx_path))
    if manifest is None:
        return "no manifest"
    for key, value in meta.items():
        if manifest.get(key) != value:
            return f"manifest {key} differs"
    files = manifest.get("files")
    if not isinstance(files, dict) or onnx_path.name not in files:
        return "manifest lists no files"
    changed = False
    for name, rec in files.items():
        path = onnx_path.parent / name
        if not path.is_file():
            return f"{name} missing"
        stamp = _stamp(path)
        if stamp["size"] != rec.get("size"):
            return f"{name} has {stamp['size']} bytes, manifest says {rec.get('size')}"
        if stamp["mtime_ns"] != rec.get("mtime_ns"):
            if sha256_file(path) != rec.get("sha256"):
                return f"{name} checksum mismatch"
            rec["mtime_ns"] = stamp["mtime_ns"]  # same content, new mtime: remember it
            changed = True
    if changed:
        with contextlib.suppress(OSError):
            write_json_atomic(manifest_path(onnx_path), manifest)
    return None


def remove_export(onnx_path: Path) -> None:
    for p in (manifest_path(onnx_path), onnx_path, onnx_path.with_name(onnx_path.name + ".data")):
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
