"""`spekula generate` end to end on a tiny GGUF: stdout carries only text/JSON, stats go to stderr."""

from __future__ import annotations

import io
import json
import sys

import pytest
import structlog

from spekula.core.stats.stats import DrafterStats
from spekula.frontends.cli.main import main


@pytest.fixture(scope="module")
def tiny_path() -> str:
    from spekula.fixtures.tiny_gguf import tiny_model_path

    return str(tiny_model_path("llama"))


def test_generate_json_has_llama_server_fields(tiny_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["generate", "-m", tiny_path, "-p", "hello hello hello", "-n", "12", "--temp", "0", "-c", "128",
               "--ignore-eos", "--json", "--spec-type", "ngram-simple,ngram-mod", "--spec-ngram-simple-size-n", "2",
               "--spec-ngram-mod-n-match", "2", "--spec-ngram-mod-n-min", "1"])
    out, err = capsys.readouterr()
    assert rc == 0
    obj = json.loads(out)
    assert set(obj) >= {"content", "tokens", "stop_type", "timings"}
    assert obj["stop_type"] == "limit" and len(obj["tokens"]) == 12
    assert obj["timings"]["predicted_n"] == 12 and obj["timings"]["prompt_n"] > 0
    stats_lines = [line for line in err.splitlines() if line.startswith("spec common_specu: statistics")]
    assert {DrafterStats.parse_line(line)[0] for line in stats_lines} == {"ngram-simple", "ngram-mod"}
    if "draft_n" in obj["timings"]:
        assert "draft acceptance = " in err


def test_generate_streams_text_only(tiny_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["generate", "-m", tiny_path, "-p", "abc", "-n", "6", "--temp", "0", "-c", "64", "--ignore-eos"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert "eval time" in err and "eval time" not in out
    assert "[info" not in out


def test_generate_errors_are_one_line(tiny_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "-m", tiny_path, "-p", "x", "--spec-type", "ngram-bogus"]) == 1
    assert "unknown spec type 'ngram-bogus'" in capsys.readouterr().err
    assert main(["generate", "-m", tiny_path, "-p", "x " * 100, "-c", "16"]) == 1
    assert "context" in capsys.readouterr().err


def test_logging_follows_sys_stderr_after_a_cli_run(tiny_path: str, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A CLI run in-process configures structlog; a stream replaced (and closed) afterwards, as pytest
    does between tests, must not break later logging: records go to whatever sys.stderr is now."""
    assert main(["generate", "-m", tiny_path, "-p", "abc", "-n", "2", "--temp", "0", "-c", "64"]) == 0
    capsys.readouterr()
    old = io.StringIO()
    monkeypatch.setattr(sys, "stderr", old)
    structlog.get_logger("t").warning("first_record")
    assert "first_record" in old.getvalue()
    old.close()
    new = io.StringIO()
    monkeypatch.setattr(sys, "stderr", new)
    structlog.get_logger("t").warning("second_record")  # raised "I/O operation on closed file" before
    assert "second_record" in new.getvalue()
