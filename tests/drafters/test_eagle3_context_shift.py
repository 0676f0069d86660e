"""draft-eagle3 under a context shift (a server's --context-shift, issue #49).

* The head runtimes' `shift` (native kernels and torch): the head's one layer keeps keys and values
  that depend only on (token, g, position), so after a shift its cache must equal a fresh sequence
  holding the kept rows at their new positions: the next row's logits are compared (float16 cache on
  native, rotated from its stored keys and rounded again; float32 on torch). On torch the same
  comparison with the kept rows left at their old rotation fails, so the check sees the re-rope (the
  native kernel is the target's own, checked so in tests/backends/test_context_shift.py).
* Through the engine: a head built to agree with its target (the bigram oracle) keeps having every
  drafted token accepted while the context shifts many times, and the output is plain decoding's with
  the same shifts, on native and torch; its cache is not garbage after a shift.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from model_drafter_helpers import generate_across_shifts, head_runtime, random_draft_gguf

from spekula.backends.convert.hf import convert
from spekula.core.backend import BackendOptions, load_backend
from spekula.core.drafting.draft_models import Eagle3Rows
from spekula.core.params import SpecParams
from spekula.fixtures import tiny_hf
from spekula.fixtures.tiny_gguf import tiny_model_path

pytest.importorskip("torch")

TOL = {"torch": 1e-4, "native": 0.05}


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    target = tiny_model_path("llama", n_layer=2, weight_type="F32")
    path = random_draft_gguf(tmp_path_factory.mktemp("e3shift") / "head.gguf", "eagle3", target, weight_type="F32",
                             target_layers=[0, 1, 1])
    return target, path


def _next_logits(runtime: object, seq: int, tokens: np.ndarray, g: np.ndarray, start: int) -> np.ndarray:
    [out] = runtime.decode([Eagle3Rows(seq, tokens, g, start)])  # type: ignore[attr-defined]
    assert out.logits is not None
    return np.asarray(out.logits[-1], dtype=np.float64)


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize(("n_keep", "n_discard"), [(4, 6), (0, 9), (1, 1), (7, 0)])
def test_head_runtime_shift_equals_the_kept_rows_at_their_new_positions(head: tuple[Path, Path], backend: str,
                                                                        n_keep: int, n_discard: int) -> None:
    target, path = head
    rt = head_runtime(backend, path, target, 64)
    rng = np.random.default_rng(3)
    n, H = 20, rt.info.n_embd
    tokens = rng.integers(3, rt.info.n_vocab, n + 1).astype(np.int32)
    g = rng.standard_normal((n + 1, H)).astype(np.float32)
    shifted, fresh = rt.new_seq(), rt.new_seq()
    rt.decode([Eagle3Rows(shifted, tokens[:n], g[:n], 0, False)])
    rt.shift(shifted, n_keep, n_discard)
    assert rt.seq_len(shifted) == n - n_discard
    kept = np.r_[0:n_keep, n_keep + n_discard:n]
    rt.decode([Eagle3Rows(fresh, tokens[kept], g[kept], 0, False)])
    pos = n - n_discard
    got = _next_logits(rt, shifted, tokens[n:], g[n:], pos)
    want = _next_logits(rt, fresh, tokens[n:], g[n:], pos)
    finite = np.isfinite(want)
    assert np.array_equal(finite, np.isfinite(got))
    assert np.abs(got[finite] - want[finite]).max() <= TOL[backend]
    if backend == "torch" and n_discard and n - n_keep - n_discard > 2:
        stale = rt.new_seq()  # the moved rows left at their old rotation: visibly off
        rt.decode([Eagle3Rows(stale, tokens[:n], g[:n], 0, False)])
        rt.kv.shift(stale, n_keep, n_discard, lambda k: k)
        bad = _next_logits(rt, stale, tokens[n:], g[n:], pos)
        assert np.abs(bad[finite] - want[finite]).max() > 100 * TOL[backend]


@pytest.fixture(scope="module")
def oracle(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("e3oracle")
    target_hf = tiny_hf.write_bigram_target(root / "bigram")
    f, _ = tiny_hf.bigram_map(target_hf)
    target = root / "bigram.gguf"
    convert(target_hf, target, outtype="f32")
    draft = root / "oracle.gguf"
    convert(tiny_hf.write_eagle3_oracle(root / "oracle", f), draft, outtype="f32", target_dir=target_hf)
    return target, draft


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize(("n_keep", "n_discard"), [(-1, 0), (2, 7)])
def test_an_agreeing_head_keeps_being_accepted_across_shifts(oracle: tuple[Path, Path], backend: str, n_keep: int,
                                                             n_discard: int) -> None:
    target, draft = oracle
    n_predict = 120
    plain, _ = generate_across_shifts(backend, target, None, n_max=4, n_keep=n_keep, n_discard=n_discard)
    spec, st = generate_across_shifts(backend, target, "draft-eagle3", n_max=4, n_keep=n_keep, n_discard=n_discard,
                                      draft=draft)
    assert spec == plain and len(spec) == n_predict
    assert st is not None
    # n_predict is several contexts long: most drafts come after a shift, and all of them are accepted.
    assert int(st["gen_tokens"]) > n_predict // 2  # type: ignore[call-overload]
    assert st["acc_tokens"] == st["gen_tokens"]


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_the_drafter_moves_its_cache_and_pending_row_with_the_shift(head: tuple[Path, Path], backend: str) -> None:
    """After observe (rows queued, not yet decoded) a shift leaves the head's cache holding the kept rows
    (decoded, then moved) and its pending row at its new position, so the shifted history drafts at once."""
    from model_drafter_helpers import drafter_context

    from spekula.core.backend import SeqInput
    from spekula.core.drafting.drafter import DraftRequest
    from spekula.drafters.model.eagle3 import Eagle3Drafter

    target_path, path = head
    spec = SpecParams(types=("draft-eagle3",), n_max=3, adaptive=False)
    target = load_backend(backend, str(target_path), BackendOptions(n_ctx=64, n_seq_max=2, threads=1))
    d = Eagle3Drafter.create(drafter_context(target, path, spec, backend))
    history = np.arange(5, 25, dtype=np.int32)
    inp = SeqInput(target.new_seq(), history, 0)
    d.observe(0, inp, target.forward([inp], d.capture())[0])
    d.begin(0, history)
    st = d._slots.get(0)
    assert st.queued == len(history) - 1 and st.pending_pos == len(history) - 1
    d.shifted(0, 4, 6)
    assert st.queued == 0 and d.runtime.seq_len(st.seq) == len(history) - 1 - 6
    assert st.pending_pos == len(history) - 1 - 6
    kept = np.r_[history[:4], history[10:]]
    [draft] = d.draft([DraftRequest(0, kept, 42, 3, spec, 0.0, 0)])
    assert len(draft.tokens) == 3
    assert d.runtime.seq_len(st.seq) == len(kept) - 1  # the draft's own rows are dropped again
