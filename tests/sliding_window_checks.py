"""The checks that tests/backends/test_gemma3.py and test_gemma4.py run alike on a sliding-window
model file: logits and greedy decoding against transformers, native rings that wrap past the window
against the torch backend's masked full attention, speculation as plain decoding, edited files.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import numpy as np
from backend_helpers import fresh_logits, open_backend, random_tokens
from hf_greedy import hf_greedy
from toy_backend import make_engine, plain_decode, run_requests

from spekula.backends.gguf.weights import dequantize
from spekula.backends.native import backend as native_backend
from spekula.core.backend import Backend, SeqInput
from spekula.core.drafting.drafter import DrafterContext
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.tokenizer import Tokenizer
from spekula.core.params import CompletionRequest, SamplingParams, SpecParams
from spekula.drafters.model.draft_simple import DraftSimpleDrafter
from spekula.fixtures.tiny_gguf import write_gguf

LOGIT_TOL = 1e-3  # torch fp32 vs transformers fp32 (tests/backends/test_vs_transformers.py)
NATIVE_REL_TOL = 0.01  # float16 KV on an F32 file, of max |logit|
SMALL_RING_ROWS = 16  # a native row cap that makes the sliding rings 256 rows: short contexts wrap them


def tokens(n: int, seed: int) -> np.ndarray:
    """Token ids of the tiny vocabulary past its 3 specials."""
    return random_tokens(n, seed, 3, 300)


def assert_near_reference(got: np.ndarray, want: np.ndarray, name: str) -> None:
    """`got` of backend `name` within today's tolerance of transformers' fp32 logits `want`."""
    tol = LOGIT_TOL if name == "torch" else NATIVE_REL_TOL * float(np.abs(want).max())
    assert np.abs(got - want).max() < tol


def check_logits_match(gguf: Path, reference_logits: Callable[[np.ndarray], np.ndarray], name: str) -> None:
    rows = tokens(60, seed=1)  # far past the window of 8
    assert_near_reference(fresh_logits(open_backend(name, gguf), rows), reference_logits(rows), name)


def check_greedy_matches(gguf: Path, hf_model: Any, name: str) -> None:
    ids = tokens(12, seed=2).tolist()
    got = plain_decode(open_backend(name, gguf), ids, n_predict=40, sampling=SamplingParams(temperature=0.0), seed=0,
                       is_eog=lambda t: False, n_ctx=512, ignore_eos=True)
    assert got == hf_greedy(hf_model, ids, 40)


def check_rings_beyond_the_window(gguf: Path) -> None:
    """Native rings (of SMALL_RING_ROWS' cap) wrapped twice give the torch backend's masked full
    attention, and the same bits for other chunkings and decode steps."""
    rows = tokens(700, seed=3)
    ring = open_backend("native", gguf, n_ctx=1024)
    one_pass = fresh_logits(ring, rows)  # 44 forwards of 16 rows through rings that wrap twice
    want = fresh_logits(open_backend("torch", gguf, n_ctx=1024), rows)  # every key kept, the window masked
    assert np.abs(one_pass - want).max() < NATIVE_REL_TOL * float(np.abs(want).max())
    s = ring.new_seq()
    got = [ring.forward([SeqInput(s, rows[:500], 0, np.arange(500))])[0].logits]
    got += [ring.forward([SeqInput(s, rows[i : i + 1], i)])[0].logits for i in range(500, 520)]
    got += [ring.forward([SeqInput(s, rows[520:], 520, np.arange(180))])[0].logits]
    assert np.array_equal(np.concatenate(got), one_pass)


def check_partial_drafts_roll_back(b: Backend, s: int, cont: np.ndarray, accepted: range, k: int = 8) -> np.ndarray:
    """Sequence `s` of `b` holds a prompt of length L. Decoding `cont` a token a step gives `want`
    (returned); then, for each j in `accepted`, a draft of `k` rows whose first j + 1 are `cont`'s,
    verified from L and truncated to L + j + 1, gives `want`'s rows bitwise, before and after the cut."""
    L = b.seq_len(s)
    want = np.stack([b.forward([SeqInput(s, cont[i : i + 1], L + i)])[0].logits[0] for i in range(cont.size)])
    for j in accepted:
        b.truncate(s, L)
        draft = np.concatenate([cont[: j + 1], tokens(k - j - 1, seed=60 + j)])
        rows = b.forward([SeqInput(s, draft, L, np.arange(k))])[0].logits
        assert np.array_equal(rows[: j + 1], want[: j + 1])
        assert b.restorable(s, L + j + 1) == L + j + 1
        b.truncate(s, L + j + 1)
        rest = np.stack([b.forward([SeqInput(s, cont[i : i + 1], L + i)])[0].logits[0]
                         for i in range(j + 1, cont.size)])
        assert np.array_equal(rest, want[j + 1 :])
    return want


def engine_tokens(b: Backend, tok: Tokenizer, gguf: Path, types: tuple[str, ...], prompts: list[list[int]],
                  sampling: SamplingParams, n_ctx: int, n_predict: int) -> list[list[int]]:
    """The engine's tokens for `prompts`, one after the other on one slot (the second reuses what the
    rings allow of the first), speculating with drafters `types` (draft-simple drafts with `gguf` itself)."""
    spec = SpecParams(types=types, n_max=4, adaptive=False,
                      drafter_options={"spec-ngram-simple-size-n": 2, "spec-ngram-simple-size-m": 6})
    drafters: list[Any] = []
    if "draft-simple" in types:
        ctx = DrafterContext(spec=spec, target=b, tokenizer=tok, n_seq_max=2, draft_model_path=str(gguf))
        drafters.append(DraftSimpleDrafter.create(ctx))
    engine = make_engine(b, tok, n_slots=1, n_ctx=n_ctx, n_batch=64, spec=spec, drafters=drafters)
    out = []
    for prompt in prompts:
        req = CompletionRequest(prompt=prompt, n_predict=n_predict, sampling=sampling, ignore_eos=True)
        (final,) = anyio.run(run_requests, engine, [req], 300.0)
        assert final.error is None
        out.append(final.tokens)
    return out


def assert_lossless(b: Backend, gguf: Path, types: tuple[str, ...], prompts: list[list[int]],
                    sampling: SamplingParams, *, n_ctx: int, n_predict: int) -> None:
    """The engine's tokens (:func:`engine_tokens`) are plain decoding's, prompt by prompt."""
    got = engine_tokens(b, Tokenizer.from_gguf(GGUFFile(gguf)), gguf, types, prompts, sampling, n_ctx, n_predict)
    for prompt, row in zip(prompts, got, strict=True):
        assert row == plain_decode(b, prompt, n_predict=n_predict, sampling=sampling, seed=sampling.seed,
                                   is_eog=lambda t: False, n_ctx=n_ctx, ignore_eos=True)


def check_random_prompt_lossless(gguf: Path, prompt: list[int], types: list[str], temperature: float, seed: int,
                                 *, n_predict: int) -> None:
    """A hypothesis example: the native backend with small rings, 1024 rows of context."""
    import pytest

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(native_backend, "SWA_ROW_CAP", SMALL_RING_ROWS)
        b = open_backend("native", gguf, n_ctx=1024)
        sampling = SamplingParams(temperature=temperature, seed=seed)
        (got,) = engine_tokens(b, Tokenizer.from_gguf(GGUFFile(gguf)), gguf, tuple(types), [prompt], sampling, 1024, n_predict)
    assert got == plain_decode(b, prompt, n_predict=n_predict, sampling=sampling, seed=seed, is_eog=lambda t: False,
                               n_ctx=1024, ignore_eos=True)


def edited(src: Path, dst: Path, *, meta: dict[str, Any] | None = None, drop: tuple[str, ...] = (),
           add: dict[str, np.ndarray] | None = None) -> Path:
    """`src` rewritten to `dst` (tensors dequantized) with `meta` set, the `drop` tensors and keys
    removed and the `add` tensors added."""
    f = GGUFFile(src)
    tensors = {e.name: dequantize(e) for e in f.tensors() if e.name not in drop} | (add or {})
    keys = {k: v for k, v in f.metadata.items() if k != "general.architecture" and k not in drop} | (meta or {})
    return write_gguf(dst, f.architecture, {}, tensors, keys)
