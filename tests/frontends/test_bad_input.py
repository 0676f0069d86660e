"""Bad input through the real `spekula` command: one clear line, a non-zero exit, no traceback, and
nothing lost (a server keeps serving; no half-written output files).

Each case runs the console script in a subprocess on the tiny fixtures. Cases marked xfail(strict)
are reproduced bugs: the mark comes off when the owning module is fixed (the test then passes).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import error_line, run_cli, spekula_cmd

from spekula.fixtures.tiny_gguf import tiny_model_path
from spekula.frontends.rpc import protocol as p
from spekula.frontends.rpc.client import RpcCallError, ServerGoneError, SpekulaClient

pytestmark = pytest.mark.timeout(600)

LONG_PROMPT = "hello world " * 40  # 360 tokens with the fixture vocabulary, far over -c 32




def usage_error(proc: subprocess.CompletedProcess[str]) -> str:
    """argparse's rejection: exit 2 and one `spekula: error: ... (see 'spekula CMD --help')` line."""
    assert proc.returncode == 2, proc.stderr
    line = error_line(proc)
    assert line.endswith(" --help')"), line
    return line


@pytest.fixture(scope="module")
def llama() -> str:
    return str(tiny_model_path("llama"))


# -- generate: model files -------------------------------------------------------------------------


def test_random_bytes_model(tmp_path: Path) -> None:
    bad = tmp_path / "random.gguf"
    bad.write_bytes(os.urandom(4096))
    line = error_line(run_cli("generate", "-m", bad, "-p", "hi", "-n", "2"))
    assert str(bad) in line and "not a GGUF file" in line


@pytest.mark.parametrize("keep", ["head", "tail"])
def test_truncated_model(tmp_path: Path, llama: str, keep: str) -> None:
    data = Path(llama).read_bytes()
    bad = tmp_path / "cut.gguf"
    # cut in the header/metadata, or lose the end of the tensor data
    bad.write_bytes(data[:5000] if keep == "head" else data[:-100])
    line = error_line(run_cli("generate", "-m", bad, "-p", "hi", "-n", "2"))
    assert str(bad) in line and "truncated" in line


def test_missing_model(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    line = error_line(run_cli("generate", "-m", missing, "-p", "hi", "-n", "2"))
    assert str(missing) in line and "no such file" in line


def test_draft_model_with_another_vocabulary(llama: str) -> None:
    qwen2 = str(tiny_model_path("qwen2"))
    line = error_line(run_cli("generate", "-m", llama, "-p", "hi", "-n", "2", "--spec-type", "draft-simple", "-md", qwen2))
    assert llama in line and qwen2 in line
    assert "token " in line and "differs" in line


def test_corrupt_draft_model(tmp_path: Path, llama: str) -> None:
    bad = tmp_path / "draft.gguf"
    bad.write_bytes(Path(llama).read_bytes()[:3000])
    line = error_line(run_cli("generate", "-m", llama, "-p", "hi", "-n", "2", "--spec-type", "draft-simple", "-md", bad))
    assert str(bad) in line


# -- generate: options -----------------------------------------------------------------------------


def test_unknown_spec_type_lists_available(llama: str) -> None:
    line = error_line(run_cli("generate", "-m", llama, "-p", "hi", "-n", "2", "--spec-type", "ngram-mod,foo"))
    assert "'foo'" in line
    for name in ("ngram-simple", "ngram-mod", "ngram-cache", "draft-simple", "draft-eagle3"):
        assert name in line


@pytest.mark.parametrize("option", ["--draft-max", "--draft-min", "--spec-ngram-size-n"])
def test_removed_options(llama: str, option: str) -> None:
    line = usage_error(run_cli("generate", "-m", llama, "-p", "hi", option, "5"))
    assert f"argument {option}: argument has been removed (see 'spekula generate --help')" in line


@pytest.mark.parametrize(("args", "needle"), [
    (("generate", "--draft-max", "5"), "spekula generate --help"),
    (("convert", "somewhere"), "--outfile"),
    (("convert", "somewhere", "--outfile", "o.gguf", "--outtype", "x"), "invalid choice"),
    (("no-such-command",), "spekula --help"),
    (("generate", "-n", "many"), "-n/--n-predict"),
], ids=["removed-option", "missing-required", "bad-choice", "unknown-command", "bad-int"])
def test_usage_errors_are_one_line(tmp_path: Path, args: tuple[str, ...], needle: str) -> None:
    assert needle in usage_error(run_cli(*args, cwd=tmp_path))
    assert not list(tmp_path.iterdir())


def test_draft_needs_a_model(llama: str) -> None:
    line = error_line(run_cli("generate", "-m", llama, "-p", "hi", "--spec-type", "draft-simple"))
    assert "-md" in line


@pytest.mark.parametrize(("args", "needle"), [
    (("-n", "2"), "no prompt"),
    (("-p", "hi", "-f", "x.txt"), "not both"),
    (("-f", "missing.txt"), "missing.txt"),
    (("-p", "hi", "-np", "0"), "--parallel"),
    (("-p", "hi", "-b", "0"), "--batch-size"),
    (("-p", "hi", "--device", "tpu"), "tpu"),
    (("-p", "hi", "-c", "0"), "--ctx-size"),
    (("-p", "hi", "-c", "2"), "--ctx-size"),
    (("-p", "hi", "--spec-draft-p-min", "2"), "--spec-draft-p-min"),
    (("-p", "hi", "--spec-type", "draft-mtp"), "has no multi-token-prediction layers"),
    (("-p", "hi", "--spec-synth-rates", "0.5"), "synthetic"),
    # Both fail before any hub lookup (tests/test_hf_models.py covers -hf/-hfd themselves, offline).
    (("-p", "hi", "-hfd", "org/repo", "-md", "d.gguf"), "-md/--spec-draft-model or -hfd/--spec-draft-hf, not both"),
    (("-p", "hi", "-hf", "org/repo"), "-m/--model or -hf/--hf-repo, not both"),
], ids=["no-prompt", "prompt-and-file", "missing-prompt-file", "parallel-0", "batch-0", "device-tpu", "ctx-0",
        "ctx-2", "p-min-2", "draft-mtp", "synth-without-drafter", "hf-draft-and-md", "model-and-hf"])
def test_bad_generate_options(tmp_path: Path, llama: str, args: tuple[str, ...], needle: str) -> None:
    (tmp_path / "x.txt").write_text("hi", encoding="utf-8")
    line = error_line(run_cli("generate", "-m", llama, "-n", "2", *args, cwd=tmp_path))
    assert needle in line


def test_help_lists_only_installed_spec_types() -> None:
    proc = run_cli("generate", "--help")
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())  # argparse wraps the help text
    assert "draft-simple" in text and "ngram-mod" in text and "draft-mtp" in text


def test_draft_model_without_spec_type_warns(llama: str) -> None:
    """llama.cpp ignores a plain -md; spekula does too, but says how to use it."""
    proc = run_cli("generate", "-m", llama, "-p", "hi", "-n", "2", "--temp", "0", "-md", llama)
    assert proc.returncode == 0, proc.stderr
    warning = next(ln for ln in proc.stderr.splitlines() if "[warning" in ln)
    assert "--spec-type draft-simple" in warning


def test_model_is_a_directory(tmp_path: Path) -> None:
    line = error_line(run_cli("generate", "-m", tmp_path, "-p", "hi", "-n", "2"))
    assert str(tmp_path) in line and "is a directory" in line


def test_damaged_cached_default_model_suggests_refetch(tmp_path: Path) -> None:
    from spekula.backends.gguf.default_model import FILENAME

    (tmp_path / FILENAME).write_bytes(b"GGUF" + b"\x00" * 60)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SPEKULA_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([*spekula_cmd(), "generate", "-p", "hi", "-n", "2"], capture_output=True, text=True,
                          env=env, timeout=300, stdin=subprocess.DEVNULL)
    line = error_line(proc)
    assert FILENAME in line and "spekula fetch-default --force" in line


def test_prompt_file_not_utf8(tmp_path: Path, llama: str) -> None:
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"caf\xe9 \xff\xfe")
    line = error_line(run_cli("generate", "-m", llama, "-f", bad, "-n", "2"))
    assert str(bad) in line and "UTF-8" in line


def test_rejected_prompt_prints_nothing_on_stdout(llama: str) -> None:
    proc = run_cli("generate", "-m", llama, "-p", LONG_PROMPT, "-n", "4", "-c", "32")
    assert "context" in error_line(proc)
    assert proc.stdout == ""


def test_reader_closes_stdout_early(llama: str) -> None:
    """`spekula generate ... | head -c1`: generation stops, exit 141 (as if killed by SIGPIPE), no traceback."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([*spekula_cmd(), "generate", "-m", llama, "-p", "hello", "-n", "300", "--temp", "0",
                             "--ignore-eos"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            stdin=subprocess.DEVNULL)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.read(1)
    proc.stdout.close()  # what `spekula generate ... | head -c 1` does
    try:
        err = proc.stderr.read()
        proc.wait(timeout=120)
    finally:
        proc.kill()
    assert b"Traceback" not in err and b"Exception ignored" not in err, err.decode()
    assert proc.returncode == 141, err.decode()


def test_prompt_longer_than_context(llama: str) -> None:
    proc = run_cli("generate", "-m", llama, "-p", LONG_PROMPT, "-n", "4", "-c", "32", "--json")
    line = error_line(proc)
    assert "32" in line and "context" in line
    out = json.loads(proc.stdout)  # --json still yields one object saying what went wrong
    assert out["stop_type"] == "error" and out["tokens"] == [] and "context" in out["error"]


def _limit_memory() -> None:
    import resource

    # keeps a runaway allocation from hurting the shared machine; the fixture run needs well under 2 GiB
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


def test_huge_context_is_lazy_or_a_clear_error(llama: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*spekula_cmd(), "generate", "-m", llama, "-p", "hi", "-n", "2", "-c", "100000000"],
                          capture_output=True, text=True, env=env, timeout=300, stdin=subprocess.DEVNULL,
                          preexec_fn=_limit_memory)
    if proc.returncode != 0:
        error_line(proc)


def test_cuda_without_a_gpu(llama: str) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the error path needs a GPU-less machine")
    line = error_line(run_cli("generate", "-m", llama, "-p", "hi", "-n", "2", "--device", "cuda"))
    assert "cuda" in line.lower() and "not available" in line


# -- other subcommands -----------------------------------------------------------------------------


def test_convert_errors(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    assert "not a directory" in error_line(run_cli("convert", missing, "--outfile", tmp_path / "o.gguf"))
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "config.json" in error_line(run_cli("convert", empty, "--outfile", tmp_path / "o.gguf"))
    last = usage_error(run_cli("convert", empty, "--outfile", tmp_path / "o.gguf", "--outtype", "q3_x"))
    assert "--outtype" in last and "invalid choice" in last
    assert "--outfile" in usage_error(run_cli("convert", empty))
    assert not list(tmp_path.glob("o.gguf*")), "a failed conversion must leave no output behind"


def test_convert_outfile_under_a_file(tmp_path: Path) -> None:
    from spekula.fixtures.tiny_hf import write_target

    hf = write_target(tmp_path / "hf", "llama", n_layer=1)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    error_line(run_cli("convert", hf, "--outfile", blocker / "o.gguf"))


def test_truncate_model_errors(tmp_path: Path, llama: str) -> None:
    out = tmp_path / "d.gguf"
    assert "[1, 4]" in error_line(run_cli("truncate-model", llama, "--layers", "0", "-o", out))
    assert "[1, 4]" in error_line(run_cli("truncate-model", llama, "--layers", "9", "-o", out))
    assert "no such file" in error_line(run_cli("truncate-model", tmp_path / "nope.gguf", "--layers", "1", "-o", out))
    assert "input file" in error_line(run_cli("truncate-model", llama, "--layers", "1", "-o", llama))
    assert "--layers" in usage_error(run_cli("truncate-model", llama, "-o", out))
    assert not list(tmp_path.iterdir()), "failed runs must leave no files"


@pytest.mark.parametrize("where", ["directory", "under-file"])
def test_truncate_model_unwritable_output(tmp_path: Path, llama: str, where: str) -> None:
    target = tmp_path / "out"
    if where == "directory":
        target.mkdir()
    else:
        target.write_text("x")
        target = target / "d.gguf"
    error_line(run_cli("truncate-model", llama, "--layers", "1", "-o", target))


def test_ngram_cache_errors(tmp_path: Path, llama: str) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text("the cat sat", encoding="utf-8")
    out = tmp_path / "cache.bin"
    assert "cannot read" in error_line(run_cli("ngram-cache", "build", "-m", llama, "-o", out, tmp_path / "nope.txt"))
    latin1 = tmp_path / "l.txt"
    latin1.write_bytes(b"caf\xe9")
    assert "UTF-8" in error_line(run_cli("ngram-cache", "build", "-m", llama, "-o", out, latin1))
    assert "cannot write" in error_line(run_cli("ngram-cache", "build", "-m", llama, "-o", tmp_path, corpus))
    usage_error(run_cli("ngram-cache"))
    assert not out.exists()
    # a file that is not a lookup cache, handed to generate
    line = error_line(run_cli("generate", "-m", llama, "-p", "hi", "-n", "2", "--spec-type", "ngram-cache",
                              "-lcs", corpus))
    assert str(corpus) in line


# -- serve -----------------------------------------------------------------------------------------


def test_serve_rejects_a_useless_line_limit(tmp_path: Path, llama: str) -> None:
    for value in ("-5", "0", "100"):
        line = usage_error(run_cli("serve", "-m", llama, "--socket", tmp_path / "s.sock", "--max-line-bytes", value))
        assert "--max-line-bytes" in line and value in line
    assert not (tmp_path / "s.sock").exists()


def test_tui_fails_before_starting_the_ui(tmp_path: Path, llama: str) -> None:
    """Bad input to `spekula tui` is one line on the shell; without a terminal it never hangs."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(os.urandom(256))
    assert str(bad) in error_line(run_cli("tui", "-m", bad, timeout=120))
    assert "cannot connect" in error_line(run_cli("tui", "--socket", tmp_path / "none.sock", timeout=120))
    assert "not both" in error_line(run_cli("tui", "--socket", tmp_path / "none.sock", "-m", llama, timeout=120))
    # a good model, but stdin/stdout are not a terminal (subprocess pipes)
    assert "terminal" in error_line(run_cli("tui", "-m", llama, timeout=120))


def test_serve_startup_errors(tmp_path: Path, llama: str) -> None:
    assert "does not exist" in error_line(run_cli("serve", "-m", llama, "--socket", tmp_path / "no" / "s.sock"))
    blocker = tmp_path / "plain"
    blocker.write_text("keep me")
    assert "not a socket" in error_line(run_cli("serve", "-m", llama, "--socket", blocker))
    assert blocker.read_text() == "keep me"
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(64))
    assert str(bad) in error_line(run_cli("serve", "-m", bad, "--socket", tmp_path / "s.sock"))
    assert not (tmp_path / "s.sock").exists()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, llama: str) -> Iterator[str]:
    """One slot, so a request stuck behind a dead client would block the next one."""
    d = tmp_path_factory.mktemp("serve")
    sock, log = str(d / "s.sock"), d / "serve.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([*spekula_cmd(), "serve", "-m", llama, "--socket", sock, "-np", "1", "-c", "64",
                             "--temp", "0"], stdout=subprocess.DEVNULL, stderr=log.open("wb"), env=env)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, f"server not ready: {log.read_text()}"
            try:
                with SpekulaClient(sock, timeout=5) as c:
                    c.health()
                break
            except (OSError, ServerGoneError):
                time.sleep(0.2)
        yield sock
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()
        assert "Traceback" not in log.read_text(), log.read_text()


def raw_then_health(sock: str, payload: bytes) -> dict[str, Any]:
    """Send raw bytes, read the reply, then prove the same connection still answers."""
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(60)
    s.connect(sock)
    try:
        s.sendall(payload + p.encode(p.request("health", None, "after")))
        f = s.makefile("rb")
        first = json.loads(f.readline())
        after = json.loads(f.readline())
    finally:
        s.close()
    assert after["id"] == "after" and after["result"]["status"] == "ok"
    return dict(first)


def completion_line(params: dict[str, Any]) -> bytes:
    return p.encode(p.request("completion", params, 1))


@pytest.mark.parametrize(("payload", "code", "needle"), [
    (b"{oops\n", p.PARSE_ERROR, "parse error"),
    (b"\xff\xfe\n", p.PARSE_ERROR, "parse error"),
    (b"[]\n", p.INVALID_REQUEST, "empty batch"),
    (b'{"jsonrpc":"2.0","id":1,"method":"nope"}\n', p.METHOD_NOT_FOUND, "nope"),
    (completion_line({}), p.INVALID_PARAMS, "prompt"),
    (completion_line({"prompt": "x", "n_predict": "lots"}), p.INVALID_PARAMS, "n_predict"),
    (completion_line({"prompt": "x", "temperature": "hot"}), p.INVALID_PARAMS, "temperature"),
    (completion_line({"prompt": [99999]}), p.INVALID_PARAMS, "99999"),
    (completion_line({"prompt": "x", "bogus": 1}), p.INVALID_PARAMS, "bogus"),
    (completion_line({"prompt": "x", "speculative": {"type": "foo"}}), p.INVALID_PARAMS, "foo"),
    (p.encode(p.request("chat.completion", {"messages": "hi"}, 1)), p.INVALID_PARAMS, "messages"),
    (completion_line({"prompt": LONG_PROMPT}), p.CONTEXT_OVERFLOW, "64"),
], ids=["garbage", "not-utf8", "empty-batch", "unknown-method", "no-prompt", "n_predict-type", "temperature-type",
        "token-out-of-vocab", "unknown-field", "unknown-spec-type", "messages-type", "prompt-over-context"])
def test_serve_rejects_bad_requests_and_keeps_the_connection(server: str, payload: bytes, code: int, needle: str) -> None:
    reply = raw_then_health(server, payload)
    assert reply["error"]["code"] == code and needle in reply["error"]["message"]


def test_client_disconnects_mid_stream_then_next_request_succeeds(server: str) -> None:
    with SpekulaClient(server) as c:
        ref = c.completion("the cat sat", n_predict=12, return_tokens=True)["tokens"]
    for _ in range(2):
        gone = SpekulaClient(server)
        chunks = iter(gone.stream_completion("once upon a time", n_predict=-1, ignore_eos=True))
        next(chunks)
        gone.close()
    # a client that sends half a request, and one that never reads its reply
    for raw in (b'{"jsonrpc":"2.0","id":1,"meth', completion_line({"prompt": "abc", "n_predict": 40})):
        s = socket.socket(socket.AF_UNIX)
        s.connect(server)
        s.sendall(raw)
        s.close()
    with SpekulaClient(server, timeout=120) as c:
        assert c.completion("the cat sat", n_predict=12, return_tokens=True)["tokens"] == ref
        with pytest.raises(RpcCallError) as info:
            c.completion(LONG_PROMPT, n_predict=2)
        assert info.value.code == p.CONTEXT_OVERFLOW
        assert c.health()["slots_busy"] == 0


def test_serve_draft_type_without_a_draft_model(server: str) -> None:
    """Per-request speculative.type that needs -md on a server started without one: an error naming
    the missing option, and the same connection keeps working."""
    with SpekulaClient(server, timeout=120) as c:
        for kind in ("draft-simple", "draft-eagle3"):
            with pytest.raises(RpcCallError) as info:
                c.completion("the cat", n_predict=4, speculative={"type": kind})
            # the caller's parameter is at fault, not the engine: -32602 naming the field and why
            assert info.value.code == p.INVALID_PARAMS
            assert "'speculative.type'" in info.value.message
            assert kind in info.value.message and "-md" in info.value.message
        assert c.completion("the cat", n_predict=4, speculative={"type": "ngram-simple"})["tokens_predicted"] == 4


def test_serve_refusing_its_model_says_so_in_one_line(tmp_path: Path, llama: str) -> None:
    """`serve` loads the model inside its task group: the refusal must still be one error line, not a traceback."""
    proc = run_cli("serve", "-m", llama, "-hf", "org/repo", "--port", "0", cwd=tmp_path, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "spekula: error: give either -m/--model or -hf/--hf-repo, not both"
