"""The torch backend on Qwen3.5 (dense ``qwen35`` and MoE ``qwen35moe``): against transformers' own fp32
forward and greedy decoding of the same checkpoint, the recurrent state after a rollback bit for bit, and
the backends that do not run hybrid models refusing them by name.

The conformance suite (tests/backend_conformance.py, HYBRID_CHECKS) checks the contract through logits;
here the state itself is compared.
"""

from __future__ import annotations

import warnings
from functools import cache
from typing import Any

import numpy as np
import pytest

from spekula.backends.torch.backend import TorchBackend
from spekula.core.backend import BackendOptions, SeqInput
from spekula.core.errors import ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.tokenizer import Tokenizer
from spekula.fixtures.tiny_qwen35 import tiny_qwen35_gguf_path, tiny_qwen35_hf_path

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LOGIT_TOL = 1e-3  # as tests/backends/test_vs_transformers.py
PROMPTS = ("The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,")


@cache
def hf_model(moe: bool) -> Any:
    transformers.logging.set_verbosity_error()
    cls = transformers.Qwen3_5MoeForCausalLM if moe else transformers.Qwen3_5ForCausalLM
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = cls.from_pretrained(str(tiny_qwen35_hf_path(moe=moe)), dtype=torch.float32)
    return model.eval()


@cache
def ours(moe: bool, n_mtp: int = 0, variant: str = "full") -> TorchBackend:
    path = tiny_qwen35_gguf_path(moe=moe, n_mtp=n_mtp, variant=variant)  # type: ignore[arg-type]
    return TorchBackend(str(path), BackendOptions(n_ctx=512, n_seq_max=4, threads=1))


def our_logits(b: TorchBackend, ids: list[int]) -> np.ndarray:
    s = b.new_seq()
    try:
        return b.forward([SeqInput(s, np.array(ids, np.int32), 0, np.arange(len(ids)))])[0].logits
    finally:
        b.free_seq(s)


def hf_logits(moe: bool, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf_model(moe)(torch.tensor([ids])).logits[0].float().numpy()


def prompt_ids(moe: bool) -> list[list[int]]:
    tok = Tokenizer.from_gguf(GGUFFile(str(tiny_qwen35_gguf_path(moe=moe))))
    rng = np.random.default_rng(0)
    # the prompts, then positions well past them over every token id
    return [tok.encode(p) for p in PROMPTS] + [rng.integers(0, ours(moe).info.n_vocab, 100).tolist()]


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_logits_match_transformers(moe: bool) -> None:
    b = ours(moe)
    assert b.info.recurrent and b.info.arch == ("qwen35moe" if moe else "qwen35")
    for ids in prompt_ids(moe):
        got, want = our_logits(b, ids), hf_logits(moe, ids)
        assert got.shape == want.shape
        assert np.abs(got - want).max() < LOGIT_TOL, ids[:8]


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_mtp_blocks_are_ignored_by_the_trunk(moe: bool) -> None:
    ids = prompt_ids(moe)[0]
    with_mtp, without = ours(moe, 1), ours(moe, 1, "no_mtp")
    assert with_mtp.hparams.n_nextn == 1 and without.hparams.n_nextn == 0
    assert np.array_equal(our_logits(with_mtp, ids), our_logits(without, ids))


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_greedy_decoding_matches_transformers_generate(moe: bool) -> None:
    b, model = ours(moe), hf_model(moe)
    n_new = 24
    for ids in prompt_ids(moe)[:3]:
        with torch.no_grad():
            # min_new_tokens would mask EOS out; a huge eos id is never produced, so generate runs n_new steps
            out = model.generate(torch.tensor([ids]), max_new_tokens=n_new, do_sample=False,
                                 eos_token_id=10**9, pad_token_id=0)
        want = out[0, len(ids) :].tolist()
        s = b.new_seq()
        try:
            logits = b.forward([SeqInput(s, np.array(ids, np.int32), 0)])[0].logits[0]
            got = [int(logits.argmax())]
            while len(got) < n_new:
                logits = b.forward([SeqInput(s, np.array(got[-1:], np.int32), b.seq_len(s))])[0].logits[0]
                got.append(int(logits.argmax()))
        finally:
            b.free_seq(s)
        assert got == want, ids


def _state(b: TorchBackend, s: int) -> tuple[np.ndarray, np.ndarray]:
    rec = b.kv.get(s).rec
    assert rec is not None
    return rec.ssm.cpu().numpy().copy(), rec.conv.cpu().numpy().copy()


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_state_after_rollback_equals_plain_decoding(moe: bool) -> None:
    """checkpoint, a verification forward of k rows, truncate to j+1: the delta-rule and conv states are
    plain decoding's, bit for bit, and so are the next logits."""
    b = ours(moe)
    rng = np.random.default_rng(7)
    prompt, cont = rng.integers(0, 320, 11).astype(np.int32), rng.integers(0, 320, 8).astype(np.int32)
    L, k = prompt.size, 5
    s = b.new_seq()
    try:
        b.forward([SeqInput(s, prompt, 0)])
        plain_states, plain_next = [], []
        for i in range(k + 1):
            plain_states.append(_state(b, s))
            plain_next.append(b.forward([SeqInput(s, cont[i : i + 1], L + i)])[0].logits[0])
        for j in range(k):
            b.truncate(s, 0)
            b.forward([SeqInput(s, prompt, 0)])
            b.checkpoint(s)
            draft = np.concatenate([cont[: j + 1], rng.integers(0, 320, k - j - 1).astype(np.int32)])
            b.forward([SeqInput(s, draft, L, np.arange(k))])
            b.truncate(s, L + j + 1)
            ssm, conv = _state(b, s)
            want_ssm, want_conv = plain_states[j + 1]
            assert np.array_equal(ssm, want_ssm) and np.array_equal(conv, want_conv), f"state after keeping {j + 1}"
            nxt = b.forward([SeqInput(s, cont[j + 1 : j + 2], L + j + 1)])[0].logits[0]
            assert np.array_equal(nxt, plain_next[j + 1]), f"next logits after keeping {j + 1}"
    finally:
        b.free_seq(s)


def test_checkpoint_is_dropped_past_its_row_log() -> None:
    from spekula.backends.torch.recurrent import LOG_ROWS

    b = ours(False)
    s = b.new_seq()
    try:
        b.forward([SeqInput(s, np.arange(5, dtype=np.int32), 0)])
        b.checkpoint(s)
        b.forward([SeqInput(s, np.arange(LOG_ROWS + 1, dtype=np.int32) % 300, 5)])
        assert b.restorable(s, 6) == 0  # too many rows to replay: only 0 and the current length remain
        assert b.restorable(s, 5 + LOG_ROWS + 1) == 5 + LOG_ROWS + 1
    finally:
        b.free_seq(s)


def test_runtimes_without_the_hybrid_operations_refuse_by_name() -> None:
    from spekula.backends.onnx.export import open_model

    with pytest.raises(ModelFileError, match="the onnx backend does not implement: gated attention output, "
                                             "gated delta-net blocks"):
        open_model(tiny_qwen35_gguf_path())


def test_fixed_shape_path_keeps_rollback_and_batches_exact() -> None:
    """CUDA's exact mode (every GEMM on a full tile), run on the CPU: chunked, batched and rolled-back
    rows are still bitwise the plain ones."""
    from unittest import mock

    with mock.patch("spekula.backends.torch.backend.FIXED_SHAPE_DEVICES", {"cpu", "cuda"}):
        b = TorchBackend(str(tiny_qwen35_gguf_path(moe=True)), BackendOptions(n_ctx=256, n_seq_max=4, threads=1))
    tokens = np.random.default_rng(3).integers(0, 320, 30).astype(np.int32)
    want = our_logits(b, tokens.tolist())
    a, c = b.new_seq(), b.new_seq()
    try:
        b.forward([SeqInput(a, tokens[:20], 0, np.array([], np.int64))])
        b.checkpoint(a)
        b.forward([SeqInput(a, tokens[20:25], 20, np.array([], np.int64))])
        b.truncate(a, 22)
        outs = b.forward([SeqInput(a, tokens[22:30], 22, np.arange(8)), SeqInput(c, tokens, 0, np.arange(30))])
        assert np.array_equal(outs[0].logits, want[22:30]) and np.array_equal(outs[1].logits, want)
    finally:
        b.free_seq(a)
        b.free_seq(c)
