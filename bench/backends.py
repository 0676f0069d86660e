"""Forward latency of the torch and onnx backends on the same model, side by side in one run.

    .venv/bin/python bench/backends.py [-m MODEL.gguf] [--device cpu|cuda] [--past 256] [--reps 10]
                                       [--sizes 1,4,8,16] [--threads 1] [--loose] [--onnx-dtype f32|q4] [--json]
                                       [--backends torch,onnx] [--dtype auto|f32|bf16|f16]

For each size n it times one forward of n new tokens on top of a `--past`-token cache with logits for
every row (n = 1 is a decode step; n > 1 is a verification batch of a draft of n-1 tokens), truncating
back after each call. The two backends alternate call by call so machine noise hits both alike; the
median is reported with the onnx/torch ratio (< 1: onnx faster). `--loose` runs both with exact=False;
`--onnx-dtype q4` times the onnx backend's MatMulNBits weights against torch's fp32. `--backends torch`
times one backend alone (a GPU machine whose onnxruntime has no CUDA provider still gets torch's rows);
`--dtype` is torch's compute type (auto: f32 on the CPU, bf16 on a GPU). On a GPU each timed call ends
with the logits on the host, so the time includes the device's work.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from typing import Any

import numpy as np

BACKENDS = ("torch", "onnx")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", help="GGUF model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (default cpu)")
    p.add_argument("--past", type=int, default=256, help="tokens already in the cache (default 256)")
    p.add_argument("--reps", type=int, default=10, help="timed calls per size and backend (default 10)")
    p.add_argument("--sizes", default="1,4,8,16", help="new tokens per forward (default 1,4,8,16)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per backend (default 1; 0 = runtime default)")
    p.add_argument("--loose", action="store_true", help="exact=False for both backends")
    p.add_argument("--onnx-dtype", default="f32", choices=("f32", "q4"), help="onnx weight format (default f32)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--backends", default="torch,onnx", help="comma-separated, from torch,onnx (default both)")
    p.add_argument("--dtype", default="auto", help="torch's compute dtype: auto | f32 | bf16 | f16 (default auto)")
    return p.parse_args(argv)


def _model_path(model: str | None) -> str:
    if model:
        return model
    from spekula.backends.gguf.default_model import ensure_default_model

    return str(ensure_default_model())


def run_bench(model: str, *, device: str = "cpu", past: int = 256, reps: int = 10,
              sizes: tuple[int, ...] = (1, 4, 8, 16), threads: int = 1, exact: bool = True,
              onnx_dtype: str = "f32", names: tuple[str, ...] = BACKENDS, dtype: str = "auto") -> dict[str, Any]:
    """Median milliseconds per forward, per backend and size, plus onnx/torch ratios when both ran."""
    from spekula.core.backend import BackendOptions, SeqInput, load_backend

    provider = "cuda" if device.startswith("cuda") else "cpu"
    unknown = set(names) - set(BACKENDS)
    if unknown or not names:
        raise ValueError(f"--backends: choose from {', '.join(BACKENDS)} (got {', '.join(names) or 'none'})")
    opts = BackendOptions(device=device, dtype=dtype, n_ctx=past + max(sizes) + 8, n_seq_max=1, threads=threads,
                          exact=exact, ort_provider=provider)
    rng = np.random.default_rng(0)
    backends, seqs = {}, {}
    load_s: dict[str, float] = {}
    for name in names:
        t0 = time.perf_counter()
        backends[name] = load_backend(name, model, replace(opts, dtype=onnx_dtype) if name == "onnx" else opts)
        load_s[name] = time.perf_counter() - t0
    n_vocab = next(iter(backends.values())).info.n_vocab
    prompt = rng.integers(0, n_vocab, past).astype(np.int32)
    for name, be in backends.items():
        seqs[name] = be.new_seq()
        be.forward([SeqInput(seqs[name], prompt, 0, np.array([], dtype=np.int64))])
    times: dict[str, dict[int, list[float]]] = {name: {n: [] for n in sizes} for name in names}
    for n in sizes:
        draft = rng.integers(0, n_vocab, n).astype(np.int32)
        for rep in range(reps + 1):  # the first call per size warms caches and is not counted
            for name, be in backends.items():
                inp = SeqInput(seqs[name], draft, past, np.arange(n))
                t0 = time.perf_counter()
                be.forward([inp])
                dt = time.perf_counter() - t0
                be.truncate(seqs[name], past)
                if rep:
                    times[name][n].append(dt * 1e3)
    med = {name: {n: statistics.median(v) for n, v in per.items()} for name, per in times.items()}
    for be in backends.values():
        be.close()
    both = set(BACKENDS) <= set(names)
    return {
        "model": os.path.basename(model), "device": device, "past": past, "reps": reps, "exact": exact,
        "onnx_dtype": onnx_dtype, "dtype": dtype, "backends": list(names),
        "threads": threads, "load_s": load_s,
        "median_ms": {name: {str(n): round(v, 3) for n, v in per.items()} for name, per in med.items()},
        "ratio_onnx_over_torch": {str(n): round(med["onnx"][n] / med["torch"][n], 3) for n in sizes} if both else {},
    }


def print_table(res: dict[str, Any]) -> None:
    names = res["backends"]
    print(f"model {res['model']}  device {res['device']}  torch dtype {res['dtype']}  past {res['past']}  "
          f"exact {res['exact']}  threads {res['threads']}  onnx weights {res['onnx_dtype']}  reps {res['reps']} (median)")
    print("load: " + ", ".join(f"{name} {res['load_s'][name]:.1f} s" for name in names))
    ratios = res["ratio_onnx_over_torch"]
    print(f"{'new tokens':>10}" + "".join(f"  {name + ' ms':>9}" for name in names) + (f"  {'onnx/torch':>10}" if ratios else ""))
    for n in res["median_ms"][names[0]]:
        row = f"{n:>10}" + "".join(f"  {res['median_ms'][name][n]:>9.2f}" for name in names)
        print(row + (f"  {ratios[n]:>10.2f}" if ratios else ""))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from spekula.core.errors import SpekulaError

    try:
        sizes = tuple(int(s) for s in args.sizes.split(",") if s.strip())
        res = run_bench(_model_path(args.model), device=args.device, past=args.past, reps=args.reps,
                        sizes=sizes, threads=args.threads, exact=not args.loose, onnx_dtype=args.onnx_dtype,
                        names=tuple(b.strip() for b in args.backends.split(",") if b.strip()), dtype=args.dtype)
    except (SpekulaError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(res))
    else:
        print_table(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
