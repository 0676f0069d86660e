"""draft-mtp on the tiny Qwen3.5 targets (hybrid gated delta-net + gated attention; dense qwen35 and MoE
qwen35moe; 1 and 2 MTP layers) on the torch and native runtimes: lossless output greedy and sampled,
constructed heads that must be accepted, the MTP-only file (-md), the nextn tensors the later MTP
layers share, the heads against transformers and the native heads against the torch heads, and MTP files
made for another target refused.

The target is recurrent: the engine checkpoints it before every verification forward and a rejected
draft rolls it back from there; the heads themselves hold attention KV only (O(1) truncate).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from model_drafter_helpers import PROMPTS
from mtp_helpers import context, run_vs_plain, target_backend

from spekula.backends.native import lib as nl
from spekula.backends.native.backend import NativeBackend
from spekula.backends.native.mtp import NativeMtpRuntime
from spekula.core.backend import BackendOptions, load_backend
from spekula.core.drafting.mtp_runtime import MtpOut, MtpRows, MtpRuntime, read_mtp_info
from spekula.core.errors import SpekulaError
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.tokenizer import Tokenizer
from spekula.core.params import SamplingParams, SpecParams
from spekula.drafters.model.mtp import MtpDrafter, is_mtp_file
from spekula.drafters.model.runtimes import load_mtp_runtime
from spekula.fixtures import tiny_mtp
from spekula.fixtures.tiny_qwen35 import tiny_qwen35_gguf_path, tiny_qwen35_hf_path

SPEC = SpecParams(types=("draft-mtp",), n_max=3, adaptive=False)  # full-length drafts: they are what is checked
FIXTURES = [(moe, n) for moe in (False, True) for n in (1, 2)]
IDS = [f"{'qwen35moe' if moe else 'qwen35'}-{n}-mtp" for moe, n in FIXTURES]
BACKENDS = ["torch", "native"]
N_CTX = 128
H = 64
# Float32 weights: only the native float16 KV cache separates the two runtimes (as for GLM's heads).
F32_REL_TOL = 2e-3


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("moe", "n_mtp"), FIXTURES, ids=IDS)
def test_random_heads_are_lossless(moe: bool, n_mtp: int, backend: str) -> None:
    path = tiny_qwen35_gguf_path(moe=moe, n_mtp=n_mtp)
    for sampling in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=7)):
        outs, refs, st = run_vs_plain(path, SPEC, n_predict=16, sampling=sampling, backend=backend)
        assert outs == refs
        assert st["gen_drafts"] > 0 and st["gen_tokens"] >= st["gen_drafts"]
        assert not st["acc_per_pos"] or len(st["acc_per_pos"]) <= (SPEC.n_max if n_mtp == 1 else n_mtp)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("moe", "n_mtp"), FIXTURES, ids=IDS)
def test_constructed_heads_are_accepted(moe: bool, n_mtp: int, backend: str) -> None:
    """tiny_mtp.agreeing_qwen35_gguf: each head computes the target's own next-token function (its delta-net
    blocks pass the residual through, the heads copy its last, gated-attention block), so every greedy
    draft token is accepted up to near-ties of the target's logits (measured: all but 2 of 82 for dense
    with 2 heads, all of them otherwise); every rejection rolls the recurrent target back."""
    target = tiny_mtp.agreeing_qwen35_gguf(moe=moe, n_mtp=n_mtp)
    tok = Tokenizer.from_gguf(GGUFFile(target))
    prompts = [tok.encode(p) for p in (*PROMPTS, "hello world, hello world, and again", "a b c d e f g")]
    outs, refs, st = run_vs_plain(target, SPEC, n_predict=32, prompts=prompts, backend=backend)
    assert outs == refs
    assert st["gen_tokens"] > 60
    assert st["acc_tokens"] >= 0.95 * st["gen_tokens"], st
    assert len(st["acc_per_pos"]) == (SPEC.n_max if n_mtp == 1 else n_mtp)


def test_later_mtp_layers_share_the_first_ones_nextn_tensors() -> None:
    """Qwen3.5 stores mtp.fc / mtp.pre_fc_norm_* / mtp.norm once, with the first MTP block: head 1 reads them
    there; GLM's heads each read their own. An MTP file is recognised by its first MTP block then."""
    q2 = GGUFFile(tiny_qwen35_gguf_path(n_mtp=2))
    assert not q2.has_tensor("blk.5.nextn.eh_proj.weight")
    info = read_mtp_info(q2)
    assert (info.first_block, info.n_heads, info.nextn_blocks) == (4, 2, (4, 4))
    assert [info.block(k) for k in range(2)] == [4, 5]
    assert read_mtp_info(GGUFFile(tiny_mtp.random_mtp_gguf(2))).nextn_blocks == (3, 4)
    assert is_mtp_file(GGUFFile(tiny_qwen35_gguf_path(n_mtp=2, variant="mtp_only")))
    assert is_mtp_file(GGUFFile(tiny_qwen35_gguf_path(moe=True, n_mtp=1, variant="mtp_only")))
    assert not is_mtp_file(GGUFFile(tiny_qwen35_gguf_path(n_mtp=2, variant="no_mtp")))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("moe", "n_mtp"), [(False, 2), (True, 1)], ids=["qwen35-2-mtp", "qwen35moe-1-mtp"])
def test_mtp_only_file_with_md_drafts_what_the_target_file_does(moe: bool, n_mtp: int, backend: str) -> None:
    """-md with the converter's --mtp file (MTP blocks + token_embd, output_norm, output) holds the same heads:
    the same drafts, so the same statistics, as the heads read from the target itself; and it brings
    them to the same target converted without its MTP layers."""
    full = tiny_qwen35_gguf_path(moe=moe, n_mtp=n_mtp)
    draft = tiny_qwen35_gguf_path(moe=moe, n_mtp=n_mtp, variant="mtp_only")
    assert not GGUFFile(draft).has_tensor("blk.0.attn_norm.weight")
    own = run_vs_plain(full, SPEC, n_predict=16, backend=backend)
    md = run_vs_plain(full, SPEC, draft=draft, n_predict=16, backend=backend)
    assert own[0] == own[1] == md[0]
    keys = ("gen_drafts", "gen_tokens", "acc_tokens", "acc_per_pos")
    assert {k: own[2][k] for k in keys} == {k: md[2][k] for k in keys}
    trunk = tiny_qwen35_gguf_path(moe=moe, n_mtp=0, variant="no_mtp")
    outs, refs, st = run_vs_plain(trunk, SPEC, draft=draft, n_predict=16,
                                  sampling=SamplingParams(temperature=0.8, seed=3), backend=backend)
    assert outs == refs and st["gen_drafts"] > 0


def _script(rt: MtpRuntime, n_heads: int) -> list[MtpOut]:
    """Two sequences through every head: a 12-row chunk, then 4 single rows, one head per step."""
    def rows(seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(seed)
        return rng.integers(0, 320, n).astype(np.int32), rng.standard_normal((n, H)).astype(np.float32)

    seqs = [rt.new_seq(), rt.new_seq()]
    chunks = [rows(s, 12) for s in range(2)]
    outs = rt.decode([MtpRows(q, h, *chunks[i], 0) for i, q in enumerate(seqs) for h in range(n_heads)])
    for step in range(4):
        outs += rt.decode([MtpRows(q, step % n_heads, *rows(10 + 2 * step + i, 1), 12 + step)
                           for i, q in enumerate(seqs)])
    return outs


@pytest.mark.parametrize(("moe", "n_mtp"), FIXTURES, ids=IDS)
def test_native_heads_match_the_torch_heads(moe: bool, n_mtp: int) -> None:
    """Random heads and hidden states: the native heads' logits and hout within the float16 KV cache's
    rounding of the torch heads'; Qwen3.5's later heads use the first head's prepared eh_proj."""
    path = tiny_qwen35_gguf_path(moe=moe, n_mtp=n_mtp)
    opts = BackendOptions(n_ctx=N_CTX, n_seq_max=3, threads=1)
    target = NativeBackend(str(path), opts)
    native = load_mtp_runtime("native", target, None, opts)
    torch_rt = load_mtp_runtime("torch", load_backend("torch", str(path), opts), None, opts)
    assert isinstance(native, NativeMtpRuntime)
    for g, w in zip(_script(native, n_mtp), _script(torch_rt, n_mtp), strict=True):
        assert g.logits is not None and w.logits is not None and g.hidden is not None and w.hidden is not None
        assert np.abs(g.logits - w.logits).max() <= F32_REL_TOL * max(1.0, float(np.abs(w.logits).max()))
        assert np.abs(g.hidden - w.hidden).max() <= F32_REL_TOL * max(1.0, float(np.abs(w.hidden).max()))
    cfgs = [nl.ctx_config(c) for c in native.contexts]
    assert all(c.in_proj.data == cfgs[0].in_proj.data for c in cfgs)


@pytest.mark.parametrize("moe", [False, True], ids=["qwen35", "qwen35moe"])
def test_heads_match_transformers(moe: bool) -> None:
    """Both MTP layers of the 2-layer fixture, row by row over random tokens and hidden states, against
    transformers' decoder layer around the shared mtp.fc / pre_fc norms / mtp.norm (qwen35_mtp_reference):
    the torch heads within float32 rounding, the native heads within their float16 KV cache's."""
    import torch
    from qwen35_mtp_reference import qwen35_mtp_forward

    path, hf = tiny_qwen35_gguf_path(moe=moe, n_mtp=2), tiny_qwen35_hf_path(moe=moe, n_mtp=2)
    opts = BackendOptions(n_ctx=N_CTX, n_seq_max=2, threads=1)
    rts = [(load_mtp_runtime("torch", load_backend("torch", str(path), opts), None, opts), 1e-4),
           (load_mtp_runtime("native", NativeBackend(str(path), opts), None, opts), F32_REL_TOL)]
    rng = np.random.default_rng(1)
    tokens, hidden = rng.integers(0, 320, 10).astype(np.int32), rng.standard_normal((10, H)).astype(np.float32)
    for head in (0, 1):
        logits, hout = (x.numpy() for x in qwen35_mtp_forward(hf, head, tokens.tolist(), torch.from_numpy(hidden)))
        for rt, tol in rts:
            seq = rt.new_seq()
            for p in range(len(tokens)):
                out = rt.decode([MtpRows(seq, head, tokens[p:p + 1], hidden[p:p + 1], p)])[0]
                assert out.logits is not None and out.hidden is not None
                assert np.abs(out.logits - logits[p]).max() <= tol * max(1.0, float(np.abs(logits[p]).max()))
                assert np.abs(out.hidden - hout[p]).max() <= tol * max(1.0, float(np.abs(hout[p]).max()))
            rt.free_seq(seq)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mtp_files_of_another_target_are_one_clear_error(backend: str) -> None:
    qwen35, qwen35_md = tiny_qwen35_gguf_path(n_mtp=1), tiny_qwen35_gguf_path(n_mtp=1, variant="mtp_only")
    cases: list[tuple[Path, Path | None, str]] = [
        (tiny_qwen35_gguf_path(n_mtp=0, variant="no_mtp"), None, "qwen35.nextn_predict_layers is absent or 0"),
        (qwen35, tiny_mtp.mtp_only_gguf(1), "holds glm4moe MTP layers, target .* is a qwen35 model"),
        (qwen35, tiny_qwen35_gguf_path(moe=True, n_mtp=1, variant="mtp_only"), "holds qwen35moe MTP layers"),
        (tiny_mtp.random_mtp_gguf(1), qwen35_md, "holds qwen35 MTP layers, target .* is a glm4moe model"),
        (qwen35, tiny_mtp.mismatched_mtp_gguf("vocab", source=qwen35_md), "vocabulary of 256 tokens"),
        (qwen35, tiny_mtp.mismatched_mtp_gguf("hidden", source=qwen35_md), "hidden size 48"),
    ]
    for target_path, draft, needle in cases:
        target = target_backend(target_path, 1, backend)
        with pytest.raises(SpekulaError, match=needle) as info:
            MtpDrafter.create(context(target, SPEC, draft, 1, backend))
        assert str(draft or target_path) in str(info.value)
