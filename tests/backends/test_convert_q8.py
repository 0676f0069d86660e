"""`spekula convert --outtype q8_0`: matrices as Q8_0 blocks, read back by every loader.

Rows that do not split into 32-value blocks fall back to F16 (llama.cpp's converter rule); vectors stay
F32. A q8_0 EAGLE-3 head drafts within rounding of its f32 conversion, a q8_0 DSpark head (whose
Markov tables have 8-wide rows) runs losslessly in the engine, and a q8_0 target loads on the native
and torch backends with logits close to its f32 conversion's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from model_drafter_helpers import build_target, engine_vs_plain, target_backend

from spekula.backends.convert.hf import convert
from spekula.core.backend import BackendOptions, Capture, SeqInput, load_backend
from spekula.core.drafting.draft_models import Eagle3Rows, Eagle3Runtime
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.params import SpecParams
from spekula.drafters.model.dspark import DSparkDrafter
from spekula.drafters.model.runtimes import load_draft_runtime
from spekula.fixtures import tiny_hf

PROMPT = np.array([5, 17, 200, 33, 99, 120, 7, 8], dtype=np.int32)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("q8")
    hf, target = build_target(root)
    e3 = tiny_hf.write_eagle3(root / "e3-hf", layer_ids=(1, 4, 8))
    dspark = tiny_hf.write_dflash(root / "dspark-hf", layer_ids=(1, 6), markov_rank=8)
    return {
        "hf": hf, "target": target,
        "target-q8": convert(hf, root / "target-q8.gguf", outtype="q8_0")[1],
        "e3": convert(e3, root / "e3.gguf", outtype="f32", target_dir=hf)[1],
        "e3-q8": convert(e3, root / "e3-q8.gguf", outtype="q8_0", target_dir=hf)[1],
        "dspark-q8": convert(dspark, root / "dspark-q8.gguf", outtype="q8_0", target_gguf=target)[1],
    }


def _types(path: Path) -> dict[str, str]:
    return {t.name: t.type_name for t in GGUFFile(path).tensors()}


def test_tensor_types_follow_the_q8_0_rule(models: dict[str, Path]) -> None:
    for key in ("target-q8", "e3-q8", "dspark-q8"):
        f = GGUFFile(models[key])
        assert f.get("general.file_type") == 7, key  # MOSTLY_Q8_0
        for t in f.tensors():
            if t.name == "d2t":
                want = "I64"
            elif len(t.shape) == 1 or t.name == "conf_proj.weight":  # vectors; the confidence head is kept exact
                want = "F32"
            else:
                want = "Q8_0" if t.shape[-1] % 32 == 0 else "F16"
            assert t.type_name == want, (key, t.name, t.shape)
    assert _types(models["dspark-q8"])["markov_w1.weight"] == "F16"  # [320, 8]: no whole block in a row
    assert models["target-q8"].stat().st_size < 0.3 * models["target"].stat().st_size


def _eagle3_logits(draft: Path, target: Path) -> np.ndarray:
    runtime = load_draft_runtime("torch", str(draft), target_backend(target).info)
    assert isinstance(runtime, Eagle3Runtime)
    features = np.random.default_rng(0).standard_normal((6, 3 * tiny_hf.HIDDEN)).astype(np.float32)
    seq = runtime.new_seq()
    g = runtime.encode(features)
    out = runtime.decode([Eagle3Rows(seq, PROMPT[1:7], g, 0)])[0]
    assert out.logits is not None
    return out.logits


def test_q8_0_eagle3_logits_match_the_f32_conversion(models: dict[str, Path]) -> None:
    want, got = _eagle3_logits(models["e3"], models["target"]), _eagle3_logits(models["e3-q8"], models["target"])
    drafted = np.isfinite(want)
    assert (np.isfinite(got) == drafted).all()  # the same draft vocabulary
    assert np.abs(got[drafted] - want[drafted]).max() < 0.03 * np.abs(want[drafted]).max()
    assert (got.argmax(1) == want.argmax(1)).all()


def test_q8_0_dspark_with_f16_rows_is_lossless(models: dict[str, Path]) -> None:
    spec = SpecParams(types=("draft-dspark",), n_max=3, adaptive=False)
    outs, refs, stats = engine_vs_plain(models["target"], models["dspark-q8"], DSparkDrafter.create, spec, n_predict=12)
    assert outs == refs and stats["gen_drafts"] > 0


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_q8_0_target_loads(models: dict[str, Path], backend: str) -> None:
    logits = []
    for key in ("target", "target-q8"):
        b = load_backend(backend, str(models[key]), BackendOptions(n_ctx=64, n_seq_max=1))
        logits.append(b.forward([SeqInput(b.new_seq(), PROMPT, 0)], Capture())[0].logits)
    want, got = logits
    assert got.shape == want.shape
    assert np.abs(got - want).max() < 0.1 * np.abs(want).max()
