"""The feed-forward part of a decoder block: dense SwiGLU, or a routed mixture of SwiGLU experts.

Routing follows the model's description (gguf/architecture.py): softmax or sigmoid probabilities,
top-k on probabilities plus the optional selection bias, weights renormalised and scaled; or (gpt-oss)
top-k on the logits and a softmax over the chosen ones, experts with biases and the clamped SwiGLU. Each expert
runs as two GEMMs over the rows routed to it, never per token.

Exact mode (see ``torch.py``): a row's output must not depend on the other rows of the tile. The expert
GEMMs go through the same :class:`Lin` plan as the dense ones, so a GEMM's result for a row is the same
at any row count, and the number of rows an expert gets (which varies with routing) does not matter.
The top-k is a stable sort (ties: lower expert index first), and a row's expert contributions are summed
in the order of their rank in its top-k, one add at a time, so the sum order is the row's own.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from spekula.backends.gguf.architecture import MoEParams
from spekula.backends.gguf.moe import WEIGHT_SUM_MIN
from spekula.backends.torch.linear import Lin

MakeLin = Callable[[torch.Tensor, torch.Tensor | None], Lin]
ToTensor = Callable[[np.ndarray], torch.Tensor]


def moe_gemm_shapes(moe: MoEParams, n_embd: int) -> list[tuple[int, int]]:
    """[n, k] of every linear a MoE block runs: router, fused expert gate/up, expert down, shared expert."""
    shapes = [(moe.n_expert, n_embd), (2 * moe.n_ff_exp, n_embd), (n_embd, moe.n_ff_exp)]
    if moe.n_expert_shared:  # the shared expert's gate logit rides along as one more row of its gate/up
        shapes += [(2 * moe.n_ff_shexp + int(moe.shared_gate), n_embd), (n_embd, moe.n_ff_shexp)]
    return shapes


def _rowwise_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """sigmoid of [M, E] with each row's bits independent of M.

    On a contiguous tensor an elementwise kernel runs as one flat loop: vector chunks, then a scalar
    tail whose exp rounds differently, so which values of a narrow row (E = 4) take the tail depends
    on M. On a view whose rows are not adjacent, every row is its own inner loop, vectorised from its
    start, whatever the row count (the same reason ``silu`` on the gate half of gate/up is safe).
    """
    M, E = x.shape
    spaced = x.new_empty((M, E + 1))
    spaced[:, :E] = x
    return torch.sigmoid(spaced[:, :E])


# gpt-oss's swiglu_oai constants (llama.cpp's graph fixes them too).
SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT = 1.702, 7.0


def _swiglu_oai(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """min(gate, 7) * sigmoid(1.702 min(gate, 7)) * (clamp(up, -7, 7) + 1) of [M, F] views, row-wise exact.

    The sigmoid (the only operation whose vector and scalar paths round differently) runs on a view
    whose rows are not adjacent, as in :func:`_rowwise_sigmoid`; clamps, products and sums are
    correctly rounded whichever path computes them."""
    M, F_ = gate.shape
    x = gate.clamp(max=SWIGLU_OAI_LIMIT)
    spaced = x.new_empty((M, F_ + 1))
    spaced[:, :F_] = x * SWIGLU_OAI_ALPHA
    return x * torch.sigmoid(spaced[:, :F_]) * (up.clamp(-SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT) + 1.0)


class DenseFFN:
    """down(silu(gate x) * up x), gate and up fused into one GEMM. ``gated`` (Qwen3.5-MoE's shared expert):
    the GEMM has one more row, the logit g of the output gate, and the output is multiplied by sigmoid(g).
    ``geglu`` (Gemma): GELU with the tanh approximation in place of SiLU. ``oai``: gpt-oss's clamped
    swiglu_oai in place of silu(gate) * up."""

    def __init__(self, gate_up: Lin, down: Lin, n_ff: int, *, gated: bool = False, geglu: bool = False,
                 oai: bool = False) -> None:
        self.gate_up, self.down, self.n_ff, self.gated, self.geglu, self.oai = gate_up, down, n_ff, gated, geglu, oai

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up(h)
        F_ = self.n_ff
        gate, up = gu[:, :F_], gu[:, F_ : 2 * F_]
        if self.oai:
            out = self.down(_swiglu_oai(gate, up))
        else:
            out = self.down((F.gelu(gate, approximate="tanh") if self.geglu else F.silu(gate)) * up)
        if self.gated:
            # [M, 1] view with the GEMM's row stride: every row's sigmoid is a scalar, whatever M is.
            out = out * torch.sigmoid(gu[:, 2 * F_ : 2 * F_ + 1])
        return out


class MoEFFN:
    """Routed experts (+ the shared expert): ``sum_r w_r * expert_{e_r}(h) [+ shared(h)]`` per row."""

    def __init__(
        self,
        moe: MoEParams,
        router: Lin,
        selection_bias: torch.Tensor | None,
        experts: list[DenseFFN],
        shared: DenseFFN | None,
        expert_scale: torch.Tensor | None = None,
    ) -> None:
        self.moe = moe
        self.expert_scale = expert_scale  # [E] float32: each expert's output multiplier (Gemma 4), or None
        self.router = router  # float32 weights: routing is decided in float32 whatever the model dtype
        self.selection_bias = selection_bias
        self.experts = experts
        self.shared = shared

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [M, k] int64 in rank order, their weights [M, k] float32) for router inputs h."""
        moe = self.moe
        logits = self.router(h.float())
        if moe.gating == "softmax_weight":  # top-k of the logits, softmax over the chosen (row-wise)
            ids = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, : moe.n_expert_used]
            weights = torch.softmax(logits.gather(1, ids), dim=-1)
            return ids, weights * moe.weights_scale if moe.weights_scale != 1.0 else weights
        probs = torch.softmax(logits, dim=-1) if moe.gating == "softmax" else _rowwise_sigmoid(logits)
        choice = probs + self.selection_bias if self.selection_bias is not None else probs
        ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, : moe.n_expert_used]
        weights = probs.gather(1, ids)
        if moe.norm_weights:
            total = weights[:, 0]
            for r in range(1, moe.n_expert_used):
                total = total + weights[:, r]
            weights = weights / total.clamp_min(WEIGHT_SUM_MIN).unsqueeze(1)
        if moe.weights_scale != 1.0:
            weights = weights * moe.weights_scale
        if self.expert_scale is not None:
            weights = weights * self.expert_scale[ids]
        return ids, weights

    def __call__(self, h: torch.Tensor, route_input: torch.Tensor | None = None) -> torch.Tensor:
        """The experts over rows h, routed on h or on ``route_input`` (Gemma 4 routes on its own input)."""
        M, H = h.shape
        k = self.moe.n_expert_used
        ids, weights = self.route(h if route_input is None else route_input)
        flat_ids = ids.reshape(-1)  # slot s = row * k + rank
        flat_w = weights.reshape(-1, 1).to(h.dtype)
        # Slots grouped by expert, each group in slot order; one host sync for the group sizes.
        slots = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.moe.n_expert).tolist()
        contrib = torch.empty((M * k, H), dtype=h.dtype, device=h.device)
        off = 0
        for e, c in enumerate(counts):
            if not c:
                continue
            sel = slots[off : off + c]
            off += c
            y = self.experts[e](h.index_select(0, sel // k))
            contrib.index_copy_(0, sel, y * flat_w.index_select(0, sel))
        per_rank = contrib.view(M, k, H)
        out = per_rank[:, 0].clone()
        for r in range(1, k):
            out += per_rank[:, r]
        if self.shared is not None:
            out += self.shared(h)
        return out


def build_moe_ffn(
    moe: MoEParams,
    weights: dict[str, np.ndarray],
    prefix: str,
    *,
    to_tensor: ToTensor,
    make_lin: MakeLin,
) -> MoEFFN:
    """The MoE FFN of the block whose tensors start with ``prefix`` (``blk.N.``).

    ``to_tensor`` moves an array to the model's device and dtype; ``make_lin`` builds a planned Lin.
    The expert tensors become one [E, 2F, H] gate/up tensor and one [E, H, F] down tensor, each
    moved to the device once; an expert's Lin holds a view of them, or its prepacked copy instead (then
    nothing holds the 3-D tensor and it is freed).
    """
    F_exp = moe.n_ff_exp
    gate_up = to_tensor(np.concatenate([weights[prefix + "ffn_gate_exps.weight"],
                                        weights[prefix + "ffn_up_exps.weight"]], axis=1))
    down = to_tensor(weights[prefix + "ffn_down_exps.weight"])
    gate_up_b = down_b = None
    if moe.expert_bias:  # [E, 2F] and [E, H]: each expert's row of them
        gate_up_b = to_tensor(np.concatenate([weights[prefix + "ffn_gate_exps.bias"],
                                              weights[prefix + "ffn_up_exps.bias"]], axis=1))
        down_b = to_tensor(weights[prefix + "ffn_down_exps.bias"])
    oai, geglu = moe.activation == "swiglu_oai", moe.activation == "geglu"
    experts = [DenseFFN(make_lin(gate_up[e], None if gate_up_b is None else gate_up_b[e]),
                        make_lin(down[e], None if down_b is None else down_b[e]), F_exp, oai=oai, geglu=geglu)
               for e in range(moe.n_expert)]
    shared = None
    if moe.n_expert_shared:
        parts = [weights[prefix + "ffn_gate_shexp.weight"], weights[prefix + "ffn_up_shexp.weight"]]
        if moe.shared_gate:
            parts.append(weights[prefix + "ffn_gate_inp_shexp.weight"].reshape(1, -1))
        shared_down = to_tensor(weights[prefix + "ffn_down_shexp.weight"])
        shared = DenseFFN(make_lin(to_tensor(np.concatenate(parts)), None), make_lin(shared_down, None),
                          moe.n_ff_shexp, gated=moe.shared_gate)

    def routing_tensor(name: str) -> torch.Tensor:
        return torch.from_numpy(weights[prefix + name]).to(device=gate_up.device, dtype=torch.float32).contiguous()

    bias = routing_tensor("exp_probs_b.bias") if moe.selection_bias else None
    router_bias = routing_tensor("ffn_gate_inp.bias") if moe.expert_bias else None
    scale = routing_tensor("ffn_down_exps.scale") if prefix + "ffn_down_exps.scale" in weights else None
    return MoEFFN(moe, make_lin(routing_tensor("ffn_gate_inp.weight"), router_bias), bias, experts, shared, scale)
