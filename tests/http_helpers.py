"""A real `spekula serve --port 0` process, and plain-HTTP calls to it (tests of the HTTP frontend)."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from cli_helpers import spekula_cmd

_LISTENING = re.compile(r"HTTP server listening on (http://[\d.]+:(\d+))")


class HttpServer:
    def __init__(self, proc: subprocess.Popen[bytes], url: str, port: int, log: Path) -> None:
        self.proc, self.url, self.port, self.log = proc, url, port, log

    def call(self, method: str, path: str, body: Any = None, *, headers: dict[str, str] | None = None,
             raw: bytes | None = None, timeout: float = 120) -> tuple[int, dict[str, str], Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
            hdrs = {"Content-Type": "application/json", **(headers or {})}
            conn.request(method, path, body=data, headers=hdrs)
            resp = conn.getresponse()
            payload = resp.read()
            ctype = resp.getheader("content-type", "")
            value: Any = json.loads(payload) if "json" in ctype and payload else payload.decode("utf-8", "replace")
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, value
        finally:
            conn.close()

    def post(self, path: str, body: Any, **kw: Any) -> tuple[int, Any]:
        status, _, value = self.call("POST", path, body, **kw)
        return status, value

    def get(self, path: str, **kw: Any) -> tuple[int, Any]:
        status, _, value = self.call("GET", path, **kw)
        return status, value

    def events(self, path: str, body: Any, headers: dict[str, str] | None = None) -> list[Any]:
        """A streamed request's `data:` payloads, parsed ([DONE] kept as the string)."""
        status, _, text = self.call("POST", path, body, headers=headers)
        assert status == 200, text
        out: list[Any] = []
        for block in text.split("\n\n"):
            if block.startswith("data: "):
                data = block[len("data: "):]
                out.append(data if data == "[DONE]" else json.loads(data))
        return out

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}: {self.log.read_text()}")
            try:
                if self.get("/health", timeout=5)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"server not ready: {self.log.read_text()}")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=60)


def start(model: str | Path, *extra: str, log: Path, ready: bool = True) -> HttpServer:
    cmd = [*spekula_cmd(), "serve", "-m", str(model), "--port", "0", *map(str, extra)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    assert proc.stderr is not None
    lines: list[bytes] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        m = _LISTENING.search(line.decode(errors="replace"))
        if m:
            break
    else:
        m = None
    if not m:
        proc.kill()
        raise AssertionError("server did not report its port: " + b"".join(lines).decode(errors="replace"))
    # The rest of stderr goes to the log file, read by a thread-free copy: pump it from a child.
    log.write_bytes(b"".join(lines))
    _pump(proc, log)
    server = HttpServer(proc, m.group(1), int(m.group(2)), log)
    if ready:
        server.wait_ready()
    return server


def _pump(proc: subprocess.Popen[bytes], log: Path) -> None:
    import threading

    def copy() -> None:
        assert proc.stderr is not None
        with log.open("ab") as f:
            for line in proc.stderr:
                f.write(line)
                f.flush()

    threading.Thread(target=copy, daemon=True).start()


@contextmanager
def running(model: str | Path, *extra: str, log: Path) -> Iterator[HttpServer]:
    server = start(model, *extra, log=log)
    try:
        yield server
    finally:
        server.stop()
