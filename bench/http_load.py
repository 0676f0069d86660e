"""HTTP load with bad clients mixed in: does `spekula serve --port` keep serving, and does it leak?

50 keep-alive connections send 500 completion requests between them (short answers, greedy, each
checked against the answer the same prompt got alone); alongside, hostile clients send malformed
JSON, wrong types, unknown fields, oversized bodies, and streams they close after the first event.
The server's RSS is printed after a warm-up and at the end, with the requests served per second.

    .venv/bin/python bench/http_load.py --requests 500 --connections 50
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import socket
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prompt_cache import Spekula  # noqa: E402

PROMPTS = [f"Write one sentence about {w}." for w in
           ("rivers", "bread", "trains", "owls", "copper", "tea", "glaciers", "chess", "wool", "radio")]
HOSTILE = [b"{bad", b'{"prompt": 5}', b'{"prompt": "x", "top_k": "many"}', b'{"prompt": "x", "nope": 1}',
           b"[" * 50_000, b'{"prompt": "x", "n_predict": 99999999999999999999999}']


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def complete(conn: http.client.HTTPConnection, prompt: str, n: int) -> str:
    conn.request("POST", "/completion", body=json.dumps({"prompt": prompt, "n_predict": n, "temperature": 0}),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    body = json.loads(resp.read())
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {body}")
    return str(body["content"])


def hostile(port: int, stop: threading.Event, counts: dict[str, int], seed: int) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        kind = rng.choice(["bad", "big", "drop"])
        try:
            if kind == "bad":
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                conn.request("POST", "/completion", body=rng.choice(HOSTILE), headers={"Content-Type": "application/json"})
                status = conn.getresponse().status
                conn.close()
                key = "bad_4xx" if 400 <= status < 500 else f"bad_{status}"
            elif kind == "big":
                sock = socket.create_connection(("127.0.0.1", port), timeout=30)
                sock.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Length: 104857600\r\n\r\n" + b"a" * 65536)
                reply = sock.recv(200)
                sock.close()
                key = "big_413" if b" 413 " in reply else "big_other"
            else:
                body = json.dumps({"prompt": "Tell a long story.", "n_predict": 400, "stream": True}).encode()
                sock = socket.create_connection(("127.0.0.1", port), timeout=30)
                sock.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                seen = b""
                while b"data: " not in seen:
                    seen += sock.recv(4096)
                sock.close()
                key = "dropped_streams"
        except OSError:
            key = "os_errors"
        counts[key] = counts.get(key, 0) + 1
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", help="GGUF model (default: the embedded SmolLM2)")
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--connections", type=int, default=50)
    ap.add_argument("--n-predict", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ray-replicas", type=int, default=0,
                    help="serve with --ray and this many engine replicas (RSS is then their sum)")
    args = ap.parse_args(argv)
    ray = ["--ray", "--replicas", str(args.ray_replicas)] if args.ray_replicas else []
    srv = Spekula(args.model, args.threads, extra=["-np", "4", *ray])
    with srv:
        assert srv.proc is not None

        def server_rss() -> float:
            if not ray:
                return rss_mb(srv.proc.pid)  # type: ignore[union-attr]
            conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
            conn.request("GET", "/health")
            pids = [r["pid"] for r in json.loads(conn.getresponse().read())["replicas"] if r["pid"]]
            conn.close()
            return sum(rss_mb(pid) for pid in pids)

        ref = {}
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=600)
        for p in PROMPTS:
            ref[p] = complete(conn, p, args.n_predict)
        conn.close()
        rss_start = server_rss()
        lock = threading.Lock()
        todo = list(range(args.requests))
        done: dict[str, int] = {"ok": 0, "wrong": 0, "failed": 0}
        marks: list[tuple[int, float]] = []

        def worker() -> None:
            c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=600)
            while True:
                with lock:
                    if not todo:
                        break
                    i = todo.pop()
                p = PROMPTS[i % len(PROMPTS)]
                try:
                    got = complete(c, p, args.n_predict)
                    key = "ok" if got == ref[p] else "wrong"
                except (OSError, RuntimeError, http.client.HTTPException):
                    key = "failed"
                    c.close()
                    c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=600)
                with lock:
                    done[key] += 1
                    n = sum(done.values())
                    if n == args.requests // 5:
                        marks.append((n, server_rss()))
            c.close()

        stop = threading.Event()
        bad_counts: dict[str, int] = {}
        hostiles = [threading.Thread(target=hostile, args=(srv.port, stop, bad_counts, s), daemon=True) for s in range(3)]
        workers = [threading.Thread(target=worker) for _ in range(args.connections)]
        t0 = time.perf_counter()
        for t in hostiles + workers:
            t.start()
        for t in workers:
            t.join()
        seconds = time.perf_counter() - t0
        stop.set()
        for t in hostiles:
            t.join(timeout=60)
        time.sleep(1.0)
        rss_end = server_rss()
        health = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
        health.request("GET", "/slots")
        busy = sum(s["is_processing"] for s in json.loads(health.getresponse().read()))
    warm = marks[0][1] if marks else rss_start
    print(f"{args.requests} requests over {args.connections} keep-alive connections in {seconds:.1f} s "
          f"({args.requests / seconds:.1f} req/s): {done}")
    print(f"hostile clients alongside: {dict(sorted(bad_counts.items()))}")
    print(f"server RSS: {rss_start:.0f} MB after the reference answers, {warm:.0f} MB after "
          f"{args.requests // 5} requests, {rss_end:.0f} MB at the end ({rss_end - warm:+.0f} MB); busy slots after: {busy}")
    return 0 if done["ok"] == args.requests and busy == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
