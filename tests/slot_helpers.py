"""What the slot save / restore tests share: tiny models, engines with drafters, a running engine loop."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import cache
from typing import Any

import anyio
from backend_helpers import random_tokens
from toy_backend import make_engine

from spekula.core.backend import BackendOptions, load_backend
from spekula.core.engine.engine import Engine
from spekula.core.events import FinalEvent
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.tokenizer import Tokenizer
from spekula.core.params import CompletionRequest, SamplingParams, SpecParams
from spekula.drafters.model.draft_simple import DraftSimpleDrafter

GREEDY = SamplingParams(temperature=0.0)
N_CTX = 256
SMALL_NGRAMS = {"spec-ngram-simple-size-n": 1, "spec-ngram-simple-size-m": 4,
                "spec-ngram-map-k-size-n": 1, "spec-ngram-map-k-size-m": 4,
                "spec-ngram-map-k4v-size-n": 1, "spec-ngram-map-k4v-size-m": 4,
                "spec-ngram-mod-n-match": 1, "spec-ngram-mod-n-min": 1, "spec-ngram-mod-n-max": 4}


@cache
def slot_model(arch: str) -> tuple[str, Tokenizer]:
    if arch == "qwen35":
        from spekula.fixtures.tiny_qwen35 import tiny_qwen35_gguf_path

        path = str(tiny_qwen35_gguf_path())
    else:
        from spekula.fixtures.tiny_gguf import tiny_model_path

        path = str(tiny_model_path(arch))
    return path, Tokenizer.from_gguf(GGUFFile(path))


def slot_engine(arch: str, backend: str, drafter: str, n_slots: int = 3) -> Engine:
    path, tok = slot_model(arch)
    target = load_backend(backend, path, BackendOptions(n_ctx=N_CTX, n_seq_max=n_slots, threads=1))
    types = tuple(drafter.split(","))
    spec = SpecParams(types=types, n_max=4, adaptive=False, drafter_options=dict(SMALL_NGRAMS))
    drafters: list[Any] | None = None
    if "draft-simple" in types:  # the target's own file drafts: a model drafter that agrees often
        draft = load_backend(backend, path, BackendOptions(n_ctx=N_CTX, n_seq_max=n_slots, threads=1))
        drafters = [DraftSimpleDrafter(draft, target_n_vocab=target.info.n_vocab)]
    return make_engine(target, tok, n_slots=n_slots, n_ctx=N_CTX, n_batch=32, spec=spec, drafters=drafters)


async def complete(engine: Engine, prompt: list[int], slot: int, n_predict: int = 12) -> FinalEvent:
    handle = engine.submit(CompletionRequest(list(prompt), n_predict=n_predict, sampling=GREEDY, id_slot=slot))
    final = await handle.result()
    assert final.error is None, final.error
    return final


def repeating_prompt(seed: int, n: int = 24) -> list[int]:
    # a repeating segment, so ngram-simple finds drafts
    seg = random_tokens(6, seed, 3, 300).tolist()
    return (seg * (n // 6 + 1))[:n]


@asynccontextmanager
async def serving(engine: Engine) -> AsyncIterator[Engine]:
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        yield engine
        tg.cancel_scope.cancel()
