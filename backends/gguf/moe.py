"""Mixture-of-experts and multi-token-prediction hyper-parameters of ``qwen3moe`` / ``glm4moe`` GGUFs.

A MoE block replaces the dense FFN by a router (``ffn_gate_inp``), ``n_expert`` SwiGLU experts
stored as 3-D tensors (``ffn_{gate,up,down}_exps``, one [out, in] matrix per expert), and for GLM an
always-on shared expert (``ffn_*_shexp``). Routing, as llama.cpp computes it:

* ``probs = softmax(logits)`` (qwen3moe) or ``sigmoid(logits)`` (glm4moe);
* the ``n_expert_used`` experts with the largest ``probs + exp_probs_b`` are chosen (the bias only
  steers the choice; GLM's "expert score correction");
* their weights are the unbiased ``probs``, divided by their sum when ``norm_weights`` (clamped
  below at 2^-14), then multiplied by ``weights_scale`` (GLM's routed scaling factor) when != 1;
* the block's output is ``sum_e weight_e * expert_e(x)`` plus the shared expert's output.

GLM-4.5 keeps its first ``n_dense_lead`` blocks dense. MTP ("nextn") blocks are appended after the
trunk: ``block_count = n_layer + n_nextn``; the trunk forward never runs them (see drafters/model/mtp.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spekula.core.errors import ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile

MOE_ARCHS = frozenset({"qwen3moe", "glm4moe"})
# The smallest sum the top-k weights are divided by when normalised (2^-14, as llama.cpp clamps it).
WEIGHT_SUM_MIN = 6.103515625e-5
# llama.cpp's expert_gating_func enum as stored in GGUF.
_GATING = {1: "softmax", 2: "sigmoid"}


@dataclass(frozen=True)
class MoEParams:
    n_expert: int
    n_expert_used: int
    n_ff_exp: int  # rows of one expert's gate/up matrices
    n_expert_shared: int  # 0: no shared expert
    n_dense_lead: int  # blocks [0, n_dense_lead) use the dense FFN
    gating: str  # softmax | sigmoid
    norm_weights: bool
    weights_scale: float  # 1.0: none
    selection_bias: bool  # blk.N.exp_probs_b.bias present (GLM)

    @property
    def n_ff_shexp(self) -> int:
        return self.n_ff_exp * self.n_expert_shared

    def is_moe(self, layer: int) -> bool:
        return layer >= self.n_dense_lead


def read_moe_params(f: GGUFFile, arch: str, to_int: Callable[[str, Any], int]) -> MoEParams:
    """The MoE keys of a qwen3moe / glm4moe file; ``to_int(key, value)`` checks integer keys."""

    def opt(key: str, default: Any) -> Any:
        return f.get(f"{arch}.{key}", default)

    def req(key: str) -> Any:
        return f.require(f"{arch}.{key}")

    n_expert = to_int("expert_count", req("expert_count"))
    n_used = to_int("expert_used_count", req("expert_used_count"))
    if n_expert <= 0 or not 0 < n_used <= n_expert:
        raise ModelFileError(f.path, f"invalid expert counts: expert_count={n_expert} expert_used_count={n_used}")
    n_ff_exp = to_int("expert_feed_forward_length", opt("expert_feed_forward_length", 0))
    if n_ff_exp <= 0:
        n_ff_exp = to_int("feed_forward_length", req("feed_forward_length")) // n_used
    if arch == "qwen3moe":
        # qwen3moe's graph always normalises the top-k weights and has no shared expert or bias.
        return MoEParams(n_expert, n_used, n_ff_exp, 0, 0, "softmax", True, 1.0, False)
    gating_id = to_int("expert_gating_func", opt("expert_gating_func", 2))
    if gating_id == 0:  # "none" in the file: llama.cpp's glm4moe falls back to sigmoid
        gating_id = 2
    if gating_id not in _GATING:
        raise ModelFileError(f.path, f"unsupported expert_gating_func {gating_id} (supported: 1 softmax, 2 sigmoid)")
    scale = float(opt("expert_weights_scale", 0.0) or 0.0)
    return MoEParams(
        n_expert=n_expert,
        n_expert_used=n_used,
        n_ff_exp=n_ff_exp,
        n_expert_shared=to_int("expert_shared_count", opt("expert_shared_count", 0)),
        n_dense_lead=to_int("leading_dense_block_count", opt("leading_dense_block_count", 0)),
        gating=_GATING[gating_id],
        norm_weights=bool(opt("expert_weights_norm", False)),
        weights_scale=scale if scale not in (0.0, 1.0) else 1.0,
        selection_bias=True,  # llama.cpp requires exp_probs_b in every glm4moe MoE block
    )


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
    if moe.n_expert_shared:
        S = moe.n_ff_shexp
        shapes |= {prefix + "ffn_gate_shexp.weight": (S, H), prefix + "ffn_up_shexp.weight": (S, H),
                   prefix + "ffn_down_shexp.weight": (H, S)}
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
