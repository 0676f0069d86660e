"""draft-mtp on a Qwen3.5 target, spekula next to llama-server, on a head built to agree with its target.

The tiny Qwen3.5 fixture whose MTP head computes what the target's last block computes
(`fixtures/tiny_mtp.py` `agreeing_qwen35_gguf`, one MTP layer, as llama.cpp runs one): a correct
draft-mtp implementation accepts nearly every greedy draft, so acceptance here checks the
implementation, not a head's quality. Both engines decode the same token ids greedily, plain and with
draft-mtp, alternating in every repetition; reported: tokens/s (a tiny model: per-token overhead, not
bandwidth), acceptance, mean accepted length, and whether each output equals that engine's plain output
and llama-server's plain output.

`--head random` takes the tiny fixture whose MTP layer has random weights instead (a head that does not
agree: nearly every draft is rejected), `-m FILE` any Qwen3.5 GGUF with MTP layers (e.g. the synthetic
0.8B of bench/synthetic_qwen35.py, whose random head does not agree either); `--adaptive` turns on
adaptive draft lengths (spekula's default; the back-off then rests a head that does not pay), which
the implementation check leaves off so that every round drafts n_max tokens.

    .venv/bin/python bench/qwen35_mtp.py [--moe] [--head agreeing|random | -m FILE] [--adaptive] [-n 64]
                                         [--reps 3] [--n-max 3] [--llama-server PATH | --no-llama-server]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from llama_server import LlamaServer, find_llama_server  # noqa: E402
from spec import run_alone  # noqa: E402

from spekula.core.backend import BackendOptions, load_backend  # noqa: E402
from spekula.core.engine.engine import Engine, EngineConfig  # noqa: E402
from spekula.core.modelfile.gguf_file import GGUFFile  # noqa: E402
from spekula.core.modelfile.tokenizer import Tokenizer  # noqa: E402
from spekula.core.params import CompletionRequest, SamplingParams, SpecParams  # noqa: E402

PROMPT = [11, 42, 97, 150, 7, 230, 64, 12, 199, 3, 77, 5]
N_CTX = 512


def spekula_run(path: str, n_predict: int, spec: SpecParams | None) -> tuple[list[int], float, int, int, float]:
    """(tokens, tok/s, drafted, accepted, mean length) of one greedy request on a fresh native engine."""
    tok = Tokenizer.from_gguf(GGUFFile(path))
    backend = load_backend("native", path, BackendOptions(n_ctx=N_CTX, n_seq_max=1, threads=1))
    engine = Engine(backend, tok, EngineConfig(n_slots=1, n_ctx=N_CTX, n_batch=256, spec=spec or SpecParams()),
                    backend_name="native")  # the heads run on the native kernels beside a native target
    req = CompletionRequest(PROMPT, n_predict=n_predict, sampling=SamplingParams(temperature=0.0), ignore_eos=True)
    final = run_alone(engine, req)
    t = final.timings  # type: ignore[attr-defined]
    stats = engine.request_stats[final.request_id]["spec"]  # type: ignore[attr-defined]
    return (list(final.tokens), t["predicted_per_second"], t.get("draft_n", 0),  # type: ignore[attr-defined]
            t.get("draft_n_accepted", 0), stats.mean_len if spec else 1.0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--moe", action="store_true", help="the qwen35moe fixture instead of the dense one")
    p.add_argument("-n", "--n-predict", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--n-max", type=int, default=3)
    p.add_argument("--head", choices=("agreeing", "random"), default="agreeing",
                   help="the tiny fixture's MTP layer: built to agree with the target, or random weights")
    p.add_argument("-m", "--model", help="a Qwen3.5 GGUF with MTP layers instead of the tiny fixture")
    p.add_argument("--adaptive", action="store_true", help="adaptive draft lengths (spekula's default)")
    p.add_argument("--llama-server", metavar="PATH")
    p.add_argument("--no-llama-server", action="store_true", help="measure spekula alone")
    args = p.parse_args()
    from spekula.fixtures.tiny_mtp import agreeing_qwen35_gguf
    from spekula.fixtures.tiny_qwen35 import tiny_qwen35_gguf_path

    if args.model:
        path = args.model
    elif args.head == "agreeing":
        path = str(agreeing_qwen35_gguf(moe=args.moe, n_mtp=1))
    else:
        path = str(tiny_qwen35_gguf_path(moe=args.moe, n_mtp=1))
    binary, why = (None, "--no-llama-server") if args.no_llama_server else find_llama_server(args.llama_server)
    if binary is None:
        print(f"llama-server not found ({why}); measuring spekula alone", file=sys.stderr)
    spec = SpecParams(types=("draft-mtp",), n_max=args.n_max, adaptive=args.adaptive)
    rows: dict[str, list[tuple[list[int], float, int, int, float]]] = {}
    for rep in range(args.reps):
        for name in (["llama-server plain", "llama-server draft-mtp"] if binary else []) + ["spekula plain",
                                                                                            "spekula draft-mtp"]:
            print(f"[rep {rep + 1}] {name} ...", file=sys.stderr, flush=True)
            if name.startswith("spekula"):
                rows.setdefault(name, []).append(spekula_run(path, args.n_predict, spec if "mtp" in name else None))
                continue
            assert binary is not None
            mtp = "mtp" in name
            with LlamaServer(binary, path, spec_type="draft-mtp" if mtp else None,
                             options={"spec-draft-n-max": args.n_max, "spec-draft-n-min": 0} if mtp else {},
                             n_ctx=N_CTX, n_batch=256, threads=1) as srv:
                c = srv.complete(PROMPT, args.n_predict, ignore_eos=True)
            rows.setdefault(name, []).append((c.tokens, c.predicted_per_second, c.draft_n, c.draft_n_accepted,
                                              c.mean_len or float("nan")))
    ref = rows.get("llama-server plain", rows["spekula plain"])[0][0]
    head = "" if args.model else f" {args.head}"
    print(f"\n## draft-mtp on the{head} Qwen3.5{'-MoE' if args.moe else ''} head ({Path(path).name}), "
          f"greedy, n_predict {args.n_predict}, n_max {args.n_max}, adaptive {'on' if args.adaptive else 'off'}, "
          f"{args.reps} reps, 1 thread\n")
    print("| engine | tok/s (median) | x its plain | acceptance | mean length | = its plain | = llama-server plain |")
    print("|---|---:|---:|---:|---:|---|---|")
    for name, runs in rows.items():
        tps = statistics.median(r[1] for r in runs)
        plain = statistics.median(r[1] for r in rows[name.split()[0] + " plain"])
        drafted, accepted = runs[0][2], runs[0][3]
        acc = f"{accepted / drafted:.1%}" if drafted else "-"
        same_plain = runs[0][0] == rows[name.split()[0] + " plain"][0][0]
        print(f"| {name} | {tps:.1f} | {tps / plain:.2f}x | {acc} | {runs[0][4]:.2f} | {same_plain} | "
              f"{runs[0][0] == ref} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
