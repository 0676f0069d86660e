"""The torch backend on the tiny MoE fixtures (GGUF from `spekula convert`) against the checkpoints they
came from: transformers' own Qwen3MoeForCausalLM / Glm4MoeForCausalLM, and the independent float64
reference of tests/hf_moe_reference.py (which also stands in when transformers is not installed).

fp32 throughout; a 30-token prompt; logits, every layer input and the final-norm hidden within 1e-4
(measured: about 3e-6 against both). The fixtures' routers spread their choices (several expert sets
per layer; GLM's selection bias changes some), so a routing mistake cannot hide.
"""

from __future__ import annotations

import importlib.util
from functools import cache
from typing import Any

import hf_moe_reference as R
import numpy as np
import pytest
import torch

from spekula.core.backend import BackendOptions, Capture, SeqInput, SeqOutput, load_backend
from spekula.fixtures.tiny_hf import VOCAB
from spekula.fixtures.tiny_moe import tiny_moe_gguf_path, tiny_moe_hf_path

TOL = 1e-4
TOKENS = np.random.default_rng(7).integers(0, VOCAB, 30).astype(np.int32)
N_LAYER = 3
# case -> (arch, fixture options); "glm4moe-mtp" carries an MTP block that the trunk must not run
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3moe": ("qwen3moe", {}),
    "glm4moe": ("glm4moe", {}),
    "glm4moe-qk-norm": ("glm4moe", {"qk_norm": True}),
    "glm4moe-mtp": ("glm4moe", {"n_mtp": 1}),
}
HF_CLASSES = {"qwen3moe": "Qwen3MoeForCausalLM", "glm4moe": "Glm4MoeForCausalLM"}
HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


@cache
def torch_forward(case: str) -> SeqOutput:
    """All rows' logits, every layer input and the final-norm hidden, one forward of TOKENS."""
    arch, kw = CASES[case]
    b = load_backend("torch", str(tiny_moe_gguf_path(arch, **kw)), BackendOptions(n_ctx=64, n_seq_max=1, threads=1))
    assert b.info.n_layer == N_LAYER
    try:
        s = b.new_seq()
        cap = Capture(frozenset(range(N_LAYER + 1)), final_norm=True)
        return b.forward([SeqInput(s, TOKENS, 0, np.arange(TOKENS.size))], cap)[0]
    finally:
        b.close()


@cache
def reference(case: str) -> R.MoEForward:
    arch, kw = CASES[case]
    return R.moe_target_forward(tiny_moe_hf_path(arch, **kw), TOKENS.tolist())


def _max_diff(got: np.ndarray, want: torch.Tensor | np.ndarray) -> float:
    want_np = want.numpy() if isinstance(want, torch.Tensor) else want
    assert got.shape == want_np.shape
    return float(np.abs(got.astype(np.float64) - want_np.astype(np.float64)).max())


@pytest.mark.parametrize("case", list(CASES))
def test_torch_backend_matches_independent_reference(case: str) -> None:
    got, ref = torch_forward(case), reference(case)
    assert _max_diff(got.logits, ref.logits) < TOL
    for layer in range(N_LAYER + 1):
        assert _max_diff(got.layer_inputs[layer], ref.layer_inputs[layer]) < TOL, f"layer input {layer}"
    assert got.hidden_final is not None
    assert _max_diff(got.hidden_final, ref.final_hidden) < TOL


@pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="transformers is not installed (the independent reference "
                    "test above still checks the backend)")
@pytest.mark.parametrize("case", list(CASES))
def test_torch_backend_and_reference_match_transformers(case: str) -> None:
    import transformers

    arch, kw = CASES[case]
    cls = getattr(transformers, HF_CLASSES[arch])
    model = cls.from_pretrained(str(tiny_moe_hf_path(arch, **kw)), dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        hf = model(torch.from_numpy(TOKENS.astype(np.int64))[None], output_hidden_states=True)
    want = hf.logits[0].numpy()
    got, ref = torch_forward(case), reference(case)
    assert _max_diff(got.logits, want) < TOL
    assert _max_diff(ref.logits.float().numpy(), want) < TOL  # the fallback reference is trustworthy
    # transformers' hidden_states: the input of every layer, then the final-norm output
    states = [h[0].numpy() for h in hf.hidden_states]
    assert len(states) == N_LAYER + 1
    for layer in range(N_LAYER):
        assert _max_diff(got.layer_inputs[layer], states[layer]) < TOL, f"layer input {layer}"
    assert got.hidden_final is not None
    assert _max_diff(got.hidden_final, states[N_LAYER]) < TOL


@pytest.mark.parametrize("case", ["qwen3moe", "glm4moe"])
def test_fixture_routing_is_exercised(case: str) -> None:
    """Every sparse layer chooses more than one expert set; GLM's selection bias changes some choices."""
    ref = reference(case)
    assert sorted(ref.routing) == ([0, 1, 2] if case == "qwen3moe" else [1, 2])
    for layer, chosen in ref.routing.items():
        assert len(set(map(frozenset, chosen))) > 1, f"layer {layer} routes every token alike"
    changed = sum(a != b for layer in ref.routing for a, b in zip(ref.routing[layer], ref.routing_unbiased[layer],
                                                                    strict=True))
    assert (changed > 0) == (case == "glm4moe")


def test_mtp_blocks_do_not_change_the_trunk() -> None:
    """The same trunk with and without an MTP block after it: bitwise the same logits and hidden states."""
    with_mtp, without = torch_forward("glm4moe-mtp"), torch_forward("glm4moe")
    assert np.array_equal(with_mtp.logits, without.logits)
    assert with_mtp.hidden_final is not None and without.hidden_final is not None
    assert np.array_equal(with_mtp.hidden_final, without.hidden_final)
