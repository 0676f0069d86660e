"""Start and stop a real `spekula serve` process on the tiny llama fixture (tests of the socket server)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from spekula.fixtures.tiny_gguf import tiny_model_path
from spekula.frontends.rpc.client import ServerGoneError, SpekulaClient

N_SLOTS = 3
N_CTX = 256


def rss_mb(pid: int) -> float:
    """A process's resident memory, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def start_server(sock: str, *extra: str, log: Path, preexec_fn: Callable[[], None] | None = None) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "spekula.frontends.cli.main", "serve", "-m", str(tiny_model_path("llama")),
           "--socket", sock, "-np", str(N_SLOTS), "-c", str(N_CTX), "--temp", "0",
           "--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "2", "--spec-ngram-simple-size-m", "4",
           *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log.open("wb"), env=env, preexec_fn=preexec_fn)


def wait_ready(proc: subprocess.Popen[bytes], sock: str, log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited {proc.returncode}: {log.read_text()}")
        if os.path.exists(sock):
            try:
                with SpekulaClient(sock, timeout=5) as c:
                    c.health()
                return
            except (OSError, ServerGoneError):  # a stale file not yet replaced, or still binding
                pass
        time.sleep(0.2)
    raise AssertionError(f"server not ready: {log.read_text()}")


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    return proc.wait(timeout=60)


