"""Drive a local llama-server for side-by-side benchmarks: start it, send greedy /completion requests, stop it.

Used by bench/ngram.py. Everything stays on loopback: the server is bound to 127.0.0.1 on a free port,
requests go only there (no proxy), each request and the start-up have a time limit, a server accepts
at most MAX_REQUESTS requests, and the process is killed on exit however the caller leaves.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spekula.core.errors import SpekulaError

# The binary when neither --llama-server nor PATH names one (e.g. the venv bench/ngram.py's recipe builds).
ENV_BINARY = "SPEKULA_LLAMA_SERVER"
HOST = "127.0.0.1"
MAX_REQUESTS = 64  # per server: the benchmarks need a handful; a runaway loop must not hammer it
_LIVE: set[subprocess.Popen[bytes]] = set()


class LlamaServerError(SpekulaError):
    """llama-server could not be started or answered badly."""


def find_llama_server(explicit: str | None = None) -> tuple[str | None, str]:
    """(path, "") when found, else (None, why not): --llama-server PATH, then $SPEKULA_LLAMA_SERVER, then PATH."""
    for origin, named in (("--llama-server", explicit), (f"${ENV_BINARY}", os.environ.get(ENV_BINARY))):
        if named:
            path = Path(named)
            if path.is_file() and os.access(path, os.X_OK):
                return str(path), ""
            return None, f"{origin} {named} is not an executable file"
    found = shutil.which("llama-server")
    if found:
        return found, ""
    return None, f"llama-server is not on PATH; name it with --llama-server PATH or ${ENV_BINARY}"


def supported_spec_types(binary: str, wanted: list[str], timeout: float = 30.0) -> list[str]:
    """The types in `wanted` that this llama-server build lists in its --help (older builds lack some)."""
    try:
        out = subprocess.run(
            [binary, "--help"], capture_output=True, timeout=timeout, env=_child_env(), check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LlamaServerError(f"{binary} --help failed: {e}") from e
    text = (out.stdout + out.stderr).decode("utf-8", "replace")
    if "--spec-type" not in text:
        return []
    # Whole names only: "ngram-map-k" must not match inside "ngram-map-k4v".
    return [t for t in wanted if re.search(rf"(?<![\w-]){re.escape(t)}(?![\w-])", text)]


@dataclass(frozen=True, slots=True)
class Completion:
    """What one /completion answer says about generation speed and speculation."""

    tokens: list[int]
    content: str
    predicted_n: int
    predicted_per_second: float
    draft_n: int  # draft tokens proposed (absent from timings when 0)
    draft_n_accepted: int
    verif_steps: int | None  # verification rounds, from /metrics; None if the counter is missing

    def same_output(self, other: Completion) -> bool:
        # Token ids when the server returned them (return_tokens), else the text.
        if self.tokens and other.tokens:
            return self.tokens == other.tokens
        return self.content == other.content

    @property
    def acceptance(self) -> float:
        return self.draft_n_accepted / self.draft_n if self.draft_n else 0.0

    @property
    def mean_len(self) -> float | None:
        """Tokens emitted per verification round (llama.cpp's `mean len`); None without the step count."""
        if self.verif_steps is None:
            return None
        return 1.0 + self.draft_n_accepted / self.verif_steps if self.verif_steps else 1.0


def _child_env() -> dict[str, str]:
    # LLAMA_ARG_* variables would silently override our command line (host, port, spec type, ...).
    return {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _kill_all() -> None:
    for proc in list(_LIVE):
        _stop(proc)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    _LIVE.discard(proc)


atexit.register(_kill_all)


class LlamaServer:
    """One llama-server process for one configuration; use as a context manager.

    Per-request `speculative.*` fields are compiled out of llama-server, so each spec type needs its
    own server: `spec_type=None` is the no-speculation baseline.
    """

    def __init__(
        self,
        binary: str,
        model: str,
        *,
        spec_type: str | None,
        options: dict[str, Any],
        n_ctx: int,
        n_batch: int,
        threads: int = 0,
        startup_timeout: float = 180.0,
        request_timeout: float = 300.0,
    ) -> None:
        self.binary = binary
        self.model = model
        self.spec_type = spec_type
        self.options = options
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        self.threads = threads
        self.startup_timeout = startup_timeout
        self.request_timeout = request_timeout
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None
        self._requests = 0
        # Loopback only and never through a proxy named in the environment.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def command(self) -> list[str]:
        cmd = [self.binary, "-m", self.model, "--host", HOST, "--port", str(self.port)]
        cmd += ["-c", str(self.n_ctx), "-b", str(self.n_batch), "-np", "1", "--metrics", "--no-webui"]
        if self.threads > 0:
            cmd += ["-t", str(self.threads), "-tb", str(self.threads)]
        if self.spec_type is not None:
            cmd += ["--spec-type", self.spec_type]
            # The drafter options carry llama.cpp's own option names, so they pass through unchanged.
            for name, value in self.options.items():
                cmd += [f"--{name}", str(value)]
        return cmd

    def __enter__(self) -> LlamaServer:
        self.port = _free_port()
        self._log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)
        self._proc = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=_child_env(),
        )
        _LIVE.add(self._proc)
        try:
            self._wait_healthy()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            _stop(self._proc)
            self._proc = None
        if self._log is not None:
            self._log.close()
            with contextlib.suppress(OSError):
                os.unlink(self._log.name)
            self._log = None

    def log_tail(self, n: int = 15) -> str:
        if self._log is None:
            return ""
        self._log.flush()
        lines = Path(self._log.name).read_text("utf-8", "replace").splitlines()
        return "\n".join(lines[-n:])

    def _url(self, path: str) -> str:
        return f"http://{HOST}:{self.port}{path}"

    def _wait_healthy(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise LlamaServerError(
                    f"llama-server exited with code {self._proc.returncode} while starting:\n{self.log_tail()}"
                )
            try:
                with self._opener.open(self._url("/health"), timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass  # not listening yet, or 503 while the model loads
            time.sleep(0.25)
        raise LlamaServerError(
            f"llama-server not healthy after {self.startup_timeout:.0f} s:\n{self.log_tail()}"
        )

    def _request(self, path: str, body: dict[str, Any] | None) -> bytes:
        if self._proc is None:
            raise LlamaServerError("llama-server is not running")
        if self._requests >= MAX_REQUESTS:
            raise LlamaServerError(f"more than {MAX_REQUESTS} requests to one llama-server")
        self._requests += 1
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self._url(path), data=data, headers={"Content-Type": "application/json"})
        try:
            with self._opener.open(req, timeout=self.request_timeout) as r:
                return bytes(r.read())
        except urllib.error.HTTPError as e:
            raise LlamaServerError(
                f"{path}: HTTP {e.code}: {e.read()[:500].decode('utf-8', 'replace')}"
            ) from e
        except (urllib.error.URLError, OSError) as e:
            raise LlamaServerError(f"{path}: {e}\n{self.log_tail()}") from e

    def _verif_steps(self) -> int | None:
        text = self._request("/metrics", None).decode("utf-8", "replace")
        for line in text.splitlines():
            if line.startswith("llamacpp:spec_decode_num_drafts_total"):
                return int(float(line.split()[-1]))
        return None

    def complete(self, prompt: list[int], n_predict: int, *, ignore_eos: bool = False,
                 sampling: dict[str, Any] | None = None) -> Completion:
        """Completion of already-tokenized `prompt` (sent as ids, so both engines see the same tokens):
        greedy, or with the `sampling` fields given (temperature, top_k, seed, ...)."""
        steps_before = self._verif_steps()
        body = {
            "prompt": prompt,
            "n_predict": n_predict,
            "temperature": 0.0,
            "ignore_eos": ignore_eos,
            "cache_prompt": False,
            "return_tokens": True,
            "stream": False,
            **(sampling or {}),
        }
        answer = json.loads(self._request("/completion", body))
        steps_after = self._verif_steps()
        timings = answer.get("timings")
        if not isinstance(timings, dict) or "predicted_per_second" not in timings:
            raise LlamaServerError(f"/completion answer has no timings: {str(answer)[:300]}")
        steps = None if steps_before is None or steps_after is None else steps_after - steps_before
        return Completion(
            tokens=[int(t) for t in answer.get("tokens") or []],
            content=str(answer.get("content", "")),
            predicted_n=int(timings.get("predicted_n", 0)),
            predicted_per_second=float(timings["predicted_per_second"]),
            draft_n=int(timings.get("draft_n", 0)),
            draft_n_accepted=int(timings.get("draft_n_accepted", 0)),
            verif_steps=steps,
        )
