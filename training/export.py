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

from spekula.backends.convert_hf import convert

from .head_api import DraftHead


def write_hf_checkpoint(head: DraftHead, folder: Path) -> Path:
    config, tensors = head.hf_checkpoint()
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / "model.safetensors.tmp"
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp))
    os.chmod(tmp, 0o644)  # the writer creates it private; a checkpoint folder is meant to be shared
    os.replace(tmp, folder / "model.safetensors")
    cfg_tmp = folder / "config.json.tmp"
    cfg_tmp.write_text(json.dumps(config, indent=1, default=_plain), encoding="utf-8")
    os.replace(cfg_tmp, folder / "config.json")
    return folder


def _plain(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"cannot write {type(x).__name__} into config.json")


def export_gguf(hf_folder: Path, target_gguf: str, outfile: Path, outtype: str = "f16") -> Path:
    outfile.unlink(missing_ok=True)  # a re-export replaces the previous file
    _, path = convert(hf_folder, outfile, outtype=outtype, target_gguf=target_gguf)
    return path
