"""Training checkpoints: written whole to a temporary file, fsynced, then renamed over the previous one.

A failed write (full disk, Ctrl-C, a crash) therefore leaves the previous checkpoint intact and
readable; the temporary file is removed. A checkpoint holds everything a resumed run needs to continue
bit-identically: the head's and the optimiser's state, the step, the run configuration and the
metrics so far (data order and per-step randomness are functions of seed and step, see batches.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from spekula.core.errors import SpekulaError

CHECKPOINT = "checkpoint.pt"


class CheckpointError(SpekulaError):
    """A checkpoint cannot be written or read."""


def save_checkpoint(run_dir: Path, state: dict[str, Any]) -> Path:
    final = run_dir / CHECKPOINT
    tmp = run_dir / (CHECKPOINT + ".tmp")
    try:
        with tmp.open("wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"cannot write checkpoint {final}: {exc.strerror or exc}; "
                              f"the previous checkpoint (if any) is intact") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return final


def load_checkpoint(run_dir: Path) -> dict[str, Any]:
    path = run_dir / CHECKPOINT
    try:
        with path.open("rb") as f:
            state = torch.load(f, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no checkpoint to resume from") from None
    except Exception as exc:  # torch.load raises many kinds on damaged files
        raise CheckpointError(f"{path}: unreadable checkpoint ({exc})") from None
    if not isinstance(state, dict) or "step" not in state or "head" not in state or "config" not in state:
        raise CheckpointError(f"{path}: not a spekula training checkpoint")
    return state


def has_checkpoint(run_dir: Path) -> bool:
    return (run_dir / CHECKPOINT).is_file()
