"""A GGUF decoder (as gguf/architecture.py describes it) in plain PyTorch, run one row tile at a time.

The backend (``torch.py``) cuts a forward pass into :class:`Tile` s and this module runs a tile through
every block. What makes the exact mode exact is decided by the planner; here the rule is only that
every operation on a tile is either row-wise (norms, rope, activations, routing) or a GEMM whose shapes
the planner fixed, so a row meets the same kernels wherever it sits (the FFNs, dense and MoE, are in
``moe.py``). A hybrid model's recurrent blocks run the gated delta-net of ``delta_net.py`` instead of
attention (per sequence, token by token); its attention blocks may gate their output (Qwen3.5).
Sliding-window blocks (Gemma 3) read the tile's window masks and their own rope table; Gemma-style
blocks RMS-norm the attention and FFN outputs before each residual add, and scale the embeddings.
Gemma 4's blocks (gguf/block_layout.py) have their own head size (the KV buffers are as wide as the
widest head; a block uses its first head-size columns), may attend another block's KV instead of
computing their own, RMS-norm their values, add a per-layer input (``PerLayerInputs``) and scale
their output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from spekula.backends.gguf.architecture import ModelHParams
from spekula.backends.gguf.weights import rope_inv_freq
from spekula.backends.torch.delta_net import (
    DeltaNetWeights,
    advance,
    build_delta_net,
    delta_net_gemm_shapes,
    gated_output,
    recurrence_width,
)
from spekula.backends.torch.dense_experts import DenseBesideExperts
from spekula.backends.torch.kv import SeqCache
from spekula.backends.torch.linear import GemmPlan, Lin, plain_gemm, planned_lin
from spekula.backends.torch.moe import DenseFFN, MoEFFN, build_moe_ffn, moe_gemm_shapes
from spekula.backends.torch.per_layer import PerLayerInputs
from spekula.backends.torch.rope_tables import RopeTables


@dataclass
class AttnGroup:
    """Rows ``[r0, r1)`` of a tile: one sequence, consecutive positions, one key window ``[0, n_keys)``."""

    cache: SeqCache
    r0: int
    r1: int
    n_keys: int
    q_rows: int  # rows the attention GEMMs run on (>= r1 - r0; padding repeats the last row)
    mask: torch.Tensor  # additive [g * q_rows, n_keys]: 0 for visible keys, -inf for the row's future
    q_index: torch.Tensor  # rows of the tile's [M * (n_head + n_kv), hd] q/k view, in (kv, j, row) order
    window_mask: torch.Tensor | None = None  # sliding blocks' mask: also -inf before each row's window


@dataclass
class KVWrite:
    cache: SeqCache
    r0: int
    r1: int
    pos0: int


@dataclass
class Tile:
    tokens: torch.Tensor  # int64 [M] (padded rows hold token 0)
    cos: torch.Tensor  # [M, 1, n_rot] float32 (see torch/rope_tables.py)
    sin: torch.Tensor
    n_real: int
    writes: list[KVWrite] = field(default_factory=list)
    cos_swa: torch.Tensor | None = None  # the sliding blocks' rope (None: no block slides)
    sin_swa: torch.Tensor | None = None
    groups: list[AttnGroup] = field(default_factory=list)
    q_scale: torch.Tensor | None = None  # [M, 1, 1]: the queries' temperature by position (TorchModel.q_scale)
    per_layer: torch.Tensor | None = None  # [M, n_layer, P]: Gemma 4's per-layer inputs (set by run_tile)


def model_gemm_shapes(hp: ModelHParams) -> list[tuple[int, int]]:
    """[n, k] of every linear the model runs (fused qkv and gate/up, as built below)."""
    q_heads = 2 * hp.n_head if hp.recipe.attn_output_gate else hp.n_head  # [q | gate] per head
    shapes = [(hp.n_vocab, hp.n_embd)]
    for i in range(hp.n_layer):
        hd = hp.block_head_dim(i)
        kv_heads = 2 * hp.block_n_head_kv(i) if hp.layout.owns_kv(i) else 0
        shapes += [((q_heads + kv_heads) * hd, hp.n_embd), (hp.n_embd, hp.n_head * hd)]
    P = hp.layout.n_embd_per_layer
    if P:
        shapes += [(hp.n_layer * P, hp.n_embd), (P, hp.n_embd), (hp.n_embd, P)]
    if hp.delta_net is not None:
        shapes += delta_net_gemm_shapes(hp.delta_net, hp.n_embd)
    if hp.moe is None or hp.moe.n_dense_lead > 0 or hp.moe.beside_dense:
        for ff in sorted({hp.n_ff} | set(hp.layout.n_ff_blocks)):  # Gemma 4's widths may vary by block
            shapes += [(2 * ff, hp.n_embd), (hp.n_embd, ff)]
    if hp.moe is not None:
        shapes += moe_gemm_shapes(hp.moe, hp.n_embd)
    return shapes


@dataclass
class AttnWeights:
    qkv: Lin  # [(n_head (x2 when gated) + 2 n_kv) * hd, H]: one GEMM instead of three
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    out: Lin
    kv_layer: int  # the layer of the sequences' KV caches this block writes (or reads, when not owns_kv)
    sliding: bool = False  # attends through the window with the sliding rope
    sinks: torch.Tensor | None = None  # [n_head] float32 sink logits (gpt-oss), in every softmax
    head_dim: int = 0
    owns_kv: bool = True  # False: qkv projects queries only, the keys and values are kv_layer's (Gemma 4)
    value_norm: bool = False  # values RMS-normed per head, no weight
    n_head_kv: int = 0  # its KV heads (0: the file's; Gemma 4's global blocks may have fewer: the caches' first ones)


@dataclass
class PerLayerInput:
    """One block's share of Gemma 4's per-layer inputs: x += rms_norm(proj(gelu(gate(x)) * inp), norm)."""

    gate: Lin
    proj: Lin
    norm: torch.Tensor


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    mixer: AttnWeights | DeltaNetWeights
    ffn_norm: torch.Tensor
    ffn: DenseFFN | MoEFFN | DenseBesideExperts
    recurrent_index: int = -1  # a delta-net block's index in the sequences' recurrent state
    attn_post_norm: torch.Tensor | None = None  # Gemma: the sublayer outputs RMS-normed before the add
    ffn_post_norm: torch.Tensor | None = None
    per_layer: PerLayerInput | None = None
    out_scale: torch.Tensor | None = None  # the block's output is multiplied by this scalar

def _rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return torch.rms_norm(x, (x.shape[-1],), w, eps)
    # Half precision: normalise in float32 as the reference implementations do.
    y = torch.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)
    return y * w if w is not None else y


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """GGUF llama Q/K row order (interleaved rope pairs) back to HF's rotate-half order, per head."""
    rows = w.shape[0]
    hd = rows // n_head
    return w.reshape(n_head, hd // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class TorchModel:
    def __init__(
        self,
        hp: ModelHParams,
        weights: dict[str, np.ndarray],
        *,
        dtype: torch.dtype,
        device: torch.device,
        max_pos: int,
        gemm: GemmPlan = plain_gemm,
        blocks: Sequence[int] | None = None,
    ) -> None:
        """``blocks``: the GGUF block ids built as this model's layers, in order (default: the trunk,
        0 .. n_layer-1); the MTP runtime builds its heads' blocks, run with :meth:`run_block`."""
        self.hp, self.dtype, self.device = hp, dtype, device
        self.gemm = gemm
        block_ids = list(range(hp.n_layer)) if blocks is None else list(blocks)
        # NORM-rope rows (llama's) were permuted for interleaved rope; un-permuting Q and K alike leaves
        # every q.k score unchanged and lets all archs share the cheaper rotate-half rope.
        self.unpermuted = not hp.rope_neox and hp.n_rot == hp.head_dim and not hp.has_qk_norm
        weights = dict(weights)
        if self.unpermuted:
            for i in block_ids:
                for kind, n in (("q", hp.n_head), ("k", hp.n_head_kv)):
                    for suffix in ("weight", "bias"):
                        name = f"blk.{i}.attn_{kind}.{suffix}"
                        if name in weights:
                            weights[name] = _unpermute_rows(weights[name], n)
        self.neox = hp.rope_neox or self.unpermuted

        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(device=device, dtype=dtype).contiguous()

        def t(name: str) -> torch.Tensor:
            return dev(weights[name])

        def opt(name: str) -> torch.Tensor | None:
            return t(name) if name in weights else None

        def cat(*names: str) -> torch.Tensor:
            # Fused rows: one GEMM instead of three (qkv) or two (gate/up) per block.
            return dev(np.concatenate([weights[n] for n in names], axis=0))

        self.embd = t("token_embd.weight")
        self.lm_head = self._lin(self.embd if hp.tied_output else t("output.weight"), opt("output.bias"))
        self.out_norm = t("output_norm.weight")
        self.layers: list[LayerWeights] = []
        self.n_kv_layers = self.n_recurrent = 0
        kv_layer_of: dict[int, int] = {}  # block id -> the KV layer it writes
        for i in block_ids:
            b = f"blk.{i}."
            ffn: DenseFFN | MoEFFN | DenseBesideExperts
            moe_block = hp.moe is not None and hp.moe.is_moe(i)
            if moe_block and hp.moe is not None and not hp.moe.beside_dense:
                ffn = build_moe_ffn(hp.moe, weights, b, to_tensor=dev, make_lin=self._lin)
            else:
                gate_up = self._lin(cat(b + "ffn_gate.weight", b + "ffn_up.weight"), self._gate_up_bias(weights, b))
                ffn = DenseFFN(gate_up, self._lin(t(b + "ffn_down.weight"), opt(b + "ffn_down.bias")), hp.block_n_ff(i),
                               geglu=hp.geglu)
                if moe_block and hp.moe is not None:  # Gemma 4: the experts beside the dense FFN
                    ffn = DenseBesideExperts(
                        ffn, build_moe_ffn(hp.moe, weights, b, to_tensor=dev, make_lin=self._lin),
                        router_scale=t(b + "ffn_gate_inp.scale"), pre_norm_2=t(b + "pre_ffw_norm_2.weight"),
                        post_norm_1=t(b + "post_ffw_norm_1.weight"), post_norm_2=t(b + "post_ffw_norm_2.weight"),
                        n_embd=hp.n_embd, eps=hp.rms_eps)
            mixer: AttnWeights | DeltaNetWeights
            recurrent_index = -1
            if hp.is_recurrent(i) and i < hp.n_layer:
                mixer = build_delta_net(weights, b, device=device, to_tensor=dev, make_lin=self._lin)
                recurrent_index, self.n_recurrent = self.n_recurrent, self.n_recurrent + 1
            else:
                owns_kv = hp.layout.owns_kv(i)
                v_part = "attn_k" if i in hp.layout.values_from_keys else "attn_v"  # k_eq_v: values are the keys' rows
                parts = ("attn_q", "attn_k", v_part) if owns_kv else ("attn_q",)
                bias = cat(*(b + p + ".bias" for p in parts)) if hp.has_qkv_bias else None
                if owns_kv:
                    kv_layer_of[i], self.n_kv_layers = self.n_kv_layers, self.n_kv_layers + 1
                mixer = AttnWeights(
                    qkv=self._lin(cat(*(b + p + ".weight" for p in parts)), bias),
                    q_norm=opt(b + "attn_q_norm.weight"),
                    k_norm=opt(b + "attn_k_norm.weight"),
                    out=self._lin(t(b + "attn_output.weight"), opt(b + "attn_output.bias")),
                    kv_layer=kv_layer_of[hp.layout.kv_of(i)],
                    sliding=hp.is_sliding(i),
                    sinks=torch.from_numpy(weights[b + "attn_sinks.weight"]).to(device=device, dtype=torch.float32)
                    if hp.recipe.attn_sinks else None,
                    head_dim=hp.block_head_dim(i) if i < hp.n_layer else hp.head_dim,
                    owns_kv=owns_kv,
                    value_norm=hp.recipe.value_norm,
                    n_head_kv=hp.block_n_head_kv(i) if i < hp.n_layer else hp.n_head_kv,
                )
            per_layer = None
            if hp.layout.n_embd_per_layer and i < hp.n_layer:
                per_layer = PerLayerInput(self._lin(t(b + "inp_gate.weight"), None),
                                          self._lin(t(b + "proj.weight"), None), t(b + "post_norm.weight"))
            self.layers.append(LayerWeights(t(b + "attn_norm.weight"), mixer, t(b + hp.ffn_norm_name + ".weight"), ffn,
                                            recurrent_index, *self._post_norms(t, b), per_layer=per_layer,
                                            out_scale=opt(b + "layer_output_scale.weight")))
        self.per_layer_inputs = PerLayerInputs(hp, t, self._lin) if hp.layout.n_embd_per_layer else None
        self.rope = RopeTables(rope_inv_freq(hp, weights),
                               rope_inv_freq(hp, weights, sliding=True) if any(hp.swa_layers) else None,
                               neox=self.neox, mscale=hp.rope_mscale, max_pos=max_pos, device=device)

    def _post_norms(self, t: Callable[[str], torch.Tensor], b: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Block `b`'s post-sublayer norms where the description has them (GLM's post_attention_norm is its
        pre-FFN norm, not one of these)."""
        if not self.hp.post_norms:
            return None, None
        return t(b + "post_attention_norm.weight"), t(b + "post_ffw_norm.weight")

    def _lin(self, w: torch.Tensor, b: torch.Tensor | None) -> Lin:
        return planned_lin(self.gemm, w, b)

    def q_scale(self, positions: np.ndarray) -> torch.Tensor | None:
        """Each row's query multiplier [M, 1, 1] for a tile's positions, or None when the file has no
        attention temperature (gguf/rope_scaling.py)."""
        temp = self.hp.attn_temperature
        if temp is None:
            return None
        return torch.from_numpy(temp.factors(positions)).to(device=self.device, dtype=self.dtype).view(-1, 1, 1)

    def _gate_up_bias(self, weights: dict[str, np.ndarray], b: str) -> torch.Tensor | None:
        g, u = weights.get(b + "ffn_gate.bias"), weights.get(b + "ffn_up.bias")
        if g is None and u is None:
            return None
        n_ff = self.hp.n_ff
        parts = [g if g is not None else np.zeros(n_ff, np.float32), u if u is not None else np.zeros(n_ff, np.float32)]
        return torch.from_numpy(np.concatenate(parts)).to(device=self.device, dtype=self.dtype)

    # ---- per-tile math ---------------------------------------------------------------------------

    def _attention(self, tile: Tile, kv_layer: int, qk: torch.Tensor, out: torch.Tensor, sliding: bool = False,
                   sinks: torch.Tensor | None = None, n_kv: int = 0) -> None:
        """qk: roped [M, n_head + n_kv, hd] (a block reading another's KV: its queries in the first n_head of
        those rows). Writes each group's rows of ``out`` [M, n_head, hd].
        ``sinks``: one more logit per head in each row's softmax, whose probability weighs no value.
        ``n_kv``: the block's KV heads, the caches' first ones (0: the file's n_head_kv; qk keeps n_head_kv rows)."""
        hp = self.hp
        n_kv = n_kv or hp.n_head_kv
        g, hd = hp.n_head // n_kv, qk.shape[-1]
        flat = qk.view(-1, hd)
        for grp in tile.groups:
            n, R = grp.r1 - grp.r0, grp.q_rows
            # heads h = kv*g + j share kv head `kv`: fold (j, row) into the GEMM's M dimension.
            qg = flat.index_select(0, grp.q_index).view(n_kv, g * R, hd)
            keys = grp.cache.k[kv_layer, :n_kv, : grp.n_keys, :hd]
            vals = grp.cache.v[kv_layer, :n_kv, : grp.n_keys, :hd]
            mask = grp.window_mask if sliding and grp.window_mask is not None else grp.mask
            if g != hp.n_head // hp.n_head_kv:  # the masks repeat R rows once per query head of a group
                mask = mask[:R].repeat(g, 1)
            scores = torch.baddbmm(mask, qg, keys.transpose(1, 2), alpha=hp.attn_scale)
            if sinks is not None:  # rows (j, row) of kv head kv belong to head kv * g + j
                sink = sinks.view(n_kv, g, 1, 1).expand(n_kv, g, R, 1).reshape(n_kv, g * R, 1)
                scores = torch.cat((scores.float(), sink), dim=-1)
            if scores.dtype == torch.float32:
                probs = torch.softmax(scores, dim=-1)
            else:
                probs = torch.softmax(scores.float(), dim=-1).to(vals.dtype)
            if sinks is not None:
                probs = probs[..., : grp.n_keys].to(vals.dtype)
            o = torch.bmm(probs, vals).view(hp.n_head, R, hd)
            out[grp.r0 : grp.r1] = o[:, :n].transpose(0, 1)

    def run_tile(self, tile: Tile, capture: frozenset[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run every block on one tile; returns (post-norm hidden [M, H], captured layer inputs)."""
        hp = self.hp
        x = F.embedding(tile.tokens, self.embd)
        if hp.embd_scale != 1.0:
            x = x * hp.embd_scale
        if self.per_layer_inputs is not None:
            tile.per_layer = self.per_layer_inputs(tile.tokens, x)
        captured: dict[int, torch.Tensor] = {}
        attn_out = torch.zeros((x.shape[0], hp.n_head, hp.head_dim), dtype=self.dtype, device=self.device)
        for li in range(len(self.layers)):
            if li in capture:
                captured[li] = x[: tile.n_real].clone()
            x = self.run_block(tile, li, x, attn_out)
        if hp.n_layer in capture:
            captured[hp.n_layer] = x[: tile.n_real].clone()
        return _rms_norm(x, self.out_norm, hp.rms_eps), captured

    def run_block(self, tile: Tile, li: int, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Layer ``li`` over a tile's residual rows x [M, H]: attention (K/V written to the block's KV layer
        of the tile's caches) or the gated delta-net (the caches' recurrent state advanced), then the FFN,
        residuals added. ``attn_out``: zeroed [M, n_head, head_dim] scratch."""
        hp = self.hp
        lw = self.layers[li]
        h = _rms_norm(x, lw.attn_norm, hp.rms_eps)
        if isinstance(lw.mixer, AttnWeights):
            mixed = self._attend(tile, lw.mixer, h, attn_out)
        else:
            mixed = self._delta_net(tile, lw.mixer, lw.recurrent_index, h)
        if lw.attn_post_norm is not None:
            mixed = _rms_norm(mixed, lw.attn_post_norm, hp.rms_eps)
        x = x + mixed
        h = _rms_norm(x, lw.ffn_norm, hp.rms_eps)
        ffn = lw.ffn(h, x) if isinstance(lw.ffn, DenseBesideExperts) else lw.ffn(h)
        if lw.ffn_post_norm is not None:
            ffn = _rms_norm(ffn, lw.ffn_post_norm, hp.rms_eps)
        x = x + ffn
        if lw.per_layer is not None and tile.per_layer is not None:
            pl = lw.per_layer
            gated = F.gelu(pl.gate(x), approximate="tanh") * tile.per_layer[:, li]
            x = x + _rms_norm(pl.proj(gated), pl.norm, hp.rms_eps)
        return x * lw.out_scale if lw.out_scale is not None else x

    def _attend(self, tile: Tile, aw: AttnWeights, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        hp = self.hp
        nh, nkv, hd = hp.n_head, aw.n_head_kv or hp.n_head_kv, aw.head_dim or hp.head_dim
        M = h.shape[0]
        if attn_out.shape[-1] != hd:  # a block with its own head size (Gemma 4)
            attn_out = torch.zeros((M, nh, hd), dtype=self.dtype, device=self.device)
        proj = aw.qkv(h)
        if not aw.owns_kv:  # queries only: the keys and values are another block's (already in the caches)
            q = proj.view(M, nh, hd)
            if aw.q_norm is not None:
                q = _rms_norm(q, aw.q_norm, hp.rms_eps)
            cos, sin = (tile.cos_swa, tile.sin_swa) if aw.sliding else (tile.cos, tile.sin)
            assert cos is not None and sin is not None
            q = self.rope.apply(q, cos, sin)
            if tile.q_scale is not None:
                q = q * tile.q_scale
            # the groups' q_index addresses [n_head + n_kv] heads per row: the kv part stays unused
            qk = torch.cat((q, q.new_zeros((M, hp.n_head_kv, hd))), 1)
            self._attention(tile, aw.kv_layer, qk, attn_out, aw.sliding, aw.sinks, nkv)
            return aw.out(attn_out.view(M, nh * hd))
        gate = None
        if hp.recipe.attn_output_gate:  # [q | gate] per head, then k, v
            qg = proj[:, : 2 * nh * hd].view(M, nh, 2 * hd)
            q, gate = qg[..., :hd], qg[..., hd:]
            kv = proj[:, 2 * nh * hd :].view(M, 2 * nkv, hd)
            k, v = kv[:, :nkv], kv[:, nkv:]
            qk = torch.cat((q, k), 1)
        else:
            qkv = proj.view(M, nh + 2 * nkv, hd)
            qk, v = qkv[:, : nh + nkv], qkv[:, nh + nkv :]
        if aw.value_norm:
            v = _rms_norm(v, None, hp.rms_eps)
        if aw.q_norm is not None and aw.k_norm is not None:
            qk = torch.cat(
                (_rms_norm(qk[:, :nh], aw.q_norm, hp.rms_eps), _rms_norm(qk[:, nh:], aw.k_norm, hp.rms_eps)), 1
            )
        if aw.sliding and tile.cos_swa is not None and tile.sin_swa is not None:
            qk = self.rope.apply(qk, tile.cos_swa, tile.sin_swa)
        else:
            qk = self.rope.apply(qk, tile.cos, tile.sin)
        if tile.q_scale is not None:  # after rope, queries only (llama.cpp's mistral3 graph)
            qk = torch.cat((qk[:, :nh] * tile.q_scale, qk[:, nh:]), 1)
        kl = aw.kv_layer
        for w in tile.writes:
            n = w.r1 - w.r0
            w.cache.k[kl, :nkv, w.pos0 : w.pos0 + n, :hd] = qk[w.r0 : w.r1, nh:].transpose(0, 1)
            w.cache.v[kl, :nkv, w.pos0 : w.pos0 + n, :hd] = v[w.r0 : w.r1].transpose(0, 1)
        if nkv != hp.n_head_kv:  # the groups' q_index addresses [n_head + n_head_kv] heads per row
            qk = torch.cat((qk[:, :nh], qk.new_zeros((M, hp.n_head_kv, hd))), 1)
        self._attention(tile, kl, qk, attn_out, aw.sliding, aw.sinks, nkv)
        out = attn_out if gate is None else attn_out * torch.sigmoid(gate)
        return aw.out(out.view(M, nh * hd))

    def _delta_net(self, tile: Tile, dw: DeltaNetWeights, r: int, h: torch.Tensor) -> torch.Tensor:
        """The gated delta-net over a tile: each sequence's rows advance its state, in position order."""
        dn = self.hp.delta_net
        assert dn is not None
        proj = dw.in_proj(h)
        rows = proj[:, : recurrence_width(dn)].float()
        o = torch.zeros((h.shape[0], dn.n_v_heads, dn.head_v_dim), dtype=torch.float32, device=self.device)
        for w in tile.writes:
            rec = w.cache.rec
            assert rec is not None
            seg = rows[w.r0 : w.r1]
            rec.record(r, w.pos0, seg)
            advance(dn, dw, self.hp.rms_eps, rec.ssm[r], rec.conv[r], seg, o[w.r0 : w.r1])
        return gated_output(dn, dw, self.hp.rms_eps, o, proj, self.dtype)

    def replay(self, ssm: torch.Tensor, conv: torch.Tensor, rows: torch.Tensor) -> None:
        """Advance every recurrent block r's state (ssm[r], conv[r]) over its logged rows[r] (a rollback)."""
        dn = self.hp.delta_net
        assert dn is not None
        for lw in self.layers:
            if isinstance(lw.mixer, DeltaNetWeights):
                r = lw.recurrent_index
                advance(dn, lw.mixer, self.hp.rms_eps, ssm[r], conv[r], rows[r], None)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.lm_head(hidden)
        cap = self.hp.final_softcap
        return cap * torch.tanh(out / cap) if cap else out  # row-wise: exact mode keeps its bits
