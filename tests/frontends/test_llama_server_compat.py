"""`spekula-server`: a llama-server command line translated to `spekula serve` (frontends/cli/llama_server_compat.py)."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from http_helpers import _LISTENING, HttpServer, _pump
from llamacpp_sdist import read_source

from spekula.fixtures.tiny_gguf import tiny_model_path
from spekula.frontends.cli import llama_server_compat as compat
from spekula.frontends.cli.llama_server_compat import main, slot_layout, translate


def _serve(argv: str, env: dict[str, str] | None = None) -> list[str]:
    tr = translate(argv.split(), env or {})
    assert not tr.errors, tr.errors
    return tr.serve_argv()


def _value(args: list[str], option: str) -> str | None:
    return args[args.index(option) + 1] if option in args else None


def _errors(argv: str, env: dict[str, str] | None = None) -> list[str]:
    return translate(argv.split(), env or {}).errors


# -- context and slots -----------------------------------------------------------------------------

@pytest.mark.parametrize(("argv", "slots", "per_slot"), [
    ("-c 512 -np 2", "2", "256"),  # the tinyllama2 preset of llama.cpp's tests: 256 per slot
    ("--ctx-size 2048 --parallel 1", "1", "2048"),
    ("-c 256 -np 4 --kv-unified", "4", "256"),  # unified: every slot may use the whole context
    ("-c 256 -np 4 -kvu --no-kv-unified", "4", "256"),  # 256 / 4 = 64, rounded up to 256 as llama.cpp does
    ("-c 1000 -np 3", "3", "512"),  # total 1024, 341 per slot, rounded up to 512
    ("-c 4096", "4", "4096"),  # no -np: llama-server's auto, 4 slots over a unified cache
    ("-c 4096 -np -1 --no-kv-unified", "4", "4096"),  # auto forces the unified cache
    ("-np 2", "2", None),  # no -c: spekula's default per-slot context
    ("-c 0 -np 2", "2", None),
    ("-np 2 --kv-unified-per-slot 1024", "2", "1024"),
    ("-c 8192 -np 2 --kv-unified --kv-unified-per-slot 1024", "2", "1024"),
])
def test_context_is_divided_among_slots(argv: str, slots: str, per_slot: str | None) -> None:
    args = _serve(argv)
    assert _value(args, "-np") == slots
    assert _value(args, "-c") == per_slot


def test_slot_layout_matches_llama_context_rounding() -> None:
    assert slot_layout(512, 2, False, None) == (2, 256)
    assert slot_layout(100, 1, False, None) == (1, 256)
    assert slot_layout(None, None, None, None) == (4, None)


def test_zero_slots_is_an_error() -> None:
    assert _errors("-np 0") == ["-np: expected a number, got '0'"]


# -- names, aliases and defaults -------------------------------------------------------------------

def test_the_llama_cpp_harness_command_line() -> None:
    """What tools/server/tests/utils.py passes for the tinyllama2 preset (with a local model)."""
    args = _serve("--port 8080 --temp 0.8 --seed 42 --host 127.0.0.1 --offline --model m.gguf --batch-size 32 "
                  "--no-slots --alias tinyllama-2 --ctx-size 512 --parallel 2 --n-predict 64 --no-jinja")
    assert args == ["--port", "8080", "--temp", "0.8", "-s", "42", "--host", "127.0.0.1", "-m", "m.gguf", "-b", "32",
                    "--alias", "tinyllama-2", "-n", "64", "--cors-origins", "*", "-np", "2", "-c", "256",
                    *(["--no-slots"] if "--slots" in compat.serve_options() else []), "--spec-adaptive", "off"]
    assert translate(["--offline"], {}).env == {"HF_HUB_OFFLINE": "1"}


def test_underscores_in_long_names_and_aliases() -> None:
    args = _serve("--n_predict 7 --model_draft d.gguf --spec_type draft-simple --spec_draft_n_max 8 "
                  "--draft_p_min 0.5 -devd CUDA1 -dev none --threads_draft 2")
    assert _value(args, "-n") == "7"
    assert _value(args, "-md") == "d.gguf"
    assert _value(args, "--spec-type") == "draft-simple"
    assert _value(args, "--spec-draft-n-max") == "8"
    assert _value(args, "--spec-draft-p-min") == "0.5"
    assert _value(args, "--spec-draft-device") == "cuda:1"
    assert _value(args, "--device") == "cpu"
    assert _value(args, "--spec-draft-threads") == "2"


def test_aliases_and_defaults() -> None:
    args = _serve("-a first,second --cors-origins localhost -to 30 --port=9000")
    assert _value(args, "--alias") == "first"  # spekula reports one model name
    assert _value(args, "--cors-origins") == "localhost"
    assert _value(args, "--write-timeout") == "30"
    assert _value(args, "--port") == "9000"
    defaults = _serve("")
    assert _value(defaults, "--port") == "8080" and _value(defaults, "--cors-origins") == "*"
    biased = _serve("-l 15043-inf --logit-bias 7+1")
    assert [v for k, v in zip(biased, biased[1:], strict=False) if k == "--logit-bias"] == ["15043-inf", "7+1"]


def test_chat_template_options_are_passed_on() -> None:
    args = _serve('--chat-template llama3 --chat-template-kwargs {"enable_thinking":false} --no-prefill-assistant')
    assert _value(args, "--chat-template") == "llama3"
    assert _value(args, "--chat-template-kwargs") == '{"enable_thinking":false}'
    assert "--no-prefill-assistant" in args
    assert _value(_serve("--reasoning-budget 0"), "--reasoning-budget") == "0"
    assert _value(_serve("--reasoning-budget 10"), "--reasoning-budget") == "10"
    assert _value(_serve("--reasoning-budget-message Done."), "--reasoning-budget-message") == "Done."


def test_serve_reads_the_reasoning_budget() -> None:
    from spekula.frontends.cli.serve_options import _reasoning_budget

    assert (_reasoning_budget("-1"), _reasoning_budget("0"), _reasoning_budget("5")) == (-1, 0, 5)
    for bad in ("-2", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            _reasoning_budget(bad)


def test_performance_options_are_accepted_and_dropped() -> None:
    argv = ("-ngl 99 --n_gpu_layers 99 -fa on --flash-attn auto -ub 512 --ubatch-size 128 --cont-batching "
            "--no-cont-batching --no-ui --ui --offline --mlock-free -ctk f16 -ctv f16 --jinja --no-jinja "
            "--threads-batch 4 --no-webui --log-disable --log-colors off --props --no-warmup --cache-ram 0 "
            "--kv-unified --swa-full --backend_sampling -cb -kvo --no-mmproj --metrics")
    assert _errors(argv) == ["unknown option --mlock-free: not a llama-server option (see 'spekula-server --help')"]
    tr = translate(argv.replace("--mlock-free ", "").split(), {})
    assert not tr.errors
    assert tr.args == ["--metrics"]
    assert "-ngl 99" in tr.ignored and "--n-gpu-layers 99" in tr.ignored and "-ctk f16" in tr.ignored


def test_disabled_sampler_values_are_accepted() -> None:
    assert not _errors("--presence-penalty 0 --frequency-penalty 0.0 --adaptive-target -1 --reasoning-budget -1")
    assert _errors("--adaptive-target 0.5") == ["--adaptive-target 0.5 (the adaptive-p sampler) is not implemented by spekula"]
    assert translate(["--presence-penalty", "0.5", "--frequency-penalty", "0.25"], {}).args == [
        "--presence-penalty", "0.5", "--frequency-penalty", "0.25"]


def test_sampler_stage_options_are_translated() -> None:
    argv = ("--dry-multiplier 0.8 --dry-base 1.5 --dry-allowed-length 3 --dry-penalty-last-n 128 "
            "--dry-sequence-breaker none --xtc-probability 0.5 --xtc-threshold 0.2 --typical 0.9 --top-nsigma 1.5 "
            "--dynatemp-range 0.3 --dynatemp-exp 2 --mirostat 2 --mirostat-lr 0.2 --mirostat-ent 4 "
            "--samplers penalties;dry;top_k;temperature --sampling-seq edkt")
    tr = translate(argv.split(), {})
    assert not tr.errors
    assert tr.args == ["--dry-multiplier", "0.8", "--dry-base", "1.5", "--dry-allowed-length", "3",
                       "--dry-penalty-last-n", "128", "--dry-sequence-breaker", "none", "--xtc-probability", "0.5",
                       "--xtc-threshold", "0.2", "--typical-p", "0.9", "--top-n-sigma", "1.5", "--dynatemp-range", "0.3",
                       "--dynatemp-exp", "2", "--mirostat", "2", "--mirostat-lr", "0.2", "--mirostat-ent", "4",
                       "--samplers", "penalties;dry;top_k;temperature", "--sampler-seq", "edkt"]


def test_api_key_file_skips_comments(tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("# production keys\nsk-a\n\nsk-b\n")
    args = _serve(f"--api-key-file {keys} --api-key sk-c")
    assert [args[i + 1] for i, a in enumerate(args) if a == "--api-key"] == ["sk-a", "sk-b", "sk-c"]
    assert _errors(f"--api-key-file {tmp_path / 'missing'}")[0].startswith("--api-key-file ")


# -- environment -----------------------------------------------------------------------------------

def test_environment_variables_as_llama_server_reads_them() -> None:
    env = {"LLAMA_API_KEY": "sk-1", "LLAMA_ARG_CTX_SIZE": "1024", "LLAMA_ARG_N_PARALLEL": "2",
           "LLAMA_ARG_ENDPOINT_METRICS": "1", "LLAMA_ARG_NO_CONTEXT_SHIFT": "1", "LLAMA_ARG_EMBEDDINGS": "0",
           "LLAMA_ARG_KV_UNIFIED": "true", "LLAMA_CACHE": "tmp"}
    tr = translate([], env)
    assert not tr.errors, tr.errors
    args = tr.serve_argv()
    assert _value(args, "--api-key") == "sk-1" and "--metrics" in args
    assert _value(args, "-np") == "2" and _value(args, "-c") == "1024"  # unified from the environment
    assert tr.env == {"HF_HUB_CACHE": "tmp"}  # llama.cpp's -hf cache


def test_command_line_overrides_environment() -> None:
    env = {"LLAMA_ARG_CTX_SIZE": "1024", "LLAMA_ARG_KV_UNIFIED": "1", "LLAMA_ARG_PORT": "9999"}
    args = _serve("-c 512 -np 2 --no-kv-unified", env)
    assert _value(args, "-c") == "256" and _value(args, "--port") == "9999"


def test_embedding_options_are_translated() -> None:
    args = _serve("--embeddings --pooling mean --embd-normalize 1")
    assert "--embedding" in args and _value(args, "--pooling") == "mean" and _value(args, "--embd-normalize") == "1"
    assert "--reranking" in _serve("--rerank")
    env = {"LLAMA_ARG_EMBEDDINGS": "1", "LLAMA_ARG_POOLING": "last", "LLAMA_ARG_RERANKING": "0"}
    args = _serve("", env)
    assert "--embedding" in args and _value(args, "--pooling") == "last" and "--reranking" not in args


def test_unimplemented_feature_from_environment_is_an_error() -> None:
    assert _errors("", {"LLAMA_ARG_MMPROJ_OFFLOAD": "1"}) == [
        "$LLAMA_ARG_MMPROJ_OFFLOAD (multimodal input) is not implemented by spekula"]
    assert _errors("", {"LLAMA_ARG_CONTEXT_SHIFT": "maybe"}) == ["$LLAMA_ARG_CONTEXT_SHIFT='maybe': invalid boolean value"]


def test_context_shift_options_pass_through() -> None:
    assert translate(["--context-shift", "--keep", "-1"], {}).args[-3:] == ["--context-shift", "--keep", "-1"]
    assert "--no-context-shift" in translate(["--no-context-shift"], {}).args
    assert "--context-shift" in translate([], {"LLAMA_ARG_CONTEXT_SHIFT": "1"}).args
    assert "--no-context-shift" in translate([], {"LLAMA_ARG_CONTEXT_SHIFT": "0"}).args


# -- errors ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("argv", "message"), [
    ("--lora a.gguf", "spekula-server: --lora (LoRA adapters) is not implemented by spekula"),
    ("--mmproj-url http://x", "spekula-server: --mmproj-url (multimodal input) is not implemented by spekula"),
    ("--grammar-file g.gbnf", "spekula-server: --grammar-file (server-wide grammar) is not implemented by spekula"),
    ("--models-dir d", "spekula-server: --models-dir (router mode (several models)) is not implemented by spekula"),
    ("-ctk q8_0", "spekula-server: -ctk q8_0 (quantized KV cache) is not implemented by spekula"),
    ("--rope-freq-base 10000", "spekula-server: --rope-freq-base (RoPE/YaRN overrides) is not implemented by spekula"),
    ("--grp_attn_n 2", "spekula-server: --grp-attn-n (group attention / self-extend) is not implemented by spekula"),
    ("--frobnicate 3", "spekula-server: unknown option --frobnicate: not a llama-server option "
                       "(see 'spekula-server --help')"),
    ("model.gguf", "spekula-server: unknown argument 'model.gguf': not a llama-server option "
                   "(see 'spekula-server --help')"),
    ("--port", "spekula-server: --port expects a value"),
    ("--draft-max 8", "spekula-server: --draft-max has been removed from llama-server too; use the "
                      "--spec-draft-* / --spec-ngram-* options"),
])
def test_errors_name_the_option_and_exit_1(argv: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv.split()) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [message]


def test_every_error_is_reported(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--mmproj-offload", "--lora", "x", "--tools", "all"]) == 1
    assert len(capsys.readouterr().err.splitlines()) == 3


def test_main_runs_spekula_serve_in_process(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from spekula.frontends.cli import main as cli

    seen: list[list[str]] = []
    monkeypatch.setattr(cli, "main", lambda argv: seen.append(argv) or 0)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # restored afterwards: main() sets it for --offline
    monkeypatch.setenv(compat.EXTRA_ARGS_ENV, "--backend native")
    assert main(["-m", "m.gguf", "--offline", "--api-key", "sk-secret", "-ngl", "99"]) == 0
    assert seen[0][:5] == ["serve", "-m", "m.gguf", "--api-key", "sk-secret"]
    assert seen[0][-2:] == ["--backend", "native"]
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    err = capsys.readouterr().err
    assert "sk-secret" not in err and "--api-key '***'" in err and "no effect in spekula: -ngl 99" in err


def test_help_lists_the_accepted_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["-h"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: spekula-server")
    for option in ("--ctx-size", "--model-draft", "--n-gpu-layers", "--flash-attn", "--kv-unified", "--embedding"):
        assert option in out


def _llama_server_options(source: str) -> dict[str, tuple[int, str | None]]:
    """{spelling: (values, env)} of every llama-server option in common/arg.cpp."""
    out: dict[str, tuple[int, str | None]] = {}
    for m in re.finditer(r"add_opt\(common_arg\(", source):
        depth, j = 2, m.end()
        while depth:  # the add_opt(...) call, strings skipped
            c = source[j]
            if c == '"':
                j += 1
                while source[j] != '"':
                    j += 2 if source[j] == "\\" else 1
            depth += (c == "(") - (c == ")")
            j += 1
        body = re.sub(r"^\s*//[^\n]*\n", "", source[m.end():j], flags=re.M)  # whole-line comments
        examples = re.search(r"set_examples\((\{[^}]*\}|\w+)\)", body)
        excludes = re.search(r"set_excludes\(\{([^}]*)\}\)", body)
        ex = examples.group(1) if examples else ""
        if (ex and not re.search(r"SERVER|COMMON|mmproj_examples", ex)) or (excludes and "SERVER" in excludes.group(1)):
            continue
        head = re.match(r"\s*\{([^}]*)\}\s*,\s*(\{([^}]*)\}\s*,)?", body)
        assert head, body[:200]
        sig = re.search(r"\[\]\(common_params\s*&[^,)]*(,[^)]*)?\)", body)
        params = re.sub(r"/\*.*?\*/", "", sig.group(1) or "") if sig else ""
        nargs = 0 if not params or "bool" in params else params.count(",")
        env = re.search(r'set_env\("([^"]*)"\)', body)
        for name in re.findall(r'"([^"]+)"', head.group(1) + (head.group(3) or "")):
            out[name] = (nargs, env.group(1) if env else None)
    return out


def test_table_covers_every_llama_server_option() -> None:
    options = _llama_server_options(read_source("common/arg.cpp"))
    assert len(options) > 300
    missing = sorted(set(options) - set(compat.BY_NAME))
    assert not missing
    for name, (nargs, env) in options.items():
        opt = compat.BY_NAME[name]
        assert opt.nargs == nargs, name
        if env != "HF_TOKEN":  # huggingface_hub reads that one itself
            assert opt.env == env, name


# -- end to end ------------------------------------------------------------------------------------

def _start(*argv: str, log: Path) -> HttpServer:
    script = Path(sys.executable).with_name("spekula-server")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "spekula.frontends.cli.llama_server_compat"]
    proc = subprocess.Popen([*cmd, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.stderr is not None
    lines: list[bytes] = []
    deadline = time.monotonic() + 120
    match = None
    while time.monotonic() < deadline and match is None:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        match = _LISTENING.search(line.decode(errors="replace"))
    if match is None:
        proc.kill()
        raise AssertionError("server did not report its port: " + b"".join(lines).decode(errors="replace"))
    log.write_bytes(b"".join(lines))
    _pump(proc, log)
    server = HttpServer(proc, match.group(1), int(match.group(2)), log)
    server.wait_ready()
    return server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    log = tmp_path_factory.mktemp("compat") / "server.log"
    srv = _start("--model", str(tiny_model_path("llama")), "--port", "0", "--host", "127.0.0.1", "--ctx-size", "512",
                 "--parallel", "2", "--temp", "0", "--seed", "42", "--n_gpu_layers", "99", "-fa", "on",
                 "--ubatch-size", "64", "--cont-batching", "--jinja", "--alias", "tiny", log=log)
    try:
        yield srv
    finally:
        assert srv.stop() == 0, log.read_text()


def test_end_to_end_health_and_completion(server: HttpServer) -> None:
    assert server.get("/health") == (200, {"status": "ok"})
    status, props = server.get("/props")
    assert status == 200 and props["total_slots"] == 2
    assert props["default_generation_settings"]["n_ctx"] == 256  # 512 shared by 2 slots
    status, body = server.post("/completion", {"prompt": "Hello", "n_predict": 4})
    assert status == 200, body
    assert isinstance(body["content"], str) and body["tokens_predicted"] == 4
    assert body["model"] == "tiny"
    log = server.log.read_text()
    assert "spekula-server: spekula serve" in log and "--n-gpu-layers 99" in log, log
    assert json.dumps(body)  # a plain JSON object
