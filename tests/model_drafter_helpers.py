"""Shared setup for the model-drafter tests (EAGLE-3, DFlash, DSpark): a tiny HF target converted to
GGUF and run by the torch backend, and an engine-vs-plain-decoding check.

Imported by tests/test_eagle3.py, test_dflash.py, test_dspark.py (not a pytest conftest on purpose).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
from toy_backend import make_engine, plain_decode, run_requests

from spekula.backends.convert.hf import convert
from spekula.core.backend import Backend, BackendOptions, load_backend
from spekula.core.drafting.drafter import Drafter, DrafterContext
from spekula.core.engine.engine import Engine, EngineConfig
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.tokenizer import Tokenizer
from spekula.core.params import CompletionRequest, SamplingParams, SpecParams
from spekula.fixtures import tiny_hf

N_CTX = 256
PROMPTS = ("the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the",
           "one, two, three, four, five, six, seven, one, two, three,")


def build_target(root: Path, arch: str = "llama") -> tuple[Path, Path]:
    """(HF folder, converted f32 GGUF) of an 8-layer tiny target."""
    hf = tiny_hf.write_target(root / f"target-{arch}", arch, n_layer=8)
    out = root / f"target-{arch}.gguf"
    convert(hf, out, outtype="f32")
    return hf, out


def target_backend(path: Path, backend: str = "torch") -> Backend:
    return load_backend(backend, str(path), BackendOptions(n_ctx=N_CTX, n_seq_max=2))


def drafter_context(target: Backend, draft_path: Path, spec: SpecParams, backend_name: str = "torch") -> DrafterContext:
    """`backend_name` names the target's backend (a native one makes EAGLE-3 heads run natively)."""
    tok = Tokenizer.from_gguf(GGUFFile(target.info.path))
    return DrafterContext(spec=spec, target=target, tokenizer=tok, n_seq_max=2, draft_model_path=str(draft_path),
                          backend_name=backend_name)


def engine_vs_plain(target_path: Path, draft_path: Path, make: Callable[[DrafterContext], Drafter], spec: SpecParams, *,
                    n_predict: int = 24, sampling: SamplingParams | None = None,
                    backend: str = "torch") -> tuple[list[list[int]], list[list[int]], dict[str, Any]]:
    """Run both prompts concurrently (2 slots) with the drafter on a `backend` target; return (engine
    outputs, plain outputs, drafter stats)."""
    sampling = sampling or SamplingParams(temperature=0.0)
    target = target_backend(target_path, backend)
    tok = Tokenizer.from_gguf(GGUFFile(target_path))
    drafter = make(drafter_context(target, draft_path, spec, backend))
    engine = make_engine(target, tok, n_slots=2, n_ctx=N_CTX, spec=spec, drafters=[drafter])
    prompts = [tok.encode(p) for p in PROMPTS]
    reqs = [CompletionRequest(prompt=p, n_predict=n_predict, sampling=sampling, ignore_eos=True) for p in prompts]
    finals = anyio.run(run_requests, engine, reqs, 300.0)
    for f in finals:
        assert f.error is None, f.error
    plain = target_backend(target_path, backend)
    refs = [plain_decode(plain, p, n_predict=n_predict, sampling=sampling, seed=max(sampling.seed, 0),
                         is_eog=tok.is_eog, n_ctx=N_CTX, ignore_eos=True) for p in prompts]
    return [f.tokens for f in finals], refs, engine.stats()["drafters"][drafter.name]


def head_runtime(backend: str, head: Path, target_path: Path, n_ctx: int, *, target: Any = None,
                 threads: int = 1) -> Any:
    """A draft head's runtime for tests of the native runtimes: ``native`` over ``target`` (a native
    backend) when given, else over a fresh one's info alone; ``torch`` in float32. Three sequences."""
    from spekula.backends.native.backend import NativeBackend
    from spekula.drafters.model.runtimes import load_draft_runtime

    t = target or NativeBackend(str(target_path), BackendOptions(n_ctx=n_ctx, n_seq_max=3, threads=threads))
    opts = (BackendOptions(n_ctx=n_ctx, n_seq_max=3, threads=threads) if backend == "native"
            else BackendOptions(n_ctx=n_ctx, n_seq_max=3, dtype="f32"))
    return load_draft_runtime(backend, str(head), t.info, opts, target_backend=target)


def smollm2_or_skip() -> Path:
    import pytest

    from spekula.backends.gguf.default_model import DefaultModelError, ensure_default_model

    try:
        return ensure_default_model(quiet=True)
    except DefaultModelError as exc:
        pytest.skip(f"default model unavailable: {exc}")


def random_draft_gguf(path: Path, arch: str, target: Path, *, seed: int = 0, draft_vocab: int = 0,
                      weight_type: str = "F16", **keys: Any) -> Path:
    """A random EAGLE-3 or DFlash draft GGUF sized for ``target`` (no HF checkpoint needed), F16 weights
    (or ``weight_type``: F32, F16, Q8_0 for the matrices).

    EAGLE-3: one layer, reduced 2048-token vocabulary (the whole one when smaller) with its own head
    (d2t), borrowed embeddings.
    DFlash: two layers, borrowed embeddings and head, or with ``draft_vocab`` its own head over that
    many target ids (d2t). Both read three / two target layers.
    """
    import numpy as np

    from spekula.fixtures.tiny_gguf import write_gguf

    f = GGUFFile(target)
    t_arch = f.architecture
    H, n_layer_t = int(f.require(f"{t_arch}.embedding_length")), int(f.require(f"{t_arch}.block_count"))
    n_vocab = len(f.require("tokenizer.ggml.tokens"))
    rng = np.random.default_rng(seed)
    n_head, n_kv, hd, ff = 4, 2, 64, 256

    def mat(r: int, c: int) -> tuple[np.ndarray, str]:
        return (rng.standard_normal((r, c)) / np.sqrt(c)).astype(np.float32), weight_type

    def ones(n: int) -> np.ndarray:
        return np.ones(n, np.float32)

    width = 2 * H if arch == "eagle3" else H
    layer = {"attn_norm.weight": ones(H), "attn_q.weight": mat(n_head * hd, width), "attn_k.weight": mat(n_kv * hd, width),
             "attn_v.weight": mat(n_kv * hd, width), "attn_output.weight": mat(H, n_head * hd), "ffn_norm.weight": ones(H),
             "ffn_gate.weight": mat(ff, H), "ffn_up.weight": mat(ff, H), "ffn_down.weight": mat(H, ff)}
    hp: dict[str, Any] = {"embedding_length": H, "feed_forward_length": ff, "attention.head_count": n_head,
                          "attention.head_count_kv": n_kv, "attention.key_length": hd, "attention.value_length": hd,
                          "rope.freq_base": 10000.0, "attention.layer_norm_rms_epsilon": 1e-5, "context_length": 2048,
                          "vocab_size": n_vocab}
    tensors: dict[str, Any] = {"output_norm.weight": ones(H)}
    if arch == "eagle3":
        layers = [2, n_layer_t // 2, n_layer_t - 3]
        hp.update({"block_count": 1, "target_layers": layers, "target_hidden_size": H, "rope.dimension_count": hd})
        tensors.update({f"blk.0.{k}": v for k, v in layer.items()})
        n_draft = min(2048, n_vocab)
        tensors.update({"blk.0.attn_norm_2.weight": ones(H), "fc.weight": mat(H, 3 * H), "output.weight": mat(n_draft, H),
                        "d2t": np.sort(rng.choice(n_vocab, n_draft, replace=False)).astype(np.int64)})
        meta: dict[str, Any] = {}
    else:
        layers = [2, n_layer_t - 2]
        hp.update({"block_count": 2, "target_layers": layers, "block_size": 8})
        for i in range(2):
            tensors.update({f"blk.{i}.{k}": v for k, v in layer.items()})
            tensors.update({f"blk.{i}.attn_q_norm.weight": ones(hd), f"blk.{i}.attn_k_norm.weight": ones(hd)})
        tensors.update({"fc.weight": mat(H, 2 * H), "enc.output_norm.weight": ones(H)})
        if draft_vocab:
            tensors.update({"output.weight": mat(draft_vocab, H),
                            "d2t": np.sort(rng.choice(n_vocab, draft_vocab, replace=False)).astype(np.int64)})
        meta = {"tokenizer.ggml.mask_token_id": n_vocab - 1}
    hp.update(keys)
    return write_gguf(path, arch, hp, tensors, meta)


class Recording:
    """Wraps a drafter and records every request it answers: (history, last, draft tokens, probe).

    ``probe(drafter, request)``, if given, runs just before each draft and may read the draft model's
    state (e.g. its logits for this request); it must leave the draft caches as it found them.
    """

    model_based = True

    def __init__(self, inner: Any, probe: Callable[[Any, Any], Any] | None = None) -> None:
        self.inner = inner
        self.probe = probe
        self.name = inner.name
        self.log: list[tuple[list[int], int, list[int], Any]] = []

    def capture(self) -> Any:
        return self.inner.capture()

    def begin(self, slot: int, prompt: Any) -> None:
        self.inner.begin(slot, prompt)

    def observe(self, slot: int, inp: Any, out: Any) -> None:
        self.inner.observe(slot, inp, out)

    def accept(self, slot: int, n_accepted: int, mine: bool) -> None:
        self.inner.accept(slot, n_accepted, mine)

    def end(self, slot: int) -> None:
        self.inner.end(slot)

    def draft(self, requests: Any) -> Any:
        probes = [self.probe(self.inner, r) if self.probe else None for r in requests]
        drafts = self.inner.draft(requests)
        for r, d, p in zip(requests, drafts, probes, strict=True):
            self.log.append(([int(t) for t in r.history], int(r.last), list(d.tokens), p))
        return drafts


def recorded_drafts(target_path: Path, draft_path: Path, make: Callable[[DrafterContext], Drafter], spec: SpecParams,
                    *, n_predict: int = 16, probe: Callable[[Any, Any], Any] | None = None,
                    ) -> list[tuple[list[int], int, list[int], Any]]:
    """Drafts made during a 2-slot engine run, each with the committed history it was made from."""
    box: list[Recording] = []

    def wrapped(ctx: DrafterContext) -> Drafter:
        box.append(Recording(make(ctx), probe))
        return box[0]  # type: ignore[return-value]

    outs, refs, _ = engine_vs_plain(target_path, draft_path, wrapped, spec, n_predict=n_predict)
    assert outs == refs
    return [entry for entry in box[0].log if entry[2]]


def assert_logits_close(got: Any, want: Any, atol: float = 1e-4) -> None:
    import numpy as np

    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert np.array_equal(np.isfinite(got), np.isfinite(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], atol=atol, rtol=0)


def agree_unless_near_tie(drafted: list[int], ref_logits: list[Any], gap: float = 1e-3) -> int:
    """Assert drafted[i] == argmax(ref_logits[i]) up to the first reference near-tie; return how many were checked."""
    import numpy as np

    for i, (tok, row) in enumerate(zip(drafted, ref_logits, strict=False)):
        row = np.asarray(row, dtype=np.float64)
        top2 = np.sort(row[np.isfinite(row)])[-2:]
        if top2[1] - top2[0] < gap:
            return i
        assert tok == int(np.argmax(row)), f"draft token {i}: {tok} != reference {int(np.argmax(row))}"
    return len(drafted)


def block_logits(d: Any, r: Any) -> Any:
    """The draft block's logits for this request from the drafter's current context (block K/V undone)."""
    from spekula.core.drafting.draft_models import DFlashBlock

    st, pos0 = d._slots.get(r.slot), len(r.history)
    if st is None or not d.sync(st, pos0):  # the context injected up to the committed history
        return None
    n_spec = min(int(r.spec.n_max), d.max_block_draft())
    out = d.runtime.draft_blocks([DFlashBlock(st.seq, d.block_at(int(r.last), n_spec, pos0), pos0)])[0]
    d.runtime.truncate(st.seq, pos0)
    return out.logits


def generate_across_shifts(backend: str, target: Path, spec_type: str | None, *, n_max: int, n_keep: int,
                           n_discard: int, draft: Path | None = None, n_ctx: int = 32,
                           n_predict: int = 120) -> tuple[list[int], dict[str, Any] | None]:
    """Greedy "hello world" continued for n_predict tokens, several contexts long with context shift on
    (spec_type None: plain decoding): the tokens and the drafter's statistics. The request must end by
    its length, shifted (truncated), without error."""
    tok = Tokenizer.from_gguf(GGUFFile(str(target)))
    b = load_backend(backend, str(target), BackendOptions(n_ctx=n_ctx, n_seq_max=1, threads=1))
    spec = SpecParams(types=(spec_type,) if spec_type else (), n_max=n_max, adaptive=False)
    config = EngineConfig(n_slots=1, n_ctx=n_ctx, n_batch=64, spec=spec, context_shift=True)
    engine = Engine(b, tok, config, draft_model_path=str(draft) if draft else None, backend_name=backend)
    req = CompletionRequest(tok.encode("hello world"), n_predict=n_predict, sampling=SamplingParams(temperature=0.0),
                            ignore_eos=True, n_keep=n_keep, n_discard=n_discard)
    [final] = anyio.run(run_requests, engine, [req], 120.0)
    assert final.error is None, final.error
    assert final.truncated
    stats = engine.stats()["drafters"].get(spec_type) if spec_type else None
    engine.close()
    return final.tokens, stats
