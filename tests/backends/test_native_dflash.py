"""The native DFlash runtime (backends/native/dflash.py): against the torch runtime (float32 and Q8_0
heads, a borrowed head and a reduced draft vocabulary), the block seeing itself in both directions,
bitwise invariance to batching, injection chunks and threads, which runtime draft-dflash picks,
lossless drafting on a native target, and bad input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from model_drafter_helpers import (
    build_target,
    drafter_context,
    engine_vs_plain,
    head_runtime,
    random_draft_gguf,
)

from spekula.backends.native.backend import NativeBackend
from spekula.backends.native.dflash import NativeDFlashRuntime
from spekula.backends.torch.dflash import TorchDFlashRuntime
from spekula.core.backend import BackendOptions
from spekula.core.drafting.draft_models import DFlashBlock, DFlashOut, DFlashRuntime
from spekula.core.errors import ConfigError, ContextOverflowError
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.params import SamplingParams, SpecParams
from spekula.drafters.model.dflash import DFlashDrafter
from spekula.drafters.model.dspark import DSparkDrafter

N_CTX = 128
SPEC = SpecParams(types=("draft-dflash",), n_max=4, adaptive=False)
N_CONTEXT = 9  # target positions injected before the block
# Float32 weights: only the float16 KV cache separates native from torch (measured 1e-4 of max |logit|).
# Q8_0 adds int8 activations (measured 0.5 %). The injected context moves the logits by ~40 %.
F32_REL_TOL = 2e-3
Q8_REL_TOL = 2e-2


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("native-dflash")
    _, target = build_target(root)
    out = {"target": target}
    for name, kw in {"f32": {"weight_type": "F32"}, "q8_0": {"weight_type": "Q8_0"},
                     "vocab": {"weight_type": "F32", "draft_vocab": 128},
                     "causal": {"weight_type": "F32", "attention.causal": True}}.items():
        out[name] = random_draft_gguf(root / f"dflash-{name}.gguf", "dflash", target, seed=1, **kw)
    return out


def native_target(models: dict[str, Path], threads: int = 1) -> NativeBackend:
    return NativeBackend(str(models["target"]), BackendOptions(n_ctx=N_CTX, n_seq_max=3, threads=threads))


def native_runtime(models: dict[str, Path], kind: str, target: NativeBackend | None = None,
                   threads: int = 1) -> NativeDFlashRuntime:
    rt = head_runtime("native", models[kind], models["target"], N_CTX, target=target, threads=threads)
    assert isinstance(rt, NativeDFlashRuntime)
    return rt


def torch_runtime(models: dict[str, Path], kind: str) -> DFlashRuntime:
    rt = head_runtime("torch", models[kind], models["target"], N_CTX)
    assert isinstance(rt, TorchDFlashRuntime)
    return rt


def features(rt: DFlashRuntime, n: int, seed: int = 0) -> np.ndarray:
    width = len(rt.info.target_layers) * rt.info.target_hidden
    return np.random.default_rng(seed).standard_normal((n, width)).astype(np.float32)


def block(rt: DFlashRuntime, last: int = 42, n: int = 4) -> np.ndarray:
    return np.array([last] + [rt.info.mask_token_id] * (n - 1), np.int32)


def spread(out: DFlashOut, n_vocab: int) -> np.ndarray:
    """The logits over the whole target vocabulary, -inf outside a reduced one."""
    if out.vocab is None:
        return out.logits
    full = np.full((len(out.logits), n_vocab), -np.inf, np.float32)
    full[:, out.vocab] = out.logits
    return full


def draft_once(rt: DFlashRuntime, x: np.ndarray, blk: np.ndarray) -> DFlashOut:
    seq = rt.new_seq()
    rt.inject(seq, x, 0)
    return rt.draft_blocks([DFlashBlock(seq, blk, len(x))])[0]


def rel(a: np.ndarray, b: np.ndarray) -> float:
    finite = np.isfinite(b)
    return float(np.abs(a[finite] - b[finite]).max() / np.abs(b[finite]).max())


@pytest.mark.parametrize(("kind", "tol"), [("f32", F32_REL_TOL), ("q8_0", Q8_REL_TOL), ("vocab", F32_REL_TOL),
                                           ("causal", F32_REL_TOL)])
def test_native_matches_the_torch_runtime(models: dict[str, Path], kind: str, tol: float) -> None:
    native, ref = native_runtime(models, kind), torch_runtime(models, kind)
    x = features(ref, N_CONTEXT)
    got, want = draft_once(native, x, block(native)), draft_once(ref, x, block(ref))
    assert (got.vocab is not None) == (kind == "vocab") and want.vocab is None
    full = spread(got, native.info.n_vocab)
    assert full.shape == want.logits.shape == (4, native.info.n_vocab)
    assert np.array_equal(np.isfinite(full), np.isfinite(want.logits))  # -inf outside a draft vocabulary alike
    assert rel(full, want.logits) < tol
    assert (full.argmax(1) == want.logits.argmax(1)).all()
    # the context is read: other features, other logits (far beyond the tolerance)
    other = spread(draft_once(native, features(ref, N_CONTEXT, seed=5), block(native)), native.info.n_vocab)
    assert rel(other, full) > 10 * tol


def test_a_block_row_sees_the_rows_after_it_unless_the_head_is_causal(models: dict[str, Path]) -> None:
    for kind, sees_later in (("f32", True), ("causal", False)):
        rt = native_runtime(models, kind)
        x = features(rt, N_CONTEXT)
        a, b = block(rt), block(rt)
        b[-1] = 7  # only the last row differs
        first, second = draft_once(rt, x, a), draft_once(rt, x, b)
        assert np.array_equal(first.logits[0], second.logits[0]) != sees_later


@pytest.mark.parametrize("kind", ["f32", "q8_0"])
def test_outputs_do_not_depend_on_batching_injection_chunks_or_threads(models: dict[str, Path], kind: str) -> None:
    alone = native_runtime(models, kind)
    x, y = features(alone, N_CONTEXT, seed=1), features(alone, 5, seed=2)
    want = draft_once(alone, x, block(alone))
    other = native_runtime(models, kind, threads=2)
    s, t = other.new_seq(), other.new_seq()
    other.inject(t, y, 0)
    other.inject(s, x[:4], 0)
    other.inject(s, x[4:], 4)
    assert other.seq_len(s) == N_CONTEXT
    outs = other.draft_blocks([DFlashBlock(t, block(other, 9, 3), 5), DFlashBlock(s, block(other), N_CONTEXT)])
    assert np.array_equal(outs[1].logits, want.logits)
    assert other.seq_len(s) == N_CONTEXT + 4 and other.seq_len(t) == 5 + 3
    # the block's own keys are dropped by truncation and rewritten: the same bits again
    other.truncate(s, N_CONTEXT)
    again = other.draft_blocks([DFlashBlock(s, block(other), N_CONTEXT)])[0]
    assert np.array_equal(again.logits, want.logits)
    # context rewritten after a truncation (a rejected round) reads as if injected once
    other.truncate(s, 3)
    other.inject(s, x[3:], 3)
    assert np.array_equal(other.draft_blocks([DFlashBlock(s, block(other), N_CONTEXT)])[0].logits, want.logits)


@pytest.mark.parametrize("runtime", ["native", "torch"])
@pytest.mark.parametrize("kind", ["f32", "vocab"])
def test_logit_rows_are_those_rows_of_the_whole_block(models: dict[str, Path], kind: str, runtime: str) -> None:
    """A block that asks for some rows' logits (DFlashBlock.logit_rows: what a short draft reads) gets
    exactly those rows of the whole block's logits, batched beside a block that asks for all."""
    rt = native_runtime(models, kind) if runtime == "native" else torch_runtime(models, kind)
    x, y = features(rt, N_CONTEXT, seed=1), features(rt, 5, seed=2)
    s, t = rt.new_seq(), rt.new_seq()
    rt.inject(s, x, 0)
    rt.inject(t, y, 0)
    whole = rt.draft_blocks([DFlashBlock(s, block(rt), N_CONTEXT)])[0]
    for rows in ([1], [1, 2], [0, 2, 3], []):
        rt.truncate(s, N_CONTEXT)
        rt.truncate(t, 5)
        some, other = rt.draft_blocks([DFlashBlock(s, block(rt), N_CONTEXT, rows), DFlashBlock(t, block(rt, 9, 3), 5)])
        assert np.array_equal(some.logits, whole.logits[rows]) and len(other.logits) == 3
        assert rt.seq_len(s) == N_CONTEXT + 4  # every row of the block still wrote its keys
    if runtime == "native":
        rt.truncate(s, N_CONTEXT)
        with pytest.raises(ValueError, match="logit rows"):
            rt.draft_blocks([DFlashBlock(s, block(rt), N_CONTEXT, [2, 1])])


def test_over_a_native_target_it_uses_the_targets_threads_and_embedding(models: dict[str, Path]) -> None:
    target = native_target(models, threads=2)
    over = native_runtime(models, "q8_0", target=target)
    own = native_runtime(models, "q8_0", threads=2)
    x = features(own, N_CONTEXT)
    got = draft_once(over, x, block(over))
    assert np.array_equal(got.logits, draft_once(own, x, block(own)).logits)
    target.close()  # the draft's context keeps the target's alive
    assert np.array_equal(draft_once(over, x, block(over)).logits, got.logits)


def test_draft_dflash_picks_the_native_runtime_beside_a_native_target_and_dspark_stays_on_torch(
        models: dict[str, Path], tmp_path: Path) -> None:
    target = native_target(models)
    ctx = drafter_context(target, models["q8_0"], SPEC, backend_name="native")
    assert isinstance(DFlashDrafter.create(ctx).runtime, NativeDFlashRuntime)
    from model_drafter_helpers import target_backend

    torch_ctx = drafter_context(target_backend(models["target"]), models["q8_0"], SPEC)
    assert isinstance(DFlashDrafter.create(torch_ctx).runtime, TorchDFlashRuntime)
    # a DSpark file (a Markov head on top) has only the torch runtime
    from spekula.backends.convert.hf import convert
    from spekula.fixtures import tiny_hf

    hf = tmp_path / "target-hf"
    tiny_hf.write_target(hf, "llama", n_layer=8)
    dspark = tmp_path / "dspark.gguf"
    convert(tiny_hf.write_dflash(tmp_path / "ds-hf", markov_rank=4), dspark, outtype="f32", target_dir=hf)
    assert GGUFFile(dspark).has_tensor("markov_w1.weight")
    ds_ctx = drafter_context(target, dspark, SpecParams(types=("draft-dspark",), n_max=3), backend_name="native")
    assert isinstance(DSparkDrafter.create(ds_ctx).runtime, TorchDFlashRuntime)


@pytest.mark.parametrize("kind", ["q8_0", "vocab"])
@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=5)],
                         ids=["greedy", "sampled"])
def test_lossless_on_a_native_target(models: dict[str, Path], kind: str, sampling: SamplingParams) -> None:
    spec = SPEC if sampling.temperature == 0 else SPEC.with_(draft_sampling="probabilistic")
    outs, refs, st = engine_vs_plain(models["target"], models[kind], DFlashDrafter.create, spec, sampling=sampling,
                                     backend="native")
    assert outs == refs
    assert st["gen_drafts"] > 0


def test_bad_input_is_one_clear_error_and_leaves_the_runtime_usable(models: dict[str, Path]) -> None:
    rt = native_runtime(models, "q8_0")
    s = rt.new_seq()
    x = features(rt, N_CONTEXT)
    with pytest.raises(ConfigError, match="gap"):
        rt.inject(s, x, 2)
    with pytest.raises(ContextOverflowError):
        rt.inject(s, features(rt, N_CTX + 1), 0)
    with pytest.raises(ValueError, match="features"):
        rt.inject(s, np.zeros((2, 5), np.float32), 0)
    with pytest.raises(ConfigError, match="gap"):
        rt.draft_blocks([DFlashBlock(s, block(rt), 3)])
    with pytest.raises(ContextOverflowError):
        rt.draft_blocks([DFlashBlock(s, np.zeros(N_CTX + 1, np.int32), 0)])
    with pytest.raises(ConfigError, match="twice"):
        rt.draft_blocks([DFlashBlock(s, block(rt), 0), DFlashBlock(s, block(rt), 0)])
    with pytest.raises(ConfigError, match="rejected"):  # a token outside the vocabulary
        rt.draft_blocks([DFlashBlock(s, np.array([rt.info.n_vocab], np.int32), 0)])
    assert rt.seq_len(s) == 0
    rt.inject(s, x, 0)
    out = rt.draft_blocks([DFlashBlock(s, block(rt), N_CONTEXT)])[0]
    assert np.isfinite(out.logits).all()
    rt.close()
    with pytest.raises(ConfigError, match="closed"):
        rt.inject(s, x, 0)
