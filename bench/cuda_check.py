"""One command for a CUDA machine: the backend conformance checks and the backend bench, on the GPU,
for both backends, with a summary at the end.

    .venv/bin/python bench/cuda_check.py [-m MODEL.gguf] [--device cuda:0] [--reps 10]
                                         [--models llama,...,smollm2] [--no-extras] [--no-bench]

Conformance: every check of tests/backend_conformance.py on the tiny fixtures and SmolLM2, with both
backends built for the GPU in fp32 (the torch backend on CUDA is also the reference there). The torch
backend's exact mode is bitwise on CUDA by running every GEMM on one fixed shape (backends/torch/backend.py),
so its bitwise checks must pass there like anywhere else.
MoE targets: the qwen3moe and glm4moe fixtures are in the conformance list; draft-mtp on the GLM fixture
(torch on the GPU) must print what plain decoding prints.
The torch backend's exact mode is also checked bitwise against itself in bf16 (batched, truncated and
chunked rows). Every model's logits on the GPU are also compared with the torch backend's on the CPU (fp32 both).
Bench: bench/backends.py's decode/verification latencies on the GPU, for the backends that can use it,
in fp32 and in the GPU's default bf16. `--models` picks the conformance models, `--no-extras` skips the
draft-mtp and training checks, `--no-bench` the bench (so the work can be split over several runs).
Without a usable CUDA GPU it prints "skipped: no CUDA" and exits 0. Exit 1 when a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import traceback
from collections.abc import Callable
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("llama", "qwen2", "qwen3", "qwen3moe", "glm4moe", "smollm2")


def cuda_status(device_id: int) -> dict[str, str | None]:
    """Per backend: None when it can run on the GPU, else why not."""
    status: dict[str, str | None] = {}
    try:
        import torch

        status["torch"] = None if torch.cuda.is_available() and torch.cuda.device_count() > device_id else (
            f"torch {torch.__version__} sees no CUDA device {device_id}")
    except ImportError as exc:
        status["torch"] = f"torch not importable: {exc}"
    try:
        from spekula.backends.onnx.providers import cuda_usable

        status["onnx"] = cuda_usable(device_id)
    except ImportError as exc:
        status["onnx"] = f"onnxruntime not importable: {exc}"
    return status


def attempt(check: Callable[..., str | None], *args: str) -> str | None:
    """The check's verdict, or the exception it raised as the failure (every check is reported)."""
    try:
        return check(*args)
    except Exception as exc:  # noqa: BLE001
        return traceback.format_exception_only(type(exc), exc)[-1].strip()[:300]


def run_conformance(device: str, backends: list[str], models: list[str], dtype: str = "f32",
                    checks: tuple[str, ...] | None = None) -> list[tuple[str, str, str, str | None]]:
    """(backend, model, check, None or the failure) for every combination; `checks` limits them."""
    sys.path.insert(0, str(ROOT / "tests"))
    import backend_conformance as bc

    from spekula.core.backend import Backend, BackendOptions, load_backend

    @cache
    def on_gpu(name: str, model: str) -> Backend:
        opts = BackendOptions(device=device, dtype=dtype, n_ctx=bc.N_CTX, n_seq_max=4, exact=True,
                              ort_provider="cuda")
        return load_backend(name, bc.model_path(model), opts)

    bc.get_backend = on_gpu  # the checks look the factory up at call time
    results = []
    for name in backends:
        for model in models:
            for check, fn in sorted(bc.CHECKS.items()):
                if checks is not None and check not in checks:
                    continue
                label = check if dtype == "f32" else f"{check} ({dtype})"
                results.append((name, model, label, attempt(fn, name, model)))  # a conformance check returns None
    for name in backends:  # free the GPU for the next part (a model that failed to load is loaded no more)
        for model in models:
            with contextlib.suppress(Exception):  # its failure is in the results already
                on_gpu(name, model).close()
    on_gpu.cache_clear()
    return results


def gpu_matches_cpu(device: str, model: str) -> str | None:
    """None when the torch backend's fp32 logits on the GPU are within the reference tolerance of the CPU's."""
    sys.path.insert(0, str(ROOT / "tests"))
    import backend_conformance as bc
    import numpy as np

    from spekula.core.backend import BackendOptions, load_backend

    path = bc.model_path(model)
    logits = []
    for dev in (device, "cpu"):
        opts = BackendOptions(device=dev, dtype="f32", n_ctx=bc.N_CTX, n_seq_max=1, exact=dev != "cpu")
        backend = load_backend("torch", path, opts)
        try:
            logits.append(bc.run_fresh(backend, bc.random_tokens(backend, 37, seed=10)).logits)
        finally:
            backend.close()
    gpu, cpu = logits
    diff = float(np.abs(gpu - cpu).max())
    tol = bc.REF_TOL * max(1.0, float(np.abs(cpu).max()))
    return None if diff <= tol else f"max |gpu - cpu| {diff:.3g} > {tol:.3g}"


def mtp_matches_plain(device: str) -> str | None:
    """None when draft-mtp on the GPU gives plain decoding's text on the GLM-MoE fixture, else why not."""
    from spekula.fixtures.tiny_moe import tiny_moe_gguf_path

    model = str(tiny_moe_gguf_path("glm4moe", n_mtp=2))
    base = [sys.executable, "-m", "spekula.frontends.cli.main", "generate", "-m", model, "--device", device,
            "--dtype", "f32", "-n", "48", "--temp", "0", "--ignore-eos", "-p", "the cat sat on the mat"]
    outs = []
    for extra in ([], ["--spec-type", "draft-mtp"]):
        done = subprocess.run(base + extra, capture_output=True, text=True, timeout=600, check=False)
        if done.returncode != 0:
            return f"{' '.join(extra) or 'plain'} failed: {done.stderr.strip()[-300:]}"
        outs.append(done.stdout)
    return None if outs[0] == outs[1] else "draft-mtp output differs from plain decoding"


def quick_training_on(device: str) -> str | None:
    """None when `train-drafter --quick --device DEVICE` trains both head kinds on a tiny target (distillation
    on the GPU's torch backend, the heads on the GPU), in each training precision, and every EAGLE-3 head
    decodes what plain decoding does."""
    import tempfile

    from spekula.fixtures.tiny_gguf import tiny_model_path

    model = str(tiny_model_path("llama"))
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("eagle3", "dflash"):
            for precision in ("f32", "bf16"):
                cmd = [sys.executable, "-m", "spekula.frontends.cli.main", "train-drafter", kind, "-m", model, "-o",
                       f"{tmp}/{kind}-{precision}", "--quick", "--device", device, "--precision", precision,
                       "--cache-dir", f"{tmp}/cache-{kind}"]
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
                if done.returncode != 0:
                    return f"train-drafter {kind} --precision {precision} failed: {done.stderr.strip()[-300:]}"
        base = [sys.executable, "-m", "spekula.frontends.cli.main", "generate", "-m", model, "--device", device,
                "--dtype", "f32", "-n", "32", "--temp", "0", "--ignore-eos", "-p", "the cat sat on the mat"]
        outs = []
        for extra in ([], *(["--spec-type", "draft-eagle3", "-md", f"{tmp}/eagle3-{p}/eagle3.gguf"] for p in ("f32", "bf16"))):
            done = subprocess.run(base + extra, capture_output=True, text=True, timeout=600, check=False)
            if done.returncode != 0:
                return f"{' '.join(extra) or 'plain'} failed: {done.stderr.strip()[-300:]}"
            outs.append(done.stdout)
    return None if outs[0] == outs[1] == outs[2] else "draft-eagle3 with a trained head differs from plain decoding"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", help="GGUF model for the bench (default: the embedded SmolLM2)")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--models", default=",".join(MODELS), help=f"conformance models (default {','.join(MODELS)})")
    p.add_argument("--no-extras", action="store_true", help="skip the draft-mtp and train-drafter checks")
    p.add_argument("--no-bench", action="store_true", help="skip the latency bench")
    args = p.parse_args(argv)
    device_id = int(args.device.split(":", 1)[1]) if ":" in args.device else 0
    status = cuda_status(device_id)
    usable = [name for name, why in status.items() if why is None]
    if not usable:
        print("skipped: no CUDA (" + "; ".join(f"{k}: {v}" for k, v in status.items()) + ")")
        return 0
    for name, why in status.items():
        if why is not None:
            print(f"{name} backend cannot use CUDA: {why}")

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    results = run_conformance(args.device, usable, models)
    if "torch" in usable:
        # Exact mode's fixed shapes hold in half precision too: a row's bits against itself, batched and chunked.
        results += run_conformance(args.device, ["torch"], models, dtype="bf16",
                                   checks=("batched_equals_alone", "truncate_then_continue"))
        for model in models:
            results.append(("torch", model, "GPU logits match the CPU's", attempt(gpu_matches_cpu, args.device, model)))
        if not args.no_extras:
            results.append(("torch", "glm4moe", "draft-mtp equals plain", attempt(mtp_matches_plain, args.device)))
            results.append(("torch", "llama", "train-drafter --quick on the GPU",
                            attempt(quick_training_on, args.device)))
    failed = [r for r in results if r[3] is not None]
    print(f"\nconformance on {args.device}: {len(results) - len(failed)} passed, {len(failed)} failed")
    for name, model, check, why in failed:
        print(f"  FAIL {name:6} {model:8} {check}: {why}")

    bench_lines = ["bench skipped (--no-bench)"]
    if not args.no_bench:
        sys.path.insert(0, str(ROOT / "bench"))
        from backends import _model_path, print_table, run_bench

        bench_lines = []
        for dtype in ("f32", "bf16"):
            res = run_bench(_model_path(args.model), device=args.device, reps=args.reps, threads=0,
                            names=tuple(usable), dtype=dtype, sizes=(1, 2, 4, 8, 16, 32))
            print()
            print_table(res)
            ms = res["median_ms"][usable[0]]
            bench_lines.append(f"{usable[0]} {dtype} ms per forward by new tokens: "
                               + ", ".join(f"{n}: {v:.2f}" for n, v in ms.items()))
            if res["ratio_onnx_over_torch"]:
                bench_lines.append(f"onnx/torch ({dtype}) latency ratio per new-token count: " + ", ".join(
                    f"{n}: {r:.2f}" for n, r in res["ratio_onnx_over_torch"].items()))
    print("\nsummary:")
    print(f"  CUDA: {', '.join(usable)} on {args.device}")
    print(f"  conformance: {len(results) - len(failed)}/{len(results)} passed")
    for line in bench_lines:
        print(f"  {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
