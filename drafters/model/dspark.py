"""draft-dspark: DFlash plus a Markov head and an optional confidence head (docs/model-formats.md §4).

The runtime chains the Markov bias greedily through the block (each position's bias is keyed on
the previous position's argmax), so drafts are always the argmax tokens. ``--spec-draft-p-min``
gates on the confidence head here, not on the top-10 probability: the draft is cut at the first
position whose confidence is below it. Anchor-first exports read every block index
(``[x, MASK * (n-1)]``, n <= block_size); bonus-anchor exports use DFlash's layout.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from spekula.core.drafting.description import DrafterDescription
from spekula.core.drafting.draft_models import DFlashOut
from spekula.core.drafting.drafter import Draft, DrafterContext, DraftRequest
from spekula.core.errors import ConfigError
from spekula.drafters.model.dflash import DFlashDrafter, _Plan, is_draft_kind


class DSparkDrafter(DFlashDrafter):
    name: ClassVar[str] = "draft-dspark"
    kind: ClassVar[str] = "dspark"
    description: ClassVar[DrafterDescription] = DrafterDescription(
        summary="DFlash with a Markov head (and an optional confidence head that --spec-draft-p-min gates on)",
        builtin_order=10, hidden_states=True, draft_model="optional", implied_by=is_draft_kind("dspark"),
    )

    @classmethod
    def create(cls, ctx: DrafterContext) -> DSparkDrafter:
        drafter = super().create(ctx)
        assert isinstance(drafter, DSparkDrafter)
        return drafter

    def check_spec(self, n_max: int, p_min: float) -> None:
        if p_min > 0 and not self.info.has_confidence:
            raise ConfigError(f"{self.name}: --spec-draft-p-min gates on the confidence head, "
                              f"but {self.info.path} has none")
        super().check_spec(n_max, p_min)

    def max_block_draft(self) -> int:
        return self.info.block_size if self.info.sample_from_anchor else self.info.block_size - 1

    def block_drafts(self, n_spec: int, room: int) -> int:
        # The draft's length: the runtime chains the Markov bias through every row of the block, per
        # token in Python, so rows past the draft would cost as much as drafted ones.
        return n_spec

    def block_for(self, last: int, n: int) -> np.ndarray:
        if not self.info.sample_from_anchor:
            return super().block_for(last, n)
        return np.array([last] + [self.info.mask_token_id] * (n - 1), dtype=np.int32)

    def read_rows(self, n: int) -> range:
        return range(0, n) if self.info.sample_from_anchor else super().read_rows(n)

    def select(self, plan: _Plan, out: DFlashOut, req: DraftRequest) -> Draft:
        p_min = float(req.spec.p_min)
        if p_min > 0 and out.confidence is None:
            self._warn("per-request p_min ignored: the model has no confidence head")
            p_min = 0.0
        tokens: list[int] = []
        confidence: list[float] = []
        for i in range(len(self.logit_rows(plan))):  # row i of out is block index logit_rows(plan)[i]
            if p_min > 0 and out.confidence is not None and float(out.confidence[i]) < p_min:
                break
            best = int(np.argmax(out.logits[i]))
            tokens.append(best if out.vocab is None else int(out.vocab[best]))
            if out.confidence is not None:
                confidence.append(float(out.confidence[i]))
        # Its confidence head's number is what a DSpark draft is sure of; without one there is none.
        return Draft(tokens, None, confidence if out.confidence is not None else None)
