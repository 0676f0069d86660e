"""The native backend on Qwen3.5 (qwen35, qwen35moe): against transformers, and its exactness.

transformers' own fp32 forward of the tiny checkpoints is the reference for the float32 files; the
quantized files (every matrix re-encoded as Q8_0 or Q4_0) are checked for the project's exactness
rules: a row's logits and a sequence's recurrent state do not depend on the batch, the chunking or the
thread count, and rolling back a partly rejected draft (checkpoint, forward k rows, truncate to j + 1)
leaves bitwise the state and logits of plain decoding.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import anyio
import numpy as np
import pytest
from backend_helpers import fresh_logits
from backend_helpers import random_tokens as tokens
from hf_greedy import hf_greedy
from toy_backend import GarbageDrafter, RepeatDrafter, make_engine, plain_decode, run_requests

from spekula.backends.native.backend import NativeBackend
from spekula.core.backend import BackendOptions, SeqInput
from spekula.core.errors import ConfigError
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.tokenizer import Tokenizer
from spekula.core.params import CompletionRequest, SamplingParams, SpecParams
from spekula.fixtures.tiny_gguf import OUT_DIR
from spekula.fixtures.tiny_moe_quant import rewrite_gguf
from spekula.fixtures.tiny_qwen35 import tiny_qwen35_gguf_path, tiny_qwen35_hf_path

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# float32 weights: the differences left are the float16 KV cache and summation order (measured <= 7e-4
# on logits of magnitude ~4).
LOGIT_TOL = 5e-3
# name -> (moe, block type of the matrices); f32 files keep the checkpoint's values.
MODELS = {"dense": (False, "F32"), "moe": (True, "F32"), "dense-q8_0": (False, "Q8_0"), "moe-q4_0": (True, "Q4_0")}


def model_path(name: str) -> Path:
    moe, type_name = MODELS[name]
    src = tiny_qwen35_gguf_path(moe=moe, variant="no_mtp")
    if type_name == "F32":
        return src
    dst = OUT_DIR / f"{src.stem}-{type_name.lower()}.gguf"
    if dst.is_file():
        return dst

    def encode(tensor: str, values: np.ndarray) -> tuple[np.ndarray, str]:
        # every matrix of whole 32-value blocks (the shared expert's one-row gate included); the conv
        # kernel (4 taps a row) and the vectors stay float32, as llama-quantize leaves them
        blocks = values.ndim >= 2 and values.shape[-1] % 32 == 0 and "ssm_conv1d" not in tensor
        return values, type_name if blocks else "F32"

    return rewrite_gguf(src, dst, encode)


@cache
def backend(name: str, threads: int = 1) -> NativeBackend:
    return NativeBackend(str(model_path(name)), BackendOptions(n_ctx=256, n_seq_max=4, threads=threads))


@cache
def hf_model(moe: bool) -> object:
    transformers.logging.set_verbosity_error()
    return transformers.AutoModelForCausalLM.from_pretrained(str(tiny_qwen35_hf_path(moe=moe)),
                                                             dtype=torch.float32).eval()


def decode(b: NativeBackend, s: int, first: int, n: int) -> tuple[list[int], np.ndarray]:
    """Greedy decoding of n tokens one row at a time from token `first`: the tokens and their logits."""
    out, rows, tok = [], [], first
    for _ in range(n):
        lg = b.forward([SeqInput(s, np.array([tok], np.int32), b.seq_len(s))])[0].logits[0]
        rows.append(lg)
        tok = int(lg.argmax())
        out.append(tok)
    return out, np.stack(rows)


def states(b: NativeBackend, s: int) -> list[np.ndarray]:
    dn = b.hparams.delta_net
    assert dn is not None
    return [b.recurrent_state(s, i) for i in range(b.info.n_layer) if dn.is_recurrent(i)]


# ---- against transformers ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_logits_match_transformers(name: str) -> None:
    b = backend(name)
    assert b.info.recurrent and b.info.arch == ("qwen35moe" if MODELS[name][0] else "qwen35")
    ids = tokens(60, seed=1)
    with torch.no_grad():
        want = hf_model(MODELS[name][0])(torch.tensor([ids.tolist()])).logits[0].numpy()
    got = fresh_logits(b, ids)
    assert np.abs(got - want).max() < LOGIT_TOL


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_greedy_decoding_matches_transformers(name: str) -> None:
    b, model = backend(name), hf_model(MODELS[name][0])
    prompt = tokens(12, seed=2)
    want = hf_greedy(model, prompt.tolist(), 30)  # transformers' own incremental decoding
    s = b.new_seq()
    try:
        first = int(b.forward([SeqInput(s, prompt, 0)])[0].logits[0].argmax())
        got, _ = decode(b, s, first, 29)
    finally:
        b.free_seq(s)
    assert [first, *got] == want


def test_mtp_blocks_are_not_run_by_the_trunk() -> None:
    with_mtp, without = (NativeBackend(str(tiny_qwen35_gguf_path(n_mtp=1, variant=v)), BackendOptions(n_ctx=64))
                         for v in ("full", "no_mtp"))
    assert with_mtp.info.n_layer == without.info.n_layer == 4
    ids = tokens(20, seed=3)
    assert np.array_equal(fresh_logits(with_mtp, ids), fresh_logits(without, ids))


# ---- exactness -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(MODELS))
def test_batching_and_chunking_are_bitwise_invariant(name: str) -> None:
    b = backend(name)
    seqs = [tokens(n, seed=20 + n) for n in (5, 23, 1)]
    alone = [fresh_logits(b, t) for t in seqs]
    ids = [b.new_seq() for _ in seqs]
    try:
        outs = b.forward([SeqInput(i, t, 0, np.arange(t.size)) for i, t in zip(ids, seqs, strict=True)])
        for o, want in zip(outs, alone, strict=True):
            assert np.array_equal(o.logits, want)
        s, t = ids[1], seqs[1]  # the same prompt in chunks of 8 and 15, then one row at a time
        b.truncate(s, 0)
        got = [b.forward([SeqInput(s, t[a:z], a, np.arange(z - a))])[0].logits for a, z in ((0, 8), (8, 23))]
        assert np.array_equal(np.concatenate(got), alone[1])
        b.truncate(s, 0)
        singles = [b.forward([SeqInput(s, t[i : i + 1], i)])[0].logits[0] for i in range(t.size)]
        assert np.array_equal(np.stack(singles), alone[1])
    finally:
        for i in ids:
            b.free_seq(i)


@pytest.mark.parametrize("name", ["moe", "dense-q8_0"])
def test_thread_count_does_not_change_results(name: str) -> None:
    ids = tokens(33, seed=4)
    one, three = backend(name, 1), backend(name, 3)
    assert np.array_equal(fresh_logits(one, ids), fresh_logits(three, ids))
    s1, s3 = one.new_seq(), three.new_seq()
    try:
        for b, s in ((one, s1), (three, s3)):
            b.forward([SeqInput(s, ids, 0)])
        for a, z in zip(states(one, s1), states(three, s3), strict=True):
            assert np.array_equal(a, z)
    finally:
        one.free_seq(s1)
        three.free_seq(s3)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("kept", [0, 3, 6])  # draft rows kept after the checkpoint (6: all of them)
def test_rollback_after_a_partly_rejected_draft_is_exact(name: str, kept: int) -> None:
    """checkpoint, forward x + 5 draft rows, truncate to the checkpoint + kept: the recurrent and conv
    states, the next logits and a longer continuation equal plain decoding's, bit for bit."""
    b = backend(name)
    prompt, draft = tokens(17, seed=5), tokens(6, seed=6)
    plain, spec = b.new_seq(), b.new_seq()
    try:
        b.forward([SeqInput(plain, np.concatenate([prompt, draft[:kept]]), 0)])
        b.forward([SeqInput(spec, prompt, 0)])
        b.checkpoint(spec)
        b.forward([SeqInput(spec, draft, prompt.size, np.arange(draft.size))])
        n = prompt.size + kept
        assert b.restorable(spec, n) == n
        b.truncate(spec, n)
        assert b.seq_len(spec) == n
        for a, z in zip(states(b, spec), states(b, plain), strict=True):
            assert np.array_equal(a, z)
        nxt = tokens(1, seed=7)
        got_toks, got = decode(b, spec, int(nxt[0]), 12)
        want_toks, want = decode(b, plain, int(nxt[0]), 12)
        assert got_toks == want_toks and np.array_equal(got, want)
        # a second round: the new checkpoint, rows verified, all rejected but x
        b.checkpoint(spec)
        b.forward([SeqInput(spec, draft, b.seq_len(spec), np.arange(draft.size))])
        b.truncate(spec, b.seq_len(plain) + 1)
        b.forward([SeqInput(plain, draft[:1], b.seq_len(plain))])
        for a, z in zip(states(b, spec), states(b, plain), strict=True):
            assert np.array_equal(a, z)
    finally:
        b.free_seq(plain)
        b.free_seq(spec)


@pytest.mark.parametrize("name", ["dense", "moe-q4_0"])
def test_rows_a_truncate_leaves_pending_run_in_the_next_forward_exactly(name: str) -> None:
    """A truncate back into the rows after a checkpoint runs nothing: the next forward runs those rows
    first. Over rounds that move the checkpoint (taken while rows are pending), keep an older one, share
    a batch with another sequence and snapshot while rows are pending, every logit row and the final
    states equal plain decoding's, bit for bit."""
    b = backend(name)
    ids, other_ids = tokens(48, seed=11), tokens(40, seed=12)
    want, other_want = fresh_logits(b, ids), fresh_logits(b, other_ids)
    spec, other, plain = b.new_seq(), b.new_seq(), b.new_seq()
    try:
        b.forward([SeqInput(spec, ids[:10], 0)])
        n, m = 10, 0
        # (draft rows, rows kept, checkpoint first, snapshot after the truncate, the other sequence's rows)
        rounds = [(6, 2, True, False, 4), (5, 0, True, False, 0), (4, 3, False, True, 3), (7, 6, True, False, 5),
                  (3, 1, True, False, 2), (2, 2, True, False, 1)]
        for k, kept, checkpoint, snapshot, mo in rounds:
            if checkpoint:
                b.checkpoint(spec)
            batch = [SeqInput(spec, ids[n : n + k], n, np.arange(k))]
            if mo:
                batch.append(SeqInput(other, other_ids[m : m + mo], m, np.arange(mo)))
            outs = b.forward(batch)
            assert np.array_equal(outs[0].logits, want[n : n + k])
            if mo:
                assert np.array_equal(outs[1].logits, other_want[m : m + mo])
            n, m = n + kept, m + mo
            b.truncate(spec, n)
            assert b.seq_len(spec) == n and b.restorable(spec, n) == n
            if snapshot:
                b.snapshot(spec)
                snap = n
        b.forward([SeqInput(plain, ids[:n], 0)])
        for a, z in zip(states(b, spec), states(b, plain), strict=True):
            assert np.array_equal(a, z)
        b.truncate(spec, snap)
        b.truncate(plain, 0)
        b.forward([SeqInput(plain, ids[:snap], 0)])
        for a, z in zip(states(b, spec), states(b, plain), strict=True):
            assert np.array_equal(a, z)
    finally:
        for s in (spec, other, plain):
            b.free_seq(s)


def test_restorable_snapshots_and_refusals() -> None:
    b = backend("dense-q8_0")
    ids = tokens(40, seed=8)
    s, ref = b.new_seq(), b.new_seq()
    try:
        b.forward([SeqInput(s, ids[:10], 0)])
        b.snapshot(s)
        b.forward([SeqInput(s, ids[10:20], 10)])
        b.checkpoint(s)
        b.forward([SeqInput(s, ids[20:30], 20)])
        assert [b.restorable(s, n) for n in (40, 30, 25, 20, 19, 12, 10, 9, 0)] == [30, 30, 25, 20, 10, 10, 10, 0, 0]
        with pytest.raises(ConfigError, match="truncate to 15: .*cannot go back there"):
            b.truncate(s, 15)
        b.truncate(s, 10)  # the snapshot
        b.forward([SeqInput(ref, ids[:10], 0)])
        for a, z in zip(states(b, s), states(b, ref), strict=True):
            assert np.array_equal(a, z)
        assert b.restorable(s, 9) == 0  # the checkpoint lay beyond 10
        # a forward past the checkpoint's log capacity drops it; the snapshot at 10 stays
        b.checkpoint(s)
        b.forward([SeqInput(s, tokens(65, seed=9), 10)])
        assert b.restorable(s, 20) == 10
        # rewriting positions a snapshot covers drops it
        b.truncate(s, 0)
        b.forward([SeqInput(s, ids[:4], 0)])
        assert (b.restorable(s, 3), b.restorable(s, 4)) == (0, 4)
        b.forward([SeqInput(s, ids[4:12], 4)])
        assert b.restorable(s, 11) == 0
        with pytest.raises(ConfigError):  # a forward from an earlier position goes back there first
            b.forward([SeqInput(s, ids[2:4], 2)])
    finally:
        b.free_seq(s)
        b.free_seq(ref)


@pytest.mark.parametrize("name", ["dense", "moe-q4_0"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_speculative_decoding_through_the_engine_is_lossless(name: str, temperature: float) -> None:
    """The engine's checkpoints, truncations and prompt snapshots over the native recurrent state: two
    slots, drafts that are partly or wholly rejected, a second turn of each prompt reusing its slot."""
    path = str(model_path(name))
    tok = Tokenizer.from_gguf(GGUFFile(path))
    b = NativeBackend(path, BackendOptions(n_ctx=128, n_seq_max=2, threads=2))
    spec = SpecParams(types=("ngram-simple", "test-repeat", "test-garbage"),
                      drafter_options={"spec-ngram-simple-size-n": 2, "spec-ngram-simple-size-m": 5})
    engine = make_engine(b, tok, n_slots=2, n_ctx=128, n_batch=32, spec=spec,
                         drafters=[RepeatDrafter(), GarbageDrafter(b.info.n_vocab, n_max=3)])
    sampling = SamplingParams(temperature=temperature, seed=11)
    prompts = [tokens(9, seed=12).tolist() * 3, tokens(5, seed=13).tolist() * 2]
    reqs = [CompletionRequest(p, n_predict=20, sampling=sampling, ignore_eos=True) for p in prompts + prompts]
    finals = anyio.run(run_requests, engine, reqs, 120.0)
    ref = backend(name)
    for req, final in zip(reqs, finals, strict=True):
        assert final.error is None
        want = plain_decode(ref, req.prompt, n_predict=20, sampling=sampling, seed=11, is_eog=tok.is_eog, n_ctx=128,
                            ignore_eos=True)
        assert final.tokens == want
    assert sum(f.timings.get("draft_n", 0) for f in finals) > 0  # drafts were verified and rolled back
