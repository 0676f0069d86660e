"""The native EAGLE-3 runtime (backends/native/eagle3.py): against the torch runtime (float32 and Q8_0
heads), bitwise invariance to batching, chunking and threads, which runtime draft-eagle3 picks,
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

from spekula.backends.convert.hf import convert
from spekula.backends.native.backend import NativeBackend
from spekula.backends.native.eagle3 import NativeEagle3Runtime
from spekula.backends.torch.eagle3 import TorchEagle3Runtime
from spekula.core.backend import BackendOptions
from spekula.core.drafting.draft_models import Eagle3Out, Eagle3Rows, Eagle3Runtime
from spekula.core.errors import ConfigError, ContextOverflowError
from spekula.core.params import SamplingParams, SpecParams
from spekula.drafters.model.dflash import DFlashDrafter
from spekula.drafters.model.eagle3 import Eagle3Drafter
from spekula.fixtures import tiny_hf

N_CTX = 128
SPEC = SpecParams(types=("draft-eagle3",), n_max=4, adaptive=False)
TOKENS = np.array([5, 17, 200, 33, 99, 120, 7], np.int32)
# Float32 weights go through the float matmuls: only the float16 KV cache separates native from torch
# (measured on these fixtures: 1.2e-4 of max |logit|). Q8_0 adds int8 activations (measured 0.7 %).
F32_REL_TOL = 2e-3
Q8_REL_TOL = 3e-2


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("native-eagle3")
    hf, target = build_target(root)
    e3_hf = tiny_hf.write_eagle3(root / "e3-hf", layer_ids=(1, 4, 8))
    out = {"target": target}
    for outtype in ("f32", "q8_0"):
        out[outtype] = root / f"eagle3-{outtype}.gguf"
        convert(e3_hf, out[outtype], outtype=outtype, target_dir=hf)
    out["dflash"] = random_draft_gguf(root / "dflash.gguf", "dflash", target)
    return out


def native_target(models: dict[str, Path], threads: int = 1) -> NativeBackend:
    return NativeBackend(str(models["target"]), BackendOptions(n_ctx=N_CTX, n_seq_max=3, threads=threads))


def native_runtime(models: dict[str, Path], kind: str, target: NativeBackend | None = None,
                   threads: int = 1) -> NativeEagle3Runtime:
    rt = head_runtime("native", models[kind], models["target"], N_CTX, target=target, threads=threads)
    assert isinstance(rt, NativeEagle3Runtime)
    return rt


def torch_runtime(models: dict[str, Path], kind: str) -> Eagle3Runtime:
    rt = head_runtime("torch", models[kind], models["target"], N_CTX)
    assert isinstance(rt, TorchEagle3Runtime)
    return rt


def features(n: int, seed: int = 0) -> np.ndarray:
    """Captured target features: what the encoder reads."""
    return np.random.default_rng(seed).standard_normal((n, 3 * tiny_hf.HIDDEN)).astype(np.float32)


def hidden(n: int, seed: int = 0) -> np.ndarray:
    """Rows of g: what the layer reads beside each token."""
    return np.random.default_rng(seed).standard_normal((n, tiny_hf.HIDDEN)).astype(np.float32)


def two_steps(rt: Eagle3Runtime, g: np.ndarray) -> tuple[Eagle3Out, Eagle3Out]:
    """The prompt's rows, then one draft step from the last row's pre-norm output."""
    seq = rt.new_seq()
    first = rt.decode([Eagle3Rows(seq, TOKENS, g, 0)])[0]
    second = rt.decode([Eagle3Rows(seq, np.array([42], np.int32), first.prenorm[-1:], len(TOKENS))])[0]
    rt.free_seq(seq)
    return first, second


def rel(a: np.ndarray, b: np.ndarray) -> float:
    finite = np.isfinite(b)
    return float(np.abs(a[finite] - b[finite]).max() / np.abs(b[finite]).max())


@pytest.mark.parametrize(("kind", "tol"), [("f32", F32_REL_TOL), ("q8_0", Q8_REL_TOL)])
def test_native_matches_the_torch_runtime(models: dict[str, Path], kind: str, tol: float) -> None:
    native, ref = native_runtime(models, kind), torch_runtime(models, kind)
    x = features(len(TOKENS))
    g_ref = ref.encode(x)
    assert rel(native.encode(x), g_ref) < tol
    for got, want in zip(two_steps(native, g_ref), two_steps(ref, g_ref), strict=True):
        assert got.logits is not None and want.logits is not None
        assert got.logits.shape == want.logits.shape == (len(got.prenorm), tiny_hf.VOCAB)
        # -inf outside the reduced draft vocabulary, in the same places
        assert np.array_equal(np.isfinite(got.logits), np.isfinite(want.logits))
        assert rel(got.logits, want.logits) < tol and rel(got.prenorm, want.prenorm) < tol
        assert (got.logits.argmax(1) == want.logits.argmax(1)).all()


@pytest.mark.parametrize("kind", ["f32", "q8_0"])
def test_a_rows_outputs_do_not_depend_on_batching_chunking_or_threads(models: dict[str, Path], kind: str) -> None:
    g = hidden(len(TOKENS), seed=1)
    alone = native_runtime(models, kind)
    s = alone.new_seq()
    want = alone.decode([Eagle3Rows(s, TOKENS, g, 0)])[0]
    # another sequence in the same batch, the rows in two chunks, two threads
    other = native_runtime(models, kind, threads=2)
    a, b = other.new_seq(), other.new_seq()
    first = other.decode([Eagle3Rows(b, TOKENS[::-1].copy(), g, 0), Eagle3Rows(a, TOKENS[:3], g[:3], 0)])
    second = other.decode([Eagle3Rows(a, TOKENS[3:], g[3:], 3, want_logits=False)])[0]
    assert second.logits is None
    assert np.array_equal(np.concatenate([first[1].prenorm, second.prenorm]), want.prenorm)
    assert first[1].logits is not None and want.logits is not None
    assert np.array_equal(first[1].logits, want.logits[:3])
    # truncating and decoding the same rows again gives the same bits
    other.truncate(a, 2)
    again = other.decode([Eagle3Rows(a, TOKENS[2:], g[2:], 2)])[0]
    assert again.logits is not None and np.array_equal(again.logits, want.logits[2:])


@pytest.mark.parametrize("kind", ["f32", "q8_0"])
def test_a_draft_step_answers_for_the_last_row_over_the_draft_vocabulary(models: dict[str, Path], kind: str) -> None:
    """draft_step answers for each entry's last row, over the head's own vocabulary (its columns named by
    ``vocab``), with the bits decode() spreads over the target's: for a queue-plus-step entry, for two
    sequences in one step, and for one row from its reused buffers."""
    g = hidden(len(TOKENS), seed=2)
    ref, rt = native_runtime(models, kind), native_runtime(models, kind)
    b, a, ra, rb = rt.new_seq(), rt.new_seq(), ref.new_seq(), ref.new_seq()  # a in slot 1: not the buffers zeros
    want = ref.decode([Eagle3Rows(ra, TOKENS, g, 0)])[0]
    want_b = ref.decode([Eagle3Rows(rb, TOKENS[:3], g[:3], 0)])[0]
    step = rt.draft_step([Eagle3Rows(a, TOKENS[:4], g[:4], 0, want_logits=False), Eagle3Rows(b, TOKENS[:3], g[:3], 0)])
    assert want.logits is not None and want_b.logits is not None
    for out, full, last in ((step[0], want.logits[3], want.prenorm[3]), (step[1], want_b.logits[2], want_b.prenorm[2])):
        assert out.logits is not None and out.vocab is not None and out.logits.shape == (1, len(out.vocab))
        assert np.array_equal(out.logits[0], full[out.vocab]) and np.array_equal(out.prenorm[0], last)
        assert not np.isfinite(np.delete(full, out.vocab)).any()  # the rest is what spreading fills in
    assert rt.seq_len(a) == 4 and rt.seq_len(b) == 3
    for k in range(4, len(TOKENS)):  # one row at a time: the preallocated path
        [out] = rt.draft_step([Eagle3Rows(a, TOKENS[k:k + 1], g[k:k + 1], k)])
        assert out.logits is not None and out.vocab is not None
        assert np.array_equal(out.logits[0], want.logits[k][out.vocab]) and np.array_equal(out.prenorm[0], want.prenorm[k])
        assert rt.seq_len(a) == k + 1
    with pytest.raises(ValueError, match="hidden"):
        rt.draft_step([Eagle3Rows(a, TOKENS[:1], g[0], 2)])
    with pytest.raises(ConfigError, match="gap"):
        rt.draft_step([Eagle3Rows(a, TOKENS[:1], g[:1], len(TOKENS) + 1)])
    assert rt.seq_len(a) == len(TOKENS)


def test_the_default_draft_step_answers_like_decode(models: dict[str, Path]) -> None:
    """A runtime without its own draft_step (torch) decodes an entry's rows and answers for the last."""
    ref, rt = torch_runtime(models, "f32"), torch_runtime(models, "f32")
    g = hidden(len(TOKENS), seed=3)
    want = ref.decode([Eagle3Rows(ref.new_seq(), TOKENS, g, 0)])[0]
    s = rt.new_seq()
    [out] = rt.draft_step([Eagle3Rows(s, TOKENS, g, 0)])
    assert want.logits is not None and out.logits is not None and out.vocab is None and rt.seq_len(s) == len(TOKENS)
    assert out.logits.shape == (1, tiny_hf.VOCAB) and rel(out.logits[0], want.logits[-1]) < 1e-5
    assert rel(out.prenorm[0], want.prenorm[-1]) < 1e-5


def test_over_a_native_target_it_uses_the_targets_threads_and_embedding(models: dict[str, Path]) -> None:
    target = native_target(models, threads=2)
    over = native_runtime(models, "q8_0", target=target)
    own = native_runtime(models, "q8_0", threads=2)
    g = hidden(len(TOKENS), seed=2)
    got, want = two_steps(over, g), two_steps(own, g)
    for a, b in zip(got, want, strict=True):
        assert a.logits is not None and b.logits is not None and np.array_equal(a.logits, b.logits)
    # the draft's context keeps the target's alive: closing the target first is safe
    target.close()
    after = two_steps(over, g)
    assert after[1].logits is not None and got[1].logits is not None
    assert np.array_equal(after[1].logits, got[1].logits)


def test_draft_eagle3_picks_the_native_runtime_for_native_targets_only(models: dict[str, Path]) -> None:
    target = native_target(models)
    ctx = drafter_context(target, models["q8_0"], SPEC, backend_name="native")
    assert isinstance(Eagle3Drafter.create(ctx).runtime, NativeEagle3Runtime)
    # a float --spec-draft-dtype asks for the torch runtime; a torch target always has it
    floats = drafter_context(target, models["q8_0"], SPEC, backend_name="native")
    floats.draft_backend_options = BackendOptions(dtype="f32")
    assert isinstance(Eagle3Drafter.create(floats).runtime, TorchEagle3Runtime)
    from model_drafter_helpers import target_backend

    torch_ctx = drafter_context(target_backend(models["target"]), models["q8_0"], SPEC)
    assert isinstance(Eagle3Drafter.create(torch_ctx).runtime, TorchEagle3Runtime)
    # a DFlash head gets its own native runtime (tests/test_native_dflash.py), not this one
    dflash = drafter_context(target, models["dflash"], SpecParams(types=("draft-dflash",), n_max=4), backend_name="native")
    assert type(DFlashDrafter.create(dflash).runtime).__name__ == "NativeDFlashRuntime"


@pytest.mark.parametrize("kind", ["f32", "q8_0"])
@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=5)],
                         ids=["greedy", "sampled"])
def test_lossless_on_a_native_target(models: dict[str, Path], kind: str, sampling: SamplingParams) -> None:
    outs, refs, st = engine_vs_plain(models["target"], models[kind], Eagle3Drafter.create, SPEC, sampling=sampling,
                                     backend="native")
    assert outs == refs
    assert st["gen_drafts"] > 0


def test_bad_rows_are_one_clear_error_and_leave_the_runtime_usable(models: dict[str, Path]) -> None:
    rt = native_runtime(models, "q8_0")
    s = rt.new_seq()
    g = hidden(len(TOKENS))
    with pytest.raises(ConfigError, match="gap"):
        rt.decode([Eagle3Rows(s, TOKENS, g, 2)])
    with pytest.raises(ContextOverflowError):
        rt.decode([Eagle3Rows(s, np.zeros(N_CTX + 1, np.int32), np.zeros((N_CTX + 1, tiny_hf.HIDDEN), np.float32), 0)])
    with pytest.raises(ConfigError, match="twice"):
        rt.decode([Eagle3Rows(s, TOKENS[:1], g[:1], 0), Eagle3Rows(s, TOKENS[1:2], g[1:2], 1)])
    with pytest.raises(ConfigError, match="rejected"):  # a token outside the vocabulary
        rt.decode([Eagle3Rows(s, np.array([tiny_hf.VOCAB], np.int32), g[:1], 0)])
    with pytest.raises(ValueError, match="features"):
        rt.encode(np.zeros((2, 5), np.float32))
    assert rt.seq_len(s) == 0
    out = rt.decode([Eagle3Rows(s, TOKENS, g, 0)])[0]
    assert out.logits is not None and np.isfinite(out.logits).any()
    rt.close()
    with pytest.raises(ConfigError, match="closed"):
        rt.decode([Eagle3Rows(s, TOKENS, g, 0)])
