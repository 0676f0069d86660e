"""Editing a Hugging Face checkpoint directory in place, for the converter's bad-input tests.

Imported by tests/test_convert.py and tests/test_convert_moe.py (tests/conftest.py puts tests/ on sys.path).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file


def edit_config(path: Path, **changes: object) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def edit_tensors(path: Path, drop: tuple[str, ...] = (), **replace: np.ndarray) -> None:
    t = load_file(str(path / "model.safetensors"))
    for k in drop:
        del t[k]
    t.update(replace)
    save_file(t, str(path / "model.safetensors"))
