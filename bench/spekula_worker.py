"""One spekula configuration measured in a process of its own, for bench/vs_llama_server.py.

    python bench/spekula_worker.py --model M --path native --threads 2 --job JOB.json

JOB.json: {"workloads": {name: [token ids]}, "n_predict": N, "specs": ["none", "ngram-mod", ...],
"prompt_512": [token ids], "sampling": {SamplingParams fields}}. Prints one JSON object: per spec and workload the generated tokens and
tok/s, the engine's own time per round next to the forward's, the workloads' tok/s at the job's
sampling (to n_predict tokens), the 512-token prompt's tok/s, the load
time, the process's peak RSS (VmHWM) and (native) the bytes of its packed weights. `--native-library
SO` runs the native path on another build of the kernels library (an older one, to compare against). A fresh Engine per spec (drafter state carries across the
workloads of one spec, as it does across requests on one llama-server).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

PATHS = {  # spekula path name -> (backend, dtype)
    "native": ("native", "auto"),
    "torch": ("torch", "auto"),
    "onnx": ("onnx", "auto"),
    "onnx-q4": ("onnx", "q4"),
}


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def packed_by_type(model: str) -> dict[str, list[int]]:
    """Per block type of the blocks' matrices: [bytes in the native kernels' packed layout, bytes in the
    file] (the layout's size asked of the library; nothing is packed here)."""
    import ctypes

    from spekula.backends.native import lib as nl
    from spekula.core.modelfile.gguf_file import GGUFFile

    sizes: dict[str, list[int]] = {}
    for entry in GGUFFile(model).tensors():
        if not entry.name.startswith("blk.") or len(entry.shape) != 2 or entry.type_name not in nl.TYPE_IDS:
            continue
        t = nl.tensor(entry.data, entry.type_name, entry.shape[0], entry.shape[1])
        packed = int(nl.lib().sk_test_pack(ctypes.byref(t), 0, None))
        pair = sizes.setdefault(entry.type_name, [0, 0])
        pair[0] += packed if packed > 0 else entry.data.nbytes  # not packed: read as stored
        pair[1] += entry.data.nbytes
    return sizes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--path", choices=sorted(PATHS), required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--n-ctx", type=int, default=2048)
    p.add_argument("--native-library", metavar="SO", help="the native kernels library to load (default: the package's)")
    args = p.parse_args(argv)
    # The serving process's imports as the CLI makes them: structlog first, without rich (13 MB of rich
    # and pygments that `spekula serve` never loads; frontends/logging_setup.py).
    from spekula.frontends import logging_setup  # noqa: F401

    job = json.loads(Path(args.job).read_text())
    # Only the result goes to stdout: anything the runtimes print (exporter progress) goes to stderr.
    result_out, sys.stdout = sys.stdout, sys.stderr

    import anyio

    from spekula.backends.native import lib as native_lib

    if args.native_library:
        native_lib.library_path = lambda: Path(args.native_library)  # before the first call loads it

    from spekula.core.backend import BackendOptions, backend_class
    from spekula.core.drafting.registry import parse_spec_types
    from spekula.core.engine.engine import Engine, EngineConfig
    from spekula.core.modelfile.gguf_file import GGUFFile
    from spekula.core.modelfile.tokenizer import Tokenizer
    from spekula.core.params import CompletionRequest, SamplingParams, SpecParams
    from spekula.core.verify.sampling import banning_end_of_generation
    from spekula.frontends.cli.in_thread import BackendLoad

    t0 = time.perf_counter()
    backend_name, dtype = PATHS[args.path]
    options = BackendOptions(n_ctx=args.n_ctx, n_seq_max=1, threads=args.threads, dtype=dtype)
    # As `spekula serve` loads (frontends/cli/options.py build_engine): the header parsed once and shared
    # (a second parse would hold a second copy of the vocabulary), the backend loading in a thread while
    # the tokenizer is built (in_thread.BackendLoad), so the peak RSS is the server's.
    model_file = GGUFFile.shared(args.model)
    make_backend = backend_class(backend_name, options)
    load = BackendLoad(lambda o: make_backend(args.model, o), options, model_file.metadata, "spekula-backend-load")
    tokenizer = load.beside(lambda: Tokenizer.from_gguf(model_file))
    backend = load.result()
    load_s = time.perf_counter() - t0
    forward_s: list[float] = []  # each forward's seconds during the current request
    inner = backend.forward

    def timed_forward(*a: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return inner(*a, **kw)
        finally:
            forward_s.append(time.perf_counter() - t)

    backend.forward = timed_forward  # type: ignore[method-assign]
    greedy = SamplingParams(temperature=0.0)
    out: dict[str, Any] = {"path": args.path, "threads": args.threads, "load_s": load_s, "specs": {}}

    async def run_spec(spec_name: str) -> dict[str, Any]:
        types = () if spec_name == "none" else tuple(parse_spec_types(spec_name.split("+")))
        spec = SpecParams(types=types, drafter_options=job.get("drafter_options", {}))
        engine = Engine(backend, tokenizer, EngineConfig(n_slots=1, n_ctx=args.n_ctx, spec=spec),
                        backend_name=backend_name)
        result: dict[str, Any] = {}
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            # warm-up: first-call allocations (scratch buffers, rope tables) stay out of the numbers
            await engine.submit(CompletionRequest(job["prompt_512"][:64], n_predict=4, sampling=greedy)).result()
            for name, prompt in job["workloads"].items():
                forward_s.clear()
                # Cold prompts: the forward count below assumes the whole prompt is evaluated.
                final = await engine.submit(CompletionRequest(list(prompt), n_predict=job["n_predict"], sampling=greedy,
                                                              cache_prompt=False)).result()
                t = final.timings
                # The first forwards are the prompt's chunks (n_batch tokens each); the rest are the
                # decode rounds, which the engine's decode time (predicted_ms) spans.
                decode_fwd = forward_s[-(-len(prompt) // engine.config.n_batch):]
                rounds = max(1, len(decode_fwd))
                engine_s = t["predicted_ms"] / 1e3 - sum(decode_fwd)
                result[name] = {
                    "tokens": final.tokens, "tps": t["predicted_per_second"], "n": t["predicted_n"],
                    "draft_n": t.get("draft_n", 0), "draft_n_accepted": t.get("draft_n_accepted", 0),
                    "rounds": rounds, "forward_ms_per_round": 1e3 * sum(decode_fwd) / rounds,
                    "engine_ms_per_round": 1e3 * engine_s / rounds, "error": final.error,
                }
            if spec_name == "none":
                if "sampling" in job:  # the same workloads at the job's sampling
                    # ignore_eos as llama-server reads it: end-of-generation tokens banned, not only passed over
                    sampled = banning_end_of_generation(SamplingParams(**job["sampling"]), tokenizer.eog_ids)
                    out["sampled_tps"] = {}
                    for name, prompt in job["workloads"].items():
                        final = await engine.submit(CompletionRequest(list(prompt), n_predict=job["n_predict"],
                                                                      sampling=sampled, cache_prompt=False,
                                                                      ignore_eos=True)).result()
                        out["sampled_tps"][name] = final.timings["predicted_per_second"]
                final = await engine.submit(CompletionRequest(list(job["prompt_512"]), n_predict=1, sampling=greedy,
                                                              cache_prompt=False)).result()
                out["prompt_512_tps"] = final.timings["prompt_per_second"]
            tg.cancel_scope.cancel()
        engine.close()
        return result

    for spec_name in job["specs"]:
        out["specs"][spec_name] = anyio.run(run_spec, spec_name)
    out["peak_rss_mb"] = peak_rss_mb()
    context = getattr(backend, "context", None)
    if args.path == "native" and context:
        out["packed_mb"] = native_lib.lib().sk_ctx_packed_bytes(context) / 2**20
        out["packed_by_type"] = packed_by_type(args.model)
    backend.close()
    json.dump(out, result_out)
    result_out.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
