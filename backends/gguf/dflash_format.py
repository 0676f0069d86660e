"""What a DFlash / DSpark draft GGUF may hold for spekula's runtimes to decode it as trained.

Both runtimes (torch and native) refuse the same keys and tensors: each changes the forward in a way
neither implements, and a draft decoded wrongly would only ever be rejected, silently wasting rounds.
"""

from __future__ import annotations

from spekula.core.errors import ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile

UNSUPPORTED_KEYS = ("attention.sliding_window", "attention.value_scale", "logit_scale", "final_logit_softcapping",
                    "embedding_scale", "rope.dimension_sections", "selector_rank", "conv_kernel_size")
UNSUPPORTED_TENSORS = ("blk.0.post_attention_norm.weight", "blk.0.post_ffw_norm.weight",
                       "blk.0.layer_output_scale.weight", "blk.0.attn_sinks.weight", "selector_hidden.weight")


def check_supported(f: GGUFFile, arch: str = "dflash") -> None:
    """ModelFileError naming the first key or tensor of ``f`` that the runtimes do not implement."""
    for key in UNSUPPORTED_KEYS:
        if f.get(f"{arch}.{key}") is not None:
            raise ModelFileError(f.path, f"key {arch}.{key} is not supported by this runtime")
    for name in UNSUPPORTED_TENSORS:
        if f.has_tensor(name):
            raise ModelFileError(f.path, f"tensor {name!r} is not supported by this runtime")
