"""Scale-out on Ray Serve: throughput and latency with 1 and 2 engine replicas, in one run.

Each replica is one spekula engine with `--threads 1`; the clients are `--clients` threads, each
sending chat requests back to back (distinct prompts, greedy, `--max-tokens` each) over HTTP.
Measured, in this order, on one machine:

    plain     spekula serve --port (no Ray), 1 thread        -- the cost of Ray itself
    plain x2  two such servers side by side, half the clients each -- what the cores give without Ray
    ray x1    spekula serve --ray --replicas 1, 1 thread      -- at --clients, and at half of them
    ray x2    spekula serve --ray --replicas 2, 1 thread each -- at --clients

Throughput is completion tokens per second of wall time across all clients; latency is each
request's wall time. Goals (issue 17): ray x2 >= 1.7x ray x1 throughput at the same client count;
ray x2's p50 latency no worse than ray x1's at equal load per replica (x1 with half the clients).
Beside that ratio it prints the same ratio for the two plain servers: what two engines on these cores
reach with no Ray cost at all.

    .venv/bin/python bench/ray_scale.py --clients 16 --requests 3 --max-tokens 64
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prompt_cache import Spekula  # noqa: E402

TOPICS = ("rivers", "bread", "trains", "owls", "copper", "tea", "glaciers", "chess", "wool", "radio", "maps",
          "bees", "clocks", "salt", "kites", "ferns", "bridges", "paper", "wolves", "glass", "honey", "lamps",
          "tides", "coral", "violins", "deserts", "printing", "volcanoes", "bicycles", "lighthouses", "cheese",
          "comets", "silk", "moss", "canals", "pottery", "sundials", "whales", "bamboo", "telescopes", "ink",
          "olives", "mirrors", "caves", "sails", "rain", "looms", "pepper", "marble", "frogs", "harps", "dams")


def get(port: int, path: str) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null")
    finally:
        conn.close()


def chat(conn: http.client.HTTPConnection, topic: str, max_tokens: int) -> int:
    body = {"messages": [{"role": "user", "content": f"Write a short paragraph about {topic}."}],
            "max_tokens": max_tokens, "temperature": 0}
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    answer = json.loads(resp.read())
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {answer}")
    return int(answer["usage"]["completion_tokens"])


def load_pair(ports: tuple[int, int], clients: int, requests: int, max_tokens: int) -> dict[str, float]:
    """Two servers loaded at once, half the clients each: the rows of both, combined."""
    out: list[dict[str, float]] = []
    threads = [threading.Thread(target=lambda p=p, i=i: out.append(load(p, clients // 2, requests, max_tokens, i * 97)))
               for i, p in enumerate(ports)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = max(r["wall_s"] for r in out)
    tokens = sum(r["tokens"] for r in out)
    return {"tok_s": tokens / wall, "p50_s": statistics.median(r["p50_s"] for r in out),
            "p90_s": max(r["p90_s"] for r in out), "requests": sum(r["requests"] for r in out), "tokens": tokens,
            "wall_s": wall}


def load(port: int, clients: int, requests: int, max_tokens: int, offset: int) -> dict[str, float]:
    latencies: list[float] = []
    tokens = [0]
    errors: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(clients + 1)

    def client(c: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        start.wait()
        for r in range(requests):
            topic = TOPICS[(offset + c * requests + r) % len(TOPICS)]
            t0 = time.perf_counter()
            try:
                n = chat(conn, f"{topic} (note {c}.{r})", max_tokens)
            except Exception as exc:  # noqa: BLE001 - counted and reported
                with lock:
                    errors.append(repr(exc))
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
                continue
            with lock:
                latencies.append(time.perf_counter() - t0)
                tokens[0] += n
        conn.close()

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) failed, e.g. {errors[0]}")
    return {"tok_s": tokens[0] / wall, "p50_s": statistics.median(latencies),
            "p90_s": statistics.quantiles(latencies, n=10)[-1] if len(latencies) > 1 else latencies[0],
            "requests": len(latencies), "tokens": tokens[0], "wall_s": wall}


def measure(name: str, server: Spekula, clients: int, args: argparse.Namespace, rows: list[tuple[str, dict]]) -> None:
    load(server.port, min(clients, 4), 1, 16, offset=1000)  # warm-up: first forwards, caches, Ray paths
    row = load(server.port, clients, args.requests, args.max_tokens, offset=len(rows) * 7)
    rows.append((name, row))
    print(f"{name:<34} {row['tok_s']:8.1f} tok/s   p50 {row['p50_s']:6.2f} s   p90 {row['p90_s']:6.2f} s   "
          f"({row['requests']} requests, {row['tokens']} tokens, {row['wall_s']:.1f} s)", flush=True)


def one_round(args: argparse.Namespace, common: list[str]) -> dict[str, float]:
    """Every configuration once; returns this round's ratios."""
    rows: list[tuple[str, dict]] = []
    full, half = args.clients, args.clients // 2
    def server(*extra: str) -> Spekula:
        return Spekula(args.model, 1, [*extra, *common], ctx=2048)

    with server() as srv:
        measure(f"plain, {full} clients", srv, full, args, rows)
    with server() as a, server() as b:
        for srv in (a, b):
            load(srv.port, 4, 1, 16, offset=1000)
        pair = load_pair((a.port, b.port), full, args.requests, args.max_tokens)
        print(f"{'plain x2 side by side, ' + str(full) + ' clients':<34} {pair['tok_s']:8.1f} tok/s   "
              f"p50 {pair['p50_s']:6.2f} s   p90 {pair['p90_s']:6.2f} s   ({pair['requests']} requests)", flush=True)
    with server("--ray", "--replicas", "1") as srv:
        measure(f"ray x1, {full} clients", srv, full, args, rows)
        measure(f"ray x1, {half} clients", srv, half, args, rows)
    with server("--ray", "--replicas", "2") as srv:
        measure(f"ray x2, {full} clients", srv, full, args, rows)
        routed = [r["routed"] for r in get(srv.port, "/health")[1]["replicas"]]
    plain, one, one_half, two = (row for _, row in rows)
    ratios = {"hop": one["tok_s"] / plain["tok_s"], "scale": two["tok_s"] / one["tok_s"],
              "p50": two["p50_s"] / one_half["p50_s"], "cores": pair["tok_s"] / plain["tok_s"],
              # Two engines without Ray against one Ray replica with a core to spare: what the p50
              # ratio would be if Ray cost nothing at all.
              "p50_bound": pair["p50_s"] / one_half["p50_s"]}
    print(f"  round: plain pair / plain {ratios['cores']:.2f}x, ray x1 / plain {ratios['hop']:.2f}x, "
          f"ray x2 / ray x1 {ratios['scale']:.2f}x, "
          f"p50 x2@{full} / x1@{half} {ratios['p50']:.2f}x (plain x2 {ratios['p50_bound']:.2f}x), "
          f"requests per replica {routed}", flush=True)
    return ratios


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", default=None, help="GGUF model (default: the embedded SmolLM2)")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=4, help="requests per client")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--parallel", type=int, default=4, help="slots per engine (-np)")
    p.add_argument("--spec-type", default="ngram-simple,ngram-mod")
    p.add_argument("--rounds", type=int, default=3,
                   help="repeat every configuration this many times (this machine's speed drifts)")
    args = p.parse_args(argv)
    common = ["-np", str(args.parallel), "--spec-type", args.spec_type]  # -t 1: Spekula's threads
    print(f"{args.clients} clients x {args.requests} chat requests x {args.max_tokens} tokens, "
          f"-np {args.parallel}, --spec-type {args.spec_type}, 1 thread per engine, {os.cpu_count()} cores")
    rounds = [one_round(args, common) for _ in range(args.rounds)]

    def median(key: str) -> float:
        return statistics.median(r[key] for r in rounds)

    print(f"\nmedians over {args.rounds} round(s):")
    print(f"two plain servers / one: {median('cores'):.2f}x (what the cores scale to without Ray)")
    print(f"ray x1 / plain throughput: {median('hop'):.2f}x (the cost of the Ray hop)")
    print(f"ray x2 / ray x1 throughput at {args.clients} clients: {median('scale'):.2f}x (goal >= 1.7x)")
    print(f"ray x2 p50 at {args.clients} clients / ray x1 p50 at {args.clients // 2} clients: "
          f"{median('p50'):.2f}x (goal <= 1.0x: equal load per replica)")
    print(f"plain x2 p50 at {args.clients} clients / ray x1 p50 at {args.clients // 2} clients: "
          f"{median('p50_bound'):.2f}x (the same ratio with no Ray cost at all)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
