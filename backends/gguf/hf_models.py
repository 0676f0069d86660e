"""GGUF models from the Hugging Face hub: llama.cpp's `-hf user/repo[:quant]`, `-hff FILE` and `-hfd`.

Which file a repository yields follows llama.cpp (common/download.cpp, `find_best_model`):

- `--hf-file FILE` names the file (case-insensitive match on its path in the repo);
- else `:quant` picks the first GGUF whose path contains the tag followed by `.` or `-`, ignoring
  case (`:q4_k_m` finds `model-Q4_K_M.gguf` but `:Q4_K` does not find `model-Q4_K_S.gguf`);
- without a tag Q4_K_M is preferred, then Q8_0, then the first GGUF;
- a split model (`-00001-of-0000N.gguf`) is chosen by its first part, and every part is fetched
  into the same snapshot folder, where the loader finds them beside the first (modelfile/gguf_split.py);
- projector, importance-matrix and draft-head sidecars (mmproj, imatrix, mtp-, eagle3-, dflash-,
  dspark-) are never the model.

Where the file comes from, in order: the local hub cache (the layout and the reading of it are
huggingface_hub's: `scan_cache_dir`), then a download through `hf_hub_download` (its progress bar,
its cache) unless HF_HUB_OFFLINE is set, else a ConfigError that says what was searched and what to
do. The network is only touched on a cache miss, and its first request has a short timeout, so an
offline machine fails in seconds instead of hanging.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from spekula.core.errors import ConfigError

if TYPE_CHECKING:
    from huggingface_hub.utils import CachedRevisionInfo

log = structlog.get_logger("spekula.hf_models")

# Without a tag llama.cpp tries these, in order, before falling back to the first GGUF.
DEFAULT_QUANTS = ("Q4_K_M", "Q8_0")
# Substrings of a file name that mark a sidecar, never a model (llama.cpp's gguf_filename_is_model).
SIDECAR_MARKERS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")
_SPLIT = re.compile(r"^(?P<prefix>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
# The first request to the hub (listing the repo) answers in well under a second when the hub is
# reachable; anything slower is treated as "offline" rather than left to hang. HF_HUB_ETAG_TIMEOUT,
# huggingface_hub's own knob for its metadata requests, overrides it.
DEFAULT_TIMEOUT_S = 5.0
_TRUE = {"1", "ON", "YES", "TRUE"}  # huggingface_hub's reading of boolean env vars


@dataclass(frozen=True)
class HfModelSpec:
    """One `-hf`/`-hfd` request: repo, optional quant tag, optional explicit file."""

    repo_id: str
    quant: str | None = None
    filename: str | None = None
    option: str = "-hf"  # the option it came from, for messages
    local_option: str = "-m"  # the option that takes a local file instead

    @property
    def label(self) -> str:
        text = f"{self.option} {self.repo_id}" + (f":{self.quant}" if self.quant else "")
        return text + (f" --hf-file {self.filename}" if self.filename else "")


def parse_hf_repo(text: str, *, filename: str | None = None, option: str = "-hf",
                  local_option: str = "-m") -> HfModelSpec:
    """`user/repo[:quant]` -> HfModelSpec; llama.cpp accepts exactly one `/` in the repo part."""
    repo_id, sep, quant = text.strip().partition(":")
    if sep and (not quant or ":" in quant):
        raise ConfigError(f"{option} {text!r}: expected <user>/<repo>[:quant], "
                          "e.g. bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M")
    if repo_id.count("/") != 1:
        raise ConfigError(f"{option} {text!r}: expected <user>/<repo>[:quant], with exactly one '/'")
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise ConfigError(f"{option} {text!r}: {exc}") from None
    return HfModelSpec(repo_id=repo_id, quant=quant or None, filename=filename or None, option=option,
                       local_option=local_option)


# ---------------------------------------------------------------------------------------------
# File selection: pure functions over the repo's file list (paths relative to the repo root).
# ---------------------------------------------------------------------------------------------

def split_info(path: str) -> tuple[str, int, int]:
    """(prefix, part index, part count) of a GGUF path; (path, 1, 1) when it is not split."""
    m = _SPLIT.match(path)
    if m is None:
        return path, 1, 1
    return m["prefix"], int(m["index"]), int(m["count"])


def is_model_file(path: str) -> bool:
    name = path.rsplit("/", 1)[-1].lower()
    return name.endswith(".gguf") and not any(marker in name for marker in SIDECAR_MARKERS)


def select_model_file(files: Iterable[str], quant: str | None = None) -> str | None:
    """The repo file llama.cpp would load for `:quant` (None: Q4_K_M, then Q8_0, then the first GGUF).

    Paths are sorted first so the pick does not depend on the order a listing happens to return."""
    candidates = sorted(f for f in files if is_model_file(f) and split_info(f)[1] == 1)
    for tag in (quant,) if quant else DEFAULT_QUANTS:
        pattern = re.compile(re.escape(tag) + r"[.-]", re.IGNORECASE)
        for path in candidates:
            if pattern.search(path):
                return path
    if quant is None and candidates:
        return candidates[0]
    return None


def split_parts(files: Iterable[str], primary: str) -> list[str]:
    """Every file of `primary`'s split model (just `primary` when it is not split), in order."""
    prefix, _, count = split_info(primary)
    if count <= 1:
        return [primary]
    wanted = {f"{prefix}-{i:05d}-of-{count:05d}.gguf".lower(): i for i in range(1, count + 1)}
    found = sorted((wanted[f.lower()], f) for f in files if f.lower() in wanted)
    return [f for _, f in found]


def _choose(spec: HfModelSpec, files: list[str]) -> str | None:
    if spec.filename:
        wanted = spec.filename.strip("/").lower()
        return next((f for f in sorted(files) if f.lower() == wanted), None)
    return select_model_file(files, spec.quant)


def _gguf_list(files: Iterable[str]) -> str:
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf"))
    return ", ".join(ggufs) if ggufs else "none"


def _what(spec: HfModelSpec) -> str:
    if spec.filename:
        return f"file {spec.filename!r}"
    if spec.quant:
        return f"GGUF matching quant {spec.quant!r}"
    return "GGUF model file"


# ---------------------------------------------------------------------------------------------
# Environment: read when called, not at huggingface_hub's import, so that the variables of this
# process (and a test's monkeypatch) decide; the precedence is the library's own.
# ---------------------------------------------------------------------------------------------

def _expand(value: str) -> Path:
    return Path(os.path.expandvars(os.path.expanduser(value)))


def hub_cache_dir() -> Path:
    """HF_HUB_CACHE, else HUGGINGFACE_HUB_CACHE, else $HF_HOME/hub, else huggingface_hub's default."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return _expand(os.environ[var])
    if os.environ.get("HF_HOME"):
        return _expand(os.environ["HF_HOME"]) / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as set now. Offline mode forced on the library itself
    (huggingface_hub.constants) still holds: its requests then fail, and that is reported as offline."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in _TRUE


def network_timeout() -> float:
    try:
        return float(os.environ.get("HF_HUB_ETAG_TIMEOUT") or DEFAULT_TIMEOUT_S)
    except ValueError:
        return DEFAULT_TIMEOUT_S


# ---------------------------------------------------------------------------------------------
# Resolution
# ---------------------------------------------------------------------------------------------

def _cached_revision(repo_id: str, cache_dir: Path) -> CachedRevisionInfo | None:
    """The cached snapshot `main` points at, else one another ref points at, else the newest one."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.utils import CacheNotFound

    try:
        info = scan_cache_dir(cache_dir)
    except (CacheNotFound, ValueError, OSError):  # no cache yet, or the path is not a directory
        return None
    repo = next((r for r in info.repos if r.repo_type == "model" and r.repo_id == repo_id), None)
    if repo is None or not repo.revisions:
        return None
    revisions = sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True)
    return (next((r for r in revisions if "main" in r.refs), None)
            or next((r for r in revisions if r.refs), None)
            or revisions[0])


def _from_cache(spec: HfModelSpec, cache_dir: Path) -> tuple[Path | None, str]:
    """(the chosen file, with every part of a split model present; else None and what the cache lacks)."""
    revision = _cached_revision(spec.repo_id, cache_dir)
    if revision is None:
        return None, "the repository is not in the cache"
    snapshot = revision.snapshot_path
    by_name = {f.file_path.relative_to(snapshot).as_posix(): f.file_path for f in revision.files}
    files = sorted(by_name)
    primary = _choose(spec, files)
    if primary is None:
        return None, f"the cached copy has no {_what(spec)}; its GGUF files: {_gguf_list(files)}"
    count = split_info(primary)[2]
    if len(split_parts(files, primary)) < count:
        return None, f"the cached copy of split model {primary} lacks some of its {count} parts"
    return by_name[primary], ""


def _download(spec: HfModelSpec, cache_dir: Path, cache_note: str) -> Path:
    """List the repo on the hub, pick the file, download it (and its split parts) into the cache.

    Anything going wrong while talking to the hub (no network, DNS, proxy, timeout, HTTP error,
    offline mode forced in huggingface_hub) becomes a ConfigError: the library's exception types
    differ across its versions (requests, httpx, httpx2), so the net is deliberately wide."""
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.utils import GatedRepoError, RepositoryNotFoundError

    timeout = network_timeout()
    try:
        # One request without retries: list_repo_files/list_repo_tree go through http_backoff, which
        # retries network errors for about 20 s before giving up.
        info = HfApi().model_info(spec.repo_id, timeout=timeout)
    except GatedRepoError:
        raise ConfigError(f"{spec.label}: the repository is gated; accept its terms on huggingface.co and "
                          "log in (`hf auth login`) or set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise ConfigError(f"{spec.label}: no such repository on the Hugging Face hub (or it is private: "
                          "log in with `hf auth login` or set HF_TOKEN)") from None
    except Exception as exc:  # noqa: BLE001 - see the docstring
        reason = f"the Hugging Face hub is unreachable ({_describe(exc)})"
        raise _not_found(spec, cache_dir, cache_note, reason=reason) from None
    files = sorted(s.rfilename for s in info.siblings or ())
    primary = _choose(spec, files)
    if primary is None:
        raise ConfigError(f"{spec.label}: no {_what(spec)} in the repository; "
                          f"its GGUF files: {_gguf_list(files)}")
    parts = split_parts(files, primary)
    paths: dict[str, Path] = {}
    for part in parts:
        try:
            local = hf_hub_download(spec.repo_id, part, cache_dir=cache_dir, etag_timeout=timeout)
            paths[part] = Path(str(local))
        except Exception as exc:  # noqa: BLE001 - see the docstring
            raise ConfigError(f"{spec.label}: downloading {part} failed ({_describe(exc)}); "
                              f"retry, or fetch it with {_hint(spec)}") from None
    return paths[primary]


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _hint(spec: HfModelSpec) -> str:
    if spec.filename:
        return f"`hf download {spec.repo_id} {spec.filename}`"
    pattern = f"*{spec.quant}*.gguf" if spec.quant else "*.gguf"
    return f"`hf download {spec.repo_id} --include '{pattern}'`"


def _not_found(spec: HfModelSpec, cache_dir: Path, cache_note: str, *, reason: str) -> ConfigError:
    return ConfigError(
        f"{spec.label}: no {_what(spec)} in the Hugging Face cache {cache_dir} ({cache_note}), and {reason}; "
        f"download it on a connected machine with {_hint(spec)} (`huggingface-cli download` on older "
        "huggingface_hub; HF_HOME / HF_HUB_CACHE choose the cache), "
        f"or pass a local file with {spec.local_option}")


def resolve_hf_model(spec: HfModelSpec) -> Path:
    """The local path of the GGUF `spec` names: from the cache, else downloaded, else ConfigError."""
    cache_dir = hub_cache_dir()
    path, cache_note = _from_cache(spec, cache_dir)
    if path is not None:
        log.debug("hf_model_cached", repo=spec.repo_id, path=str(path))
        return path
    if hub_offline():
        reason = "HF_HUB_OFFLINE is set, so nothing is downloaded"
        raise _not_found(spec, cache_dir, cache_note, reason=reason)
    path = _download(spec, cache_dir, cache_note)
    log.info("hf_model_downloaded", repo=spec.repo_id, path=str(path))
    return path
