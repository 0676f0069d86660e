"""Running the real `spekula` console script in a subprocess, as a user would.

Shared by tests/test_cli_e2e.py and test_bad_input.py (tests/conftest.py puts tests/ on sys.path).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path


def spekula_cmd() -> list[str]:
    """The installed console script next to this interpreter, else the module (same entry point)."""
    script = Path(sys.executable).with_name("spekula")
    if script.exists():
        return [str(script)]
    found = shutil.which("spekula")
    return [found] if found else [sys.executable, "-m", "spekula.frontends.cli.main"]


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """One `spekula ARGS...` run with a single OpenMP thread, no stdin, output captured as text."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([*spekula_cmd(), *map(str, args)], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def error_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The single `spekula: error: ...` line; fails on a traceback, extra lines or exit code 0."""
    assert proc.returncode != 0, f"expected failure, got exit 0\nstdout: {proc.stdout}\nstderr: {proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    # log lines written before the failure (structlog's "HH:MM:SS [info ...") are allowed
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and " [info " not in ln and " INFO " not in ln]
    assert len(lines) == 1, f"expected one error line, got:\n{proc.stderr}"
    assert lines[0].startswith("spekula: error: "), lines[0]
    return lines[0]
