"""Multi-token-prediction heads on torch: the nextn input projection around the target's own decoder block.

The block code is the torch target's (:class:`TorchModel` built over the MTP block ids, run one block
at a time with ``run_block``), so an MTP head's attention (gated for Qwen3.5) and its dense or MoE FFN
are computed exactly as a trunk block is. Only the MTP tensors are read from the file: each head's block and ``nextn.*`` tensors, plus
the embedding, head norm and output head it borrows when it has none of its own. On a CPU float32 torch
target those borrowed tensors are the target's own (no second copy).

Head k keeps KV layer k of every sequence's cache (one :class:`KVPool` with a layer per head). Draft
numerics need not be batch-invariant, so a decode batches all rows of one head through one tile.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from spekula.backends.context_shift import shift_refusal
from spekula.backends.gguf.architecture import ModelHParams, read_hparams
from spekula.backends.gguf.moe import HeadSources, head_sources, nextn_shapes
from spekula.backends.gguf.recipes import FEATURES
from spekula.backends.gguf.weights import block_shapes, dequantize
from spekula.backends.seq_slots import PooledSeqs
from spekula.backends.torch.draft_common import device_dtype, rms_norm
from spekula.backends.torch.kv import KVPool, SeqCache, shift_cache
from spekula.backends.torch.linear import Lin, plain_gemm, planned_lin
from spekula.backends.torch.model import AttnGroup, KVWrite, Tile, TorchModel
from spekula.core.backend import Backend, BackendOptions
from spekula.core.drafting.mtp_runtime import MtpInfo, MtpOut, MtpRows, MtpRuntime, decode_by_head
from spekula.core.errors import ConfigError, ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile

KEY_GRANULE = 64  # KV capacity grows in whole granules, as the target's


@dataclass
class _Head:
    embd: torch.Tensor  # [V, H]
    enorm: torch.Tensor
    hnorm: torch.Tensor
    eh_proj: Lin  # [H, 2H]: embedding columns first
    out_norm: torch.Tensor
    head: Lin  # [V, H]


def _borrowable(target: Backend, device: torch.device, dtype: torch.dtype) -> dict[str, np.ndarray]:
    """The target's embedding / final norm / head as numpy views, when a CPU float32 torch target holds them
    unpacked (torch.from_numpy then shares their memory); empty otherwise."""
    model = getattr(target, "model", None)
    if not isinstance(model, TorchModel) or device.type != "cpu" or dtype != torch.float32:
        return {}
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return {}
    out = {"token_embd.weight": model.embd.numpy(), "output_norm.weight": model.out_norm.numpy()}
    if model.lm_head.w is not None and model.lm_head.b is None and not model.hp.tied_output:
        out["output.weight"] = model.lm_head.w.numpy()
    return out


class _Loader:
    """Named float32 tensors of the MTP file, each read once, shape-checked."""

    def __init__(self, f: GGUFFile, borrowed: dict[str, np.ndarray]) -> None:
        self.f, self.borrowed = f, borrowed
        self.arrays: dict[str, np.ndarray] = {}

    def has(self, name: str) -> bool:
        return name in self.borrowed or self.f.has_tensor(name)

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.arrays:
            if name in self.borrowed:
                arr = self.borrowed[name]
            elif self.f.has_tensor(name):
                arr = dequantize(self.f.tensor(name), self.f.path)
            else:
                raise ModelFileError(self.f.path, f"missing tensor {name!r} (MTP block)")
            if len(shape) == 1 and arr.shape == (1, *shape):
                arr = arr.reshape(shape)  # a vector stored as one row (Qwen3.5's ffn_gate_inp_shexp)
            if tuple(arr.shape) != shape:
                raise ModelFileError(self.f.path, f"tensor {name!r} has shape {tuple(arr.shape)}, expected {shape}")
            self.arrays[name] = arr
        return self.arrays[name]



class TorchMtpRuntime(PooledSeqs, MtpRuntime):
    def __init__(self, f: GGUFFile, info: MtpInfo, target: Backend, options: BackendOptions) -> None:
        self.info = info
        self.device, self.dtype = device_dtype(options)
        # every operation of FEATURES, as the torch backend: gated attention, the gated shared expert
        hp = read_hparams(f, implements=FEATURES, runtime="the torch MTP runtime")
        self.hp = hp
        if hp.n_nextn != info.n_heads:
            raise ModelFileError(f.path, f"{hp.arch} MTP heads need nextn_predict_layers = {info.n_heads}")
        blocks = [info.block(k) for k in range(info.n_heads)]
        # Borrow only from the target's own file: an MTP-only GGUF brings its own embedding and head.
        same_file = GGUFFile.shared(target.info.path) is f
        load = _Loader(f, _borrowable(target, self.device, self.dtype) if same_file else {})
        weights, sources = self._read(load, hp, info)
        with torch.inference_mode():
            self.kv = self._seqs = KVPool(n_layer=info.n_heads, n_head_kv=hp.n_head_kv, head_dim=hp.head_dim, n_ctx=options.n_ctx,
                             n_seq_max=options.n_seq_max, granule=KEY_GRANULE, dtype=self.dtype, device=self.device)
            # The model's token_embd / output_norm / output are head 0's (its own or the borrowed ones).
            self.model = TorchModel(hp, weights, dtype=self.dtype, device=self.device, max_pos=self.kv.max_capacity,
                                    blocks=blocks)
            self.heads = self._heads(load, sources, info)

    # --- loading ---------------------------------------------------------------------------------
    def _read(self, load: _Loader, hp: ModelHParams,
              info: MtpInfo) -> tuple[dict[str, np.ndarray], list[HeadSources]]:
        H, V = hp.n_embd, hp.n_vocab
        weights: dict[str, np.ndarray] = {}
        sources: list[HeadSources] = []
        for head in range(info.n_heads):
            for name, shape in block_shapes(hp, info.block(head)).items():
                weights[name] = load.get(name, shape)
            required, _optional = nextn_shapes(f"blk.{info.nextn_block(head)}.", H, V)
            for name, shape in required.items():
                load.get(name, shape)
            # Borrowed tensors are the same file's trunk tensors, so the file answers which exist.
            src = head_sources(load.f, hp.tied_output, info.nextn_block(head))
            for name, shape in ((src.embd, (V, H)), (src.norm, (H,)), (src.head, (V, H))):
                load.get(name, shape)
            sources.append(src)
        weights["token_embd.weight"] = load.arrays[sources[0].embd]
        weights["output_norm.weight"] = load.arrays[sources[0].norm]
        if not hp.tied_output:
            weights["output.weight"] = load.arrays[sources[0].head]
        if load.has("rope_freqs.weight"):
            weights["rope_freqs.weight"] = load.get("rope_freqs.weight", (hp.n_rot // 2,))
        return weights, sources

    def _heads(self, load: _Loader, sources: list[HeadSources], info: MtpInfo) -> list[_Head]:
        # Head 0's tensors are the model's (its head too, unless a tied model made the embedding its head);
        # another head naming the same source shares the tensor.
        tensors: dict[str, torch.Tensor] = {sources[0].embd: self.model.embd, sources[0].norm: self.model.out_norm}
        lins: dict[str, Lin] = {} if self.hp.tied_output else {sources[0].head: self.model.lm_head}

        def tensor(name: str) -> torch.Tensor:
            if name not in tensors:
                tensors[name] = torch.from_numpy(load.arrays[name]).to(self.device, self.dtype).contiguous()
            return tensors[name]

        def lin(name: str) -> Lin:
            if name not in lins:
                lins[name] = planned_lin(plain_gemm, tensor(name), None)
            return lins[name]

        heads = []
        for head, src in enumerate(sources):
            b = f"blk.{info.nextn_block(head)}.nextn."
            heads.append(_Head(tensor(src.embd), tensor(b + "enorm.weight"), tensor(b + "hnorm.weight"),
                               lin(b + "eh_proj.weight"), tensor(src.norm), lin(src.head)))
        return heads

    # --- sequences (new_seq, free_seq, seq_len, truncate: PooledSeqs over the KV pool) -----------
    @property
    def n_ctx(self) -> int:
        return self.kv.n_ctx

    def shift(self, seq_id: int, n_keep: int, n_discard: int) -> None:
        """Every head's cache shifts as the target's does (rows moved, keys re-roped by -n_discard)."""
        refusal = shift_refusal(self.hp, "the torch MTP runtime")
        if refusal is not None:
            raise ConfigError(refusal)
        shift_cache(self.kv.get(seq_id), n_keep, n_discard, self.model.rope.rotate_keys)

    # --- decoding --------------------------------------------------------------------------------
    @torch.inference_mode()
    def decode(self, rows: Sequence[MtpRows]) -> list[MtpOut]:
        return decode_by_head(rows, self.info, self._decode_head, seq_len=self.seq_len, n_ctx=self.n_ctx)

    def _decode_head(self, head: int, rows: list[MtpRows]) -> list[MtpOut]:
        hw = self.heads[head]
        eps = self.hp.rms_eps
        tokens = torch.from_numpy(np.concatenate([np.asarray(r.tokens, dtype=np.int64) for r in rows])).to(self.device)
        h = torch.from_numpy(np.concatenate([np.asarray(r.hidden, dtype=np.float32) for r in rows]))
        h = h.to(self.device, self.dtype)
        e = rms_norm(hw.embd[tokens], hw.enorm, eps)
        x = hw.eh_proj(torch.cat([e, rms_norm(h, hw.hnorm, eps)], dim=-1))
        tile, caches = self._tile(rows)
        attn_out = torch.zeros((x.shape[0], self.hp.n_head, self.hp.head_dim), dtype=self.dtype, device=self.device)
        x = self.model.run_block(tile, head, x, attn_out)
        for r, cache in zip(rows, caches, strict=True):
            cache.length = r.start + len(r.tokens)
        ends = np.cumsum([len(r.tokens) for r in rows]) - 1
        want = [int(ends[k]) for k, r in enumerate(rows) if r.want_last]
        outs = [MtpOut(None, None) for _ in rows]
        if want:
            hout = rms_norm(x[torch.tensor(want, device=self.device)], hw.out_norm, eps)
            logits = hw.head(hout).float().cpu().numpy()
            hidden = hout.float().cpu().numpy()
            k = 0
            for j, r in enumerate(rows):
                if r.want_last:
                    outs[j] = MtpOut(logits[k], hidden[k])
                    k += 1
        return outs

    def _tile(self, rows: list[MtpRows]) -> tuple[Tile, list[SeqCache]]:
        """One tile over all rows: each sequence's rows attend causally to its cache and to each other."""
        hp = self.hp
        positions = np.concatenate([np.arange(r.start, r.start + len(r.tokens)) for r in rows])
        self.model.rope.ensure(int(positions.max()) + 1)
        pos_t = torch.from_numpy(positions).to(self.device)
        tile = Tile(tokens=torch.zeros(len(positions), dtype=torch.int64, device=self.device),
                    n_real=len(positions), q_scale=self.model.q_scale(positions), **self.model.rope.tile(pos_t))
        caches = []
        group = hp.n_head // hp.n_head_kv
        r0 = 0
        for r in rows:
            cache = self.kv.get(r.seq_id)
            n, end = len(r.tokens), r.start + len(r.tokens)
            self.kv.reserve_for(cache, end)
            future = np.arange(end)[None, :] > positions[r0:r0 + n, None]
            mask = torch.from_numpy(np.tile(np.where(future, -np.inf, 0.0).astype(np.float32), (group, 1)))
            # rows of the tile's [M * (n_head + n_kv), hd] q/k view in (kv head, j, row) order
            q_index = (np.arange(r0, r0 + n)[None, :] * (hp.n_head + hp.n_head_kv) + np.arange(hp.n_head)[:, None])
            tile.writes.append(KVWrite(cache, r0, r0 + n, r.start))
            tile.groups.append(AttnGroup(cache, r0, r0 + n, end, n, mask.to(self.device, self.dtype),
                                         torch.from_numpy(q_index.reshape(-1)).to(self.device)))
            caches.append(cache)
            r0 += n
        return tile, caches


runtime_class = TorchMtpRuntime
