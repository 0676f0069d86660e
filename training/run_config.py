"""What defines a training run, shared by the loop and the head factory."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class RunConfig:
    """What defines a training run; a resumed run must ask for the same."""

    kind: str  # eagle3 | dflash
    steps: int
    seed: int
    lr: float = 1e-3
    warmup: int = 20
    weight_decay: float = 0.0
    clip: float = 1.0
    batch_seqs: int = 8
    seq_len: int = 512
    n_eval: int = 16
    answer_only: bool = False
    precision: str = "f32"  # f32 | bf16 (matrix products under bfloat16 autocast; weights stay float32)
    head: dict[str, Any] = field(default_factory=dict)  # the head's own options
    soft_labels: bool = False  # learn the target's top-K distribution (the cache must keep it)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if not self.soft_labels:  # checkpoints written before soft labels existed still resume
            out.pop("soft_labels")
        return out
