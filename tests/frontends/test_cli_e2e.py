"""User-level checks of the `spekula` console script: every test runs the real command in a subprocess,
the way a user would, and checks what lands on stdout, stderr and the exit code.

Tiny fixture GGUFs keep each run to a few seconds; SmolLM2 runs are marked slow. Error paths live in
tests/test_bad_input.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import run_cli, spekula_cmd

from spekula.fixtures.tiny_gguf import tiny_model_path

pytestmark = pytest.mark.timeout(600)

# Repetitive enough that n-gram drafters with small n find matches in the tiny model's output.
PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat"
N = 24
# ngram-simple with N=1 drafts on this fixture; the defaults (N=12) would never draft and prove nothing.
NGRAM_SMALL = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "1", "--spec-ngram-simple-size-m", "4"]


def assert_ok(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout: {proc.stdout}\nstderr: {proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr


def generate_json(model: str | Path, *extra: str, prompt: str | None = PROMPT, n: int = N) -> dict[str, Any]:
    prompt_args = ["-p", prompt] if prompt is not None else []
    proc = run_cli("generate", "-m", str(model), *prompt_args, "-n", str(n), "--json", *extra)
    assert_ok(proc)
    return dict(json.loads(proc.stdout))


@pytest.fixture(scope="module")
def llama() -> str:
    return str(tiny_model_path("llama"))


@pytest.fixture(scope="module")
def greedy_ref(llama: str) -> dict[str, Any]:
    """Plain greedy decoding: the output every speculative configuration must reproduce."""
    return generate_json(llama, "--temp", "0")


def test_json_has_llama_server_fields_without_draft_counters(greedy_ref: dict[str, Any]) -> None:
    assert set(greedy_ref) >= {"content", "tokens", "stop_type", "stopping_word", "tokens_evaluated", "timings"}
    assert len(greedy_ref["tokens"]) == N and greedy_ref["stop_type"] == "limit"
    assert greedy_ref["tokens_evaluated"] > 0 and greedy_ref["content"]
    t = greedy_ref["timings"]
    assert t["predicted_n"] == N and t["prompt_n"] == greedy_ref["tokens_evaluated"]
    # llama-server adds draft_n / draft_n_accepted only when a draft token was produced (docs/semantics.md §4.2)
    assert "draft_n" not in t and "draft_n_accepted" not in t


def test_text_alone_on_stdout_statistics_on_stderr(llama: str, greedy_ref: dict[str, Any]) -> None:
    # Fixed lengths: this checks where the statistics go, and the cost model may (rightly) skip every
    # draft on this fixture when forwards of several rows happen to be dear on a loaded machine.
    proc = run_cli("generate", "-m", llama, "-p", PROMPT, "-n", str(N), "--temp", "0", *NGRAM_SMALL,
                   "--spec-adaptive", "off")
    assert_ok(proc)
    assert proc.stdout == greedy_ref["content"] + "\n"
    err = proc.stderr
    assert "prompt eval time =" in err and "eval time =" in err
    stats = [ln for ln in err.splitlines() if ln.startswith("spec common_specu: statistics")]
    assert len(stats) == 1 and "ngram-simple:" in stats[0]
    assert "slot print_timing: id  0 | task 0 | draft acceptance =" in err
    for marker in ("eval time", "statistics", "draft acceptance", "[info"):
        assert marker not in proc.stdout


@pytest.mark.parametrize("spec", [
    NGRAM_SMALL,
    ["--spec-type", "ngram-simple,ngram-mod", "--spec-type", "ngram-map-k,ngram-map-k4v"],
    ["--spec-default", "--spec-type", "ngram-cache"],
], ids=["ngram-simple-n1", "four-ngram-types", "spec-default+cache"])
def test_greedy_output_identical_with_ngram_speculation(llama: str, greedy_ref: dict[str, Any], spec: list[str]) -> None:
    out = generate_json(llama, "--temp", "0", *spec)
    assert out["tokens"] == greedy_ref["tokens"] and out["content"] == greedy_ref["content"]
    t = out["timings"]
    assert ("draft_n" in t) == ("draft_n_accepted" in t)
    if "draft_n" in t:
        assert t["draft_n"] > 0 and 0 <= t["draft_n_accepted"] <= t["draft_n"]


def test_spec_type_none_is_plain_decoding(llama: str, greedy_ref: dict[str, Any]) -> None:
    proc = run_cli("generate", "-m", llama, "-p", PROMPT, "-n", str(N), "--temp", "0", "--json",
                   "--spec-type", "none")
    assert_ok(proc)
    out = json.loads(proc.stdout)
    assert out["tokens"] == greedy_ref["tokens"] and "draft_n" not in out["timings"]
    assert "statistics" not in proc.stderr


def test_self_draft_accepts_everything_and_reports_counters(llama: str, greedy_ref: dict[str, Any]) -> None:
    """The target as its own draft model: every drafted token must be accepted, and timings say so."""
    out = generate_json(llama, "--temp", "0", "--spec-type", "draft-simple", "-md", llama)
    assert out["tokens"] == greedy_ref["tokens"]
    t = out["timings"]
    assert t["draft_n"] > 0 and t["draft_n_accepted"] == t["draft_n"]


def test_seed_makes_sampling_reproducible(llama: str) -> None:
    args = ("--temp", "0.8", "--seed", "7")
    first = generate_json(llama, *args, prompt="hello there", n=20)
    again = generate_json(llama, *args, prompt="hello there", n=20)
    # sample-and-match verification keeps seeded sampling identical under greedy draft-simple (docs/semantics.md §8.1)
    drafted = generate_json(llama, *args, "--spec-type", "draft-simple", "-md", llama, prompt="hello there", n=20)
    other = generate_json(llama, "--temp", "0.8", "--seed", "8", prompt="hello there", n=20)
    assert first["tokens"] == again["tokens"] == drafted["tokens"]
    assert drafted["timings"]["draft_n"] > 0
    assert other["tokens"] != first["tokens"], "a different seed should sample differently at temp 0.8"


def test_onnx_backend_matches_torch_greedy(llama: str, greedy_ref: dict[str, Any]) -> None:
    out = generate_json(llama, "--temp", "0", "--backend", "onnx", "--ort-provider", "cpu")
    assert out["tokens"] == greedy_ref["tokens"]


def test_prompt_from_file_and_chat_template(llama: str, greedy_ref: dict[str, Any], tmp_path: Path) -> None:
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(PROMPT, encoding="utf-8")
    from_file = generate_json(llama, "--temp", "0", "-f", str(prompt_file), prompt=None)
    assert from_file["tokens"] == greedy_ref["tokens"]
    chat = generate_json(llama, "--temp", "0", "--jinja")
    # the ChatML wrapper adds tokens around the user message
    assert chat["tokens_evaluated"] > greedy_ref["tokens_evaluated"]


def test_generation_stops_at_the_context(llama: str) -> None:
    out = generate_json(llama, "--temp", "0", "-c", "32", "--ignore-eos", prompt="hello", n=100)
    assert out["tokens_evaluated"] + len(out["tokens"]) <= 32 and out["stop_type"] == "limit"
    drafted = generate_json(llama, "--temp", "0", "-c", "32", "--ignore-eos", "--spec-type", "draft-simple", "-md",
                            llama, prompt="hello", n=100)
    assert drafted["tokens"] == out["tokens"]


def stop_string_from(content: str) -> str | None:
    """A short alphanumeric run in the middle of the output that does not occur earlier."""
    for i in range(3, len(content) - 3):
        cand = content[i:i + 3]
        if cand.isascii() and cand.isalnum() and cand not in content[: i + 2]:
            return cand
    return None


def test_stop_string_with_and_without_drafting(llama: str, greedy_ref: dict[str, Any]) -> None:
    stop = stop_string_from(greedy_ref["content"])
    assert stop is not None, f"no usable stop string in {greedy_ref['content']!r}"
    expected = greedy_ref["content"][: greedy_ref["content"].index(stop)]
    # drafts run past the stop string; the verified output must still end right before it
    for spec in ([], ["--spec-type", "draft-simple", "-md", llama, "--spec-draft-n-max", "6"]):
        out = generate_json(llama, "--temp", "0", "--stop", stop, *spec)
        assert out["stop_type"] == "word" and out["stopping_word"] == stop
        assert out["content"] == expected


def test_n_predict_never_exceeded_by_drafts(llama: str, greedy_ref: dict[str, Any]) -> None:
    out = generate_json(llama, "--temp", "0", "--spec-type", "draft-simple", "-md", llama,
                        "--spec-draft-n-max", "8", n=5)
    assert out["tokens"] == greedy_ref["tokens"][:5] and out["timings"]["predicted_n"] == 5
    assert out["timings"]["draft_n"] == out["timings"]["draft_n_accepted"] > 0


def test_probabilistic_self_draft_at_temperature(llama: str) -> None:
    """Rejection sampling with draft == target accepts every drafted token. The draft proposes from its
    top 10 at the temperature, so the target's chain is set to the same (top-k 10, no top-p / min-p):
    then p == q exactly and every min(1, p/q) is 1."""
    out = generate_json(llama, "--temp", "0.8", "--seed", "3", "--top-k", "10", "--top-p", "1", "--min-p", "0",
                        "--spec-type", "draft-simple", "-md", llama, "--spec-draft-sampling", "probabilistic")
    assert len(out["tokens"]) == N or out["stop_type"] == "eos"
    assert out["timings"]["draft_n"] == out["timings"]["draft_n_accepted"] > 0


def test_ctrl_c_exits_130_quietly(llama: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([*spekula_cmd(), "generate", "-m", llama, "-p", "hello", "-n", "-1", "--temp", "0",
                             "--ignore-eos"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            stdin=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        proc.stdout.read(1)  # generation has started
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130 and b"Traceback" not in err, err.decode()


def test_truncate_model_gives_a_working_draft(llama: str, greedy_ref: dict[str, Any], tmp_path: Path) -> None:
    draft = tmp_path / "draft.gguf"
    proc = run_cli("truncate-model", llama, "--layers", "2", "-o", str(draft))
    assert_ok(proc)
    assert draft.is_file() and "2 of 4 layers" in proc.stderr
    out = generate_json(llama, "--temp", "0", "--spec-type", "draft-simple", "-md", str(draft))
    assert out["tokens"] == greedy_ref["tokens"]
    assert out["timings"]["draft_n"] > 0


def test_ngram_cache_build_then_use(llama: str, greedy_ref: dict[str, Any], tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(PROMPT + " " + greedy_ref["content"], encoding="utf-8")
    cache = tmp_path / "static.bin"
    proc = run_cli("ngram-cache", "build", "-m", llama, "-o", str(cache), str(corpus))
    assert_ok(proc)
    assert cache.stat().st_size > 0 and "2-grams" in proc.stderr
    out = generate_json(llama, "--temp", "0", "--spec-type", "ngram-cache", "-lcs", str(cache))
    assert out["tokens"] == greedy_ref["tokens"]


def test_convert_tiny_hf_checkpoint_then_generate(tmp_path: Path) -> None:
    from spekula.fixtures.tiny_hf import write_target

    hf = write_target(tmp_path / "hf", "qwen2", n_layer=2)
    out_file = tmp_path / "conv.gguf"
    proc = run_cli("convert", str(hf), "--outfile", str(out_file), "--outtype", "f32")
    assert_ok(proc)
    assert out_file.is_file() and str(out_file) in proc.stderr
    out = generate_json(out_file, "--temp", "0", prompt="hello", n=6)
    assert len(out["tokens"]) == 6 and out["stop_type"] == "limit"


def test_converted_dspark_draft_is_inferred_from_md_alone(tmp_path: Path) -> None:
    """convert (target + DSpark checkpoint) -> generate with only -md: the type comes from the GGUF."""
    from spekula.fixtures import tiny_hf

    target_hf = tiny_hf.write_target(tmp_path / "target-hf", "llama", n_layer=8)
    target, draft = tmp_path / "target.gguf", tmp_path / "dspark.gguf"
    assert_ok(run_cli("convert", str(target_hf), "--outfile", str(target), "--outtype", "f32"))
    proc = run_cli("convert", str(tiny_hf.write_dflash(tmp_path / "dspark-hf", markov_rank=8)),
                   "--target-model-dir", str(target_hf), "--outfile", str(draft), "--outtype", "f32")
    assert_ok(proc)
    assert "dspark" in proc.stderr
    plain = generate_json(target, "--temp", "0", prompt="hello world", n=12)
    proc = run_cli("generate", "-m", str(target), "-p", "hello world", "-n", "12", "--temp", "0", "--json",
                   "-md", str(draft))
    assert_ok(proc)
    drafted = json.loads(proc.stdout)
    assert drafted["tokens"] == plain["tokens"] and drafted["timings"]["draft_n"] > 0
    assert "statistics     draft-dspark:" in proc.stderr


def test_no_command_prints_help() -> None:
    proc = run_cli()
    assert proc.returncode == 2
    for name in ("generate", "serve", "tui", "convert", "truncate-model", "ngram-cache", "fetch-default"):
        assert name in proc.stdout


@pytest.mark.slow
def test_smollm2_chat_greedy_equal_with_speculation(tmp_path: Path) -> None:
    from spekula.backends.gguf.default_model import ensure_default_model
    from spekula.core.errors import SpekulaError

    try:
        model = str(ensure_default_model(quiet=True))
    except SpekulaError as exc:
        pytest.skip(f"default model unavailable: {exc}")
    prompt = "Repeat exactly: one two three four, one two three four, one two three four"
    plain = generate_json(model, "--temp", "0", "--jinja", prompt=prompt, n=24)
    draft = tmp_path / "smol-L8.gguf"
    assert_ok(run_cli("truncate-model", model, "--layers", "8", "-o", str(draft)))
    spec = generate_json(model, "--temp", "0", "--jinja", "--spec-type", "ngram-mod,draft-simple", "-md", str(draft),
                         prompt=prompt, n=24)
    assert spec["tokens"] == plain["tokens"] and spec["content"] == plain["content"]
    assert spec["timings"]["draft_n"] > 0
    assert plain["stop_type"] in ("eos", "limit") and plain["content"].strip()


def test_logit_bias_option_bans_tokens_with_and_without_drafting(llama: str, greedy_ref: dict[str, Any]) -> None:
    """`-l ID-inf` (llama.cpp's form) bans a token for the whole run; drafters that copy it from the prompt
    cannot bring it back, and a bad form or an id outside the vocabulary is a clear error at start."""
    banned = sorted(set(greedy_ref["tokens"][:4]))
    bans = [a for t in banned for a in ("-l", f"{t}-inf")]
    plain = generate_json(llama, "--temp", "0", *bans)
    assert not set(plain["tokens"]) & set(banned) and plain["tokens"] != greedy_ref["tokens"]
    assert generate_json(llama, "--temp", "0", *bans, *NGRAM_SMALL)["tokens"] == plain["tokens"]
    for bad, word in (("12x3", "TOKEN_ID"), ("5+inf", "TOKEN_ID"), ("999999+1", "vocabulary")):
        proc = run_cli("generate", "-m", llama, "-p", PROMPT, "-n", "4", "-l", bad)
        assert proc.returncode != 0 and word in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
