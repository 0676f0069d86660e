"""onnxruntime-genai as a second speed peer, run with the python of its own venv (never spekula's).

    PEER/bin/python bench/ortgenai_worker.py --build MODEL.gguf --out DIR    # once: HF checkpoint + builder
    PEER/bin/python bench/ortgenai_worker.py --model-dir DIR --threads N --job JOB.json

--build has transformers read the GGUF (dequantized to float32) and save a Hugging Face checkpoint,
then runs onnxruntime-genai's model builder on it for the CPU with int4 weights (its own quantization
of the same weights: its tokens differ from llama.cpp's). The measuring mode reads the same job file as
bench/spekula_worker.py (the same prompt token ids), decodes each workload greedily and prints one
JSON object in the same shape: tok/s from the first generated token on, prompt tok/s of the 512-token
prompt, peak RSS. It has no speculative decoding, so only the "none" spec is measured.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def build(gguf: str, out: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(gguf).resolve()
    with tempfile.TemporaryDirectory() as hf_dir, tempfile.TemporaryDirectory() as cache:
        loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name)
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        # transformers marks a GGUF-loaded model as quantized and refuses to save it: copy the (float32,
        # dequantized) weights into a plain model of the same config.
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config)
        model.load_state_dict(loaded.state_dict())
        model.save_pretrained(hf_dir)
        tok.save_pretrained(hf_dir)
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-m", "HuggingFaceTB/SmolLM2-135M-Instruct",
                        "-i", hf_dir, "-o", out, "-p", "int4", "-e", "cpu", "-c", cache], check=True)


def set_threads(model_dir: str, threads: int) -> None:
    cfg_path = Path(model_dir) / "genai_config.json"
    cfg = json.loads(cfg_path.read_text())
    opts = cfg["model"]["decoder"].setdefault("session_options", {})
    opts["intra_op_num_threads"] = threads
    opts["inter_op_num_threads"] = 1
    cfg_path.write_text(json.dumps(cfg, indent=2))


def generate(og: Any, model: Any, prompt: list[int], n: int) -> tuple[list[int], float, float]:
    """(tokens, prompt seconds, decode tok/s after the first token)."""
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(prompt) + n, min_length=len(prompt) + n)
    gen = og.Generator(model, params)
    t0 = time.perf_counter()
    gen.append_tokens(prompt)
    gen.generate_next_token()
    out = [int(gen.get_next_tokens()[0])]
    t1 = time.perf_counter()
    while not gen.is_done() and len(out) < n:
        gen.generate_next_token()
        out.append(int(gen.get_next_tokens()[0]))
    t2 = time.perf_counter()
    return out, t1 - t0, (len(out) - 1) / (t2 - t1) if len(out) > 1 else 0.0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--build", metavar="GGUF")
    p.add_argument("--out")
    p.add_argument("--model-dir")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--job")
    args = p.parse_args()
    if args.build:
        build(args.build, args.out)
        return 0
    import onnxruntime_genai as og

    result_out, sys.stdout = sys.stdout, sys.stderr
    job = json.loads(Path(args.job).read_text())
    set_threads(args.model_dir, args.threads)
    t0 = time.perf_counter()
    model = og.Model(args.model_dir)
    out: dict[str, Any] = {"path": "onnxruntime-genai", "threads": args.threads, "load_s": time.perf_counter() - t0}
    generate(og, model, job["prompt_512"][:64], 4)  # warm-up
    runs = {}
    for name, prompt in job["workloads"].items():
        tokens, _, tps = generate(og, model, list(prompt), job["n_predict"])
        runs[name] = {"tokens": tokens, "tps": tps, "n": len(tokens)}
    _, prompt_s, _ = generate(og, model, list(job["prompt_512"]), 1)
    out["prompt_512_tps"] = len(job["prompt_512"]) / prompt_s
    out["specs"] = {"none": runs}
    out["peak_rss_mb"] = peak_rss_mb()
    json.dump(out, result_out)
    result_out.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
