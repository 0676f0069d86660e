"""The engine's embedding jobs beside generation (tiny llama on the native backend): a job waits for an
idle slot, runs between steps, does not change what a concurrent greedy generation emits, and a bad
sequence is refused before it is queued."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from spekula.core.backend import BackendOptions, load_backend
from spekula.core.embedding import Pooling
from spekula.core.engine.embedding_jobs import EmbeddingsOff, InputTooLong
from spekula.core.engine.engine import Engine, EngineConfig
from spekula.core.engine.request_plan import RequestRejected
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.tokenizer import Tokenizer
from spekula.core.params import CompletionRequest, SamplingParams

IDS = [5, 17, 99, 140, 33, 7, 250, 61]


def _engine(n_slots: int, pooling: Pooling | None) -> Engine:
    from spekula.fixtures.tiny_gguf import tiny_model_path

    path = str(tiny_model_path("llama"))
    backend = load_backend("native", path, BackendOptions(n_ctx=128, n_seq_max=n_slots, threads=1))
    return Engine(backend, Tokenizer.from_gguf(GGUFFile(path)),
                  EngineConfig(n_slots=n_slots, n_ctx=128, n_batch=16, pooling=pooling), backend_name="native")


def _greedy(n: int) -> CompletionRequest:
    return CompletionRequest(prompt=IDS, n_predict=n, sampling=SamplingParams(temperature=0.0), ignore_eos=True)


async def _generate_and_embed(engine: Engine, n_embed: int) -> tuple[list[int], list[np.ndarray]]:
    vectors: list[np.ndarray] = []
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        handle = engine.submit(_greedy(40))

        async def embed() -> None:
            await anyio.sleep(0.01)  # once the generation is under way
            for i in range(n_embed):
                vectors.append(await engine.embed(IDS[: 3 + i]))

        async with anyio.create_task_group() as inner:
            inner.start_soon(embed)
            final = await handle.result()
        tg.cancel_scope.cancel()
    return final.tokens, vectors


@pytest.mark.anyio
@pytest.mark.parametrize("n_slots", [1, 2])
async def test_embeddings_beside_a_generation_change_nothing(n_slots: int) -> None:
    alone = _engine(1, Pooling.MEAN)
    async with anyio.create_task_group() as tg:
        await tg.start(alone.run)
        want = (await alone.submit(_greedy(40)).result()).tokens
        tg.cancel_scope.cancel()
    engine = _engine(n_slots, Pooling.MEAN)
    with anyio.fail_after(60):
        tokens, vectors = await _generate_and_embed(engine, 4)
    assert tokens == want
    alone.close()  # its slot's sequence is free again
    ref = alone.backend
    seq = ref.new_seq()
    for i, v in enumerate(vectors):
        assert np.array_equal(v, ref.embed(seq, np.asarray(IDS[: 3 + i], np.int32), Pooling.MEAN, 16))


@pytest.mark.anyio
async def test_bad_sequences_are_refused_before_queueing() -> None:
    engine = _engine(1, Pooling.LAST)
    with pytest.raises(RequestRejected, match="empty"):
        await engine.embed([])
    with pytest.raises(InputTooLong, match="too large"):
        await engine.embed([5] * 129)
    with pytest.raises(RequestRejected, match="vocabulary"):
        await engine.embed([5, 10_000])
    with pytest.raises(EmbeddingsOff, match="--embeddings"):
        await _engine(1, None).embed([5])
