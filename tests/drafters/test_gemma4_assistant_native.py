"""draft-mtp with Gemma 4's assistant (-md) beside a native Gemma 4 target: the native runtime
(backends/native/gemma4_assistant.py) against the torch one, and lossless speculation on native.

The torch runtime claims no exactness for the assistant (it runs row by row in float32 over float32 keys);
native reads the float16 cache its target wrote, and quantizes activations to int8 before Q8_0 weights. So
logits are compared within a tolerance (TOL, relative to the row's largest logit: about 2e-4 is measured in
F32, 8e-3 in Q8_0) and the drafts token for token, which is the acceptance check: on the tiny fixture every
draft the native runtime makes is torch's.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip("transformers")

from mtp_helpers import context, run_vs_plain, target_backend  # noqa: E402

from spekula.core.backend import Capture, SeqInput  # noqa: E402
from spekula.core.drafting.assistant_runtime import AssistantRow  # noqa: E402
from spekula.core.drafting.drafter import DraftRequest  # noqa: E402
from spekula.core.errors import ConfigError  # noqa: E402
from spekula.core.modelfile.gguf_file import GGUFFile  # noqa: E402
from spekula.core.params import SamplingParams, SpecParams  # noqa: E402
from spekula.drafters.model.mtp import MtpDrafter  # noqa: E402
from spekula.fixtures.tiny_gemma4 import tiny_gemma4_gguf_path  # noqa: E402
from spekula.fixtures.tiny_gemma4_assistant import tiny_assistant_gguf_path  # noqa: E402

SPEC = SpecParams(types=("draft-mtp",), n_max=3, p_min=0.0, adaptive=False)
# |native - torch| / max|torch| per logits row: float16 keys and values against float32 ones (and int8 activations)
TOL = {"F32": 1e-3, "Q8_0": 2e-2}

# Histories shorter than the window (8), across it, and far past it (the sliding blocks read a ring there).
PROMPTS = [[5, 17], [200, 33, 99, 4, 61], list(range(40, 52)), [(7 * i + 3) % 300 for i in range(70)]]


def _drafter(backend: str, global_kv_heads: int = 0, type_name: str = "F32") -> tuple[Any, MtpDrafter]:
    target = target_backend(tiny_gemma4_gguf_path(global_kv_heads=global_kv_heads, type_name=type_name), n_slots=1,
                            name=backend)
    return target, MtpDrafter.create(context(target, SPEC, tiny_assistant_gguf_path(type_name=type_name), n_slots=1,
                                             backend_name=backend))


def _drafts_and_steps(backend: str, global_kv_heads: int = 0,
                      type_name: str = "F32") -> tuple[list[list[int]], list[np.ndarray]]:
    """Each prompt's draft (3 tokens after a correction token), and the runtime's logits of one step at the
    prompt's end, on a `backend` target (target and assistant in `type_name`)."""
    target, d = _drafter(backend, global_kv_heads, type_name)
    drafts, logits = [], []
    for prompt in PROMPTS:
        seq = target.new_seq()
        inp = SeqInput(seq, np.array(prompt, dtype=np.int32), 0)
        out = target.forward([inp], Capture(final_norm=True))[0]
        d.observe(0, inp, out)
        (draft,) = d.draft([DraftRequest(0, np.array(prompt, np.int32), 250, 3, SPEC, 0.0, 0)])
        drafts.append(list(draft.tokens))
        assert out.hidden_final is not None
        row = AssistantRow(seq, 250, np.asarray(out.hidden_final[-1], np.float32), len(prompt))
        logits.append(d.runtime.step([row])[0].logits)
        d.end(0)
        target.free_seq(seq)
    return drafts, logits


@pytest.mark.parametrize(("global_kv_heads", "type_name"), [(0, "F32"), (1, "F32"), (0, "Q8_0")])
def test_native_drafts_are_torch_drafts(global_kv_heads: int, type_name: str) -> None:
    """The acceptance check: token for token the torch runtime's drafts, logits within TOL, before the
    window, across it and past it; also over a target whose global blocks have fewer KV heads, and with
    quantized weights (the native runtime's packed copies and int8 activations)."""
    native_drafts, native_logits = _drafts_and_steps("native", global_kv_heads, type_name)
    torch_drafts, torch_logits = _drafts_and_steps("torch", global_kv_heads, type_name)
    assert native_drafts == torch_drafts
    assert all(len(t) == 3 for t in native_drafts) and len({tuple(t) for t in native_drafts}) > 1
    for n, t in zip(native_logits, torch_logits, strict=True):
        assert np.max(np.abs(n - t)) <= TOL[type_name] * np.max(np.abs(t)), np.max(np.abs(n - t))


def test_rows_of_one_step_do_not_change_each_other() -> None:
    """Two sequences in one step give each the logits it gets alone (rows run one after another)."""
    target = target_backend(tiny_gemma4_gguf_path(), n_slots=2, name="native")
    d = MtpDrafter.create(context(target, SPEC, tiny_assistant_gguf_path(), n_slots=2, backend_name="native"))
    rows = []
    for prompt in PROMPTS[1:3]:
        seq = target.new_seq()
        out = target.forward([SeqInput(seq, np.array(prompt, np.int32), 0)], Capture(final_norm=True))[0]
        assert out.hidden_final is not None
        rows.append(AssistantRow(seq, 9, np.asarray(out.hidden_final[-1], np.float32), len(prompt)))
    both = d.runtime.step(rows)
    for row, out in zip(rows, both, strict=True):
        (alone,) = d.runtime.step([row])
        assert np.array_equal(alone.logits, out.logits) and np.array_equal(alone.hidden, out.hidden)


@pytest.mark.parametrize("type_name", ["F32", "Q8_0"])
def test_greedy_output_is_lossless_on_native(type_name: str) -> None:
    outs, refs, st = run_vs_plain(tiny_gemma4_gguf_path(type_name=type_name), SPEC,
                                  draft=tiny_assistant_gguf_path(type_name=type_name), backend="native")
    assert outs == refs
    assert st["gen_drafts"] > 0 and 2 * st["gen_drafts"] < st["gen_tokens"] <= 3 * st["gen_drafts"]


def test_sampled_output_is_lossless_on_native() -> None:
    outs, refs, st = run_vs_plain(tiny_gemma4_gguf_path(global_kv_heads=1), SPEC, draft=tiny_assistant_gguf_path(),
                                  sampling=SamplingParams(temperature=0.8, seed=8), backend="native")
    assert outs == refs and st["gen_drafts"] > 0


def test_a_draft_past_the_cache_is_refused() -> None:
    target, d = _drafter("native")
    seq = target.new_seq()
    out = target.forward([SeqInput(seq, np.array([5, 17, 9], np.int32), 0)], Capture(final_norm=True))[0]
    assert out.hidden_final is not None
    with pytest.raises(ConfigError, match=r"holds 3 positions, a draft at 5 needs 5"):
        d.runtime.step([AssistantRow(seq, 4, np.asarray(out.hidden_final[-1], np.float32), 5)])


def test_the_native_runtime_reads_a_native_target_only() -> None:
    from spekula.backends.native.gemma4_assistant import NativeGemma4Assistant
    from spekula.core.drafting.assistant_runtime import read_assistant_info

    f = GGUFFile.shared(str(tiny_assistant_gguf_path()))
    torch_target = target_backend(tiny_gemma4_gguf_path(), n_slots=1, name="torch")
    with pytest.raises(ConfigError, match=r"on native reads a native target's KV cache"):
        NativeGemma4Assistant(f, read_assistant_info(f), torch_target)


def test_a_backend_without_a_runtime_refuses_it_by_name() -> None:
    from spekula.core.drafting.assistant_runtime import open_assistant_runtime
    from spekula.drafters.model.runtimes import DRAFT_RUNTIMES

    target = target_backend(tiny_gemma4_gguf_path(), n_slots=1, name="native")
    with pytest.raises(ConfigError, match=r"is a 'gemma4-assistant' drafter, which reads the target's KV cache; the "
                                          r"onnx backend does not run it \(use --backend native or torch\)"):
        open_assistant_runtime(DRAFT_RUNTIMES, "onnx", target, str(tiny_assistant_gguf_path()))
