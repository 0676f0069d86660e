"""The tensors of mixture-of-experts and multi-token-prediction blocks (routing: gguf/architecture.py).

A MoE block replaces the dense FFN by a router (``ffn_gate_inp``), ``n_expert`` SwiGLU experts
stored as 3-D tensors (``ffn_{gate,up,down}_exps``, one [out, in] matrix per expert), an optional
always-on shared expert (``ffn_*_shexp``) and optionally the selection bias (``exp_probs_b``). MTP
("nextn") blocks are appended after the trunk: ``block_count = n_layer + n_nextn``; the trunk forward
never runs them (see drafters/model/mtp.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from spekula.backends.gguf.architecture import MoEParams
from spekula.core.errors import ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile

# The smallest sum the top-k weights are divided by when normalised (2^-14, as llama.cpp clamps it).
WEIGHT_SUM_MIN = 6.103515625e-5


def moe_ffn_shapes(moe: MoEParams, prefix: str, n_embd: int) -> dict[str, tuple[int, ...]]:
    """Required tensors of one MoE block's FFN (PyTorch order: experts first)."""
    H, E, F = n_embd, moe.n_expert, moe.n_ff_exp
    shapes: dict[str, tuple[int, ...]] = {
        prefix + "ffn_gate_inp.weight": (E, H),
        prefix + "ffn_gate_exps.weight": (E, F, H),
        prefix + "ffn_up_exps.weight": (E, F, H),
        prefix + "ffn_down_exps.weight": (E, H, F),
    }
    if moe.selection_bias:
        shapes[prefix + "exp_probs_b.bias"] = (E,)
    if moe.expert_bias:
        shapes |= {prefix + "ffn_gate_inp.bias": (E,), prefix + "ffn_gate_exps.bias": (E, F),
                   prefix + "ffn_up_exps.bias": (E, F), prefix + "ffn_down_exps.bias": (E, H)}
    if moe.beside_dense:  # Gemma 4: the router's input scale and the two halves' own norms
        shapes |= {prefix + "ffn_gate_inp.scale": (H,), prefix + "pre_ffw_norm_2.weight": (H,),
                   prefix + "post_ffw_norm_1.weight": (H,), prefix + "post_ffw_norm_2.weight": (H,)}
    if moe.n_expert_shared:
        S = moe.n_ff_shexp
        shapes |= {prefix + "ffn_gate_shexp.weight": (S, H), prefix + "ffn_up_shexp.weight": (S, H),
                   prefix + "ffn_down_shexp.weight": (H, S)}
        if moe.shared_gate:
            shapes[prefix + "ffn_gate_inp_shexp.weight"] = (H,)
    return shapes


@dataclass(frozen=True)
class HeadSources:
    """The tensors MTP head k reads besides its block: its own when the file has them, else the trunk's."""

    embd: str
    norm: str
    head: str


def head_sources(f: GGUFFile, tied_output: bool, block: int) -> HeadSources:
    b = f"blk.{block}.nextn."

    def first(*names: str) -> str:
        for name in names:
            if f.has_tensor(name):
                return name
        raise ModelFileError(f.path, f"missing tensor {names[-1]!r} (needed by the MTP head)")

    trunk_head = "token_embd.weight" if tied_output else "output.weight"
    return HeadSources(first(b + "embed_tokens.weight", "token_embd.weight"),
                       first(b + "shared_head_norm.weight", "output_norm.weight"),
                       first(b + "shared_head_head.weight", trunk_head))


def nextn_shapes(prefix: str, n_embd: int, n_vocab: int) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """(required, optional) nextn tensors of one MTP block, on top of its ordinary block tensors."""
    H = n_embd
    required = {prefix + "nextn.eh_proj.weight": (H, 2 * H), prefix + "nextn.enorm.weight": (H,),
                prefix + "nextn.hnorm.weight": (H,)}
    optional = {prefix + "nextn.shared_head_norm.weight": (H,), prefix + "nextn.shared_head_head.weight": (n_vocab, H),
                prefix + "nextn.embed_tokens.weight": (n_vocab, H)}
    return required, optional
