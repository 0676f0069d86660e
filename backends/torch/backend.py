"""PyTorch backend: GGUF decoders (any architecture gguf/architecture.py describes) on CPU or CUDA, with a
batch-invariant exact mode.

Exact mode (``BackendOptions.exact``, default): a row's logits are bitwise the same whatever else is
in the forward and however the sequence was chunked. How (CPU fp32):

* Linear layers: plain ``F.linear`` (MKL) gives a row bits that depend on the row count M (GEMV for
  M=1, other kernels for small M and for the last rows of a micro-kernel). Which library path avoids
  that depends on the CPU, so it is measured when the model loads (``torch_exact_probe``): oneDNN's
  prepacked linear when it is row-invariant at every shape of the model (it was on an AVX2 machine,
  not at every shape on an AVX-512/AMX one), else MKL on row counts padded to the measured multiple.
  MoE experts, shared experts and routers are planned GEMMs like the others, so an expert's GEMM
  gives a row the same bits whatever number of rows was routed to that expert.
* Attention: a row at position p always attends over the key window
  ``[0, ceil((p+1)/KEY_GRANULE) * KEY_GRANULE)`` with later keys masked to an exact 0 weight, and its
  query GEMMs run on row groups padded to the same measured multiple, so every reduction has the same
  length and kernel.
* Norms, rope, activations and routing (top-k by a stable sort) are row-wise.
* Hybrid models (Qwen3.5): a recurrent block advances each sequence's state token by token in position
  order (``delta_net.py``), so the state and the rows' outputs do not depend on the batch or the chunking;
  what a truncate can rebuild (checkpoints, snapshots) is ``recurrent.py``'s.

Rows go through the blocks in tiles of at most ``TILE_ROWS`` rows. Proven by tests/test_torch_backend.py
and the conformance suite (bitwise checks). On CUDA cuBLAS picks its kernels by shape alone, so exact
mode runs every tile, attention group and expert GEMM on exactly ``TILE_ROWS`` rows: one shape per key
window, the same kernels every forward (bench/cuda_check.py checks it bitwise on a GPU). On the CPU in
f16/bf16 nothing guarantees invariance. ``exact=False`` drops the padding and windows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from spekula.backends.context_shift import shift_refusal
from spekula.backends.gguf.architecture import ModelHParams, read_hparams
from spekula.backends.gguf.classifier import read_classifier_head
from spekula.backends.gguf.encoder import is_encoder
from spekula.backends.gguf.recipes import FEATURES
from spekula.backends.gguf.weights import load_model_weights
from spekula.backends.seq_inputs import check_inputs
from spekula.backends.seq_slots import PooledSeqs
from spekula.backends.torch.delta_net import recurrence_width
from spekula.backends.torch.encoder import TorchEncoderBackend
from spekula.backends.torch.exact_probe import attention_align, choose_exact_gemm, onednn_packing_available
from spekula.backends.torch.kv import KVPool, SeqCache, shift_cache
from spekula.backends.torch.model import AttnGroup, KVWrite, Tile, TorchModel, model_gemm_shapes
from spekula.backends.torch.recurrent import RecurrentSeq
from spekula.core.backend import Backend, BackendOptions, Capture, ModelInfo, SeqInput, SeqOutput, SeqState
from spekula.core.embedding import ClassifierHead
from spekula.core.errors import ConfigError
from spekula.core.modelfile.gguf_file import GGUFFile

KEY_GRANULE = 64
TILE_ROWS = 64
FAST_TILE_ROWS = 512
# Device types whose exact mode runs every GEMM on TILE_ROWS rows instead of a plan measured at load
# (a set so that a test can run the same path on the CPU, where MKL is row-invariant at 64 rows too).
FIXED_SHAPE_DEVICES = {"cuda"}

_NO_CAPTURE = Capture()
_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def resolve_device(options: BackendOptions) -> torch.device:
    dev = options.device.strip().lower()
    if dev == "cpu":
        return torch.device("cpu")
    if dev == "cuda" or dev.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise ConfigError(f"device {options.device!r} requested but CUDA is not available to torch")
        device = torch.device(dev)
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"device {options.device!r}: only {torch.cuda.device_count()} CUDA device(s)")
        return device
    raise ConfigError(f"unknown device {options.device!r} (cpu, cuda, cuda:N)")


def resolve_dtype(options: BackendOptions, device: torch.device) -> torch.dtype:
    if options.dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if options.dtype not in _DTYPES:
        raise ConfigError(f"unknown dtype {options.dtype!r} (auto, f32, f16, bf16)")
    return _DTYPES[options.dtype]


@dataclass
class _Req:
    """One validated SeqInput."""

    cache: SeqCache
    tokens: np.ndarray
    start: int
    logit_rows: np.ndarray
    out: SeqOutput
    logit_slot: dict[int, int]  # row index in tokens -> row in out.logits


class TorchBackend(PooledSeqs, Backend):
    def __init__(self, model_path: str, options: BackendOptions) -> None:
        self.options = options
        if options.n_ctx <= 0 or options.n_seq_max <= 0:
            raise ConfigError(f"n_ctx and n_seq_max must be positive (got {options.n_ctx}, {options.n_seq_max})")
        self.device = resolve_device(options)
        self.dtype = resolve_dtype(options, self.device)
        if options.threads > 0:
            torch.set_num_threads(options.threads)
        f = GGUFFile.shared(model_path)
        # every operation of FEATURES: gated delta-net blocks, gated attention, the gated shared expert
        self.hparams: ModelHParams = read_hparams(f, implements=FEATURES, runtime="the torch backend")
        hp = self.hparams
        # Sliding blocks read the window masks; the torch backend keeps every position's keys (a
        # reference runtime: memory is not bounded by the window, every length stays restorable).
        self._sliding = any(hp.swa_layers)
        self.info = ModelInfo(
            path=str(model_path),
            arch=hp.arch,
            name=str(f.get("general.name", f.path.stem)),
            n_vocab=hp.n_vocab,
            n_embd=hp.n_embd,
            n_layer=hp.n_layer,
            n_ctx_train=hp.n_ctx_train,
            recurrent=hp.is_hybrid,
        )
        self.exact = options.exact
        cpu_f32 = self.device.type == "cpu" and self.dtype == torch.float32
        self.gemm_plan: dict[tuple[int, int], tuple[bool, int]] = {}
        self._align, self._attn_align, self._gemm_align = 1, 1, 1
        if self.exact and self.device.type in FIXED_SHAPE_DEVICES:
            # cuBLAS picks a kernel by shape, and a kernel gives an output element the same bits whatever
            # the other rows hold. So every tile is padded to the full TILE_ROWS, every attention group's
            # queries to TILE_ROWS, every expert's rows to TILE_ROWS: each GEMM, softmax and norm of a
            # forward then has one shape per key window, whatever rows the forward carries.
            self._align = self._attn_align = self._gemm_align = TILE_ROWS
        elif self.exact and cpu_f32:
            # Per weight shape: oneDNN packing where it is row-invariant, else MKL padded to what was
            # measured, so one shape that needs padding does not make every GEMM pay for it.
            allow = onednn_packing_available()
            for shape in model_gemm_shapes(hp):
                packed, align = choose_exact_gemm([shape], allow_packed=allow)
                if align is None:
                    raise ConfigError(f"no fp32 GEMM path of this torch build is row-invariant on this CPU at {shape}, "
                                      "so the torch backend cannot be exact here; use --backend native")
                self.gemm_plan[shape] = (packed, align)
            # (query group, head size) of every block: Gemma 4's may vary by block
            shapes = sorted({(hp.n_head // hp.block_n_head_kv(i), hp.block_head_dim(i)) for i in range(hp.n_layer)})
            attn = [attention_align(n, hd, group, hp.attn_scale) for n in (KEY_GRANULE, 4 * KEY_GRANULE)
                    for group, hd in shapes]
            if None in attn:
                raise ConfigError("no fp32 attention GEMM of this torch build is row-invariant on this CPU; "
                                  "use --backend native")
            self._attn_align = max(a for a in attn if a is not None)
        elif self.exact:
            self._align = self._attn_align = 4  # CPU half precision: fixed shapes, no bitwise claim
        self.packed = any(p for p, _ in self.gemm_plan.values())
        self._tile_rows = TILE_ROWS if self.exact else FAST_TILE_ROWS
        weights = load_model_weights(f, hp=hp)
        with torch.inference_mode():
            self.kv = self._seqs = KVPool(
                n_layer=sum(not hp.is_recurrent(i) and hp.layout.owns_kv(i) for i in range(hp.n_layer)),
                n_head_kv=hp.n_head_kv,
                head_dim=hp.max_head_dim,  # blocks with smaller heads use the first columns (Gemma 4)
                n_ctx=options.n_ctx,
                n_seq_max=options.n_seq_max,
                granule=KEY_GRANULE,
                dtype=self.dtype,
                device=self.device,
                new_recurrent=self._new_recurrent if hp.is_hybrid else None,
            )
            self.model = TorchModel(
                hp, weights, dtype=self.dtype, device=self.device, max_pos=self.kv.max_capacity,
                gemm=lambda n, k: self.gemm_plan.get((n, k), (False, self._gemm_align))
            )
        del weights

    # ---- sequences (new_seq, free_seq, seq_len: PooledSeqs over the KV pool) ------------------------

    def _new_recurrent(self) -> RecurrentSeq:
        dn = self.hparams.delta_net
        assert dn is not None
        n_rec = sum(dn.recurrent)
        with torch.inference_mode():
            return RecurrentSeq((n_rec, dn.n_v_heads, dn.head_v_dim, dn.head_k_dim),
                                (n_rec, dn.conv_kernel - 1, dn.conv_dim), recurrence_width(dn), self.device)

    def truncate(self, seq_id: int, n_keep: int) -> None:
        cache = self.kv.get(seq_id)
        if n_keep < 0:
            raise ConfigError(f"truncate: n_keep must be >= 0, got {n_keep}")
        if cache.rec is not None:
            with torch.inference_mode():
                cache.rec.restore(cache.length, min(n_keep, cache.length), self.model.replay)
        self.kv.truncate(seq_id, n_keep)

    def context_shift_refusal(self) -> str | None:
        return shift_refusal(self.hparams, "the torch backend")

    def shift(self, seq_id: int, n_keep: int, n_discard: int) -> None:
        refusal = self.context_shift_refusal()
        if refusal is not None:
            raise ConfigError(refusal)
        shift_cache(self.kv.get(seq_id), n_keep, n_discard, self.model.rope.rotate_keys)

    def checkpoint(self, seq_id: int) -> None:
        cache = self.kv.get(seq_id)
        if cache.rec is not None:
            with torch.inference_mode():
                cache.rec.checkpoint(cache.length)

    def snapshot(self, seq_id: int) -> None:
        cache = self.kv.get(seq_id)
        if cache.rec is not None:
            with torch.inference_mode():
                cache.rec.snapshot(cache.length)

    def restorable(self, seq_id: int, n_keep: int) -> int:
        cache = self.kv.get(seq_id)
        if cache.rec is None:
            return super().restorable(seq_id, n_keep)
        return cache.rec.restorable(cache.length, n_keep)

    def classifier_head(self) -> ClassifierHead | None:
        return read_classifier_head(self.info.path)

    @property
    def seq_state_format(self) -> str:
        return f"torch: {str(self.dtype).removeprefix('torch.')} KV [layer, kv head, position, head dim]" + (
            ", f32 delta-net state" if self.info.recurrent else "")

    def export_seq(self, seq_id: int) -> SeqState:
        return self.kv.export_seq(seq_id)

    def import_seq(self, seq_id: int, state: SeqState) -> None:
        self.kv.import_seq(seq_id, state)

    def close(self) -> None:
        self.kv.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ---- forward ----------------------------------------------------------------------------------

    def _validate(self, inputs: Sequence[SeqInput], capture: Capture) -> list[_Req]:
        hp = self.hparams
        checked = check_inputs(inputs, capture, n_layer=hp.n_layer, n_vocab=hp.n_vocab, n_ctx=self.options.n_ctx,
                               seq_len=lambda seq_id: self.kv.get(seq_id).length)
        reqs: list[_Req] = []
        for c in checked:
            n = int(c.tokens.size)
            out = SeqOutput(logits=np.empty((c.logit_rows.size, hp.n_vocab), dtype=np.float32))
            for layer in capture.layers:
                out.layer_inputs[layer] = np.empty((n, hp.n_embd), dtype=np.float32)
            if capture.final_norm:
                out.hidden_final = np.empty((n, hp.n_embd), dtype=np.float32)
            slots: dict[int, int] = {}
            for j, r in enumerate(c.logit_rows.tolist()):
                slots.setdefault(r, j)
            reqs.append(_Req(self.kv.get(c.seq_id), c.tokens, c.start, c.logit_rows, out, slots))
        return reqs

    def _plan_tiles(self, reqs: list[_Req]) -> list[tuple[Tile, list[tuple[int, int]]]]:
        """Cut all rows into tiles; each tile comes with its rows' (request index, token index)."""
        rows = [(ri, j) for ri, r in enumerate(reqs) for j in range(r.tokens.size)]
        tiles = []
        for t0 in range(0, len(rows), self._tile_rows):
            trows = rows[t0 : t0 + self._tile_rows]
            tiles.append((self._make_tile(reqs, trows), trows))
        return tiles

    def _make_tile(self, reqs: list[_Req], trows: list[tuple[int, int]]) -> Tile:
        n_real = len(trows)
        M = _round_up(n_real, self._align)
        tokens = np.zeros(M, dtype=np.int64)
        pos = np.zeros(M, dtype=np.int64)
        for i, (ri, j) in enumerate(trows):
            tokens[i] = reqs[ri].tokens[j]
            pos[i] = reqs[ri].start + j
        self.model.rope.ensure(int(pos.max()) + 1)
        pos_t = torch.from_numpy(pos).to(self.device)
        tile = Tile(tokens=torch.from_numpy(tokens).to(self.device), n_real=n_real, q_scale=self.model.q_scale(pos),
                    **self.model.rope.tile(pos_t))
        r0 = 0
        while r0 < n_real:  # one segment per request: consecutive rows, consecutive positions
            ri = trows[r0][0]
            r1 = r0
            while r1 < n_real and trows[r1][0] == ri:
                r1 += 1
            cache = reqs[ri].cache
            tile.writes.append(KVWrite(cache, r0, r1, int(pos[r0])))
            self._add_groups(tile, cache, r0, r1, pos)
            r0 = r1
        return tile

    def _add_groups(self, tile: Tile, cache: SeqCache, r0: int, r1: int, pos: np.ndarray) -> None:
        if self.exact:
            window = (pos[r0:r1] // KEY_GRANULE + 1) * KEY_GRANULE
        else:
            window = np.full(r1 - r0, int(pos[r1 - 1]) + 1)
        a = r0
        while a < r1:
            b = a
            while b < r1 and window[b - r0] == window[a - r0]:
                b += 1
            n_keys = int(window[a - r0])
            q_rows = _round_up(b - a, self._attn_align)
            rows = np.concatenate([np.arange(a, b), np.full(q_rows - (b - a), b - 1)])
            sliding_mask = self._mask(pos[rows], n_keys, self.hparams.sliding_window) if self._sliding else None
            tile.groups.append(
                AttnGroup(cache, a, b, n_keys, q_rows, self._mask(pos[rows], n_keys), self._q_index(rows), sliding_mask)
            )
            a = b

    def _mask(self, pos: np.ndarray, n_keys: int, window: int = 0) -> torch.Tensor:
        """Additive mask [g * R, n_keys] in (j, row) order: -inf on keys after each row's position (and,
        with a `window`, on keys at or before position - window: a sliding block's)."""
        hp = self.hparams
        keys = np.arange(n_keys)[None, :]
        hidden = keys > pos[:, None]
        if window:
            hidden |= keys <= pos[:, None] - window
        add = np.where(hidden, -np.inf, 0.0).astype(np.float32)
        add = np.tile(add, (hp.n_head // hp.n_head_kv, 1))
        return torch.from_numpy(add).to(device=self.device, dtype=self.dtype)

    def _q_index(self, rows: np.ndarray) -> torch.Tensor:
        """Indices into the tile's [M * (n_head + n_kv), hd] view, ordered (kv head, j, row)."""
        hp = self.hparams
        stride = hp.n_head + hp.n_head_kv
        heads = np.arange(hp.n_head)  # h = kv * g + j, so plain head order is (kv, j)
        idx = rows[None, :] * stride + heads[:, None]
        return torch.from_numpy(idx.reshape(-1).astype(np.int64)).to(self.device)

    def forward(self, inputs: Sequence[SeqInput], capture: Capture = _NO_CAPTURE) -> list[SeqOutput]:
        reqs = self._validate(inputs, capture)
        for r, inp in zip(reqs, inputs, strict=True):
            if r.cache.rec is not None and r.start != r.cache.length:
                self.truncate(inp.seq_id, r.start)  # the recurrent state must be rebuilt at `start` (or refused)
        with torch.inference_mode():
            for r in reqs:
                r.cache.length = r.start  # writing at `start` drops anything after it
                self.kv.reserve_for(r.cache, r.start + r.tokens.size)
            for tile, trows in self._plan_tiles(reqs):
                self._run_tile(reqs, tile, trows, capture)
            for r in reqs:
                r.cache.length = r.start + r.tokens.size
        return [r.out for r in reqs]

    def _run_tile(self, reqs: list[_Req], tile: Tile, trows: list[tuple[int, int]], capture: Capture) -> None:
        hidden, captured = self.model.run_tile(tile, capture.layers)
        want = [i for i, (ri, j) in enumerate(trows) if j in reqs[ri].logit_slot]
        if want:
            pad = [want[-1]] * (_round_up(len(want), self._align) - len(want))
            sel = hidden[torch.tensor(want + pad, device=self.device)]
            logits = self.model.logits(sel)[: len(want)].float().cpu().numpy()
            for k, i in enumerate(want):
                ri, j = trows[i]
                out = reqs[ri].out
                for slot in np.nonzero(reqs[ri].logit_rows == j)[0]:
                    out.logits[slot] = logits[k]
        if not capture:
            return
        cap_np = {layer: t.float().cpu().numpy() for layer, t in captured.items()}
        fin = hidden[: tile.n_real].float().cpu().numpy() if capture.final_norm else None
        for i, (ri, j) in enumerate(trows):
            out = reqs[ri].out
            for layer, arr in cap_np.items():
                out.layer_inputs[layer][j] = arr[i]
            if fin is not None and out.hidden_final is not None:
                out.hidden_final[j] = fin[i]


def backend_class(model_path: str, options: BackendOptions) -> Backend:
    """The torch runtime for `model_path`: TorchBackend for decoders, TorchEncoderBackend for BERT-style
    encoders (embeddings only, backends/torch/encoder.py)."""
    if options.on_setup_done is not None:
        options.on_setup_done()  # its load holds the GIL off and on throughout: a caller waits for none of it
    if is_encoder(GGUFFile.shared(model_path)):
        device = resolve_device(options)
        return TorchEncoderBackend(model_path, options, device, resolve_dtype(options, device))
    return TorchBackend(model_path, options)
