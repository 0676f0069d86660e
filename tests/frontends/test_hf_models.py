"""-hf/--hf-repo, -hff/--hf-file and -hfd through huggingface_hub, never touching the network.

Every test builds a hub cache in tmp_path in huggingface_hub's own layout
(models--user--repo/{blobs, refs/main, snapshots/<commit>/<file> -> ../../blobs/<hash>}), points
HF_HUB_CACHE/HF_HOME at it and sets HF_HUB_OFFLINE=1, except where a test checks what happens with
offline mode unset: there the hub is either a stub or a closed port on localhost.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import huggingface_hub
import pytest
from cli_helpers import run_cli, spekula_cmd

from spekula.backends.gguf import hf_models
from spekula.backends.gguf.hf_models import (
    hub_cache_dir,
    parse_hf_repo,
    resolve_hf_model,
    select_model_file,
    split_parts,
)
from spekula.core.errors import ConfigError, ModelFileError
from spekula.fixtures.gguf_split_writer import write_split
from spekula.fixtures.tiny_gguf import tiny_model_path
from spekula.frontends.cli.options import (
    add_engine_options,
    build_engine,
    resolve_draft_path,
    resolve_model_path,
)

pytestmark = pytest.mark.timeout(300)

COMMIT = "0123456789abcdef0123456789abcdef01234567"
HF_ENV = ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
          "HF_ENDPOINT", "HF_HUB_ETAG_TIMEOUT")


def make_repo(cache: Path, repo_id: str, files: dict[str, bytes | Path], *, ref: str | None = "main",
              commit: str = COMMIT) -> Path:
    """A cached repo as hf_hub_download leaves it: content-addressed blobs, snapshot symlinks, a ref."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "blobs").mkdir(exist_ok=True)
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    for name, content in files.items():
        data = content.read_bytes() if isinstance(content, Path) else content
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snapshot


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty offline hub cache at tmp_path/hf/hub, found through HF_HOME and HF_HUB_CACHE alike."""
    for var in HF_ENV:
        monkeypatch.delenv(var, raising=False)
    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


@pytest.fixture(scope="module")
def llama() -> Path:
    return tiny_model_path("llama")


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(exit_on_error=False)
    add_engine_options(p)
    return p.parse_args(list(argv))


def hf_env(cache: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in HF_ENV}
    return {**env, "OMP_NUM_THREADS": "1", "HF_HUB_CACHE": str(cache), "HF_HOME": str(cache.parent), **extra}


def run_hf_cli(*args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`spekula ARGS...` as cli_helpers.run_cli runs it, with the hub variables of `env`."""
    return subprocess.run([*spekula_cmd(), *args], capture_output=True, text=True, env=env, timeout=timeout,
                          stdin=subprocess.DEVNULL)


# --- selection (llama.cpp's find_best_model) ---------------------------------------------------

QUANTS = ["model-Q2_K.gguf", "model-Q4_K_S.gguf", "model-Q8_0.gguf", "model-Q4_K_M.gguf", "README.md"]


def test_quant_tag_selects_case_insensitively() -> None:
    assert select_model_file(QUANTS, "Q8_0") == "model-Q8_0.gguf"
    assert select_model_file(QUANTS, "q4_k_s") == "model-Q4_K_S.gguf"
    # The tag must end at '.' or '-' as in llama.cpp: Q4_K is not a prefix match for Q4_K_M / Q4_K_S.
    assert select_model_file(QUANTS, "Q4_K") is None
    assert select_model_file(QUANTS, "Q5_K_M") is None


def test_default_prefers_q4_k_m_then_q8_0_then_first_gguf() -> None:
    assert select_model_file(QUANTS) == "model-Q4_K_M.gguf"
    assert select_model_file([f for f in QUANTS if "Q4_K_M" not in f]) == "model-Q8_0.gguf"
    assert select_model_file(["b-F16.gguf", "a-Q2_K.gguf", "notes.txt"]) == "a-Q2_K.gguf"
    assert select_model_file(["README.md"]) is None


def test_sidecars_are_never_the_model() -> None:
    files = ["mmproj-model-f16.gguf", "mmproj-Q4_K_M.gguf", "model.imatrix.gguf", "tiny-F16.gguf"]
    assert select_model_file(files) == "tiny-F16.gguf"
    assert select_model_file(files, "f16") == "tiny-F16.gguf"
    assert select_model_file(["mmproj-F16.gguf"]) is None


def test_split_model_takes_the_first_part() -> None:
    files = [f"Q4_K_M/big-Q4_K_M-{i:05d}-of-00003.gguf" for i in (3, 1, 2)] + ["big-Q8_0.gguf"]
    primary = select_model_file(files)
    assert primary == "Q4_K_M/big-Q4_K_M-00001-of-00003.gguf"
    assert split_parts(files, primary) == [f"Q4_K_M/big-Q4_K_M-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
    assert split_parts(files, "big-Q8_0.gguf") == ["big-Q8_0.gguf"]


@pytest.mark.parametrize("text", ["noslash", "a/b/c", "user/repo:", "user/repo:Q4:Q8", "bad name/x"])
def test_malformed_repo_is_config_error(text: str) -> None:
    with pytest.raises(ConfigError, match="-hf"):
        parse_hf_repo(text)


def test_repo_and_quant_parse() -> None:
    spec = parse_hf_repo("user/repo:q8_0", filename=None)
    assert (spec.repo_id, spec.quant, spec.filename) == ("user/repo", "q8_0", None)
    assert parse_hf_repo("user/repo").quant is None


# --- the cache ----------------------------------------------------------------------------------

def test_cache_dir_follows_hf_home_and_hf_hub_cache(hub: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    assert hub_cache_dir() == hub
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "elsewhere"))
    assert hub_cache_dir() == tmp_path / "elsewhere" / "hub"


def test_quant_and_default_resolve_from_the_cache(hub: Path) -> None:
    snap = make_repo(hub, "user/repo", {name: name.encode() for name in QUANTS})
    assert resolve_hf_model(parse_hf_repo("user/repo:Q8_0")) == snap / "model-Q8_0.gguf"
    assert resolve_hf_model(parse_hf_repo("user/repo:q4_k_s")) == snap / "model-Q4_K_S.gguf"
    assert resolve_hf_model(parse_hf_repo("user/repo")) == snap / "model-Q4_K_M.gguf"
    # A symlink into blobs/ in huggingface_hub's layout, which the loaders read through.
    assert (snap / "model-Q4_K_M.gguf").is_symlink()
    assert (snap / "model-Q4_K_M.gguf").read_bytes() == b"model-Q4_K_M.gguf"


def test_explicit_hf_file_wins_over_the_tag(hub: Path) -> None:
    snap = make_repo(hub, "user/repo", {"sub/Other-F16.gguf": b"x", "model-Q4_K_M.gguf": b"y"})
    args = _parse("-hf", "user/repo:Q4_K_M", "-hff", "sub/other-f16.GGUF")
    assert resolve_model_path(args) == str(snap / "sub/Other-F16.gguf")
    with pytest.raises(ConfigError, match=r"no file 'missing.gguf'.*Other-F16.gguf"):
        resolve_model_path(_parse("-hf", "user/repo", "-hff", "missing.gguf"))


def test_mmproj_is_not_picked_from_the_cache(hub: Path) -> None:
    snap = make_repo(hub, "user/vision", {"mmproj-F16.gguf": b"p", "vision-F16.gguf": b"m"})
    assert resolve_hf_model(parse_hf_repo("user/vision")) == snap / "vision-F16.gguf"
    assert resolve_hf_model(parse_hf_repo("user/vision:F16")) == snap / "vision-F16.gguf"


def test_split_model_in_the_cache_needs_every_part(hub: Path) -> None:
    parts = {f"big-Q4_K_M-{i:05d}-of-00002.gguf": bytes([i]) for i in (1, 2)}
    snap = make_repo(hub, "user/split", parts)
    assert resolve_hf_model(parse_hf_repo("user/split")) == snap / "big-Q4_K_M-00001-of-00002.gguf"
    make_repo(hub, "user/half", dict(list(parts.items())[:1]))
    with pytest.raises(ConfigError, match="user/half.*lacks some of its 2 parts"):
        resolve_hf_model(parse_hf_repo("user/half"))


def test_main_ref_chooses_the_snapshot(hub: Path) -> None:
    old = "f" * 40
    make_repo(hub, "user/repo", {"model-Q8_0.gguf": b"old"}, ref=None, commit=old)
    snap = make_repo(hub, "user/repo", {"model-Q8_0.gguf": b"new"})
    os.utime(hub / "models--user--repo" / "snapshots" / old, (time.time() + 100,) * 2)
    assert resolve_hf_model(parse_hf_repo("user/repo")) == snap / "model-Q8_0.gguf"


def test_missing_repo_names_repo_quant_and_cache(hub: Path) -> None:
    with pytest.raises(ConfigError) as err:
        resolve_model_path(_parse("-hf", "nobody/nothing:Q5_K_M"))
    text = str(err.value)
    assert "-hf nobody/nothing:Q5_K_M" in text and str(hub) in text and "HF_HUB_OFFLINE" in text
    assert "hf download nobody/nothing --include '*Q5_K_M*.gguf'" in text and "-m" in text


def test_cached_repo_without_the_quant_lists_what_it_has(hub: Path) -> None:
    make_repo(hub, "user/repo", {"model-Q8_0.gguf": b"x"})
    with pytest.raises(ConfigError, match=r"user/repo:Q2_K.*cached copy has no .*GGUF files: model-Q8_0.gguf"):
        resolve_hf_model(parse_hf_repo("user/repo:Q2_K"))


def test_hf_repo_via_hf_home_only(hub: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    snap = make_repo(hub, "user/repo", {"model-Q8_0.gguf": b"x"})
    monkeypatch.delenv("HF_HUB_CACHE")  # HF_HOME=<tmp>/hf, so the cache is <tmp>/hf/hub
    assert resolve_hf_model(parse_hf_repo("user/repo")) == snap / "model-Q8_0.gguf"


# --- options ------------------------------------------------------------------------------------

def test_model_and_hf_repo_together_is_an_error(hub: Path) -> None:
    with pytest.raises(ConfigError, match="-m/--model or -hf/--hf-repo, not both"):
        build_engine(_parse("-m", "x.gguf", "-hf", "user/repo"))
    with pytest.raises(ConfigError, match="-md/--spec-draft-model or -hfd/--spec-draft-hf, not both"):
        build_engine(_parse("-m", "x.gguf", "-md", "d.gguf", "-hfd", "user/repo"))
    with pytest.raises(ConfigError, match="give -hf too"):
        build_engine(_parse("-hff", "model.gguf"))


def test_llama_cpp_option_spellings(hub: Path) -> None:
    for flag in ("-hf", "-hfr", "--hf-repo"):
        assert _parse(flag, "u/r:Q8_0").hf_repo == "u/r:Q8_0"
    for flag in ("-hfd", "-hfrd", "--hf-repo-draft", "--spec-draft-hf"):
        assert _parse(flag, "u/d").spec_draft_hf == "u/d"
    assert _parse("-hff", "f.gguf").hf_file == "f.gguf" and _parse("--hf-file", "f.gguf").hf_file == "f.gguf"


def test_draft_repo_resolves_like_md(hub: Path, llama: Path) -> None:
    snap = make_repo(hub, "fake/draft", {"draft-Q8_0.gguf": llama})
    assert resolve_draft_path(_parse("-hfd", "fake/draft")) == str(snap / "draft-Q8_0.gguf")
    assert resolve_draft_path(_parse("-md", "d.gguf")) == "d.gguf" and resolve_draft_path(_parse()) is None
    with pytest.raises(ConfigError, match=r"-hfd fake/absent.*or pass a local file with -md"):
        resolve_draft_path(_parse("-hfd", "fake/absent"))


def test_corrupt_hf_model_is_a_model_file_error(hub: Path) -> None:
    make_repo(hub, "user/bad", {"bad-Q8_0.gguf": b"GGUF" + b"\x00" * 10})
    with pytest.raises(ModelFileError, match="bad-Q8_0.gguf"):  # not the embedded default's advice
        build_engine(_parse("-hf", "user/bad"))


# --- the network, stubbed -----------------------------------------------------------------------

class _Sibling:
    def __init__(self, name: str) -> None:
        self.rfilename = name


def test_no_network_without_offline_mode_is_a_clear_error(hub: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE")
    calls: list[Any] = []

    def unreachable(self: Any, repo_id: str, **kw: Any) -> Any:
        calls.append(kw.get("timeout"))
        raise ConnectionError("[Errno -3] Temporary failure in name resolution")

    def no_download(*a: Any, **kw: Any) -> str:
        raise AssertionError("no download without a listing")

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", unreachable)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_download)
    with pytest.raises(ConfigError) as err:
        resolve_model_path(_parse("-hf", "user/repo:Q4_K_M"))
    text = str(err.value)
    assert "user/repo:Q4_K_M" in text and str(hub) in text and "unreachable" in text
    assert "Temporary failure in name resolution" in text and "Traceback" not in text
    assert calls and 0 < calls[0] <= hf_models.DEFAULT_TIMEOUT_S  # fails fast, not the library's long wait


def test_download_goes_to_the_cache_with_every_split_part(hub: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE")
    parts = ["big-Q4_K_M-00001-of-00002.gguf", "big-Q4_K_M-00002-of-00002.gguf"]
    remote = ["README.md", "mmproj-F16.gguf", *parts, "big-Q8_0.gguf"]
    fetched: list[tuple[str, str]] = []

    class Info:
        siblings = [_Sibling(n) for n in remote]

    def download(repo_id: str, filename: str, *, cache_dir: Any, etag_timeout: float, **kw: Any) -> str:
        fetched.append((repo_id, filename))
        assert Path(cache_dir) == hub and etag_timeout <= hf_models.DEFAULT_TIMEOUT_S
        return str(make_repo(hub, repo_id, {filename: filename.encode()}) / filename)

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, repo_id, **kw: Info())
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    path = resolve_hf_model(parse_hf_repo("user/remote"))
    assert path.name == "big-Q4_K_M-00001-of-00002.gguf"
    assert fetched == [("user/remote", part) for part in parts]
    # Now cached: a second resolution stays offline.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_hf_model(parse_hf_repo("user/remote")) == path
    # A tag the hub listing lacks: the error lists what the repository has.
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with pytest.raises(ConfigError, match=r"no GGUF matching quant 'Q2_K' in the repository; .*big-Q8_0.gguf"):
        resolve_hf_model(parse_hf_repo("user/remote:Q2_K"))


def test_repository_not_found_on_the_hub(hub: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE")
    from huggingface_hub.utils import RepositoryNotFoundError

    def missing(self: Any, repo_id: str, **kw: Any) -> Any:
        # Built without an HTTP response, whose type differs across huggingface_hub versions.
        err = RepositoryNotFoundError.__new__(RepositoryNotFoundError)
        Exception.__init__(err, "404 Client Error: Repository Not Found")
        raise err

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", missing)
    with pytest.raises(ConfigError, match="-hf user/gone: no such repository on the Hugging Face hub"):
        resolve_hf_model(parse_hf_repo("user/gone"))


# --- the real command ----------------------------------------------------------------------------

def test_generate_from_the_hub_cache_end_to_end(tmp_path: Path, llama: Path) -> None:
    cache = tmp_path / "hf" / "hub"
    make_repo(cache, "fake/tiny", {"tiny-Q8_0.gguf": llama, "mmproj-tiny-F16.gguf": b"not a model"})
    env = hf_env(cache, HF_HUB_OFFLINE="1")
    args = ["-n", "4", "--temp", "0", "-p", "hi", "--json"]
    via_hub = run_hf_cli("generate", "-hf", "fake/tiny", *args, env=env)
    assert via_hub.returncode == 0 and "Traceback" not in via_hub.stderr, via_hub.stderr
    direct = run_cli("generate", "-m", str(llama), *args)
    assert direct.returncode == 0, direct.stderr
    assert json.loads(via_hub.stdout)["tokens"] == json.loads(direct.stdout)["tokens"]
    assert len(json.loads(via_hub.stdout)["tokens"]) == 4
    # The same repo as the draft model, given to draft-simple exactly like -md: every token accepted.
    # Fixed lengths: a draft model as dear as the target is rightly not asked by the cost model.
    drafted = run_hf_cli("generate", "-hf", "fake/tiny", "-hfd", "fake/tiny:Q8_0", "--spec-type", "draft-simple",
                         "--spec-adaptive", "off", *args, env=env)
    assert drafted.returncode == 0, drafted.stderr
    timings = json.loads(drafted.stdout)["timings"]
    assert timings["draft_n"] > 0 and timings["draft_n_accepted"] == timings["draft_n"]


def test_split_model_from_the_hub_cache_end_to_end(tmp_path: Path, llama: Path) -> None:
    # The shards live in the cache as links to blobs named by hash: the loader finds the set by the links.
    shards = write_split(llama, tmp_path / "shards" / "tiny-Q8_0", 9)
    cache = tmp_path / "hf" / "hub"
    make_repo(cache, "fake/split", {f"Q8_0/{p.name}": p for p in shards})
    env = hf_env(cache, HF_HUB_OFFLINE="1")
    args = ["-n", "6", "--temp", "0", "-p", "hi", "--json"]
    direct = run_cli("generate", "-m", str(llama), *args)
    assert direct.returncode == 0, direct.stderr
    for extra in ([], ["--hf-file", f"Q8_0/{shards[-1].name}"]):
        via_hub = run_hf_cli("generate", "-hf", "fake/split", *extra, *args, env=env)
        assert via_hub.returncode == 0 and "Traceback" not in via_hub.stderr, via_hub.stderr
        assert json.loads(via_hub.stdout)["tokens"] == json.loads(direct.stdout)["tokens"]


def test_cli_missing_repo_offline_is_one_clear_line(tmp_path: Path) -> None:
    cache = tmp_path / "hf" / "hub"
    proc = run_hf_cli("generate", "-hf", "fake/absent:Q4_K_M", "-n", "1", "-p", "hi",
                   env=hf_env(cache, HF_HUB_OFFLINE="1"))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "spekula: error: -hf fake/absent:Q4_K_M" in proc.stderr and str(cache) in proc.stderr


def test_cli_unreachable_hub_fails_fast_without_traceback(tmp_path: Path) -> None:
    """HF_HUB_OFFLINE unset, the hub a closed port on localhost: the real huggingface_hub request fails
    and the user gets the same clear error, in seconds."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again at once: connecting is refused
    cache = tmp_path / "hf" / "hub"
    env = hf_env(cache, HF_ENDPOINT=f"http://127.0.0.1:{port}", NO_PROXY="127.0.0.1,localhost",
                 no_proxy="127.0.0.1,localhost", HF_HUB_DISABLE_TELEMETRY="1")
    start = time.monotonic()
    proc = run_hf_cli("generate", "-hf", "fake/absent", "-n", "1", "-p", "hi", env=env, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "-hf fake/absent" in proc.stderr and "unreachable" in proc.stderr and str(cache) in proc.stderr
    assert time.monotonic() - start < 60
