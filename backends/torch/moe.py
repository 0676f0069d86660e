"""The feed-forward part of a decoder block: dense SwiGLU, or a routed mixture of SwiGLU experts.

Routing follows the model's description (gguf/architecture.py): softmax or sigmoid probabilities,
top-k on probabilities plus the optional selection bias, weights renormalised and scaled. Each expert
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


class DenseFFN:
    """down(silu(gate x) * up x), gate and up fused into one GEMM. ``gated`` (Qwen3.5-MoE's shared expert):
    the GEMM has one more row, the logit g of the output gate, and the output is multiplied by sigmoid(g).
    ``geglu`` (Gemma): GELU with the tanh approximation in place of SiLU."""

    def __init__(self, gate_up: Lin, down: Lin, n_ff: int, *, gated: bool = False, geglu: bool = False) -> None:
        self.gate_up, self.down, self.n_ff, self.gated, self.geglu = gate_up, down, n_ff, gated, geglu

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up(h)
        F_ = self.n_ff
        act = F.gelu(gu[:, :F_], approximate="tanh") if self.geglu else F.silu(gu[:, :F_])
        out = self.down(act * gu[:, F_ : 2 * F_])
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
    ) -> None:
        self.moe = moe
        self.router = router  # float32 weights: routing is decided in float32 whatever the model dtype
        self.selection_bias = selection_bias
        self.experts = experts
        self.shared = shared

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [M, k] int64 in rank order, their weights [M, k] float32)."""
        moe = self.moe
        logits = self.router(h.float())
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
        return ids, weights

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        M, H = h.shape
        k = self.moe.n_expert_used
        ids, weights = self.route(h)
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
    experts = [DenseFFN(make_lin(gate_up[e], None), make_lin(down[e], None), F_exp) for e in range(moe.n_expert)]
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
    return MoEFFN(moe, make_lin(routing_tensor("ffn_gate_inp.weight"), None), bias, experts, shared)
