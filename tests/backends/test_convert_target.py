"""`spekula convert DRAFT --target-model TARGET.gguf`: drafts for a target that exists only as a GGUF.

The GGUF target stands in for its HF folder: the same draft converted either way has byte-identical
tensors, and the GGUF way copies the target's tokenizer keys (values and value types) unchanged.
Both run in the engine, and, where a llama.cpp build is at hand, in llama-server as its draft.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import run_cli
from model_drafter_helpers import build_target, engine_vs_plain

from spekula.backends.convert.hf import convert
from spekula.core.errors import ConfigError, ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.params import SpecParams
from spekula.drafters.model.dflash import DFlashDrafter
from spekula.drafters.model.eagle3 import Eagle3Drafter
from spekula.fixtures import tiny_gguf, tiny_hf

BENCH = Path(__file__).resolve().parents[2] / "bench"
DRAFTS = {
    "eagle3": (lambda p: tiny_hf.write_eagle3(p, layer_ids=(1, 4, 8)), Eagle3Drafter.create, "draft-eagle3"),
    "dflash": (lambda p: tiny_hf.write_dflash(p, layer_ids=(1, 6), block_size=4), DFlashDrafter.create, "draft-dflash"),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny 8-layer target (HF folder and its GGUF) and each draft converted against either."""
    root = tmp_path_factory.mktemp("convert-target")
    hf, target = build_target(root)
    out = {"hf": hf, "target": target}
    for kind, (write, _, _) in DRAFTS.items():
        ckpt = write(root / f"{kind}-hf")
        out[f"{kind}-ckpt"] = ckpt
        out[f"{kind}-dir"] = convert(ckpt, root / f"{kind}-dir.gguf", outtype="f32", target_dir=hf)[1]
        out[f"{kind}-gguf"] = convert(ckpt, root / f"{kind}-gguf.gguf", outtype="f32", target_gguf=target)[1]
    return out


def _tokenizer_keys(f: GGUFFile) -> dict[str, tuple[object, tuple[int, int | None]]]:
    return {k: (v, f.value_type(k)) for k, v in f.metadata.items() if k.startswith("tokenizer.")}


@pytest.mark.parametrize("kind", list(DRAFTS))
def test_same_tensors_and_the_targets_tokenizer_keys(models: dict[str, Path], kind: str) -> None:
    by_dir, by_gguf, target = (GGUFFile(models[k]) for k in (f"{kind}-dir", f"{kind}-gguf", "target"))
    assert by_gguf.tensor_names() == by_dir.tensor_names()
    for name in by_dir.tensor_names():
        a, b = by_dir.tensor(name), by_gguf.tensor(name)
        assert (a.type_name, a.shape) == (b.type_name, b.shape), name
        assert np.asarray(a.data).tobytes() == np.asarray(b.data).tobytes(), name
    want = _tokenizer_keys(target)
    got = _tokenizer_keys(by_gguf)
    if kind == "dflash":  # the draft's own mask token, which the target does not name
        assert got.pop("tokenizer.ggml.mask_token_id")[0] == tiny_hf.VOCAB - 1
    assert got == want
    # what the converters read from the target is the same either way, so the rest of the file is too
    rest = {k for k in by_dir.metadata if not k.startswith("tokenizer.")}
    assert {k: by_gguf.get(k) for k in rest} == {k: by_dir.get(k) for k in rest}


@pytest.mark.parametrize("kind", list(DRAFTS))
def test_gguf_target_draft_is_lossless_in_the_engine(models: dict[str, Path], kind: str) -> None:
    _, make, name = DRAFTS[kind]
    spec = SpecParams(types=(name,), n_max=3, adaptive=False)
    outs, refs, stats = engine_vs_plain(models["target"], models[f"{kind}-gguf"], make, spec, n_predict=12)
    assert outs == refs and stats["gen_drafts"] > 0


def test_cli_takes_target_model_and_refuses_both(models: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "e3.gguf"
    proc = run_cli("convert", models["eagle3-ckpt"], "--target-model", models["target"], "--outfile", out,
                   "--outtype", "f32")
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes() == models["eagle3-gguf"].read_bytes()
    proc = run_cli("convert", models["eagle3-ckpt"], "--target-model", models["target"],
                   "--target-model-dir", models["hf"], "--outfile", tmp_path / "x.gguf")
    assert proc.returncode == 2 and "not allowed with argument" in proc.stderr


def test_not_a_decoder_target(models: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="eagle3 draft, not a target model"):
        convert(models["dflash-ckpt"], tmp_path / "x.gguf", target_gguf=models["eagle3-gguf"])
    not_gguf = tmp_path / "config.gguf"
    not_gguf.write_text("{}")
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        convert(models["eagle3-ckpt"], tmp_path / "x.gguf", target_gguf=not_gguf)
    assert not (tmp_path / "x.gguf").exists()


def test_both_or_neither_target_and_pre(models: dict[str, Path], tmp_path: Path) -> None:
    ckpt, out = models["eagle3-ckpt"], tmp_path / "x.gguf"
    with pytest.raises(ConfigError, match="both name the target"):
        convert(ckpt, out, target_dir=models["hf"], target_gguf=models["target"])
    with pytest.raises(ConfigError, match="needs --target-model-dir .* or --target-model"):
        convert(ckpt, out)
    with pytest.raises(ConfigError, match="--pre"):
        convert(ckpt, out, target_gguf=models["target"], pre="smollm")
    assert not out.exists()


def test_vocab_and_hidden_mismatch(models: dict[str, Path], tmp_path: Path) -> None:
    wider_vocab = tiny_gguf.build("llama", tmp_path / "v384.gguf", n_layer=8, vocab_size=384, quantize=False)
    narrower = tiny_gguf.build("llama", tmp_path / "h32.gguf", n_layer=8, n_embd=32, n_head=2, n_head_kv=1,
                               quantize=False)
    for kind in DRAFTS:
        with pytest.raises(ModelFileError, match="vocab_size 320 differs from the target's 384"):
            convert(models[f"{kind}-ckpt"], tmp_path / "x.gguf", target_gguf=wider_vocab)
    with pytest.raises(ModelFileError, match=r"fc.weight shape .* made for another target"):
        convert(models["eagle3-ckpt"], tmp_path / "x.gguf", target_gguf=narrower)
    with pytest.raises(ModelFileError, match="draft hidden_size 64 != target hidden_size 32"):
        convert(models["dflash-ckpt"], tmp_path / "x.gguf", target_gguf=narrower)
    assert not (tmp_path / "x.gguf").exists()


def test_llama_server_runs_the_drafts(models: dict[str, Path]) -> None:
    """llama.cpp loads each GGUF-target draft beside its target (the vocabulary check included), drafts
    with it, and its greedy output equals its own plain decoding."""
    sys.path.insert(0, str(BENCH))
    try:
        from llama_server import LlamaServer, find_llama_server, supported_spec_types
    finally:
        sys.path.remove(str(BENCH))
    binary, why = find_llama_server()
    if binary is None:
        pytest.skip(why)
    names = [name for _, _, name in DRAFTS.values()]
    if supported_spec_types(binary, names) != names:
        pytest.skip(f"{binary} has no --spec-type {' / '.join(names)}")
    prompt = [5, 17, 200, 33, 99, 120, 7, 8]
    args = {"n_ctx": 256, "n_batch": 64, "threads": 1}
    with LlamaServer(binary, str(models["target"]), spec_type=None, options={}, **args) as plain:
        ref = plain.complete(prompt, 16, ignore_eos=True)
    for kind, (_, _, name) in DRAFTS.items():
        draft = {"spec-draft-model": str(models[f"{kind}-gguf"]), "spec-draft-n-max": 3}
        with LlamaServer(binary, str(models["target"]), spec_type=name, options=draft, **args) as spec:
            got = spec.complete(prompt, 16, ignore_eos=True)
        assert got.same_output(ref) and len(got.tokens) == 16, kind
        assert got.draft_n > 0, kind
