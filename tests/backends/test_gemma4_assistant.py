"""The torch Gemma 4 assistant step over a torch Gemma 4 target's KV against transformers'
``Gemma4AssistantForCausalLM`` fed the target's shared KV states (fp32, eager)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")

from spekula.core.backend import BackendOptions, SeqInput, load_backend  # noqa: E402
from spekula.core.drafting.assistant_runtime import AssistantRow, read_assistant_info  # noqa: E402
from spekula.core.modelfile.gguf_file import GGUFFile  # noqa: E402
from spekula.fixtures import tiny_gemma4  # noqa: E402
from spekula.fixtures.tiny_gemma4_assistant import reference_steps, tiny_assistant_gguf_path  # noqa: E402


@pytest.mark.parametrize("global_kv_heads", [0, 1])  # 1: a target whose global blocks have 1 KV head, not 2
@pytest.mark.parametrize("n_prompt", [3, 7])  # at most W - 1 keys: there llama.cpp's window and transformers' agree
def test_torch_assistant_steps_match_transformers(n_prompt: int, global_kv_heads: int) -> None:
    from spekula.backends.torch.gemma4_assistant import TorchGemma4Assistant

    prompt = (np.arange(n_prompt, dtype=np.int32) * 37 + 11) % tiny_gemma4.VOCAB
    x, n_steps = 42, 3
    h0, want = reference_steps(prompt, x, n_steps, global_kv_heads)
    target = load_backend("torch", str(tiny_gemma4.tiny_gemma4_gguf_path(global_kv_heads=global_kv_heads)),
                          BackendOptions(n_ctx=64, n_seq_max=1, threads=2))
    seq = target.new_seq()
    target.forward([SeqInput(seq, prompt, 0)])
    f = GGUFFile.shared(str(tiny_assistant_gguf_path()))
    assistant = TorchGemma4Assistant(f, read_assistant_info(f), target)
    h, token = h0, x
    for step in range(n_steps):
        (out,) = assistant.step([AssistantRow(seq, token, h, n_prompt)])
        assert out.logits is not None and out.hidden is not None
        logits, h = out.logits, out.hidden
        np.testing.assert_allclose(logits, want[step], rtol=1e-4, atol=1e-4, err_msg=f"step {step}")
        token = int(np.argmax(logits))
