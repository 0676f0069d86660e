"""Trained draft heads shipped with spekula, found by the target file they were trained for.

``drafters/model/heads/`` (package data; ``$SPEKULA_HEADS_DIR`` replaces it, for tests and for trying heads
out) holds GGUF heads and ``index.json``, a JSON list of entries::

    {"file": "smollm2-eagle3.gguf", "kind": "eagle3" | "dflash", "target": "sha256:<hex>",
     "target_name": "SmolLM2-135M-Instruct.Q4_1", "recipe": "how it was trained"}

``--spec-type draft-eagle3`` or ``draft-dflash`` without ``-md`` runs the head whose ``kind`` matches
and whose ``target`` is the loaded target's fingerprint.

The fingerprint is the sha256 of the whole target file. A head is trained on one file's hidden
states and vocabulary; any other file (another quantization of the same model included) may compute
different features, so only identical bytes may share a head, and a hash of everything is the one
rule that never matches a different file. It costs one read of the file the first time that file is
looked up: the digest is memoised per (path, size, mtime_ns) in the user cache, in the same table the
ONNX exports key their graphs by (backends/onnx/cache.py), so a file is hashed once for both. An
empty index (or one without the asked kind) hashes nothing.

``register_head`` installs a freshly trained head (``make drafter``): it copies the GGUF into the
folder and rewrites index.json atomically, replacing an entry for the same target and kind.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import structlog

from spekula.backends.convert.output import atomic_output
from spekula.backends.onnx.cache import gguf_sha256
from spekula.core.errors import ConfigError, ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile

log = structlog.get_logger("spekula.drafters")

HEADS_ENV = "SPEKULA_HEADS_DIR"
INDEX = "index.json"
KINDS = ("eagle3", "dflash")  # index kinds = GGUF architectures of the head files
_FIELDS = ("file", "kind", "target", "target_name", "recipe")


@dataclass(frozen=True, slots=True)
class HeadEntry:
    file: str  # a name inside the heads folder
    kind: str
    target: str  # target_fingerprint of the file the head was trained for
    target_name: str
    recipe: str


def shipped_heads_dir() -> Path:
    """$SPEKULA_HEADS_DIR, else the package's own drafters/model/heads/."""
    env = os.environ.get(HEADS_ENV)
    return Path(env).expanduser() if env else Path(__file__).resolve().parent / "heads"


def target_fingerprint(path: str | os.PathLike[str]) -> str:
    """``"sha256:<hex>"`` of the target file's bytes (memoised; see the module docstring)."""
    p = Path(path)
    if not p.is_file():
        raise ModelFileError(p, "no such file (a target fingerprint needs the model file)")
    return f"sha256:{gguf_sha256(p)}"


def load_index(folder: Path) -> list[HeadEntry]:
    """The entries of ``folder``/index.json; none when the file is absent, ModelFileError naming it when
    it is not a list of well-formed entries."""
    path = folder / INDEX
    if not path.is_file():
        return []
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelFileError(path, f"unreadable shipped-heads index: {exc}") from None
    if not isinstance(data, list):
        raise ModelFileError(path, "the shipped-heads index must be a JSON list of entries")
    entries: list[HeadEntry] = []
    for i, item in enumerate(data):
        if not isinstance(item, dict) or any(not isinstance(item.get(k), str) for k in _FIELDS):
            raise ModelFileError(path, f"entry {i} must be an object with string fields {', '.join(_FIELDS)}")
        entry = HeadEntry(**{k: item[k] for k in _FIELDS})
        if entry.kind not in KINDS:
            raise ModelFileError(path, f"entry {i}: kind {entry.kind!r} is not one of {', '.join(KINDS)}")
        if Path(entry.file).name != entry.file or entry.file in ("", ".", ".."):
            raise ModelFileError(path, f"entry {i}: file {entry.file!r} must be a plain name inside {folder}")
        entries.append(entry)
    return entries


def find_shipped_head(target_path: str | os.PathLike[str], kind: str) -> Path | None:
    """The shipped head of ``kind`` trained for this target file, or None."""
    if kind not in KINDS:
        raise ConfigError(f"unknown head kind {kind!r}; choose one of {', '.join(KINDS)}")
    folder = shipped_heads_dir()
    candidates = [e for e in load_index(folder) if e.kind == kind]
    if not candidates:
        return None
    fingerprint = target_fingerprint(target_path)
    for entry in candidates:
        if entry.target == fingerprint:
            head = folder / entry.file
            if not head.is_file():
                raise ModelFileError(folder / INDEX, f"lists {entry.file!r}, which is not in {folder}")
            return head
    return None


def shipped_draft_path(name: str, target_path: str) -> str:
    """For a drafter ``name`` (draft-eagle3, ...) given no -md: the shipped head for the target, logged;
    otherwise the ConfigError that says how to get one."""
    kind = name.removeprefix("draft-")
    hint = ""
    if kind in KINDS:
        head = find_shipped_head(target_path, kind)
        if head is not None:
            log.info("using a shipped draft head", drafter=name, file=str(head))
            return str(head)
        hint = (f"; no shipped {kind} head matches {target_path}, and `spekula train-drafter {kind} "
                f"-m {target_path} -o DIR` can train one")
    raise ConfigError(f"{name} needs a draft model: pass -md/--spec-draft-model FILE.gguf{hint}")


def register_head(heads_dir: str | os.PathLike[str], gguf_file: str | os.PathLike[str], kind: str,
                  target_path: str | os.PathLike[str], recipe: str) -> Path:
    """Install ``gguf_file`` (a head of ``kind`` trained for ``target_path``) into ``heads_dir`` and list
    it in index.json, replacing any entry for the same target and kind or the same file name (a
    replaced head's file is removed). Returns the installed file's path."""
    folder, src = Path(heads_dir), Path(gguf_file)
    if kind not in KINDS:
        raise ConfigError(f"unknown head kind {kind!r}; choose one of {', '.join(KINDS)}")
    head = GGUFFile(src)
    if head.architecture != kind or head.has_tensor("markov_w1.weight"):
        what = "dspark" if head.has_tensor("markov_w1.weight") else head.architecture
        raise ModelFileError(src, f"is a {what} model, but it is being registered as kind {kind!r}")
    target = GGUFFile(target_path)
    entry = HeadEntry(file=src.name, kind=kind, target=target_fingerprint(target_path),
                      target_name=str(target.get("general.name") or Path(target_path).stem), recipe=recipe)
    old = load_index(folder)
    entries = [e for e in old if e.file != entry.file and (e.kind, e.target) != (entry.kind, entry.target)]
    dst = folder / entry.file
    if not (dst.exists() and dst.resolve() == src.resolve()):
        with atomic_output(dst, "the shipped head") as tmp:
            shutil.copyfile(src, tmp)
    text = json.dumps([asdict(e) for e in [*entries, entry]], indent=1) + "\n"
    # renamed into place: a reader (a starting engine) sees the old index or the new, never half of one
    with atomic_output(folder / INDEX, "the shipped-heads index") as tmp:
        tmp.write_text(text, encoding="utf-8")
    for gone in {e.file for e in old} - {e.file for e in [*entries, entry]}:
        (folder / gone).unlink(missing_ok=True)  # the head this one replaces: nothing lists it any more
    return dst
