"""`spekula generate` on the native backend imports only what it uses: each heavy package below costs
tens of milliseconds of start-up (bench/startup.py), so an eager import of one of them anywhere on
the path fails here. Each check runs in a fresh interpreter, since this one has imported everything.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from spekula.fixtures.tiny_gguf import tiny_model_path

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
