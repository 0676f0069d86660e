"""Editing a Hugging Face checkpoint directory in place, for the converter tests (bad inputs, other layouts).

Imported by tests/backends/test_convert*.py (tests/conftest.py puts tests/ on sys.path).
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


def nest_as_conditional_generation(path: Path) -> None:
    """Rewrite a Qwen3.5 text checkpoint as the published multimodal layout stores it: config under
    ``text_config`` of a ``...ForConditionalGeneration``, trunk tensors under ``model.language_model.``,
    plus one vision-tower tensor (``model.visual.*``) that a text converter must skip."""
    cfg = json.loads((path / "config.json").read_text())
    moe = cfg["architectures"][0].startswith("Qwen3_5Moe")
    text = {k: v for k, v in cfg.items() if k not in ("architectures", "transformers_version", "dtype")}
    outer = {"architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
             "model_type": "qwen3_5_moe" if moe else "qwen3_5", "text_config": text,
             "tie_word_embeddings": cfg.get("tie_word_embeddings", False)}
    (path / "config.json").write_text(json.dumps(outer))
    t = load_file(str(path / "model.safetensors"))
    renamed = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v for k, v in t.items()}
    renamed["model.visual.patch_embed.proj.weight"] = np.ones((8, 3), np.float32)
    save_file(renamed, str(path / "model.safetensors"))
