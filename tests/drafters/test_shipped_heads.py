"""Shipped draft heads: registered for a target by fingerprint, picked up by draft-eagle3/-dflash without -md.

$SPEKULA_HEADS_DIR points at a temporary heads folder and $SPEKULA_CACHE_DIR at a temporary cache
(where the fingerprints are memoised), so nothing here reads or writes the package's or user's own.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from cli_helpers import run_cli
from model_drafter_helpers import build_target, target_backend

from spekula.backends.convert.hf import convert
from spekula.core.drafting.drafter import DrafterContext
from spekula.core.errors import ConfigError, ModelFileError
from spekula.core.params import SpecParams
from spekula.drafters.model import shipped_heads
from spekula.drafters.model.eagle3 import Eagle3Drafter
from spekula.drafters.model.shipped_heads import find_shipped_head, register_head, target_fingerprint
from spekula.fixtures import tiny_hf

PACKAGE_HEADS = Path(shipped_heads.__file__).resolve().parent / "heads"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("heads")
    hf, target = build_target(root)
    other = convert(tiny_hf.write_target(root / "other-hf", "llama", n_layer=8, seed=5), root / "other.gguf",
                    outtype="f32")[1]
    e3 = convert(tiny_hf.write_eagle3(root / "e3-hf", layer_ids=(1, 4, 8)), root / "tiny-eagle3.gguf",
                 outtype="q8_0", target_gguf=target)[1]
    df = convert(tiny_hf.write_dflash(root / "df-hf", layer_ids=(1, 6)), root / "tiny-dflash.gguf",
                 outtype="q8_0", target_gguf=target)[1]
    return {"target": target, "other": other, "eagle3": e3, "dflash": df}


@pytest.fixture
def heads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "heads"
    monkeypatch.setenv("SPEKULA_HEADS_DIR", str(folder))
    monkeypatch.setenv("SPEKULA_CACHE_DIR", str(tmp_path / "cache"))
    return folder


def _generate(target: Path, *extra: str) -> tuple[dict[str, object], str]:
    proc = run_cli("generate", "-m", target, "-p", "the quick brown fox", "-n", "12", "--temp", "0", "--json", *extra)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), proc.stderr


def test_generate_without_md_runs_the_registered_head(models: dict[str, Path], heads: Path) -> None:
    installed = register_head(heads, models["eagle3"], "eagle3", models["target"], "tiny fixture, untrained")
    assert installed == heads / "tiny-eagle3.gguf" and installed.read_bytes() == models["eagle3"].read_bytes()
    plain, _ = _generate(models["target"])
    # Fixed lengths: the untrained head never pays, so adaptive lengths (the default) would soon rest it
    # and cut its drafts (core/policy/backoff.py); here the head only has to be found and to draft.
    drafted, log = _generate(models["target"], "--spec-type", "draft-eagle3", "--spec-adaptive", "off", "-v")
    assert drafted["tokens"] == plain["tokens"]
    assert drafted["timings"]["draft_n"] > 0  # type: ignore[index]
    assert "shipped draft head" in log and str(installed) in log


def test_another_target_gets_the_clear_error(models: dict[str, Path], heads: Path) -> None:
    register_head(heads, models["eagle3"], "eagle3", models["target"], "r")
    assert find_shipped_head(models["target"], "eagle3") == heads / "tiny-eagle3.gguf"
    assert find_shipped_head(models["target"], "dflash") is None
    assert find_shipped_head(models["other"], "eagle3") is None
    spec = SpecParams(types=("draft-eagle3",), n_max=3)
    ctx = DrafterContext(spec=spec, target=target_backend(models["other"]), tokenizer=None, n_seq_max=1)
    with pytest.raises(ConfigError, match="-md/--spec-draft-model") as info:
        Eagle3Drafter.create(ctx)
    assert "spekula train-drafter eagle3" in str(info.value) and str(models["other"]) in str(info.value)


def test_corrupt_index_is_an_error_naming_it(models: dict[str, Path], heads: Path) -> None:
    heads.mkdir()
    index = heads / "index.json"
    for text, needle in (("[{", "unreadable"), ('{"file": "x"}', "JSON list"),
                         ('[{"file": "x.gguf", "kind": "eagle3"}]', "string fields"),
                         ('[{"file": "../x.gguf", "kind": "eagle3", "target": "t", "target_name": "n", "recipe": "r"}]',
                          "plain name")):
        index.write_text(text)
        with pytest.raises(ModelFileError, match=needle) as info:
            find_shipped_head(models["target"], "eagle3")
        assert str(index) in str(info.value)
    proc = run_cli("generate", "-m", models["target"], "-p", "hi", "-n", "2", "--spec-type", "draft-eagle3")
    assert proc.returncode != 0 and str(index) in proc.stderr


def test_register_replaces_the_head_for_the_same_target_and_kind(models: dict[str, Path], heads: Path,
                                                                 tmp_path: Path) -> None:
    register_head(heads, models["eagle3"], "eagle3", models["target"], "first")
    register_head(heads, models["dflash"], "dflash", models["target"], "dflash")
    newer = shutil.copyfile(models["eagle3"], tmp_path / "tiny-eagle3-v2.gguf")
    register_head(heads, newer, "eagle3", models["target"], "second")
    entries = json.loads((heads / "index.json").read_text())
    assert [(e["file"], e["kind"], e["recipe"]) for e in entries] == [
        ("tiny-dflash.gguf", "dflash", "dflash"), ("tiny-eagle3-v2.gguf", "eagle3", "second")]
    assert {e["target"] for e in entries} == {target_fingerprint(models["target"])}
    assert entries[0]["target_name"] == "target-llama"
    assert sorted(p.name for p in heads.iterdir()) == ["index.json", "tiny-dflash.gguf", "tiny-eagle3-v2.gguf"]
    with pytest.raises(ModelFileError, match="is a dflash model, but it is being registered as kind 'eagle3'"):
        register_head(heads, models["dflash"], "eagle3", models["target"], "wrong kind")
    with pytest.raises(ConfigError, match="unknown head kind"):
        register_head(heads, models["dflash"], "dspark", models["target"], "r")


def test_fingerprint_is_the_files_content(models: dict[str, Path], heads: Path, tmp_path: Path) -> None:
    fp = target_fingerprint(models["target"])
    assert fp.startswith("sha256:") and len(fp) == len("sha256:") + 64
    copy = shutil.copyfile(models["target"], tmp_path / "copy.gguf")
    assert target_fingerprint(copy) == fp
    assert target_fingerprint(models["other"]) != fp
    data = bytearray(copy.read_bytes())
    data[-1] ^= 1  # one weight bit: another file, whatever its metadata says
    before = copy.stat().st_mtime_ns
    copy.write_bytes(bytes(data))
    os.utime(copy, ns=(before + 10**9, before + 10**9))  # a later mtime even on a coarse clock: the memo's key
    assert target_fingerprint(copy) != fp


def test_the_package_ships_a_valid_index() -> None:
    entries = shipped_heads.load_index(PACKAGE_HEADS)
    for e in entries:
        assert (PACKAGE_HEADS / e.file).is_file(), e.file
