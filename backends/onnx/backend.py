"""ONNX Runtime backend: the exported decoder graph (onnx/export.py) run by onnxruntime.

Selected with ``--backend onnx``. The graph is exported once per GGUF and cached; the KV caches live in
per-sequence buffers (onnx/kv.py) that ORT reads and writes in place through IO binding, on the host
for the CPU provider and on the GPU (as OrtValues) for the CUDA provider.

Two ways to run a forward:
  * per sequence (``exact=True``, the default, and always on CUDA): one ORT run per sequence, with the
    past bound as a prefix of the sequence's buffer and the new keys/values written straight into it.
    A row never shares a kernel call with another sequence, so its logits cannot depend on what else
    is in the batch.
  * batched (``exact=False``, CPU): all sequences in one run, caches gathered into a padded batch and
    the new entries scattered back. Faster with many live slots; rows may differ from a lone run in
    the last float bits.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import structlog

from spekula.backends.gguf.classifier import read_classifier_head
from spekula.backends.onnx import cache as onnx_cache
from spekula.backends.onnx.export import Export, ensure_export
from spekula.backends.onnx.graph import HIDDEN_FINAL, resid_name
from spekula.backends.onnx.kv import KVPool, SeqKV
from spekula.backends.onnx.moe import MOE_ROWS, moe_rows
from spekula.backends.onnx.providers import ProviderChoice, select_provider
from spekula.backends.seq_slots import PooledSeqs
from spekula.core.backend import Backend, BackendOptions, Capture, ModelInfo, SeqInput, SeqOutput
from spekula.core.embedding import ClassifierHead
from spekula.core.errors import ConfigError, ModelFileError

if TYPE_CHECKING:
    import onnxruntime as ort

log = structlog.get_logger("spekula.onnx")

# Exact mode pads every run's new rows to a multiple of this. MLAS (ORT's CPU GEMM) computes a row
# differently when a matmul has 1-3 rows than when it has more (measured on SmolLM2, AVX2: chunkings
# such as 3,1,1,1,17,... differ by ~1e-4 from one 70-row pass); with every row count a multiple of 4
# all chunkings agree bitwise, whatever the cache length. Cost: ~10% on a one-token decode step.
EXACT_ROW_MULTIPLE = 4

# BackendOptions.dtype -> weight format of the export. f16/bf16 graphs are not built (docs/backends.md, "ONNX Runtime").
_DTYPES = {"auto": "f32", "f32": "f32", "q4": "q4"}


_NO_CAPTURE = Capture()


def _weight_format(dtype: str) -> str:
    fmt = _DTYPES.get(dtype)
    if fmt is None:
        raise ConfigError(f"onnx backend: dtype {dtype!r} not supported; use one of {', '.join(_DTYPES)}")
    return fmt


def _causal_mask(start: int, n: int) -> np.ndarray:
    """[n, start+n] additive mask: row t (position start+t) sees keys 0..start+t."""
    return np.triu(np.full((n, start + n), -np.inf, dtype=np.float32), k=start + 1)


class OnnxBackend(PooledSeqs, Backend):
    def __init__(self, model_path: str | os.PathLike[str], options: BackendOptions | None = None) -> None:
        self.options = options = options or BackendOptions()
        if options.on_setup_done is not None:
            options.on_setup_done()  # a caller waits for none of this load (see BackendOptions)
        # Named as the user sets them (-c / -np), not by the field names: this is what a CLI user sees.
        if options.n_ctx <= 0:
            raise ConfigError(f"context size (-c/--ctx-size) must be at least 1; got {options.n_ctx}")
        if options.n_seq_max <= 0:
            raise ConfigError(f"number of sequences (-np/--parallel) must be at least 1; got {options.n_seq_max}")
        self._weight_format = _weight_format(options.dtype)
        self.provider: ProviderChoice = select_provider(options)
        self._model_path = str(model_path)
        self._export = ensure_export(model_path, self._weight_format)
        hp = self.hp = self._export.hp
        self.info = ModelInfo(path=self._model_path, arch=hp.arch, name=self._export.name, n_vocab=hp.n_vocab,
                              n_embd=hp.n_embd, n_layer=hp.n_layer, n_ctx_train=hp.n_ctx_train)
        self._session = self._open_session()
        if self.provider.name == "cuda" and self._session.get_providers()[0] != "CUDAExecutionProvider":
            # ORT falls back to CPU silently when the CUDA provider fails at session creation; the device
            # KV buffers would then not match the session.
            raise ConfigError(f"onnx backend: the CUDA provider did not attach to the session "
                              f"(got {self._session.get_providers()}); use --ort-provider cpu")
        # Bitwise row invariance is a property of the CPU kernels; on CUDA (cuBLAS picks algorithms by
        # shape) the exact flag cannot be honoured, so rows are not padded there.
        self._row_multiple = EXACT_ROW_MULTIPLE if options.exact and self.provider.name == "cpu" else 1
        # MoE graphs name the rows their experts compute; exact mode gives each expert GEMM a multiple of
        # the row multiple by sending every row that many times (onnx/moe.py).
        self._has_moe_rows = MOE_ROWS in {i.name for i in self._session.get_inputs()}
        self._kv = self._seqs = KVPool(n_layer=hp.n_layer, n_head_kv=hp.n_head_kv, head_dim=hp.head_dim, n_ctx=options.n_ctx,
                          n_seq_max=options.n_seq_max, device=self.provider.name, device_id=self.provider.device_id,
                          slack=self._row_multiple - 1)
        log.info("onnx backend ready", provider=self.provider.name, device_id=self.provider.device_id,
                 weights=self._weight_format, graph=str(self._export.path))

    # ---- session ------------------------------------------------------------------------------------

    def _session_options(self) -> ort.SessionOptions:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.log_severity_level = 3
        if self.options.threads > 0:
            so.intra_op_num_threads = self.options.threads
        so.inter_op_num_threads = 1
        # Idle ORT workers spin by default; on a shared CPU that steals time from everyone else.
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        return so

    def _open_session(self) -> ort.InferenceSession:
        """Load the cached export; if ORT rejects it (corrupt in a way the manifest missed), rebuild once."""
        import onnxruntime as ort

        for attempt in range(2):
            path = self._export.path
            try:
                return ort.InferenceSession(str(path), self._session_options(),
                                            providers=self.provider.ort_providers())
            except Exception as exc:  # ORT raises its own exception types (Fail, InvalidGraph, ...)
                reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                if attempt:
                    raise ModelFileError(path, f"onnx export does not load even after a rebuild: {reason}") from None
                log.info("cached onnx export does not load; rebuilding", path=str(path), reason=reason)
                onnx_cache.remove_export(path)
                self._export = ensure_export(self._model_path, self._weight_format)
        raise AssertionError("unreachable")

    @property
    def export(self) -> Export:
        return self._export

    def classifier_head(self) -> ClassifierHead | None:
        return read_classifier_head(self.info.path)

    def close(self) -> None:
        """Drop the session and every cache (device memory included); later calls raise ConfigError."""
        self._session = None
        self._kv.clear()

    # ---- sequences ----------------------------------------------------------------------------------

    def new_seq(self) -> int:  # free_seq, seq_len, truncate: PooledSeqs over the KV pool
        if self._session is None:
            raise ConfigError("onnx backend is closed")
        return super().new_seq()

    # ---- forward ------------------------------------------------------------------------------------

    def _check(self, inputs: Sequence[SeqInput], capture: Capture) -> list[tuple[np.ndarray, np.ndarray]]:
        """Validate everything before any cache is touched; returns (tokens int64, logit rows) per input."""
        if self._session is None:
            raise ConfigError("onnx backend is closed")
        bad = sorted(i for i in capture.layers if not 0 <= i <= self.hp.n_layer)
        if bad:
            raise ConfigError(f"capture layer(s) {bad} outside 0..{self.hp.n_layer}")
        ids = [inp.seq_id for inp in inputs]
        if len(set(ids)) != len(ids):
            raise ConfigError(f"a sequence appears twice in one forward: {ids}")
        out = []
        for inp in inputs:
            seq = self._kv.get(inp.seq_id)
            tokens = np.asarray(inp.tokens).reshape(-1).astype(np.int64)
            n = len(tokens)
            if n == 0:
                raise ConfigError(f"sequence {inp.seq_id}: a forward needs at least one token")
            if tokens.min() < 0 or tokens.max() >= self.hp.n_vocab:
                raise ConfigError(f"sequence {inp.seq_id}: token id outside 0..{self.hp.n_vocab - 1}")
            if not 0 <= inp.start <= seq.length:
                raise ConfigError(f"sequence {inp.seq_id}: start {inp.start} beyond its length {seq.length}")
            if inp.start + n > self.options.n_ctx:
                raise ConfigError(f"sequence {inp.seq_id}: {inp.start + n} positions exceed n_ctx {self.options.n_ctx}")
            rows = np.array([n - 1]) if inp.logit_rows is None else np.asarray(inp.logit_rows).reshape(-1)
            rows = rows.astype(np.int64)
            if len(rows) and (rows.min() < 0 or rows.max() >= n):
                raise ConfigError(f"sequence {inp.seq_id}: logit rows must lie in 0..{n - 1}")
            out.append((tokens, rows))
        return out

    def forward(self, inputs: Sequence[SeqInput], capture: Capture = _NO_CAPTURE) -> list[SeqOutput]:
        checked = self._check(inputs, capture)
        if len(inputs) > 1 and not self.options.exact and self.provider.name == "cpu":
            return self._run_batched(inputs, checked, capture)
        return [self._run_one(inp, toks, rows, capture) for inp, (toks, rows) in zip(inputs, checked, strict=True)]

    def _capture_names(self, capture: Capture) -> list[tuple[str, int | None]]:
        names: list[tuple[str, int | None]] = [(resid_name(i), i) for i in sorted(capture.layers)]
        if capture.final_norm:
            names.append((HIDDEN_FINAL, None))
        return names

    def _moe_feed(self, real_rows: np.ndarray) -> dict[str, np.ndarray]:
        """The ``moe_rows`` input of MoE graphs (nothing for dense ones): padding rows skip the experts."""
        return {MOE_ROWS: moe_rows(real_rows, self._row_multiple)} if self._has_moe_rows else {}

    def _run_one(self, inp: SeqInput, tokens: np.ndarray, rows: np.ndarray, capture: Capture) -> SeqOutput:
        hp, kv = self.hp, self._kv
        start, n = inp.start, len(tokens)
        m = -(-n // self._row_multiple) * self._row_multiple  # rows run; padding rows follow the real ones
        seq = kv.reserve(inp.seq_id, start + m)
        dev, dev_id = self.provider.name, self.provider.device_id
        binding = self._session.io_binding()
        ids = np.zeros((1, m), dtype=np.int64)
        ids[0, :n] = tokens
        # Padding rows sit at the next positions and see the past like real rows (so they stay finite);
        # real rows never see them, and their keys land beyond the length, where nothing reads them.
        host_inputs = {
            "input_ids": ids,
            "position_ids": np.arange(start, start + m, dtype=np.int64).reshape(1, m),
            "attn_mask": _causal_mask(start, m).reshape(1, 1, 1, m, start + m),
            # No rows wanted (a prompt chunk): compute row 0 anyway and drop it, so no kernel ever sees
            # a zero-sized matrix (cuBLAS/cuDNN paths are not all written for M = 0).
            "logit_rows": rows if len(rows) else np.zeros(1, dtype=np.int64),
            **self._moe_feed(np.arange(n)),
        }
        for name, arr in host_inputs.items():
            binding.bind_cpu_input(name, arr)
        past_shape, new_shape = [1, start, hp.n_head_kv, hp.head_dim], [1, m, hp.n_head_kv, hp.head_dim]
        for layer in range(hp.n_layer):
            for which, kind in ((0, "k"), (1, "v")):
                binding.bind_input(f"past_{kind}_{layer}", dev, dev_id, np.float32, past_shape,
                                   kv.ptr(seq, layer, which, 0))
                binding.bind_output(f"new_{kind}_{layer}", dev, dev_id, np.float32, new_shape,
                                    kv.ptr(seq, layer, which, start))
        logits = np.empty((max(len(rows), 1), hp.n_vocab), dtype=np.float32)
        host_outputs: dict[str, np.ndarray] = {"logits": logits}
        for name, _ in self._capture_names(capture):
            host_outputs[name] = np.empty((1, m, hp.n_embd), dtype=np.float32)
        for name, arr in host_outputs.items():  # ORT copies device results into these host arrays
            binding.bind_output(name, "cpu", 0, np.float32, list(arr.shape), arr.ctypes.data)
        self._session.run_with_iobinding(binding)
        seq.length = start + n
        host_outputs["logits"] = logits[: len(rows)]
        return self._make_output(host_outputs, capture, lambda a: a[0, :n])

    def _make_output(self, outs: dict[str, np.ndarray], capture: Capture,
                     pick: Callable[[np.ndarray], np.ndarray]) -> SeqOutput:
        result = SeqOutput(logits=outs["logits"])
        for name, layer in self._capture_names(capture):
            if layer is None:
                result.hidden_final = np.ascontiguousarray(pick(outs[name]))
            else:
                result.layer_inputs[layer] = np.ascontiguousarray(pick(outs[name]))
        return result

    def _run_batched(self, inputs: Sequence[SeqInput], checked: list[tuple[np.ndarray, np.ndarray]],
                     capture: Capture) -> list[SeqOutput]:
        """All sequences in one ORT run (host caches only): pad to the longest past and chunk."""
        hp, kv = self.hp, self._kv
        b_n = len(inputs)
        lens = [len(t) for t, _ in checked]
        t_max, p_max = max(lens), max(inp.start for inp in inputs)
        seqs: list[SeqKV] = [kv.reserve(inp.seq_id, inp.start + n) for inp, n in zip(inputs, lens, strict=True)]
        ids = np.zeros((b_n, t_max), dtype=np.int64)
        pos = np.zeros((b_n, t_max), dtype=np.int64)
        mask = np.full((b_n, 1, 1, t_max, p_max + t_max), -np.inf, dtype=np.float32)
        past = np.zeros((hp.n_layer, 2, b_n, p_max, hp.n_head_kv, hp.head_dim), dtype=np.float32)
        flat_rows = []
        for b, (inp, (toks, rows), seq) in enumerate(zip(inputs, checked, seqs, strict=True)):
            n, start = len(toks), inp.start
            ids[b, :n] = toks
            pos[b] = np.arange(start, start + t_max)
            mask[b, 0, 0, :, :start] = 0.0  # the sequence's own past
            new_part = np.triu(np.full((t_max, t_max), -np.inf, dtype=np.float32), k=1)
            new_part[n:, :] = -np.inf  # padding rows see only themselves, so they stay finite
            new_part[np.arange(n, t_max), np.arange(n, t_max)] = 0.0
            mask[b, 0, 0, :, p_max:] = new_part
            past[:, :, b, :start] = seq.host[:, :, :start]
            flat_rows.append(b * t_max + rows)
        real_rows = np.concatenate([b * t_max + np.arange(n) for b, n in enumerate(lens)])
        feeds = {"input_ids": ids, "position_ids": pos, "attn_mask": mask, "logit_rows": np.concatenate(flat_rows),
                 **self._moe_feed(real_rows)}
        for layer in range(hp.n_layer):
            feeds[f"past_k_{layer}"], feeds[f"past_v_{layer}"] = past[layer, 0], past[layer, 1]
        cap_names = [name for name, _ in self._capture_names(capture)]
        new_names = [f"new_{kind}_{layer}" for layer in range(hp.n_layer) for kind in ("k", "v")]
        results = dict(zip(["logits", *cap_names, *new_names],
                           self._session.run(["logits", *cap_names, *new_names], feeds), strict=True))
        outputs, offset = [], 0
        for b, (inp, (_, rows), seq) in enumerate(zip(inputs, checked, seqs, strict=True)):
            n, start = lens[b], inp.start
            for layer in range(hp.n_layer):
                seq.host[layer, 0, start : start + n] = results[f"new_k_{layer}"][b, :n]
                seq.host[layer, 1, start : start + n] = results[f"new_v_{layer}"][b, :n]
            seq.length = start + n
            per_seq = {"logits": np.ascontiguousarray(results["logits"][offset : offset + len(rows)])}
            offset += len(rows)
            for name in cap_names:
                per_seq[name] = results[name]
            outputs.append(self._make_output(per_seq, capture, lambda a, b=b, n=n: a[b, :n]))
        return outputs


with contextlib.suppress(ImportError):  # quiet ORT's own default logger before any session exists
    import onnxruntime as _ort

    _ort.set_default_logger_severity(3)

backend_class = OnnxBackend
