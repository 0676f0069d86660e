"""draft-eagle3 over gpt-oss, Gemma 3 and Gemma 4 (dense and MoE) targets (sliding windows, post-norms,
sinks, per-layer inputs, KV shared by the last blocks, experts): the layer inputs the target captures for the head are the residual
stream transformers records, on the native and torch backends; heads in the published layouts for these
targets convert with the target's layer ids and speculate losslessly; a head for another target is a
clear error naming both."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from model_drafter_helpers import engine_vs_plain

from spekula.backends.convert.hf import convert
from spekula.core.backend import BackendOptions, Capture, SeqInput, load_backend
from spekula.core.errors import ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.params import SamplingParams, SpecParams
from spekula.drafters.model.eagle3 import Eagle3Drafter
from spekula.fixtures import tiny_gemma3, tiny_gemma4, tiny_gptoss
from spekula.fixtures.llamacpp_convert import LlamaCppUnavailable
from spekula.fixtures.llamacpp_quantize import LlamaQuantizeUnavailable
from spekula.fixtures.tiny_eagle3_published import write_published_eagle3
from spekula.fixtures.tiny_hf import N_TOKENS

SPEC = SpecParams(types=("draft-eagle3",), n_max=4, adaptive=False)
NATIVE_REL_TOL = 0.01  # float16 KV (tests/backends/test_gemma3.py); torch is float32 throughout
TORCH_REL_TOL = 1e-4
# target -> (its HF folder, its float GGUF, its number of blocks)
TARGETS = {
    "gemma3": (tiny_gemma3.tiny_gemma3_hf_path, tiny_gemma3.tiny_gemma3_gguf_path, tiny_gemma3.N_LAYER),
    "gemma4": (tiny_gemma4.tiny_gemma4_hf_path, tiny_gemma4.tiny_gemma4_gguf_path, tiny_gemma4.N_LAYER),
    "gemma4-moe": (lambda: tiny_gemma4.tiny_gemma4_hf_path(moe=True), lambda: tiny_gemma4.tiny_gemma4_gguf_path(moe=True),
                   tiny_gemma4.N_LAYER_MOE),
    "gpt-oss": (tiny_gptoss.tiny_gptoss_hf_path, tiny_gptoss.tiny_gptoss_gguf_path, tiny_gptoss.N_LAYER),
}
# (target, the layout its heads are published in, layer ids: one past a shared-KV / last block each)
HEADS = [("gemma3", "speculators", [1, 3, 6]), ("gemma4", "speculators", [1, 4, 6]),
         ("gemma4-moe", "speculators", [0, 2, 4]),
         ("gpt-oss", "specforge", [0, 1, 3]), ("gpt-oss", "modelopt", [1, 3, 4])]


@cache
def _hf_hidden_states(name: str, tokens: tuple[int, ...]) -> list[np.ndarray]:
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(TARGETS[name][0]()), dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    with torch.no_grad():
        out = model(torch.as_tensor(tokens, dtype=torch.long)[None], output_hidden_states=True)
    return [h[0].numpy() for h in out.hidden_states]


def _captured(backend: str, gguf: Path, tokens: np.ndarray, layers: frozenset[int]) -> dict[int, np.ndarray]:
    b = load_backend(backend, str(gguf), BackendOptions(n_ctx=256, n_seq_max=2, threads=2))
    s = b.new_seq()
    half = tokens.size // 2  # two forwards: the second reads the first one's KV (and rings)
    first = b.forward([SeqInput(s, tokens[:half], 0, np.array([half - 1]))], Capture(layers))[0].layer_inputs
    second = b.forward([SeqInput(s, tokens[half:], half, np.array([0]))], Capture(layers))[0].layer_inputs
    return {li: np.concatenate([first[li], second[li]]) for li in layers}


FULL = pytest.mark.quant_matrix  # the whole matrix: pytest -m quant_matrix (a sample runs by default)


def _capture_cases() -> list[Any]:
    """Native for every target; torch (the slow one) for one target by default, every one under FULL."""
    return [pytest.param(name, backend, marks=() if backend == "native" or i == 0 else FULL, id=f"{name}-{backend}")
            for i, name in enumerate(sorted(TARGETS)) for backend in ("native", "torch")]


def _lossless_cases() -> list[Any]:
    """Native greedy for every head; native sampled and torch greedy for one head each by default (rotating
    through the heads so each mode meets a different target), every pair under FULL."""
    modes = [("native", GREEDY, "native-greedy"), ("native", SAMPLED, "native-sampled"), ("torch", GREEDY, "torch-greedy")]
    return [pytest.param(name, layout, ids, backend, sampling,
                         marks=() if m == 0 or h == m % len(HEADS) else FULL, id=f"{name}-{layout}-{mode_id}")
            for h, (name, layout, ids) in enumerate(HEADS) for m, (backend, sampling, mode_id) in enumerate(modes)]


@pytest.mark.parametrize(("name", "backend"), _capture_cases())
def test_captured_layer_inputs_are_the_residual_stream_transformers_records(name: str, backend: str) -> None:
    """Layer input l is transformers' hidden_states[l] (its last entry is after the final norm, so the
    residual after the last block is checked against torch's instead), past every sliding window."""
    _, gguf_path, n_layer = TARGETS[name]
    tokens = np.random.default_rng(3).integers(3, 290, 100).astype(np.int32)  # past the windows (8, 64)
    want = _hf_hidden_states(name, tuple(int(t) for t in tokens))
    got = _captured(backend, gguf_path(), tokens, frozenset(range(n_layer + 1)))
    tol = NATIVE_REL_TOL if backend == "native" else TORCH_REL_TOL
    for li in range(n_layer):
        scale = float(np.abs(want[li]).max())
        assert np.abs(got[li] - want[li]).max() < tol * scale, (name, backend, li)
    if backend == "native":
        ref = _captured("torch", gguf_path(), tokens, frozenset({n_layer}))[n_layer]
        assert np.abs(got[n_layer] - ref).max() < NATIVE_REL_TOL * float(np.abs(ref).max())


@pytest.fixture(scope="module")
def heads(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("eagle3-targets")
    out = {}
    for name, layout, ids in HEADS:
        hf = TARGETS[name][0]()
        ckpt = write_published_eagle3(root / f"{name}-{layout}", hf, layout, layer_ids=ids)
        out[name, layout] = convert(ckpt, root / f"{name}-{layout}.gguf", outtype="f32", target_dir=hf)[1]
    return out


@pytest.mark.parametrize(("name", "layout", "ids"), HEADS)
def test_published_layouts_convert_with_the_targets_layer_ids(heads: dict[tuple[str, str], Path], name: str,
                                                              layout: str, ids: list[int]) -> None:
    f = GGUFFile(heads[name, layout])
    assert f.architecture == "eagle3"
    assert list(f.require("eagle3.target_layers")) == ids
    assert bool(f.get("eagle3.norm_before_fc")) == (layout == "modelopt")
    assert f.has_tensor("enc.output_norm.weight") == (layout == "modelopt")
    assert bool(f.get("eagle3.norm_before_residual")) == (layout == "speculators")
    # the fixtures' tokenizer.json holds N_TOKENS entries; for a Gemma config transformers' tokenizer class
    # adds <pad> and <mask> after them, which llama.cpp's converter writes into the target and spekula's
    # tokenizer.json reader does not: --target-model (below) copies the target's vocabulary exactly
    want = GGUFFile(TARGETS[name][1]()).require("tokenizer.ggml.tokens")
    got = f.require("tokenizer.ggml.tokens")
    assert len(got) == len(want) and got[:N_TOKENS] == want[:N_TOKENS]


def test_a_head_converted_against_the_target_gguf_copies_its_vocabulary(tmp_path: Path) -> None:
    target = tiny_gemma4.tiny_gemma4_gguf_path()
    ckpt = write_published_eagle3(tmp_path / "h", tiny_gemma4.tiny_gemma4_hf_path(), "speculators", layer_ids=[1, 4, 6])
    _, out = convert(ckpt, tmp_path / "h.gguf", outtype="f32", target_gguf=target)
    f = GGUFFile(out)
    assert f.require("tokenizer.ggml.tokens") == GGUFFile(target).require("tokenizer.ggml.tokens")
    assert list(f.require("eagle3.target_layers")) == [1, 4, 6]


def test_without_layer_ids_a_too_shallow_target_is_a_clear_error(tmp_path: Path) -> None:
    """The default [2, N/2, N-3] needs N >= 8 (tests/drafters/test_eagle3.py converts with it)."""
    hf = tiny_gemma3.tiny_gemma3_hf_path()
    ckpt = write_published_eagle3(tmp_path / "h", hf, "speculators")
    _edit_config(ckpt, eagle_aux_hidden_state_layer_ids=None)
    with pytest.raises(ModelFileError, match=r"3 distinct target layer ids in \[0, 6\], got \[2, 3, 3\]"):
        convert(ckpt, tmp_path / "h.gguf", outtype="f32", target_dir=hf)


GREEDY, SAMPLED = SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=3)


@pytest.mark.parametrize(("name", "layout", "ids", "backend", "sampling"), _lossless_cases())
def test_a_random_head_is_lossless(heads: dict[tuple[str, str], Path], name: str, layout: str, ids: list[int],
                                   backend: str, sampling: SamplingParams) -> None:
    # gpt-oss: past its window of 64 (the prompts are about 20 tokens)
    outs, refs, st = engine_vs_plain(TARGETS[name][1](), heads[name, layout], Eagle3Drafter.create, SPEC,
                                     backend=backend, sampling=sampling, n_predict=72 if name == "gpt-oss" else 32)
    assert outs == refs
    assert st["gen_drafts"] > 0


def _edit_config(ckpt: Path, **changes: Any) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update(changes)
    (ckpt / "config.json").write_text(json.dumps(cfg))


def test_a_head_for_another_target_names_both(tmp_path: Path) -> None:
    gemma, gptoss = tiny_gemma3.tiny_gemma3_hf_path(), tiny_gptoss.tiny_gptoss_hf_path()
    ckpt = write_published_eagle3(tmp_path / "g3", gemma, "speculators", layer_ids=[1, 3, 5])
    # vocabulary: a Gemma head (303 tokens) against gpt-oss's (320)
    with pytest.raises(ModelFileError, match=rf"vocab_size 303 differs from the target's 320 \({gptoss}\)"):
        convert(ckpt, tmp_path / "x.gguf", target_dir=gptoss)
    # hidden size: declared by the head, and read from fc.weight when it declares none
    _edit_config(ckpt, target_hidden_size=2880)
    with pytest.raises(ModelFileError, match=rf"target_hidden_size 2880 differs from the hidden size 64 of the "
                                             rf"target {gemma}"):
        convert(ckpt, tmp_path / "x.gguf", target_dir=gemma)
    _edit_config(ckpt, target_hidden_size=None)
    wide = tmp_path / "wide-target"
    wide.mkdir()
    cfg = json.loads((gemma / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**cfg, "hidden_size": 128}))
    with pytest.raises(ModelFileError, match=rf"fc.weight shape \(64, 192\) != \(64, 3\*128\) for the target {wide}"):
        convert(ckpt, tmp_path / "x.gguf", target_dir=wide)


def test_eagle31_heads_are_refused_by_name(tmp_path: Path) -> None:
    hf = tiny_gptoss.tiny_gptoss_hf_path()
    ckpt = write_published_eagle3(tmp_path / "h", hf, "specforge", layer_ids=[0, 1, 3])
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["eagle_config"]["norm_output"] = True
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFileError, match=r"EAGLE-3.1 head \(norm_output set\)"):
        convert(ckpt, tmp_path / "x.gguf", target_dir=hf)


def test_a_converted_head_refuses_another_targets_file(heads: dict[tuple[str, str], Path]) -> None:
    from spekula.core.errors import ConfigError

    outs = pytest.raises(ConfigError, match=r"vocabulary of 303 tokens, target .* has 320: the draft was made for "
                                            r"another target")
    with outs:
        engine_vs_plain(tiny_gptoss.tiny_gptoss_gguf_path(), heads["gemma3", "speculators"], Eagle3Drafter.create, SPEC)


@pytest.mark.parametrize(("name", "layout", "ids"), HEADS)
def test_the_native_head_beside_a_native_target_answers_as_torch(heads: dict[tuple[str, str], Path], name: str,
                                                                 layout: str, ids: list[int]) -> None:
    """Beside a native target the head borrows the target's prepared embedding rows (Gemma's are scaled
    in the target's forward, not in the table): its outputs are the float torch runtime's."""
    from model_drafter_helpers import head_runtime

    from spekula.backends.native.backend import NativeBackend
    from spekula.core.drafting.draft_models import Eagle3Rows

    target_path = TARGETS[name][1]()
    target = NativeBackend(str(target_path), BackendOptions(n_ctx=128, n_seq_max=3, threads=2))
    native = head_runtime("native", heads[name, layout], target_path, 128, target=target, threads=2)
    ref = head_runtime("torch", heads[name, layout], target_path, 128)
    rng = np.random.default_rng(1)
    tokens = rng.integers(3, 290, 9).astype(np.int32)
    feats = rng.standard_normal((tokens.size, 3 * 64)).astype(np.float32)
    g = ref.encode(feats)
    outs = []
    for rt in (native, ref):
        seq = rt.new_seq()
        first = rt.decode([Eagle3Rows(seq, tokens, g, 0)])[0]
        second = rt.decode([Eagle3Rows(seq, np.array([42], np.int32), first.prenorm[-1:], tokens.size)])[0]
        outs.append((first.logits, second.logits))
    for got, want in zip(outs[0], outs[1], strict=True):
        finite = np.isfinite(want)
        assert np.array_equal(np.isfinite(got), finite)
        assert np.abs(got[finite] - want[finite]).max() < 2e-3 * np.abs(want[finite]).max()
        assert (got.argmax(1) == want.argmax(1)).all()


def test_lossless_on_the_mxfp4_gpt_oss_file(heads: dict[tuple[str, str], Path]) -> None:
    """The same head beside llama-quantize's MXFP4_MOE file of the target (its experts stay MXFP4 blocks)."""
    try:
        target = tiny_gptoss.tiny_gptoss_gguf_path("mxfp4")
    except (LlamaCppUnavailable, LlamaQuantizeUnavailable) as exc:
        pytest.skip(str(exc))
    outs, refs, st = engine_vs_plain(target, heads["gpt-oss", "modelopt"], Eagle3Drafter.create, SPEC,
                                     backend="native", n_predict=72)
    assert outs == refs
    assert st["gen_drafts"] > 0
