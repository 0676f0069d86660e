"""The model drafters through the engine with an ONNX target (and, for draft-simple, an ONNX draft
model): greedy output equals plain one-token-per-forward decoding on the same ONNX backend.

The drafters only see the Backend interface; these runs show they need nothing torch-specific from
the target (EAGLE-3 and DFlash read the captured layer inputs the onnx graph returns). Exact mode
makes a row's logits independent of batching and chunking, so equality here is bitwise-safe.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from spekula.core.backend import BackendOptions
from spekula.core.drafting.drafter import Drafter, DrafterContext
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.tokenizer import Tokenizer
from spekula.core.params import CompletionRequest, SamplingParams, SpecParams
from spekula.fixtures.tiny_gguf import tiny_model_path

pytest.importorskip("onnxruntime")
from model_drafter_helpers import build_target
from toy_backend import make_engine, plain_decode, run_requests

from spekula.backends.convert.hf import convert
from spekula.backends.onnx.backend import OnnxBackend
from spekula.fixtures import tiny_hf

N_CTX = 256
PROMPTS = ("the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the",
           "one, two, three, four, five, six, seven, one, two, three,")


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPEKULA_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "onnx-cache"))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An 8-layer tiny target with an EAGLE-3 and a DFlash draft converted from tiny HF checkpoints."""
    root = tmp_path_factory.mktemp("onnx-drafters")
    hf, target = build_target(root)
    eagle3, dflash = root / "eagle3.gguf", root / "dflash.gguf"
    convert(tiny_hf.write_eagle3(root / "e3-hf", layer_ids=(1, 4, 8)), eagle3, outtype="f32", target_dir=hf)
    convert(tiny_hf.write_dflash(root / "df-hf", layer_ids=(1, 6), block_size=4), dflash, outtype="f32", target_dir=hf)
    return {"target": target, "eagle3": eagle3, "dflash": dflash}


def _run(target_path: Path, draft_path: Path, make: Callable[[DrafterContext], Drafter], spec: SpecParams,
         sampling: SamplingParams) -> dict[str, Any]:
    backend = OnnxBackend(target_path, BackendOptions(n_ctx=N_CTX, n_seq_max=3, threads=1))
    tok = Tokenizer.from_gguf(GGUFFile(target_path))
    ctx = DrafterContext(spec=spec, target=backend, tokenizer=tok, n_seq_max=2, backend_name="onnx",
                         draft_model_path=str(draft_path),
                         draft_backend_options=BackendOptions(n_ctx=N_CTX, n_seq_max=2, threads=1))
    drafter = make(ctx)
    engine = make_engine(backend, tok, n_slots=2, n_ctx=N_CTX, spec=spec, drafters=[drafter])
    prompts = [tok.encode(p) for p in PROMPTS]
    reqs = [CompletionRequest(prompt=p, n_predict=24, sampling=sampling, ignore_eos=True) for p in prompts]
    finals = anyio.run(run_requests, engine, reqs, 300.0)
    for prompt, final in zip(prompts, finals, strict=True):
        assert final.error is None, final.error
        ref = plain_decode(backend, prompt, n_predict=24, sampling=sampling, seed=max(sampling.seed, 0),
                           is_eog=tok.is_eog, n_ctx=N_CTX, ignore_eos=True)
        assert final.tokens == ref
    return engine.stats()["drafters"][drafter.name]


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=5)],
                         ids=["greedy", "sampled"])
def test_draft_simple_on_onnx(sampling: SamplingParams) -> None:
    from spekula.drafters.model.draft_simple import DraftSimpleDrafter

    path = tiny_model_path("qwen3")
    st = _run(path, path, DraftSimpleDrafter.create, SpecParams(types=("draft-simple",), n_max=4), sampling)
    assert st["gen_tokens"] > 0
    if sampling.greedy:  # the draft model is the target: every greedy draft token is accepted
        assert st["acc_tokens"] == st["gen_tokens"]


def test_eagle3_on_onnx_target(models: dict[str, Path]) -> None:
    from spekula.drafters.model.eagle3 import Eagle3Drafter

    st = _run(models["target"], models["eagle3"], Eagle3Drafter.create, SpecParams(types=("draft-eagle3",), n_max=4),
              SamplingParams(temperature=0.0))
    assert st["gen_drafts"] > 0


def test_dflash_on_onnx_target(models: dict[str, Path]) -> None:
    from spekula.drafters.model.dflash import DFlashDrafter

    st = _run(models["target"], models["dflash"], DFlashDrafter.create, SpecParams(types=("draft-dflash",), n_max=3),
              SamplingParams(temperature=0.0))
    assert st["gen_drafts"] > 0


def test_model_drafters_on_a_q4_onnx_target_draft_in_float(models: dict[str, Path]) -> None:
    """Without --spec-draft-dtype the draft runtimes take the target's options; onnx's q4 is not a type
    they compute in, so they draft in the device's float type instead of refusing."""
    from spekula.drafters.model.dflash import DFlashDrafter
    from spekula.drafters.model.eagle3 import Eagle3Drafter

    backend = OnnxBackend(models["target"], BackendOptions(n_ctx=N_CTX, n_seq_max=3, threads=1, dtype="q4"))
    for make, name, draft in ((Eagle3Drafter.create, "draft-eagle3", "eagle3"),
                              (DFlashDrafter.create, "draft-dflash", "dflash")):
        ctx = DrafterContext(spec=SpecParams(types=(name,), n_max=3), target=backend, tokenizer=None, n_seq_max=2,
                             backend_name="onnx", draft_model_path=str(models[draft]))
        drafter = make(ctx)
        assert str(drafter.runtime.dtype) == "torch.float32"  # the CPU's float type
