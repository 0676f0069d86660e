"""The native MTP runtime (backends/native/mtp.py): its heads against the torch runtime's (float32 and Q8_0
GLM-MoE fixtures, 1 and 2 heads), bitwise invariance to batching, chunking and threads, the target's
prepared tensors used rather than copied, which runtime draft-mtp picks, lossless drafting on a native
target (-md with an MTP-only file included) and bad input.

The engine-level lossless checks shared with the torch runtime are parametrised in test_draft_mtp.py.
"""

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from backend_conformance import NATIVE_REL_TOL
from mtp_helpers import context, run_vs_plain

from spekula.backends.native import lib as nl
from spekula.backends.native.backend import NativeBackend
from spekula.backends.native.mtp import NativeMtpRuntime
from spekula.backends.torch.mtp import TorchMtpRuntime
from spekula.core.backend import BackendOptions, load_backend
from spekula.core.drafting.mtp_runtime import MtpOut, MtpRows, MtpRuntime, read_mtp_info
from spekula.core.errors import ConfigError, ContextOverflowError, ModelFileError, SpekulaError
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.params import SamplingParams, SpecParams
from spekula.drafters.model.mtp import MtpDrafter
from spekula.drafters.model.runtimes import load_mtp_runtime
from spekula.fixtures import tiny_moe_quant, tiny_mtp
from spekula.fixtures.tiny_gguf import OUT_DIR
from spekula.fixtures.tiny_moe import tiny_moe_gguf_path

N_CTX = 128
H = 64
SPEC = SpecParams(types=("draft-mtp",), n_max=3, adaptive=False)
# Float32 weights run through the float matmuls (no int8 activations): only the float16 KV cache
# separates native from torch. Measured on these fixtures: logits within 2.3e-4 of max |logit|, hout 4.5e-4.
F32_REL_TOL = 2e-3


@cache
def q8_copy(src: Path) -> Path:
    """`src` with every matrix re-encoded as Q8_0 (tiny_moe_quant.requantize), cached beside it."""
    digest = hashlib.sha256(Path(tiny_moe_quant.__file__).read_bytes()).hexdigest()[:12]
    dst = OUT_DIR / f"{src.stem}-Q8_0-{digest}.gguf"
    return dst if dst.is_file() else tiny_moe_quant.requantize(src, dst, "Q8_0")


def options(threads: int = 1) -> BackendOptions:
    return BackendOptions(n_ctx=N_CTX, n_seq_max=3, threads=threads)


def runtimes(path: Path, draft: Path | None = None, threads: int = 1) -> tuple[NativeBackend, MtpRuntime, MtpRuntime]:
    """(native target, native heads over it, torch heads) of one file."""
    target = NativeBackend(str(path), options(threads))
    native = load_mtp_runtime("native", target, str(draft) if draft else None, options(threads))
    torch_rt = load_mtp_runtime("torch", load_backend("torch", str(path), options()), str(draft) if draft else None,
                                options())
    assert isinstance(native, NativeMtpRuntime) and isinstance(torch_rt, TorchMtpRuntime)
    return target, native, torch_rt


def rows_of(seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 320, n).astype(np.int32), rng.standard_normal((n, H)).astype(np.float32)


def script(rt: MtpRuntime, n_heads: int) -> list[MtpOut]:
    """Two sequences through every head: a 12-row chunk, then 4 single rows, one head per step after the
    first chunk (the drafter's pattern); every decode's outputs."""
    seqs = [rt.new_seq(), rt.new_seq()]
    outs: list[MtpOut] = []
    chunks = [rows_of(s, 12) for s in range(2)]
    outs += rt.decode([MtpRows(q, h, *chunks[i], 0) for i, q in enumerate(seqs) for h in range(n_heads)])
    for step in range(4):
        rows = [MtpRows(q, step % n_heads, *rows_of(10 + 2 * step + i, 1), 12 + step) for i, q in enumerate(seqs)]
        outs += rt.decode(rows)
    for q in seqs:
        rt.free_seq(q)
    return outs


def assert_outs_close(got: list[MtpOut], want: list[MtpOut], rel: float) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.logits is not None and w.logits is not None and g.hidden is not None and w.hidden is not None
        assert g.logits.shape == w.logits.shape and g.hidden.shape == w.hidden.shape == (H,)
        assert np.abs(g.logits - w.logits).max() <= rel * max(1.0, float(np.abs(w.logits).max()))
        assert np.abs(g.hidden - w.hidden).max() <= rel * max(1.0, float(np.abs(w.hidden).max()))


@pytest.mark.parametrize("n_heads", [1, 2])
def test_f32_heads_match_the_torch_runtime(n_heads: int) -> None:
    _, native, torch_rt = runtimes(tiny_mtp.random_mtp_gguf(n_heads))
    assert_outs_close(script(native, n_heads), script(torch_rt, n_heads), F32_REL_TOL)


@pytest.mark.parametrize("n_heads", [1, 2])
def test_q8_0_heads_near_the_torch_runtime(n_heads: int) -> None:
    """Every matrix Q8_0 (eh_proj, the block, the experts, embedding and head): the int8 activations' rounding,
    within the native conformance suite's tolerance (measured: logits and hout within 2.5 % of their scale)."""
    _, native, torch_rt = runtimes(q8_copy(tiny_mtp.random_mtp_gguf(n_heads)))
    got, want = script(native, n_heads), script(torch_rt, n_heads)
    assert_outs_close(got, want, NATIVE_REL_TOL)
    agree = [g.logits.argmax() == w.logits.argmax() for g, w in zip(got, want, strict=True)]  # type: ignore[union-attr]
    assert np.mean(agree) >= 0.8


def last_logits(rt: MtpRuntime, head: int, tokens: np.ndarray, hidden: np.ndarray, chunks: list[int],
                other: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(logits, hout) of the last row of one sequence decoded in `chunks` (each beside another sequence's rows
    of the same length when `other` is given)."""
    seq, extra = rt.new_seq(), rt.new_seq()
    pos, out = 0, MtpOut(None, None)
    for n in chunks:
        rows = [MtpRows(seq, head, tokens[pos : pos + n], hidden[pos : pos + n], pos)]
        if other is not None:
            rows.insert(0, MtpRows(extra, head, other[0][pos : pos + n], other[1][pos : pos + n], pos))
        out = rt.decode(rows)[-1]
        pos += n
    rt.free_seq(seq)
    rt.free_seq(extra)
    assert out.logits is not None and out.hidden is not None
    return out.logits, out.hidden


@pytest.mark.parametrize("quant", [False, True], ids=["f32", "Q8_0"])
def test_a_rows_outputs_do_not_depend_on_batching_chunking_or_threads(quant: bool) -> None:
    path = tiny_mtp.random_mtp_gguf(2)
    path = q8_copy(path) if quant else path
    _, one, _ = runtimes(path)
    _, two, _ = runtimes(path, threads=2)
    tokens, hidden = rows_of(3, 20)
    other = rows_of(4, 20)
    for head in (0, 1):
        want = last_logits(one, head, tokens, hidden, [20])
        for rt, chunks, beside in [(one, [7, 1, 12], None), (one, [20], other), (one, [5, 15], other),
                                   (two, [20], None), (two, [1] * 20, other)]:
            got = last_logits(rt, head, tokens, hidden, chunks, beside)
            assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), (head, chunks)


def packed_bytes(ctx: int) -> int:
    return int(nl.lib().sk_ctx_packed_bytes(ctx))


@pytest.mark.parametrize("n_heads", [1, 2])
def test_the_heads_use_the_targets_embedding_and_head(n_heads: int) -> None:
    """The constructed heads borrow the trunk's token_embd and output: each head's context reads the very
    buffers the target prepared (the packed Q8_0 head included) and packs nothing of its own for them,
    while a runtime without the target behind it holds one copy of the head."""
    path = q8_copy(tiny_mtp.agreeing_mtp_gguf(n_mtp=n_heads))
    target, native, _ = runtimes(path)
    assert isinstance(native, NativeMtpRuntime) and target.context is not None
    tcfg = nl.ctx_config(target.context)
    for ctx in native.contexts:
        cfg = nl.ctx_config(ctx)
        assert cfg.output.data == tcfg.output.data and cfg.output.layout == tcfg.output.layout
        assert cfg.token_embd.data == tcfg.token_embd.data
    if target.kernels == "generic":
        return  # the generic kernels read every weight in place: nothing is packed anywhere
    assert tcfg.output.layout == 1  # repacked once, at the target's load
    alone = NativeMtpRuntime(native._file, native.info, load_backend("torch", str(path), options()), options())
    head_bytes = tcfg.output.row_bytes * -(-tcfg.output.n_rows // 16)
    assert packed_bytes(alone.contexts[0]) - packed_bytes(native.contexts[0]) == head_bytes
    assert all(packed_bytes(c) == packed_bytes(native.contexts[0]) for c in native.contexts)
    assert nl.ctx_config(alone.contexts[-1]).output.data == nl.ctx_config(alone.contexts[0]).output.data


def test_an_mtp_only_file_brings_its_own_tensors_prepared_once() -> None:
    """-md with an MTP-only file: the heads read that file's embedding and head, not the target's."""
    target_path = q8_copy(tiny_mtp.trunk_only_gguf())
    draft = q8_copy(tiny_moe_gguf_path("glm4moe", n_mtp=2, n_layer=3, variant="mtp_only"))
    target = NativeBackend(str(target_path), options())
    rt = load_mtp_runtime("native", target, str(draft), options())
    assert isinstance(rt, NativeMtpRuntime) and target.context is not None
    tcfg = nl.ctx_config(target.context)
    heads = [nl.ctx_config(c) for c in rt.contexts]
    assert all(h.output.data != tcfg.output.data and h.token_embd.data != tcfg.token_embd.data for h in heads)


def test_closing_the_target_first_keeps_the_heads_working() -> None:
    path = q8_copy(tiny_mtp.random_mtp_gguf(1))
    target, native, _ = runtimes(path, threads=2)
    tokens, hidden = rows_of(5, 9)
    want = last_logits(native, 0, tokens, hidden, [9])
    target.close()
    got = last_logits(native, 0, tokens, hidden, [4, 5])
    assert np.array_equal(got[0], want[0])
    assert isinstance(native, NativeMtpRuntime)
    native.close()
    with pytest.raises(ConfigError, match="closed"):
        native.decode([MtpRows(0, 0, tokens[:1], hidden[:1], 0)])


def test_draft_mtp_picks_the_native_runtime_for_native_targets_only() -> None:
    path = tiny_mtp.random_mtp_gguf(1)
    native_target = NativeBackend(str(path), options())
    assert isinstance(MtpDrafter.create(context(native_target, SPEC, backend_name="native")).runtime, NativeMtpRuntime)
    torch_target = load_backend("torch", str(path), options())
    assert isinstance(MtpDrafter.create(context(torch_target, SPEC)).runtime, TorchMtpRuntime)
    ctx = context(native_target, SPEC, backend_name="native")
    ctx.draft_backend_options = BackendOptions(n_ctx=N_CTX, dtype="f32")  # --spec-draft-dtype f32: torch
    assert isinstance(MtpDrafter.create(ctx).runtime, TorchMtpRuntime)


@pytest.mark.parametrize("quant", [False, True], ids=["f32", "Q8_0"])
@pytest.mark.parametrize("n_heads", [1, 2])
def test_lossless_on_a_native_target(n_heads: int, quant: bool) -> None:
    path = tiny_mtp.random_mtp_gguf(n_heads)
    path = q8_copy(path) if quant else path
    for sampling in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=5)):
        outs, refs, st = run_vs_plain(path, SPEC, n_predict=16, sampling=sampling, backend="native")
        assert outs == refs and st["gen_drafts"] > 0


def test_md_with_an_mtp_only_file_on_a_native_target() -> None:
    """The same drafts from the MTP-only file as from the target's own heads, and -md onto a trunk-only target."""
    target, draft = tiny_mtp.random_mtp_gguf(1), tiny_mtp.mtp_only_gguf(1)
    own = run_vs_plain(target, SPEC, n_predict=16, backend="native")
    md = run_vs_plain(target, SPEC, draft=draft, n_predict=16, backend="native")
    assert own[0] == own[1] == md[0]
    keys = ("gen_drafts", "gen_tokens", "acc_tokens", "acc_per_pos")
    assert {k: own[2][k] for k in keys} == {k: md[2][k] for k in keys}
    outs, refs, st = run_vs_plain(tiny_mtp.trunk_only_gguf(), SPEC, draft=draft, n_predict=16,
                                  sampling=SamplingParams(temperature=0.8, seed=3), backend="native")
    assert outs == refs and st["gen_drafts"] > 0


@pytest.mark.parametrize("n_heads", [1, 2])
def test_constructed_heads_are_accepted_on_native(n_heads: int) -> None:
    """The agreeing heads (tiny_mtp) compute the target's own next token through the same kernels."""
    outs, refs, st = run_vs_plain(q8_copy(tiny_mtp.agreeing_mtp_gguf(n_mtp=n_heads)), SPEC, n_predict=24,
                                  backend="native")
    assert outs == refs and st["gen_tokens"] > 20
    assert st["acc_tokens"] >= 0.9 * st["gen_tokens"], st


@pytest.mark.parametrize("runtime", ["native", "torch"])
def test_bad_rows_are_one_clear_error_and_leave_the_runtime_usable(runtime: str) -> None:
    _, native_rt, torch_rt = runtimes(tiny_mtp.random_mtp_gguf(1))
    rt = native_rt if runtime == "native" else torch_rt
    seq = rt.new_seq()
    tokens, hidden = rows_of(6, 4)
    want = rt.decode([MtpRows(seq, 0, tokens, hidden, 0)])[0]
    rt.truncate(seq, 0)
    cases: list[tuple[MtpRows | list[MtpRows], type[Exception], str]] = [
        (MtpRows(seq, 1, tokens, hidden, 0), ValueError, "head 1 out of range"),
        (MtpRows(seq, 0, tokens, hidden[:3], 0), ValueError, "hidden"),
        (MtpRows(seq, 0, tokens[:0], hidden[:0], 0), ValueError, "n > 0"),
        (MtpRows(seq, 0, np.array([1, 2, 320, 3], np.int32), hidden, 0), ValueError, "token ids"),
        (MtpRows(seq, 0, tokens, hidden, 2), ConfigError, "gap"),
        (MtpRows(seq, 0, tokens, hidden, -1), ValueError, "negative"),
        ([MtpRows(seq, 0, tokens, hidden, 0)] * 2, ValueError, "twice"),
        (MtpRows(99, 0, tokens, hidden, 0), ConfigError,
         "unknown MTP sequence" if runtime == "native" else "unknown sequence id 99"),  # torch: its KV pool's words
    ]
    for rows, exc, needle in cases:
        with pytest.raises(exc, match=needle):
            rt.decode(rows if isinstance(rows, list) else [rows])
    long = rows_of(7, N_CTX + 1)
    with pytest.raises(ContextOverflowError, match="exceeds n_ctx"):
        rt.decode([MtpRows(seq, 0, *long, 0)])
    assert rt.seq_len(seq) == 0
    got = rt.decode([MtpRows(seq, 0, tokens, hidden, 0)])[0]
    assert got.logits is not None and want.logits is not None and np.array_equal(got.logits, want.logits)


def test_a_broken_head_tensor_is_named(tmp_path: Path) -> None:
    src = tiny_mtp.random_mtp_gguf(1)
    bad = tiny_moe_quant.rewrite_gguf(src, tmp_path / "bad.gguf",
                                      lambda name, v: (v[:, :H] if name == "blk.3.nextn.eh_proj.weight" else v, "F32"))
    target = NativeBackend(str(bad), options())
    with pytest.raises(ModelFileError, match=r"blk\.3\.nextn\.eh_proj\.weight.*shape \(64, 64\), expected \(64, 128\)"):
        MtpDrafter.create(context(target, SPEC, backend_name="native"))
    f = GGUFFile.shared(str(src))
    with pytest.raises(SpekulaError, match="native MTP runtime runs on the CPU"):
        NativeMtpRuntime(f, read_mtp_info(f), target, BackendOptions(n_ctx=N_CTX, device="cuda"))
