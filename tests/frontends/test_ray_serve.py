"""`spekula serve --ray` on a local Ray cluster (`ray start --head` on 127.0.0.1, started here) with
two engine replicas of the tiny fixture: same answers as one engine, prefix routing visible in
`timings.cache_n`, sessions kept on one replica, aggregated /health, /slots and /metrics, and a
replica killed under load losing no request that had not started streaming."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import run_cli
from http_helpers import HttpServer, start

from spekula.fixtures.tiny_gguf import tiny_model_path

pytest.importorskip("ray.serve", reason="the Ray extra is not installed (pip install spekula[ray])")
pytestmark = pytest.mark.ray

MODEL = tiny_model_path("llama")
SPEC = ("--spec-type", "ngram-simple,ngram-mod", "--spec-ngram-simple-size-n", "2", "--spec-ngram-simple-size-m", "4",
        "--spec-ngram-mod-n-match", "2", "--spec-ngram-mod-n-min", "1", "--spec-ngram-mod-n-max", "4")
N_SLOTS = 2  # per replica
PROMPTS = ["the cat sat on the mat and the cat", "one two three four one two three", "a b c d e f a b c d",
           "hello world, hello world, hello", "to be or not to be, that is", "red green blue red green blue red"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ray(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    ray = shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"
    return subprocess.run([ray, *args], capture_output=True, text=True, env=env, timeout=180)


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A one-node Ray cluster on 127.0.0.1, stopped (with everything it runs) at the end."""
    temp = tempfile.mkdtemp(prefix="spk-ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    port = _free_port()
    # A throw-away cluster on loopback: no auth token to hand around (the server started below
    # inherits this environment).
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_USAGE_STATS_ENABLED")}
    os.environ.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    env = dict(os.environ)
    res = _ray("start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=2",
               "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp}", env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    try:
        yield f"127.0.0.1:{port}"
    finally:
        _ray("stop", "--force", env=env)
        shutil.rmtree(temp, ignore_errors=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def server(cluster: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    log = tmp_path_factory.mktemp("ray") / "server.log"
    srv = start(MODEL, "--ray", "--ray-address", cluster, "--replicas", "2", "-np", str(N_SLOTS), "-c", "2048",
                "-t", "1", "--temp", "0", "--metrics", *SPEC, log=log)
    try:
        yield srv
    finally:
        assert srv.stop() == 0, log.read_text()


def _listener_pid(port: int) -> int | None:
    """The process holding the listening TCP socket on `port` (from /proc: no extra tools)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                cols = row.split()
                if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == "0A":  # 0A: LISTEN
                    inodes.add(cols[9])
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}").removeprefix("socket:[").rstrip("]") in inodes:
                    return int(pid)
        except OSError:
            continue
    return None


def test_a_cluster_of_its_own_answers_on_the_ingress_itself(tmp_path: Path) -> None:
    """Without --ray-address the command starts its own cluster, where the ingress replica answers
    HTTP on the user's port itself (Serve's direct ingress), not behind Serve's proxy actor. Runs
    before the module's cluster exists, so that this one is the only cluster on the machine."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        res = run_cli("serve", "--ray", "-m", MODEL, "--port", str(busy.getsockname()[1]), timeout=120)
        assert res.returncode == 1 and "cannot listen on" in res.stderr, res.stderr
    srv = start(MODEL, "--ray", "--replicas", "1", "-np", "1", "-c", "256", "-t", "1", "--temp", "0",
                log=tmp_path / "server.log")
    try:
        status, got = srv.post("/completion", {"prompt": PROMPTS[1], "n_predict": 10})
        assert status == 200, got
        assert got["content"] == _single_engine(PROMPTS[1], 10, "--spec-type", "none")["content"]
        pid = _listener_pid(srv.port)
        assert pid is not None
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            owner = f.read().replace(b"\0", b" ").decode()
        assert "ServeReplica" in owner and "ingress" in owner, owner
    finally:
        assert srv.stop() == 0, srv.log.read_text() if srv.log.exists() else ""


def test_the_serve_application_deploys_from_a_config_file(cluster: str, tmp_path: Path) -> None:
    """`serve run config.yaml`, the way Ray Serve users deploy: `spekula.frontends.ray.app:app` with
    spekula's options as the application's args. Runs before the module's server (one Serve
    instance per cluster) and shuts its Serve down on SIGINT, as `serve run` does."""
    port = _free_port()
    config = tmp_path / "serve.yaml"
    config.write_text(json.dumps({  # YAML is a superset of JSON
        "proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [{"name": "spekula", "route_prefix": "/", "import_path": "spekula.frontends.ray.app:app",
                          "args": {"model": str(MODEL), "replicas": 2, "parallel": N_SLOTS, "threads": 1,
                                   "ctx-size": 256, "temp": 0, "metrics": True}}]}))
    serve_cli = shutil.which("serve", path=os.path.dirname(sys.executable)) or "serve"
    log = tmp_path / "serve-run.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([serve_cli, "run", "--address", cluster, str(config)], stdout=out, stderr=out)
    srv = HttpServer(proc, f"http://127.0.0.1:{port}", port, log)
    try:
        srv.wait_ready(timeout=180)
        status, got = srv.post("/completion", {"prompt": PROMPTS[0], "n_predict": 12})
        assert status == 200, got
        assert got["content"] == _single_engine(PROMPTS[0], 12, "--spec-type", "none")["content"]
        assert len(_health(srv)["replicas"]) == 2 and srv.get("/props")[1]["total_slots"] == 2 * N_SLOTS
        assert srv.get("/metrics")[0] == 200
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError("serve run did not stop on SIGINT: " + log.read_text()) from None


def _single_engine(prompt: str, n: int, *extra: str) -> dict[str, Any]:
    spec = () if "--spec-type" in extra else SPEC
    res = run_cli("generate", "-m", MODEL, "-p", prompt, "-n", str(n), "--temp", "0", "--json", *spec, *extra)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def _replica(result: dict[str, Any]) -> int:
    return int(result["id_slot"]) // N_SLOTS


def _health(server: HttpServer) -> dict[str, Any]:
    status, body = server.get("/health")
    assert status == 200, body
    return body


def test_answers_equal_one_engines(server: HttpServer) -> None:
    for prompt in PROMPTS[:3]:
        want = _single_engine(prompt, 24)
        status, got = server.post("/completion", {"prompt": prompt, "n_predict": 24})
        assert status == 200, got
        assert got["content"] == want["content"]
    # Sampling with a seed: the same law and the same draws on whichever replica runs it.
    seeded = _single_engine(PROMPTS[3], 24, "--temp", "0.8", "--seed", "7")
    status, got = server.post("/completion", {"prompt": PROMPTS[3], "n_predict": 24, "temperature": 0.8, "seed": 7})
    assert status == 200 and got["content"] == seeded["content"]
    # Streaming passes through: the pieces add up to the same answer.
    events = server.events("/completion", {"prompt": PROMPTS[0], "n_predict": 24, "stream": True})
    assert "".join(e["content"] for e in events if not e.get("stop")) == _single_engine(PROMPTS[0], 24)["content"]
    assert events[-1]["stop"] is True and events[-1]["id_slot"] >= 0


def test_follow_up_turns_go_to_the_replica_that_cached_them(server: HttpServer) -> None:
    firsts: list[dict[str, Any]] = []
    for i, prompt in enumerate(PROMPTS[:2 * N_SLOTS]):  # one conversation per slot: none evicts another
        status, first = server.post("/completion", {"prompt": f"{prompt} (conversation {i})", "n_predict": 12})
        assert status == 200, first
        firsts.append(first)
    assert {_replica(f) for f in firsts} == {0, 1}  # the first turns spread over both replicas
    for i, first in enumerate(firsts):
        turn2 = first["prompt"] + first["content"] + " and then"
        status, second = server.post("/completion", {"prompt": turn2, "n_predict": 8})
        assert status == 200, second
        assert _replica(second) == _replica(first), (i, first["id_slot"], second["id_slot"])
        assert second["timings"]["cache_n"] >= first["tokens_evaluated"] - 1


def test_a_user_sticks_to_one_replica(server: HttpServer) -> None:
    homes = {}
    for user in ("alice", "bob", "carol", "dave"):
        answers = [server.post("/completion", {"prompt": f"{user} asks: {p}", "n_predict": 4, "user": user})[1]
                   for p in PROMPTS]
        replicas = {_replica(a) for a in answers}
        assert len(replicas) == 1, (user, [a["id_slot"] for a in answers])
        homes[user] = replicas.pop()
    assert set(homes.values()) == {0, 1}  # new users still spread over the replicas


def test_bad_requests_are_refused_at_the_ingress_and_serving_goes_on(server: HttpServer) -> None:
    for raw, field in ((b"{bad", "invalid JSON"), (b'{"prompt": 5}', "prompt"), (b'{"prompt": "x", "nope": 1}', "nope"),
                       (b"[" * 50_000, "invalid JSON"), (b'{"prompt": "x", "n_predict": 1e999}', "out of range"),
                       (b'{"prompt": "x", "grammar": "root ::= ("}', "grammar"),
                       (b'{"prompt": "x", "id_slot": 99}', "id_slot")):
        status, _, body = server.call("POST", "/completion", raw=raw)
        assert status == 400, (raw[:40], status, body)
        assert field in body["error"]["message"], body
    status, got = server.post("/completion", {"prompt": PROMPTS[0], "n_predict": 8})
    assert status == 200 and got["tokens_predicted"] == 8
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("GET", "/health")
    resp = conn.getresponse()
    resp.read()
    conn.close()
    assert len(resp.headers.get_all("server") or []) == 1  # Ray's proxy names itself; the app does not too


def test_a_bad_model_or_option_is_one_clear_error_before_ray_starts(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(Path(MODEL).read_bytes()[:1000])
    for args, words in ((["-m", bad], "truncated"), (["-m", tmp_path / "none.gguf"], "no such file"),
                        (["-m", MODEL, "--spec-type", "draft-mtp"], "no multi-token-prediction layers"),
                        (["-m", MODEL, "--socket", tmp_path / "s"], "--socket cannot be combined")):
        res = run_cli("serve", "--ray", "--port", "0", *args, timeout=120)
        assert res.returncode == 1 and words in res.stderr, res.stderr
    res = run_cli("serve", "-m", MODEL, "--replicas", "2", "--port", "0", timeout=60)
    assert res.returncode == 1 and "need --ray" in res.stderr


def test_health_slots_and_metrics_cover_every_replica(server: HttpServer) -> None:
    health = _health(server)
    assert [r["replica"] for r in health["replicas"]] == [0, 1] and all(r["up"] for r in health["replicas"])
    status, slots = server.get("/slots")
    assert status == 200 and [s["id"] for s in slots] == list(range(2 * N_SLOTS))
    assert [s["replica"] for s in slots] == [0] * N_SLOTS + [1] * N_SLOTS
    assert server.get("/props")[1]["total_slots"] == 2 * N_SLOTS

    before = _predicted(server)
    made = 0
    for i, prompt in enumerate(PROMPTS):  # id_slot spreads them over both replicas for certain
        status, got = server.post("/completion", {"prompt": prompt, "n_predict": 10, "id_slot": i % (2 * N_SLOTS)})
        assert status == 200, got
        made += got["tokens_predicted"]
    assert _predicted(server) - before == made


def _predicted(server: HttpServer) -> float:
    status, text = server.get("/metrics")
    assert status == 200
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith("llamacpp:tokens_predicted_total ")))


def _all_idle(server: HttpServer, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(s["is_processing"] for s in server.get("/slots")[1]):
            return
        time.sleep(0.05)
    raise AssertionError(f"slots still busy: {server.get('/slots')[1]}")


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_goes_away_frees_its_slot_on_the_replica(server: HttpServer, stream: bool) -> None:
    _all_idle(server)
    before = _predicted(server)
    body = json.dumps({"prompt": PROMPTS[1], "n_predict": 2000, "ignore_eos": True, "stream": stream})
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    sock.sendall(f"POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
    if stream:
        got = b""
        while b"data: " not in got:  # generating: the first event is out
            chunk = sock.recv(65536)
            assert chunk, got
            got += chunk
    else:
        deadline = time.monotonic() + 30
        while not any(s["is_processing"] for s in server.get("/slots")[1]):
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.01)
    sock.close()
    _all_idle(server)
    assert _predicted(server) - before < 2000  # cancelled on the replica, not run to n_predict


def test_a_replica_killed_under_load_loses_no_unstreamed_request(server: HttpServer) -> None:
    prompts = [f"request {i}: {PROMPTS[i % len(PROMPTS)]}" for i in range(16)]
    want = {p: _single_engine(p, 160)["content"] for p in prompts[:4]}
    results: dict[int, Any] = {}
    streams: dict[int, Any] = {}

    def one(i: int) -> None:
        try:
            results[i] = server.post("/completion", {"prompt": prompts[i], "n_predict": 160}, timeout=180)
        except Exception as exc:  # noqa: BLE001 - recorded and asserted on below
            results[i] = exc

    def streamed(i: int) -> None:
        try:
            streams[i] = server.events("/completion", {"prompt": prompts[i], "n_predict": 160, "stream": True})
        except Exception as exc:  # noqa: BLE001
            streams[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    threads += [threading.Thread(target=streamed, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    victim = None
    deadline = time.monotonic() + 30
    while victim is None and time.monotonic() < deadline:
        r0 = _health(server)["replicas"][0]
        if r0["in_flight"] > 0 and r0["pid"]:
            victim = int(r0["pid"])
        else:
            time.sleep(0.01)
    assert victim is not None, "replica 0 never had a request in flight"
    os.kill(victim, signal.SIGKILL)
    for t in threads:
        t.join(timeout=240)
    assert not any(t.is_alive() for t in threads), "a request hung after its replica died"
    for i, res in sorted(results.items()):
        assert not isinstance(res, Exception), (i, res)
        status, body = res
        assert status == 200, (i, body)
        assert body["tokens_predicted"] > 0
        if prompts[i] in want:
            assert body["content"] == want[prompts[i]], i
    # A stream either completes with the right answer or, cut after it started, ends with an error.
    for i, events in sorted(streams.items()):
        assert not isinstance(events, Exception), (i, events)
        last = events[-1]
        if "error" in last:
            assert "stopped in the middle of this stream" in last["error"]["message"]
        else:
            assert last["stop"] is True
            assert "".join(e["content"] for e in events[:-1]) == want[prompts[i]], i
    assert _health(server)["requests_retried"] >= 1
    # Ray starts a new replica 0; once it answers, it gets work again.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        r0 = _health(server)["replicas"][0]
        if r0["up"] and r0["pid"] not in (None, victim):
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"replica 0 did not come back: {_health(server)}")
    status, got = server.post("/completion", {"prompt": PROMPTS[0], "n_predict": 8, "id_slot": 0})
    assert status == 200 and got["id_slot"] == 0
