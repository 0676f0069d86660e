"""Plain greedy decode speed: spekula's torch backend vs transformers ``generate()`` on one GGUF.

Same process, same thread count, same prompt, same number of new tokens; runs alternate between the
engines so load changes on a shared machine hit both alike. Prints each engine's median tokens/s and
the ratios measured in this run. No speculation here: a loop of ``backend.forward`` + argmax.

    .venv/bin/python bench/decode.py --threads 2 --n-new 64 --runs 3
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from spekula.backends.torch.backend import TorchBackend
from spekula.core.backend import BackendOptions, SeqInput
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.tokenizer import Tokenizer

PROMPT = "<|im_start|>user\nWrite a short story about a lighthouse keeper.<|im_end|>\n<|im_start|>assistant\n"


def spekula_runner(path: str, ids: list[int], n_new: int, **opts: object) -> Callable[[], list[int]]:
    backend = TorchBackend(path, BackendOptions(n_ctx=len(ids) + n_new + 8, n_seq_max=1, **opts))  # type: ignore[arg-type]

    def run() -> list[int]:
        s = backend.new_seq()
        try:
            logits = backend.forward([SeqInput(s, np.array(ids, np.int32), 0)])[0].logits[0]
            gen = [int(logits.argmax())]
            while len(gen) < n_new:
                out = backend.forward([SeqInput(s, np.array(gen[-1:], np.int32), len(ids) + len(gen) - 1)])
                gen.append(int(out[0].logits[0].argmax()))
            return gen
        finally:
            backend.free_seq(s)

    return run


def transformers_runner(path: str, ids: list[int], n_new: int) -> Callable[[], list[int]]:
    import transformers

    transformers.logging.set_verbosity_error()
    p = Path(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
    model.eval()
    x = torch.tensor([ids])

    def run() -> list[int]:
        with torch.inference_mode():
            out = model.generate(
                x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n_new, min_new_tokens=n_new,
                pad_token_id=0,
            )
        return out[0, len(ids) :].tolist()

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="GGUF path (default: the cached SmolLM2)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-new", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--bf16", action="store_true", help="also time spekula with bf16 weights")
    args = ap.parse_args()
    if args.model is None:
        from spekula.backends.gguf.default_model import ensure_default_model

        args.model = str(ensure_default_model())
    torch.set_num_threads(args.threads)
    ids = Tokenizer.from_gguf(GGUFFile(args.model)).encode(PROMPT)

    runners: dict[str, Callable[[], list[int]]] = {
        "transformers generate (f32)": transformers_runner(args.model, ids, args.n_new),
        "spekula torch exact (f32)": spekula_runner(args.model, ids, args.n_new, threads=args.threads, exact=True),
        "spekula torch fast (f32)": spekula_runner(args.model, ids, args.n_new, threads=args.threads, exact=False),
    }
    if args.bf16:
        runners["spekula torch fast (bf16)"] = spekula_runner(
            args.model, ids, args.n_new, threads=args.threads, exact=False, dtype="bf16"
        )
    outputs = {name: run() for name, run in runners.items()}  # warm-up, and the tokens to compare
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(args.runs):
        for name, run in runners.items():
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)

    print(f"model {args.model}  prompt {len(ids)} tokens  new {args.n_new}  threads {args.threads}  runs {args.runs}")
    ref = "transformers generate (f32)"
    rate = {name: args.n_new / statistics.median(ts) for name, ts in times.items()}
    for name in runners:
        same = "same tokens" if outputs[name] == outputs[ref] else "tokens differ"
        ratio = rate[name] / rate[ref]
        print(f"{name:30s} {rate[name]:7.2f} tok/s  {1e3 / rate[name]:7.1f} ms/tok  x{ratio:.2f} vs transformers  ({same})")


if __name__ == "__main__":
    main()
