"""Shared setup for the model-drafter tests (EAGLE-3, DFlash, DSpark): a tiny HF target converted to
GGUF and run by the torch backend, and an engine-vs-plain-decoding check.

Imported by tests/test_eagle3.py, test_dflash.py, test_dspark.py (not a pytest conftest on purpose).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).parent))
from spekula.backends.convert_hf import convert  # noqa: E402
from spekula.core.backend import Backend, BackendOptions, load_backend  # noqa: E402
from spekula.core.drafter import Drafter, DrafterContext  # noqa: E402
from spekula.core.gguf_file import GGUFFile  # noqa: E402
from spekula.core.params import CompletionRequest, SamplingParams, SpecParams  # noqa: E402
from spekula.core.tokenizer import Tokenizer  # noqa: E402
from spekula.fixtures import tiny_hf  # noqa: E402
from toy_backend import make_engine, plain_decode, run_requests  # noqa: E402

N_CTX = 256
PROMPTS = ("the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the",
           "one, two, three, four, five, six, seven, one, two, three,")


def build_target(root: Path, arch: str = "llama") -> tuple[Path, Path]:
    """(HF folder, converted f32 GGUF) of an 8-layer tiny target."""
    hf = tiny_hf.write_target(root / f"target-{arch}", arch, n_layer=8)
    out = root / f"target-{arch}.gguf"
    convert(hf, out, outtype="f32")
    return hf, out


def target_backend(path: Path) -> Backend:
    return load_backend("torch", str(path), BackendOptions(n_ctx=N_CTX, n_seq_max=2))


def drafter_context(target: Backend, draft_path: Path, spec: SpecParams) -> DrafterContext:
    tok = Tokenizer.from_gguf(GGUFFile(target.info.path))
    return DrafterContext(spec=spec, target=target, tokenizer=tok, n_seq_max=2, draft_model_path=str(draft_path))


def engine_vs_plain(target_path: Path, draft_path: Path, make: Callable[[DrafterContext], Drafter], spec: SpecParams, *,
                    n_predict: int = 24, sampling: SamplingParams | None = None) -> tuple[list[list[int]], list[list[int]], dict[str, Any]]:
    """Run both prompts concurrently (2 slots) with the drafter; return (engine outputs, plain outputs, drafter stats)."""
    sampling = sampling or SamplingParams(temperature=0.0)
    target = target_backend(target_path)
    tok = Tokenizer.from_gguf(GGUFFile(target_path))
    drafter = make(drafter_context(target, draft_path, spec))
    engine = make_engine(target, tok, n_slots=2, n_ctx=N_CTX, spec=spec, drafters=[drafter])
    prompts = [tok.encode(p) for p in PROMPTS]
    reqs = [CompletionRequest(prompt=p, n_predict=n_predict, sampling=sampling, ignore_eos=True) for p in prompts]
    finals = anyio.run(run_requests, engine, reqs, 300.0)
    for f in finals:
        assert f.error is None, f.error
    plain = target_backend(target_path)
    refs = [plain_decode(plain, p, n_predict=n_predict, sampling=sampling, seed=max(sampling.seed, 0),
                         is_eog=tok.is_eog, n_ctx=N_CTX, ignore_eos=True) for p in prompts]
    return [f.tokens for f in finals], refs, engine.stats()["drafters"][drafter.name]
