"""Start-up of `spekula generate` (bench/startup.py measures it).

On the native backend it imports only what it uses: each heavy package below costs tens of
milliseconds, so an eager import of one of them anywhere on the path fails here. Each such check
runs in a fresh interpreter, since this one has imported everything. The cyclic garbage collector
is paused while the command starts and, in the console script only, what start-up built is frozen.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys

import pytest

from spekula.fixtures.tiny_gguf import tiny_model_path
from spekula.frontends.cli.main import collector_paused, main

# Packages the plain generate path must not import (jinja2: only for --chat).
HEAVY = ("rich", "jinja2", "torch", "onnx", "onnxruntime", "starlette", "uvicorn", "textual",
         "huggingface_hub", "llguidance", "gguf", "transformers", "safetensors")

# The modules `spekula generate --backend native` imports, the lazily imported ones included.
GENERATE_PATH = (
    "spekula.frontends.cli.main",
    "spekula.frontends.cli.cmd_generate",
    "spekula.frontends.cli.options",
    "spekula.backends.native.backend",
    "spekula.backends.gguf.default_model",
    "spekula.core.modelfile.tokenizer",
    "spekula.core.modelfile.chat_template",
)


def heavy_modules_after(code: str) -> list[str]:
    """The HEAVY packages in sys.modules after running `code` in a fresh interpreter."""
    script = f"{code}\nimport json, sys\nprint(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))\n"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    return list(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_generate_path_imports_no_heavy_package() -> None:
    assert heavy_modules_after("\n".join(f"import {m}" for m in GENERATE_PATH)) == []


@pytest.mark.timeout(300)
def test_generate_run_imports_no_heavy_package() -> None:
    """The real command, in process: imports done inside functions (backend, tokenizer) count too."""
    model = str(tiny_model_path("llama"))
    run = ("from spekula.frontends.cli.main import main\n"
           f"assert main(['generate', '-m', {model!r}, '-p', 'hi', '-n', '1', '--temp', '0', "
           "'--backend', 'native', '-t', '1']) == 0")
    assert heavy_modules_after(run) == []


@pytest.mark.timeout(300)
def test_chat_imports_jinja2_only_when_rendering() -> None:
    model = str(tiny_model_path("llama"))
    run = ("from spekula.frontends.cli.main import main\n"
           f"assert main(['generate', '-m', {model!r}, '-p', 'hi', '-n', '1', '--temp', '0', "
           "'--backend', 'native', '-t', '1', '--chat']) == 0")
    assert heavy_modules_after(run) == ["jinja2"]


def test_collector_paused_in_process_leaves_the_collector_as_it_was() -> None:
    frozen = gc.get_freeze_count()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled() and gc.get_freeze_count() == frozen
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()  # a caller that had it off keeps it off
    finally:
        gc.enable()


@pytest.mark.timeout(300)
def test_generate_in_process_freezes_nothing() -> None:
    frozen = gc.get_freeze_count()
    model = str(tiny_model_path("llama"))
    assert main(["generate", "-m", model, "-p", "hi", "-n", "1", "--temp", "0", "--backend", "native", "-t", "1"]) == 0
    assert gc.isenabled() and gc.get_freeze_count() == frozen


@pytest.mark.timeout(300)
def test_console_run_freezes_what_start_up_built() -> None:
    model = str(tiny_model_path("llama"))
    script = ("import gc, sys\n"
              f"sys.argv = ['spekula', 'generate', '-m', {model!r}, '-p', 'hi', '-n', '1', '--temp', '0', '-t', '1']\n"
              "from spekula.frontends.cli.main import main\n"
              "assert main() == 0\n"
              "print(gc.isenabled(), gc.get_freeze_count() > 1000)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "True True"
