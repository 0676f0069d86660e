"""A DFlash head's own output head cut from the target's: the same logits for its ids, errors for misuse."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from model_drafter_helpers import engine_vs_plain, head_runtime

from spekula.backends.convert.hf import convert
from spekula.core.drafting.draft_models import DFlashBlock
from spekula.core.errors import ConfigError, ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.params import SpecParams
from spekula.drafters.model.dflash import DFlashDrafter
from spekula.fixtures import tiny_hf
from spekula.training.head_vocabulary import main, vocabulary_of, with_draft_vocabulary

IDS = np.array([3, 4, 9, 17, 33, 99, 120, 200, 201, 255], dtype=np.int64)
FEATURES_SEED = 4


@pytest.fixture(scope="module", params=["f32", "q8_0"])
def files(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny llama target (its head stored as `param`), a DFlash head borrowing it, and the head cut to IDS."""
    root = tmp_path_factory.mktemp(f"head-vocab-{request.param}")
    hf = tiny_hf.write_target(root / "target", "llama", n_layer=8)
    target = root / "target.gguf"
    convert(hf, target, outtype=request.param)
    head = root / "dflash.gguf"
    convert(tiny_hf.write_dflash(root / "df-hf", layer_ids=(1, 6), block_size=4), head, outtype="f32", target_dir=hf)
    cut = with_draft_vocabulary(head, target, IDS, root / "dflash-cut.gguf")
    return {"target": target, "head": head, "cut": cut}


def _block_logits(head: Path, target: Path) -> tuple[np.ndarray, np.ndarray | None]:
    runtime = head_runtime("native", head, target, 64)
    n_in = len(runtime.info.target_layers) * runtime.info.target_hidden
    features = np.random.default_rng(FEATURES_SEED).standard_normal((9, n_in)).astype(np.float32)
    seq = runtime.new_seq()
    runtime.inject(seq, features, 0)
    block = np.array([17] + [runtime.info.mask_token_id] * 3, dtype=np.int32)
    (out,) = runtime.draft_blocks([DFlashBlock(seq, block, 9, range(1, 4))])
    return np.array(out.logits), None if out.vocab is None else np.array(out.vocab)


def test_the_cut_head_gives_the_borrowed_heads_logits_of_its_ids(files: dict[str, Path]) -> None:
    full, full_vocab = _block_logits(files["head"], files["target"])
    cut, cut_vocab = _block_logits(files["cut"], files["target"])
    assert full_vocab is None and cut_vocab is not None and cut_vocab.tolist() == IDS.tolist()
    assert cut.shape == (3, IDS.size)
    # The stored rows are the target's own blocks: each id's logit is computed as the borrowed head does.
    np.testing.assert_array_equal(cut, full[:, IDS])
    t = GGUFFile(files["target"])
    rows = t.tensor("output.weight" if t.has_tensor("output.weight") else "token_embd.weight")
    assert GGUFFile(files["cut"]).tensor("output.weight").type_name == rows.type_name
    assert vocabulary_of(files["cut"], 320).tolist() == IDS.tolist()


def test_a_cut_head_is_lossless_through_the_engine(files: dict[str, Path]) -> None:
    spec = SpecParams(types=("draft-dflash",), n_max=3, adaptive=False)
    outs, refs, st = engine_vs_plain(files["target"], files["cut"], DFlashDrafter.create, spec, backend="native")
    assert outs == refs and st["gen_drafts"] > 0


def test_misuse_is_a_clear_error(files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match="already has its own output head"):
        with_draft_vocabulary(files["cut"], files["target"], IDS, tmp_path / "again.gguf")
    with pytest.raises(ConfigError, match="ascending distinct ids"):
        with_draft_vocabulary(files["head"], files["target"], np.array([5, 5, 9]), tmp_path / "dup.gguf")
    with pytest.raises(ConfigError, match="ascending distinct ids"):
        with_draft_vocabulary(files["head"], files["target"], np.array([1, 320]), tmp_path / "range.gguf")
    with pytest.raises(ConfigError, match="DFlash heads only"):
        with_draft_vocabulary(files["target"], files["target"], IDS, tmp_path / "target-cut.gguf")
    with pytest.raises(ConfigError, match="is an input file"):
        with_draft_vocabulary(files["head"], files["target"], IDS, files["head"])
    with pytest.raises(ModelFileError, match="names no draft vocabulary"):
        vocabulary_of(files["head"], 320)
    assert main([str(files["head"]), "--vocab-from", str(files["head"]), "-m", str(files["target"]),
                 "-o", str(tmp_path / "x.gguf")]) == 1
    assert "names no draft vocabulary" in capsys.readouterr().err
    assert not (tmp_path / "x.gguf").exists()
    assert main([str(files["head"]), "--vocab-from", str(files["cut"]), "-m", str(files["target"]),
                 "-o", str(tmp_path / "y.gguf")]) == 0
    assert (tmp_path / "y.gguf").read_bytes() == files["cut"].read_bytes()
