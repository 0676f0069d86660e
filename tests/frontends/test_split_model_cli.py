"""`spekula generate` and `spekula serve` on a split model give what the one file gives; a damaged set
is one clear error line, and a server started on a good set keeps serving after bad requests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import error_line, run_cli
from http_helpers import running

from spekula.fixtures.gguf_split_writer import make_split
from spekula.fixtures.tiny_gguf import tiny_model_path

pytestmark = pytest.mark.timeout(600)
ARGS = ("-n", "8", "--temp", "0", "-p", "The little cat", "--json")


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return make_split(tiny_model_path("llama"), tmp_path_factory.mktemp("split") / "tiny", 9)


@pytest.fixture(scope="module")
def single_tokens() -> list[int]:
    proc = run_cli("generate", "-m", str(tiny_model_path("llama")), *ARGS)
    assert proc.returncode == 0, proc.stderr
    return list(json.loads(proc.stdout)["tokens"])


def test_generate_on_any_shard_equals_the_single_file(shards: list[Path], single_tokens: list[int]) -> None:
    for given in (shards[0], shards[2]):
        proc = run_cli("generate", "-m", str(given), *ARGS, "--spec-type", "ngram-simple")
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
        assert json.loads(proc.stdout)["tokens"] == single_tokens


def test_generate_on_a_set_missing_a_shard_is_one_clear_line(shards: list[Path], tmp_path: Path) -> None:
    broken = [tmp_path / p.name for p in shards]
    for src, dst in zip(shards, broken, strict=True):
        dst.write_bytes(src.read_bytes())
    broken[1].unlink()
    proc = run_cli("generate", "-m", str(broken[0]), *ARGS)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    line = error_line(proc)
    assert str(broken[1]) in line and "missing: shard 2" in line, proc.stderr


def test_serve_a_split_model(shards: list[Path], single_tokens: list[int], tmp_path: Path) -> None:
    with running(shards[-1], "-np", "2", "-c", "512", log=tmp_path / "serve.log") as server:
        status, body = server.post("/completion", {"prompt": "The little cat", "n_predict": 8, "temperature": 0,
                                                   "return_tokens": True})
        assert status == 200, body
        assert body["tokens"] == single_tokens
        # Bad requests get a 4xx and the server goes on answering.
        status, body = server.post("/completion", {"prompt": "x", "n_predict": "many"})
        assert 400 <= status < 500, body
        status, body = server.get("/props")
        assert status == 200 and body["model_path"] == str(shards[-1])
        status, body = server.post("/completion", {"prompt": "The little cat", "n_predict": 8, "temperature": 0,
                                                   "return_tokens": True})
        assert status == 200 and body["tokens"] == single_tokens


def test_truncate_model_refuses_a_split_model_saying_how_to_merge(shards: list[Path], tmp_path: Path) -> None:
    line = error_line(run_cli("truncate-model", str(shards[0]), "--layers", "2", "-o", str(tmp_path / "d.gguf")))
    assert str(shards[0]) in line and "llama-gguf-split --merge" in line
    assert not (tmp_path / "d.gguf").exists()
