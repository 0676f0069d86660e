"""How a file's blocks differ from one another beyond the sliding window (Gemma 4), read once.

Gemma 4, as llama.cpp reads it: the sliding blocks have their own head size
(``attention.key_length_swa`` = ``value_length_swa``) and rope width (``rope.dimension_count_swa``);
the global blocks' rope is "proportional": it spans their whole head but the file's ``rope_freqs``
factors (1 for the rotated pairs, 1e30 for the rest) leave all but the first pairs unrotated, and
only the global blocks apply them. The last ``attention.shared_kv_layers`` blocks compute no keys or
values: with ``s = n_layer - shared_kv_layers`` blocks owning KV, a shared sliding block reads block
``s - 2``'s and a shared global block block ``s - 1``'s (llama.cpp's mapping; the file must make those
blocks a sliding and a global one). With ``embedding_length_per_layer_input`` P > 0 every block also
takes a per-layer input of P values per token::

    inp = (rms_norm(x0 @ per_layer_model_proj * n_embd^-1/2 , per_layer_proj_norm)   # [n_layer, P] per token
           + per_layer_token_embd[token] * sqrt(P)) / sqrt(2)                         # x0: scaled embedding
    block i, after its FFN residual:  x += rms_norm(proj(gelu(inp_gate(x)) * inp[i]), post_norm)

and every block's output is multiplied by its ``layer_output_scale`` where the file has one. The dense
FFN's width may vary by block (``feed_forward_length`` an array: ``use_double_wide_mlp`` doubles the
KV-sharing blocks'); ``ModelHParams.n_ff`` is then the widest and ``block_n_ff`` each block's. The KV head
count may vary likewise (``attention.head_count_kv`` an array: ``num_global_key_value_heads`` gives the global
blocks their own, as the 31B and 26B-A4B set it); ``n_head_kv`` is then the most and ``block_n_head_kv`` each
block's, and a block sharing another's KV has its owner's count.

A block owning KV but without ``attn_v`` (transformers' ``attention_k_eq_v``: the 31B's and 26B-A4B's
global blocks) takes its values from the key projection's output, before the key norm and rope; the
weightless value norm then applies to them as to any values (llama.cpp's ``Vcur = Kcur``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spekula.core.errors import ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile


@dataclass(frozen=True)
class BlockLayout:
    """Per-block shapes and sharing of one file (the defaults: every block alike, its own KV)."""

    head_dim_swa: int = 0  # the sliding blocks' head size (0: the file's head size)
    n_rot_swa: int = 0  # the sliding blocks' rope width (0: the file's)
    kv_source: tuple[int, ...] = ()  # per trunk block: the block whose keys and values it attends (empty: itself)
    n_embd_per_layer: int = 0  # P of the per-layer inputs (0: none)
    out_scale: bool = False  # blocks multiply their output by layer_output_scale
    values_from_keys: tuple[int, ...] = ()  # blocks owning KV whose values are their key projection (no attn_v)
    n_ff_blocks: tuple[int, ...] = ()  # per trunk block: its dense FFN width (empty: the file's one width)
    n_head_kv_blocks: tuple[int, ...] = ()  # per trunk block: its KV head count (empty: the file's one count)

    def owns_kv(self, layer: int) -> bool:
        return layer >= len(self.kv_source) or self.kv_source[layer] == layer

    def kv_of(self, layer: int) -> int:
        return self.kv_source[layer] if self.kv_source and layer < len(self.kv_source) else layer


def read_block_layout(f: GGUFFile, opt: Callable[[str, Any], Any], uniform: Callable[[str, Any], int], n_layer: int,
                      swa_layers: tuple[bool, ...], head_dim: int, n_rot: int,
                      n_ff_blocks: tuple[int, ...] = (), n_head_kv_blocks: tuple[int, ...] = ()) -> BlockLayout:
    """`f`'s :class:`BlockLayout` (see the module docstring); a malformed one is a ModelFileError."""
    arch = f.architecture
    hd_swa = uniform("attention.key_length_swa", opt("attention.key_length_swa", head_dim))
    vd_swa = uniform("attention.value_length_swa", opt("attention.value_length_swa", hd_swa))
    if hd_swa <= 0 or hd_swa != vd_swa:
        raise ModelFileError(f.path, f"key_length_swa {hd_swa} != value_length_swa {vd_swa} is not supported")
    n_rot_swa = uniform("rope.dimension_count_swa", opt("rope.dimension_count_swa", min(n_rot, hd_swa)))
    if n_rot_swa <= 0 or n_rot_swa > hd_swa or n_rot_swa % 2:
        raise ModelFileError(f.path, f"invalid rope.dimension_count_swa {n_rot_swa} for head size {hd_swa}")
    shared = uniform("attention.shared_kv_layers", opt("attention.shared_kv_layers", 0))
    kv_source = tuple(range(n_layer))
    if shared:
        owners = n_layer - shared
        if shared < 0 or owners < 2 or len(swa_layers) != n_layer:
            raise ModelFileError(f.path, f"invalid {arch}.attention.shared_kv_layers = {shared} for {n_layer} blocks "
                                         "(at least two blocks must own KV, and the file must have a sliding window)")
        if not (swa_layers[owners - 2] and not swa_layers[owners - 1]):
            raise ModelFileError(f.path, f"inconsistent {arch}.attention.sliding_window_pattern: the shared KV of "
                                         f"blocks {owners}.. comes from block {owners - 2} (sliding) and "
                                         f"{owners - 1} (global), which the pattern does not make so")
        kv_source = tuple(i if i < owners else owners - (2 if swa_layers[i] else 1) for i in range(n_layer))
    if n_head_kv_blocks and any(n_head_kv_blocks[i] != n_head_kv_blocks[kv_source[i]] for i in range(n_layer)):
        raise ModelFileError(f.path, f"inconsistent {arch}.attention.head_count_kv {list(n_head_kv_blocks)}: a block "
                                     "sharing another's KV must have its KV head count")
    n_pl = uniform("embedding_length_per_layer_input", opt("embedding_length_per_layer_input", 0))
    if n_pl < 0:
        raise ModelFileError(f.path, f"invalid {arch}.embedding_length_per_layer_input = {n_pl}")
    for name in ("per_layer_token_embd.weight", "per_layer_model_proj.weight", "per_layer_proj_norm.weight"):
        if n_pl and not f.has_tensor(name):
            raise ModelFileError(f.path, f"missing tensor {name!r} (the file has per-layer inputs of {n_pl} values)")
    values_from_keys = tuple(i for i in range(n_layer)
                             if kv_source[i] == i and not f.has_tensor(f"blk.{i}.attn_v.weight"))
    layout = BlockLayout(
        head_dim_swa=hd_swa if hd_swa != head_dim else 0,
        n_rot_swa=n_rot_swa if n_rot_swa != n_rot else 0,
        kv_source=kv_source if shared else (),
        n_embd_per_layer=n_pl,
        out_scale=f.has_tensor("blk.0.layer_output_scale.weight"),
        values_from_keys=values_from_keys,
        n_ff_blocks=n_ff_blocks,
        n_head_kv_blocks=n_head_kv_blocks,
    )
    return layout
