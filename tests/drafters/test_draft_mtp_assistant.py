"""draft-mtp with Gemma 4's assistant (-md, architecture gemma4-assistant) over the tiny Gemma 4 target's KV."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")

from model_drafter_helpers import Recording  # noqa: E402
from mtp_helpers import context, run_vs_plain, target_backend  # noqa: E402

from spekula.core.backend import Capture, SeqInput  # noqa: E402
from spekula.core.drafting.drafter import DraftRequest  # noqa: E402
from spekula.core.drafting.mtp_runtime import check_mtp_files  # noqa: E402
from spekula.core.errors import ConfigError  # noqa: E402
from spekula.core.modelfile.gguf_file import GGUFFile  # noqa: E402
from spekula.core.params import SamplingParams, SpecParams  # noqa: E402
from spekula.drafters.model.mtp import MtpDrafter, check_heads  # noqa: E402
from spekula.fixtures import tiny_mtp  # noqa: E402
from spekula.fixtures.tiny_gemma4 import tiny_gemma4_gguf_path  # noqa: E402
from spekula.fixtures.tiny_gemma4_assistant import reference_steps, tiny_assistant_gguf_path  # noqa: E402

# Full-length drafts whatever their confidence (a random assistant is rarely sure): they are what is checked.
SPEC = SpecParams(types=("draft-mtp",), n_max=3, p_min=0.0, adaptive=False)


def test_the_converted_assistant_is_checked_as_a_draft_file() -> None:
    """llama.cpp's converter output of transformers' assistant: the layout the runtime reads, accepted with
    -md beside its target; as a target's own heads it is one clear error."""
    assistant = GGUFFile.shared(str(tiny_assistant_gguf_path()))
    assert assistant.architecture == "gemma4-assistant"
    assert assistant.get("gemma4-assistant.embedding_length_out") == 64
    assert tuple(assistant.tensor("nextn.pre_projection.weight").shape) == (32, 128)
    assert tuple(assistant.tensor("nextn.post_projection.weight").shape) == (64, 32)
    assert not assistant.has_tensor("blk.0.attn_k.weight") and assistant.has_tensor("blk.1.attn_q_norm.weight")
    check_heads(str(tiny_gemma4_gguf_path()), str(assistant.path))
    with pytest.raises(ConfigError, match=r"is a 'gemma4-assistant' drafter, which attends over the target's own KV "
                                          r"cache: it drafts when given with -md beside its target"):
        check_mtp_files(str(assistant.path), None)
    other = tiny_mtp.random_mtp_gguf(1)
    with pytest.raises(ConfigError, match=r"\(gemma4-assistant\) drafts for gemma4 targets, target .* is a glm4moe"):
        check_heads(str(other), str(assistant.path))


def test_greedy_output_is_lossless() -> None:
    outs, refs, st = run_vs_plain(tiny_gemma4_gguf_path(), SPEC, draft=tiny_assistant_gguf_path())
    assert outs == refs
    # full drafts but where the n_predict budget caps the last ones
    assert st["gen_drafts"] > 0 and 2 * st["gen_drafts"] < st["gen_tokens"] <= 3 * st["gen_drafts"]


def test_sampled_output_is_lossless() -> None:
    outs, refs, st = run_vs_plain(tiny_gemma4_gguf_path(), SPEC, draft=tiny_assistant_gguf_path(),
                                  sampling=SamplingParams(temperature=0.8, seed=7))
    assert outs == refs and st["gen_drafts"] > 0


def test_sampled_output_is_lossless_over_a_target_with_fewer_global_kv_heads() -> None:
    """The assistant's global block reads a target block of 1 KV head (the sliding ones have 2)."""
    outs, refs, st = run_vs_plain(tiny_gemma4_gguf_path(global_kv_heads=1), SPEC, draft=tiny_assistant_gguf_path(),
                                  sampling=SamplingParams(temperature=0.8, seed=8))
    assert outs == refs and st["gen_drafts"] > 0


def test_drafts_are_transformers_assistant_drafts() -> None:
    """Every draft while the context is shorter than the window (where llama.cpp's window and
    transformers' agree) is transformers' greedy assistant draft from the same history: the drafter hands
    the runtime the right target sequence, position and pending hidden state, after accepting too."""
    rec: list[Recording] = []

    def wrap(d: MtpDrafter) -> Recording:
        rec.append(Recording(d))
        return rec[0]

    prompts = [[5, 17], [200, 33, 99]]
    run_vs_plain(tiny_gemma4_gguf_path(), SPEC, draft=tiny_assistant_gguf_path(), prompts=prompts, n_predict=6,
                 wrap=wrap)
    checked = 0
    for history, last, tokens, _ in rec[0].log:
        if not tokens or len(history) >= 8:
            continue
        _, logits = reference_steps(history, last, len(tokens))
        assert tokens == [int(np.argmax(row)) for row in logits], (history, last)
        checked += 1
    assert checked >= 3


@pytest.mark.parametrize("n_accepted", [0, 1, 2])
def test_accept_rebases_the_pending_hidden_state(n_accepted: int) -> None:
    """After a verify forward of [x, d1, d2] of which n are accepted, the next draft starts from the
    hidden state of the last accepted row, at the position after it, over the target's cut-back cache."""
    target = target_backend(tiny_gemma4_gguf_path(), n_slots=1)
    d = MtpDrafter.create(context(target, SPEC, tiny_assistant_gguf_path(), n_slots=1))
    seq, prompt, verified = target.new_seq(), [5, 17, 200], [33, 99, 120]
    for tokens, start in ((prompt, 0), (verified, len(prompt))):
        inp = SeqInput(seq, np.array(tokens, dtype=np.int32), start)
        d.observe(0, inp, target.forward([inp], Capture(final_norm=True))[0])
    d.accept(0, n_accepted, True)
    history = prompt + verified[: n_accepted + 1]
    target.truncate(seq, len(history))  # as the engine does before the next draft
    correction = 250
    (draft,) = d.draft([DraftRequest(0, np.array(history, np.int32), correction, 3, SPEC, 0.0, 0)])
    _, logits = reference_steps(history, correction, 3)
    assert draft.tokens == [int(np.argmax(row)) for row in logits]


def test_the_registry_creates_the_assistant_mode() -> None:
    """Through the drafter registry (as the CLI and server create drafters), -md naming an assistant makes
    draft-mtp's assistant mode, a Drafter."""
    from spekula.core.drafting.drafter import Drafter
    from spekula.core.drafting.registry import create_drafter

    target = target_backend(tiny_gemma4_gguf_path(), n_slots=1)
    d = create_drafter("draft-mtp", context(target, SPEC, tiny_assistant_gguf_path(), n_slots=1))
    assert isinstance(d, Drafter) and d.name == "draft-mtp" and type(d).__name__ == "AssistantMtpDrafter"
