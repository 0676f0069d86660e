"""draft-mtp under a context shift (a server's --context-shift, issue #49).

* The MTP runtimes' `shift` (native kernels and torch), every head's cache at once: a head's cache rows
  depend only on (token, h, position), so after a shift the next row's logits must equal those of a fresh
  sequence holding the kept rows at their new positions (float16 caches on native, float32 on torch).
* Through the engine, on a GLM-MoE whose head computes what the target's last block computes (so its
  cache must be the target's own, shifted the same way, for its drafts to agree): the output equals plain
  decoding with the same shifts, on native and torch, and drafts keep being accepted across many shifts.
"""

from __future__ import annotations

import numpy as np
import pytest
from model_drafter_helpers import generate_across_shifts

from spekula.core.backend import BackendOptions, load_backend
from spekula.core.drafting.mtp_runtime import MtpRows
from spekula.drafters.model.runtimes import load_mtp_runtime
from spekula.fixtures import tiny_mtp

pytest.importorskip("torch")

TOL = {"torch": 1e-3, "native": 0.05}


def _last_logits(rt: object, seq: int, head: int, tokens: np.ndarray, h: np.ndarray, start: int) -> np.ndarray:
    [out] = rt.decode([MtpRows(seq, head, tokens, h, start)])  # type: ignore[attr-defined]
    assert out.logits is not None
    return np.asarray(out.logits, dtype=np.float64)


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize(("n_keep", "n_discard"), [(4, 6), (0, 9), (3, 0)])
def test_mtp_runtime_shift_equals_the_kept_rows_at_their_new_positions(backend: str, n_keep: int,
                                                                       n_discard: int) -> None:
    path = tiny_mtp.random_mtp_gguf(2)
    options = BackendOptions(n_ctx=64, n_seq_max=3, threads=1, dtype="f32" if backend == "torch" else "auto")
    target = load_backend(backend, str(path), options)
    rt = load_mtp_runtime(backend, target, None, options)
    rng = np.random.default_rng(5)
    n, H = 20, rt.info.n_embd
    tokens = rng.integers(3, rt.info.n_vocab, n + 1).astype(np.int32)
    h = rng.standard_normal((n + 1, H)).astype(np.float32)
    kept = np.r_[0:n_keep, n_keep + n_discard:n]
    shifted, fresh = rt.new_seq(), rt.new_seq()
    heads = range(rt.info.n_heads)
    rt.decode([MtpRows(shifted, k, tokens[:n], h[:n], 0, want_last=False) for k in heads])
    rt.shift(shifted, n_keep, n_discard)
    assert rt.seq_len(shifted) == n - n_discard
    rt.decode([MtpRows(fresh, k, tokens[kept], h[kept], 0, want_last=False) for k in heads])
    for k in heads:
        got = _last_logits(rt, shifted, k, tokens[n:], h[n:], n - n_discard)
        want = _last_logits(rt, fresh, k, tokens[n:], h[n:], n - n_discard)
        assert np.abs(got - want).max() <= TOL[backend], k


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize(("n_keep", "n_discard"), [(-1, 0), (2, 7)])
def test_an_agreeing_head_keeps_being_accepted_across_shifts(backend: str, n_keep: int, n_discard: int) -> None:
    target = tiny_mtp.agreeing_mtp_gguf()
    n_predict = 120
    plain, _ = generate_across_shifts(backend, target, None, n_max=1, n_keep=n_keep, n_discard=n_discard)
    spec, st = generate_across_shifts(backend, target, "draft-mtp", n_max=1, n_keep=n_keep, n_discard=n_discard)
    assert spec == plain and len(spec) == n_predict
    assert st is not None
    # n_predict is several contexts long: most drafts come after a shift, and (near ties aside) all agree.
    assert int(st["gen_tokens"]) > n_predict // 3  # type: ignore[call-overload]
    assert int(st["acc_tokens"]) >= 0.9 * int(st["gen_tokens"])  # type: ignore[call-overload]
