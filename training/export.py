"""A trained head on disk: the Hugging Face checkpoint folder and the GGUF converted from it.

The folder (config.json + model.safetensors) is the layout ``spekula convert`` (and llama.cpp's own
converter) read, so a head trained here also converts for other runtimes; the GGUF is converted
against the target GGUF itself, whose vocabulary it copies.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from spekula.backends.convert.hf import convert
from spekula.backends.convert.output import atomic_output
from spekula.training.head_api import DraftHead


def write_hf_checkpoint(head: DraftHead, folder: Path) -> Path:
    config, tensors = head.hf_checkpoint()
    with atomic_output(folder / "model.safetensors", "the head checkpoint") as tmp:
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp))
        os.chmod(tmp, 0o644)  # safetensors recreates the file private; a checkpoint folder is meant to be shared
    with atomic_output(folder / "config.json", "the head checkpoint") as tmp:
        tmp.write_text(json.dumps(config, indent=1, default=_plain), encoding="utf-8")
    return folder


def _plain(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"cannot write {type(x).__name__} into config.json")


def export_gguf(hf_folder: Path, target_gguf: str, outfile: Path, outtype: str = "f16") -> Path:
    _, path = convert(hf_folder, outfile, outtype=outtype, target_gguf=target_gguf)
    return path
