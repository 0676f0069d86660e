"""A llama-server process for tests that record its answers: started on a free loopback port with the
environment's LLAMA_ARG_* options removed, waited for until healthy, stopped however the caller leaves;
and JSON posted to it (never through a proxy)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def llama_server(binary: str, model: str, *extra: str, start_timeout: float = 120) -> Iterator[int]:
    """The port of a healthy `binary -m model EXTRA...` (-c 512, one slot, one thread)."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen([binary, "-m", model, *extra, "--host", "127.0.0.1", "--port", str(port), "-c", "512",
                                 "-np", "1", "-t", "1", "--no-webui"],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + start_timeout
            while True:
                try:
                    with _OPENER.open(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                        if r.status == 200:
                            break
                except (urllib.error.URLError, OSError):
                    if proc.poll() is not None or time.monotonic() > deadline:
                        log.seek(0)
                        raise RuntimeError(f"llama-server did not start ({' '.join(extra)}): "
                                           f"{log.read()[-800:]!r}") from None
                    time.sleep(0.2)
            yield port
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def post_json(port: int, path: str, body: dict[str, Any], timeout: float = 120) -> Any:
    """The decoded answer; an HTTP error status raises urllib's HTTPError."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with _OPENER.open(req, timeout=timeout) as r:
        return json.loads(r.read())
