"""One sequence's recurrent state in a hybrid model, and the lengths a truncate can bring it back to.

The state (every recurrent block's delta-rule state and conv rows) summarises all positions so far,
so unlike the KV cache it cannot be cut back by position. What is kept to rebuild earlier lengths
(core/backend.py's contract):

* a checkpoint: a copy of the state at the length the caller marked, plus each later row's recurrence
  inputs (the pre-conv qkv row, beta's and alpha's logits; at most ``LOG_ROWS`` rows, past that the
  checkpoint is dropped). Truncating to a length ``n`` in ``[checkpoint, current]`` restores the copy and
  replays rows ``[checkpoint, n)`` through the recurrence only (backends/torch/delta_net.py's
  ``advance``, the forward's own code), so the state equals plain decoding's bit for bit;
* up to ``N_SNAPSHOTS`` snapshots: copies at lengths a prompt cache may come back to;
* length 0 (the zero state) and the current length.

Truncating below a kept length drops what was kept past it: the positions it summarised are rewritten.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from spekula.core.errors import ConfigError

LOG_ROWS = 64  # rows kept after a checkpoint (a verification forward's, a draft model's steps)
N_SNAPSHOTS = 2


@dataclass
class StateCopy:
    length: int
    ssm: torch.Tensor
    conv: torch.Tensor


# replay(ssm, conv, rows): advance every recurrent block r's state (ssm[r], conv[r]) over its logged rows[r].
Replay = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


class RecurrentSeq:
    """The recurrent state of one sequence: ``ssm`` [n_rec, n_v, head_v_dim, head_k_dim] and ``conv``
    [n_rec, conv_kernel - 1, conv_dim] (float32), with its checkpoint, row log and snapshots."""

    def __init__(self, ssm_shape: tuple[int, ...], conv_shape: tuple[int, ...], log_width: int,
                 device: torch.device) -> None:
        self.ssm = torch.zeros(ssm_shape, dtype=torch.float32, device=device)
        self.conv = torch.zeros(conv_shape, dtype=torch.float32, device=device)
        self._log_shape = (ssm_shape[0], LOG_ROWS, log_width)
        self._log: torch.Tensor | None = None  # allocated at the first checkpoint, then reused
        self._checkpoint: StateCopy | None = None
        self._snapshots: list[StateCopy] = []

    def _copy(self, length: int) -> StateCopy:
        return StateCopy(length, self.ssm.clone(), self.conv.clone())

    def _load(self, kept: StateCopy) -> None:
        self.ssm.copy_(kept.ssm)
        self.conv.copy_(kept.conv)

    # ---- what callers keep --------------------------------------------------------------------------

    def checkpoint(self, length: int) -> None:
        self._checkpoint = self._copy(length)
        if self._log is None:
            self._log = torch.empty(self._log_shape, dtype=torch.float32, device=self.ssm.device)

    def snapshot(self, length: int) -> None:
        if any(s.length == length for s in self._snapshots):
            return  # the state at a length is unique: the one kept is this one
        self._snapshots.append(self._copy(length))
        del self._snapshots[:-N_SNAPSHOTS]

    def record(self, block: int, pos0: int, rows: torch.Tensor) -> None:
        """Log block ``block``'s recurrence inputs of positions [pos0, pos0 + len(rows)) if they follow the
        checkpoint; rows past ``LOG_ROWS`` after it drop the checkpoint."""
        ck = self._checkpoint
        if ck is None or self._log is None:
            return
        off, n = pos0 - ck.length, rows.shape[0]
        if off < 0 or off + n > LOG_ROWS:
            self._checkpoint = None
            return
        self._log[block, off : off + n] = rows

    def load(self, ssm: torch.Tensor, conv: torch.Tensor) -> None:
        """A restored sequence's state: what was kept (checkpoint, snapshots) described the one replaced."""
        self.ssm.copy_(ssm)
        self.conv.copy_(conv)
        self._checkpoint = None
        self._snapshots = []

    # ---- what a truncate can reach ------------------------------------------------------------------

    def restorable(self, length: int, n_keep: int) -> int:
        n = max(0, min(int(n_keep), length))
        if n == length:
            return n
        best = max((s.length for s in self._snapshots if s.length <= n), default=0)
        ck = self._checkpoint
        if ck is not None and ck.length <= n:
            return n
        return best

    def restore(self, length: int, n: int, replay: Replay) -> None:
        """Bring the state from ``length`` back to ``n`` <= length; ConfigError if ``n`` is not restorable."""
        if n == length:
            return
        ck = self._checkpoint
        snap = next((s for s in self._snapshots if s.length == n), None)
        if n == 0:
            self.ssm.zero_()
            self.conv.zero_()
        elif snap is not None:
            self._load(snap)
        elif ck is not None and ck.length <= n:
            assert self._log is not None
            self._load(ck)
            if n > ck.length:
                replay(self.ssm, self.conv, self._log[:, : n - ck.length])
        else:
            kept = sorted({0, length} | {s.length for s in self._snapshots})
            window = f", [{ck.length}, {length}]" if ck is not None else ""
            raise ConfigError(f"truncate to {n}: the recurrent state can only be brought back to "
                              f"{', '.join(map(str, kept))}{window}")
        if ck is not None and ck.length > n:
            self._checkpoint = None
        self._snapshots = [s for s in self._snapshots if s.length <= n]
