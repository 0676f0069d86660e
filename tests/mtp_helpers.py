"""draft-mtp runs checked against plain decoding, shared by the MTP drafter and runtime tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
from model_drafter_helpers import PROMPTS
from toy_backend import make_engine, plain_decode, run_requests

from spekula.core.backend import Backend, BackendOptions, load_backend
from spekula.core.drafting.drafter import Drafter, DrafterContext
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.tokenizer import Tokenizer
from spekula.core.params import CompletionRequest, SamplingParams, SpecParams
from spekula.drafters.model.mtp import MtpDrafter

N_CTX = 256


def target_backend(path: Path, n_slots: int = 2, name: str = "torch") -> Backend:
    return load_backend(name, str(path), BackendOptions(n_ctx=N_CTX, n_seq_max=n_slots))


def context(target: Backend, spec: SpecParams, draft: Path | None = None, n_slots: int = 2,
            backend_name: str = "torch") -> DrafterContext:
    tok = Tokenizer.from_gguf(GGUFFile(target.info.path))
    return DrafterContext(spec=spec, target=target, tokenizer=tok, n_seq_max=n_slots, backend_name=backend_name,
                          draft_model_path=str(draft) if draft else None)


def run_vs_plain(target_path: Path, spec: SpecParams, *, draft: Path | None = None, n_predict: int = 24,
                 sampling: SamplingParams | None = None, prompts: list[list[int]] | None = None, n_slots: int = 2,
                 wrap: Any = None, backend: str = "torch") -> tuple[list[list[int]], list[list[int]], dict[str, Any]]:
    """All prompts at once through an engine with draft-mtp on a `backend` target (whose runtime then runs
    the heads); (engine outputs, plain decoding, drafter stats)."""
    sampling = sampling or SamplingParams(temperature=0.0)
    target = target_backend(target_path, n_slots, backend)
    tok = Tokenizer.from_gguf(GGUFFile(target_path))
    drafter: Drafter = MtpDrafter.create(context(target, spec, draft, n_slots, backend))
    if wrap is not None:
        drafter = wrap(drafter)
    engine = make_engine(target, tok, n_slots=n_slots, n_ctx=N_CTX, spec=spec, drafters=[drafter])
    prompts = prompts or [tok.encode(p) for p in PROMPTS]
    reqs = [CompletionRequest(prompt=p, n_predict=n_predict, sampling=sampling, ignore_eos=True) for p in prompts]
    finals = anyio.run(run_requests, engine, reqs, 300.0)
    for f in finals:
        assert f.error is None, f.error
    plain = target_backend(target_path, 1, backend)
    refs = [plain_decode(plain, p, n_predict=n_predict, sampling=sampling, seed=max(sampling.seed, 0),
                         is_eog=tok.is_eog, n_ctx=N_CTX, ignore_eos=True) for p in prompts]
    return [f.tokens for f in finals], refs, engine.stats()["drafters"]["draft-mtp"]
