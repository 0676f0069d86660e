"""Tokens and speculation statistics of fixed-length speculation on the tiny GGUF fixtures.

`--spec-adaptive off` must reproduce the engine as it was before the cost model existed, counter for
counter. `tests/data/fixed_engine_stats.json` was written by this script run against that engine
(commit 0eb15dc, before adaptive lengths), as

    python tests/fixed_stats_golden.py --source <checkout of 0eb15dc> --write tests/data/fixed_engine_stats.json

(with that checkout's extension built in place: `python setup.py build_ext --inplace`). The native
cases run on the portable C kernels, which have not changed since that commit, so the file holds on
any CPU.

and tests/test_adaptive_off.py runs `collect()` on today's engine with adaptive lengths off and
compares. Durations are left out (they are timings); every count, per-position table, token and
statistics line (without its `dur` field) is kept.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

CASES: list[dict[str, Any]] = [
    {"arch": arch, "types": types, "n_slots": n_slots, "temperature": temperature, "n_max": n_max}
    for arch in ("toy", "llama", "qwen2", "qwen3")
    for types, n_slots, temperature, n_max in [
        (["test-repeat"], 2, 0.0, 6),
        (["test-garbage", "ngram-simple"], 1, 0.0, 4),
        (["ngram-simple"], 1, 0.0, 8),
        (["ngram-mod"], 2, 0.0, 16),
        (["ngram-map-k"], 1, 0.8, 6),
        (["ngram-map-k4v"], 2, 0.0, 8),
        (["ngram-cache"], 1, 0.0, 8),
        (["ngram-simple", "ngram-mod"], 2, 0.8, 12),
        (["ngram-map-k", "ngram-cache", "ngram-mod"], 2, 0.0, 8),
    ]
]
OPTIONS = {"spec-ngram-simple-size-n": 2, "spec-ngram-simple-size-m": 6,
           "spec-ngram-map-k-size-n": 2, "spec-ngram-map-k-size-m": 5,
           "spec-ngram-map-k4v-size-n": 2, "spec-ngram-map-k4v-size-m": 5, "spec-ngram-map-k4v-min-hits": 1,
           "spec-ngram-mod-n-match": 3, "spec-ngram-mod-n-min": 1, "spec-ngram-mod-n-max": 12}
PROMPTS = [[11, 42, 97] * 6, [5, 6, 7, 8, 9] * 4, [200, 13, 200, 13, 77, 200, 13]]
N_CTX, N_PREDICT = 96, 40
_DUR = re.compile(r", dur\(b,g,a\) = .*$")


def use_source(source: str) -> None:
    """Import `spekula` from another checkout (its package root) instead of the installed one."""
    spec = importlib.util.spec_from_file_location("spekula", str(Path(source) / "__init__.py"),
                                                  submodule_search_locations=[source])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["spekula"] = module
    spec.loader.exec_module(module)


def collect(tests_dir: Path = Path(__file__).parent) -> list[dict[str, Any]]:
    """`tests_dir`: where the checkout's toy_backend helpers live."""
    import anyio

    from spekula.core.backend import BackendOptions, load_backend
    from spekula.core.modelfile.gguf_file import GGUFFile
    from spekula.core.modelfile.tokenizer import Tokenizer
    from spekula.core.params import CompletionRequest, SamplingParams, SpecParams
    from spekula.fixtures.tiny_gguf import tiny_model_path

    sys.path.insert(0, str(tests_dir))
    from toy_backend import GarbageDrafter, RepeatDrafter, ToyBackend, ToyTokenizer, make_engine, run_requests

    fixed = {"adaptive": False} if "adaptive" in {f.name for f in dataclasses.fields(SpecParams)} else {}
    out = []
    for case in CASES:
        if case["arch"] == "toy":
            backend, tok = ToyBackend(n_ctx=N_CTX), ToyTokenizer()  # 48 tokens: greedy output falls into cycles
        else:
            path = str(tiny_model_path(case["arch"]))
            tok = Tokenizer.from_gguf(GGUFFile(path))
            # The portable kernels, so the golden holds on every CPU (each SIMD set rounds its own way).
            # Today's engine reads SPEKULA_NATIVE_KERNELS, the engine of 0eb15dc SPEKULA_NATIVE_GENERIC.
            saved = {k: os.environ.get(k) for k in ("SPEKULA_NATIVE_KERNELS", "SPEKULA_NATIVE_GENERIC")}
            os.environ.update(SPEKULA_NATIVE_KERNELS="generic", SPEKULA_NATIVE_GENERIC="1")
            try:
                backend = load_backend("native", path,
                                       BackendOptions(n_ctx=N_CTX, n_seq_max=case["n_slots"], threads=1))
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
        spec = SpecParams(types=tuple(case["types"]), n_max=case["n_max"], drafter_options=dict(OPTIONS), **fixed)
        engine = make_engine(backend, tok, n_slots=case["n_slots"], n_ctx=N_CTX, n_batch=64, spec=spec,
                             drafters=[RepeatDrafter(), GarbageDrafter(backend.info.n_vocab, n_max=4)])
        prompts = [[t % backend.info.n_vocab for t in p] for p in PROMPTS]
        reqs = [CompletionRequest(p, n_predict=N_PREDICT, ignore_eos=True,
                                  sampling=SamplingParams(temperature=case["temperature"], seed=17 + i))
                for i, p in enumerate(prompts)]
        finals = anyio.run(run_requests, engine, reqs, 120.0)
        drafters = {name: {k: v for k, v in c.items() if not k.startswith("dur_")}
                    for name, c in engine.stats()["drafters"].items()}
        out.append({
            "case": case,
            "tokens": [f.tokens for f in finals],
            "timings": [{k: f.timings[k] for k in ("draft_n", "draft_n_accepted") if k in f.timings} for f in finals],
            "drafters": drafters,
            "lines": [_DUR.sub("", line) for line in engine.spec_stats.lines(prefix=True)],
        })
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", help="package root of the spekula checkout to run (default: the installed one)")
    ap.add_argument("--write", required=True, help="JSON file to write")
    args = ap.parse_args()
    if args.source:
        use_source(args.source)
    Path(args.write).parent.mkdir(parents=True, exist_ok=True)
    tests_dir = Path(args.source) / "tests" if args.source else Path(__file__).parent
    Path(args.write).write_text(json.dumps(collect(tests_dir), indent=1) + "\n")


if __name__ == "__main__":
    main()
