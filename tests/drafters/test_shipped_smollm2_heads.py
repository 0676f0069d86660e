"""The SmolLM2 heads shipped in drafters/model/heads/: found without -md, lossless, and clearly trained."""

from __future__ import annotations

import model_drafter_helpers
import pytest
from model_drafter_helpers import engine_vs_plain, smollm2_or_skip

from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.tokenizer import Tokenizer
from spekula.core.params import SpecParams
from spekula.drafters.model.dflash import DFlashDrafter
from spekula.drafters.model.eagle3 import Eagle3Drafter
from spekula.drafters.model.shipped_heads import find_shipped_head
from spekula.training.prompts import builtin_prompts

pytestmark = pytest.mark.slow
MAKERS = {"eagle3": Eagle3Drafter.create, "dflash": DFlashDrafter.create}


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_shipped_head_is_lossless_and_accepts_on_held_out_chat(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    target = smollm2_or_skip()
    head = find_shipped_head(target, kind)
    assert head is not None, f"no shipped {kind} head lists the embedded model (run `make drafter`)"
    tok = Tokenizer.from_gguf(GGUFFile(target))
    chats = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in builtin_prompts(2, split="heldout")]
    monkeypatch.setattr(model_drafter_helpers, "N_CTX", 1024)
    monkeypatch.setattr(model_drafter_helpers, "PROMPTS", chats)
    spec = SpecParams(types=(f"draft-{kind}",), n_max=6, adaptive=False)
    outs, refs, st = engine_vs_plain(target, head, MAKERS[kind], spec, n_predict=48)
    assert outs == refs
    # A random head accepts next to nothing (0 of 100+ drafted tokens); a trained one keeps a draft
    # token in at least every tenth verification round.
    assert st["acc_tokens"] >= 0.1 * st["calls_accept"], st
