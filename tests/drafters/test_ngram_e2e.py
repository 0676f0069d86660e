"""End to end through the engine: greedy output with any one or two n-gram drafters equals plain decoding.

Two requests run at once on two slots, so the shared ngram-mod pool and the per-slot states of the
other drafters are exercised while slots interleave. One engine serves every combination (drafters
persist across requests, as in a server), and the plain run on the same engine is the reference.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import anyio
import pytest

from spekula.core.backend import BackendOptions
from spekula.core.engine.engine import Engine, EngineConfig
from spekula.core.events import FinalEvent
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.tokenizer import Tokenizer
from spekula.core.params import CompletionRequest, SamplingParams, SpecParams

NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
COMBOS = [(t,) for t in NGRAM_TYPES] + list(itertools.combinations(NGRAM_TYPES, 2))
GREEDY = SamplingParams(temperature=0.0)

# Short n-grams so that a random-weight tiny model's output (which rarely repeats long n-grams)
# still gets drafts, most of them rejected: that exercises the rollback path hardest.
TINY_OPTIONS: dict[str, Any] = {
    "spec-ngram-simple-size-n": 1,
    "spec-ngram-simple-size-m": 4,
    "spec-ngram-map-k-size-n": 1,
    "spec-ngram-map-k-size-m": 4,
    "spec-ngram-map-k4v-size-n": 1,
    "spec-ngram-map-k4v-size-m": 4,
    "spec-ngram-mod-n-match": 1,
    "spec-ngram-mod-n-min": 1,
    "spec-ngram-mod-n-max": 6,
}


async def _generate(
    engine: Engine, prompts: list[list[int]], spec: SpecParams, n_predict: int
) -> list[FinalEvent]:
    finals: list[FinalEvent | None] = [None] * len(prompts)

    async def one(i: int) -> None:
        handle = engine.submit(CompletionRequest(prompts[i], n_predict=n_predict, sampling=GREEDY, spec=spec))
        finals[i] = await handle.result()

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    assert all(f is not None and f.stop_type != "error" for f in finals), finals
    return finals  # type: ignore[return-value]


def check_all_combinations(
    model: Path, texts: list[str], options: dict[str, Any], n_predict: int
) -> dict[tuple[str, ...], int]:
    """Run plain, then every combination; assert identical tokens; return draft tokens per combination."""
    from spekula.backends.native.backend import NativeBackend

    # The default backend: exact (a row's logits never depend on its batch), so plain and speculative
    # decoding must agree token for token; tests/test_lossless_gguf.py runs the drafters on torch too.
    backend = NativeBackend(str(model), BackendOptions(n_ctx=512, n_seq_max=2))
    tokenizer = Tokenizer.from_gguf(GGUFFile(model))
    prompts = [tokenizer.encode(t) for t in texts]
    # Fixed lengths, so every combination verifies drafts (the cost model may rightly skip a drafter
    # on a tiny model; tests/test_lossless*.py cover adaptive lengths).
    spec = SpecParams(drafter_options=options, adaptive=False)
    engine = Engine(backend, tokenizer, EngineConfig(n_slots=2, n_ctx=512, n_batch=256, spec=spec))
    drafted: dict[tuple[str, ...], int] = {}

    async def main() -> None:
        with anyio.fail_after(1800):
            await run_all()

    async def run_all() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            plain = await _generate(engine, prompts, spec, n_predict)
            assert all(len(f.tokens) == n_predict for f in plain)
            for combo in COMBOS:
                finals = await _generate(engine, prompts, spec.with_(types=combo), n_predict)
                for ref, got in zip(plain, finals, strict=True):
                    assert got.tokens == ref.tokens, (
                        f"{combo}: speculative output differs from plain decoding"
                    )
                drafted[combo] = sum(int(f.timings.get("draft_n", 0)) for f in finals)
            tg.cancel_scope.cancel()

    anyio.run(main)
    return drafted


def test_every_combination_is_lossless_on_the_tiny_model() -> None:
    from spekula.fixtures.tiny_gguf import tiny_model_path

    drafted = check_all_combinations(
        tiny_model_path("llama"),
        ["the cat sat on the mat. the cat sat on the mat. the cat", "one two three one two three one two"],
        TINY_OPTIONS,
        n_predict=32,
    )
    # Every combination actually drafted, so the equality above covered verification and rollback.
    assert all(n > 0 for n in drafted.values()), drafted


@pytest.mark.slow
def test_every_combination_is_lossless_on_smollm2() -> None:
    from spekula.backends.gguf.default_model import DefaultModelError, ensure_default_model

    try:
        model = ensure_default_model(quiet=True)
    except DefaultModelError as exc:
        pytest.skip(f"default model unavailable: {exc}")
    code = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"
    chat = "<|im_start|>user\nList the days of the week.<|im_end|>\n<|im_start|>assistant\n"
    options = {
        "spec-ngram-simple-size-n": 3,
        "spec-ngram-map-k-size-n": 3,
        "spec-ngram-map-k4v-size-n": 3,
        "spec-ngram-mod-n-match": 4,
        "spec-ngram-mod-n-min": 2,
    }
    drafted = check_all_combinations(model, [code, chat], options, n_predict=48)
    assert sum(drafted.values()) > 0, drafted
