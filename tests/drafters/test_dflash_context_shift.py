"""draft-dflash and draft-dspark under a context shift (a server's --context-shift, issue #49).

* The DFlash runtimes' `shift` (native kernels and torch, NEOX rope pairs): the injected context's keys and
  values depend only on (features, position), so after a shift a block drafted over it must equal one
  drafted over a fresh sequence with the kept rows injected at their new positions (float16 caches on
  native, float32 on torch).
* Through the engine, with oracle heads over a target that repeats its last token (DFlash, and DSpark
  with its Markov head): the output equals plain decoding with the same shifts, on native and torch, and
  every drafted token is still accepted after many shifts.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from model_drafter_helpers import generate_across_shifts, head_runtime, random_draft_gguf

from spekula.backends.convert.hf import convert
from spekula.core.drafting.draft_models import DFlashBlock
from spekula.fixtures import tiny_hf
from spekula.fixtures.tiny_gguf import tiny_model_path

pytest.importorskip("torch")

TOL = {"torch": 1e-4, "native": 0.05}


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize(("n_keep", "n_discard"), [(4, 6), (0, 9), (3, 0)])
def test_dflash_runtime_shift_equals_the_kept_rows_at_their_new_positions(tmp_path: Path, backend: str, n_keep: int,
                                                                          n_discard: int) -> None:
    target = tiny_model_path("llama", n_layer=2, weight_type="F32")
    path = random_draft_gguf(tmp_path / "dflash.gguf", "dflash", target, weight_type="F32", target_layers=[0, 1])
    rt = head_runtime(backend, path, target, 64)
    rng = np.random.default_rng(7)
    n = 20
    feats = rng.standard_normal((n, 2 * rt.info.target_hidden)).astype(np.float32)
    kept = np.r_[0:n_keep, n_keep + n_discard:n]
    shifted, fresh = rt.new_seq(), rt.new_seq()
    rt.inject(shifted, feats, 0)
    rt.shift(shifted, n_keep, n_discard)
    assert rt.seq_len(shifted) == n - n_discard
    rt.inject(fresh, feats[kept], 0)
    block = np.array([11] + [rt.info.mask_token_id] * 4, dtype=np.int32)
    got, want = rt.draft_blocks([DFlashBlock(shifted, block, n - n_discard), DFlashBlock(fresh, block, n - n_discard)])
    a, b = np.asarray(got.logits, np.float64), np.asarray(want.logits, np.float64)
    finite = np.isfinite(b)
    assert np.array_equal(finite, np.isfinite(a))
    assert np.abs(a[finite] - b[finite]).max() <= TOL[backend]


@pytest.fixture(scope="module")
def oracles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dflash-oracle")
    target_hf = tiny_hf.write_bigram_target(root / "rep", identity=True)
    out = {"target": root / "rep.gguf", "draft-dflash": root / "dflash.gguf", "draft-dspark": root / "dspark.gguf"}
    convert(target_hf, out["target"], outtype="f32")
    convert(tiny_hf.write_dflash_oracle(root / "o-dflash"), out["draft-dflash"], outtype="f32", target_dir=target_hf)
    convert(tiny_hf.write_dflash_oracle(root / "o-dspark", markov_rank=4), out["draft-dspark"], outtype="f32",
            target_dir=target_hf)
    return out


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("spec_type", ["draft-dflash", "draft-dspark"])
@pytest.mark.parametrize(("n_keep", "n_discard"), [(-1, 0), (2, 7)])
def test_an_agreeing_head_keeps_being_accepted_across_shifts(oracles: dict[str, Path], backend: str, spec_type: str,
                                                             n_keep: int, n_discard: int) -> None:
    target = oracles["target"]
    n_predict = 120
    plain, _ = generate_across_shifts(backend, target, None, n_max=3, n_keep=n_keep, n_discard=n_discard)
    spec, st = generate_across_shifts(backend, target, spec_type, n_max=3, n_keep=n_keep, n_discard=n_discard,
                                      draft=oracles[spec_type])
    assert spec == plain and len(spec) == n_predict
    assert st is not None
    assert int(st["gen_tokens"]) > n_predict // 2  # type: ignore[call-overload]
    assert st["acc_tokens"] == st["gen_tokens"]
