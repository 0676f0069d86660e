"""ctypes binding of spekula's native CPU kernels (``backends/native/csrc``, built with the package).

Only this module knows the C structures. Arrays handed to the library are numpy arrays (or the
memory-mapped GGUF file) that the caller keeps alive for as long as the library may read them;
every call that takes a while releases the GIL (ctypes does so for foreign calls).
"""

from __future__ import annotations

import ctypes
import os
from functools import cache
from pathlib import Path

import numpy as np

from spekula.core.errors import ConfigError
from spekula.core.extension import extension_path

# ggml type ids of the block formats the kernels read (as stored in GGUF files).
TYPE_IDS = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8,
            "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "BF16": 30, "IQ4_NL": 20, "IQ4_XS": 23, "MXFP4": 39, "Q3_K": 11, "Q2_K": 10}
KEY_BLOCK = 16

_f32p = ctypes.POINTER(ctypes.c_float)
_i32p = ctypes.POINTER(ctypes.c_int32)


class Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("type", ctypes.c_int32), ("layout", ctypes.c_int32),
                ("n_rows", ctypes.c_int64), ("n_cols", ctypes.c_int64), ("row_bytes", ctypes.c_int64),
                ("bias", ctypes.c_void_p)]


# sk_moe's gating ids.
GATING_IDS = {"softmax": 0, "sigmoid": 1, "softmax_weight": 2}
# sk_moe's expert activations.
ACTIVATION_IDS = {"swiglu": 0, "swiglu_oai": 1, "geglu": 2}


class MoE(ctypes.Structure):
    """A MoE block's FFN (sk_moe.h): router, per-expert views into the 3-D expert tensors, shared expert."""

    _fields_ = [("n_expert", ctypes.c_int32), ("n_expert_used", ctypes.c_int32), ("gating", ctypes.c_int32),
                ("norm_weights", ctypes.c_int32), ("weights_scale", ctypes.c_float),
                ("selection_bias", ctypes.c_void_p), ("router", Tensor), ("gate", ctypes.POINTER(Tensor)),
                ("up", ctypes.POINTER(Tensor)), ("down", ctypes.POINTER(Tensor)), ("shared_gate", Tensor),
                ("shared_up", Tensor), ("shared_down", Tensor),
                ("shared_inp", Tensor),  # data NULL: the shared expert's output is not gated
                ("activation", ctypes.c_int32),  # ACTIVATION_IDS of the routed experts
                ("expert_scale", ctypes.c_void_p)]  # [n_expert] multipliers of the chosen weights (Gemma 4), or NULL


class DeltaNet(ctypes.Structure):
    """A gated delta-net block (sk_deltanet.h): its projections, conv kernel and gates (qkv.data NULL: none)."""

    _fields_ = [(name, ctypes.c_int32) for name in ("n_k_heads", "n_v_heads", "head_k_dim", "head_v_dim",
                                                     "conv_kernel")] + [
        ("qkv", Tensor), ("z", Tensor), ("beta", Tensor), ("alpha", Tensor), ("out", Tensor),
        ("conv_w", ctypes.c_void_p), ("dt_bias", ctypes.c_void_p), ("a", ctypes.c_void_p), ("norm", ctypes.c_void_p)]


class Layer(ctypes.Structure):
    _fields_ = [("attn_norm", ctypes.c_void_p), ("ffn_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("wq", Tensor), ("wk", Tensor), ("wv", Tensor), ("wo", Tensor),
                ("w_gate", Tensor), ("w_up", Tensor), ("w_down", Tensor), ("moe", ctypes.POINTER(MoE)),
                ("attn_gate", ctypes.c_int32),  # wq yields [q | gate] per head (Qwen3.5)
                ("dn", DeltaNet),  # dn.qkv.data set: a gated delta-net block in place of attention
                # Gemma: RMS-normed attention / FFN outputs before the residual add (NULL: none)
                ("attn_post_norm", ctypes.c_void_p), ("ffn_post_norm", ctypes.c_void_p),
                ("sliding", ctypes.c_int32),  # the config's window, rope_inv_freq_swa, a ring of keys and values
                ("attn_sinks", ctypes.c_void_p),  # [n_head] sink logits (gpt-oss), or NULL
                # Gemma 4 (csrc/sk_gemma4.h): own head size (0: the config's), 1 + the block whose KV it attends
                # (0: its own), weightless value norm, own KV head count (0: the config's), output scale (0: none), the
                # per-layer input's weights
                ("head_dim", ctypes.c_int32), ("kv_shared", ctypes.c_int32), ("value_norm", ctypes.c_int32),
                ("n_head_kv", ctypes.c_int32),
                ("out_scale", ctypes.c_float), ("ple_gate", Tensor), ("ple_proj", Tensor), ("ple_norm", ctypes.c_void_p),
                # Gemma 4's MoE blocks (moe_pre_norm set): the dense FFN beside the experts, each half post-normed
                ("moe_pre_norm", ctypes.c_void_p), ("router_scale", ctypes.c_void_p), ("dense_post_norm", ctypes.c_void_p),
                ("moe_post_norm", ctypes.c_void_p)]


class Config(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int32) for name in (
        "n_vocab", "n_embd", "n_layer", "n_head", "n_head_kv", "head_dim", "n_ff", "n_rot",
        "rope_neox", "n_ctx", "n_seq_max", "n_threads")] + [
        ("rms_eps", ctypes.c_float), ("attn_scale", ctypes.c_float),
        ("rope_inv_freq", ctypes.c_void_p), ("output_norm", ctypes.c_void_p),
        ("token_embd", Tensor), ("output", Tensor), ("layers", ctypes.POINTER(Layer)),
        # MTP heads' input projection (data NULL: rows enter as their token's embedding)
        ("in_proj", Tensor), ("in_embd_norm", ctypes.c_void_p), ("in_hidden_norm", ctypes.c_void_p),
        # EAGLE-3 heads: block 0 reads [normed embedding; normed hidden] itself (WIDE_* below)
        ("wide_input", ctypes.c_int32),
        # DFlash heads' context encoder (fc, then its norm) that sk_inject_kv turns into keys and values
        ("ctx_proj", Tensor), ("ctx_norm", ctypes.c_void_p),
        # sliding blocks (csrc/sk_swa.h) and Gemma-style embeddings and FFN gate
        ("rope_inv_freq_swa", ctypes.c_void_p), ("swa_window", ctypes.c_int32), ("swa_row_cap", ctypes.c_int32),
        ("ffn_geglu", ctypes.c_int32), ("embd_scale", ctypes.c_float),
        # sk_rope.h: YaRN's cos/sin magnitude, the queries' temperature by position (0: none)
        ("rope_mscale", ctypes.c_float), ("attn_temp_scale", ctypes.c_float), ("attn_temp_floor", ctypes.c_int32),
        # Gemma 4: the sliding blocks' rope width (0: n_rot); per-layer inputs (n_embd_per_layer 0: none)
        ("n_rot_swa", ctypes.c_int32), ("n_embd_per_layer", ctypes.c_int32), ("ple_embd", Tensor),
        ("ple_model_proj", Tensor), ("ple_proj_norm", ctypes.c_void_p)]


# sk_config.wide_input: none, or the 2 n_embd wide first block with the residual from hidden_in / its norm.
WIDE_NONE, WIDE_RESIDUAL_HIDDEN, WIDE_RESIDUAL_NORMED = 0, 1, 2


class Batch(ctypes.Structure):
    _fields_ = [("n_rows", ctypes.c_int64), ("tokens", ctypes.c_void_p), ("pos", ctypes.c_void_p),
                ("seq", ctypes.c_void_p), ("n_out", ctypes.c_int64), ("out_rows", ctypes.c_void_p),
                ("logits", ctypes.c_void_p), ("capture", ctypes.c_void_p), ("hidden_final", ctypes.c_void_p),
                ("hidden_in", ctypes.c_void_p),
                ("key_end", ctypes.c_void_p)]  # NULL: causal; else row r attends keys [0, key_end[r])


class AssistantBlock(ctypes.Structure):
    """One block of Gemma 4's assistant (csrc/sk_assistant.h): query-only attention over a target block's KV."""

    _fields_ = [("sliding", ctypes.c_int32), ("kv_layer", ctypes.c_int32)] + [
        (name, ctypes.c_void_p) for name in ("attn_norm", "q_norm", "attn_post_norm", "ffn_norm", "ffn_post_norm")] + [
        (name, Tensor) for name in ("wq", "wo", "w_gate", "w_up", "w_down")] + [("out_scale", ctypes.c_float)]


class Assistant(ctypes.Structure):
    """Gemma 4's assistant (csrc/sk_assistant.h): its projections to and from the target's width, tied head, blocks."""

    _fields_ = [("n_embd", ctypes.c_int32), ("n_head", ctypes.c_int32), ("n_layer", ctypes.c_int32),
                ("rms_eps", ctypes.c_float), ("embd_scale", ctypes.c_float), ("pre_proj", Tensor),
                ("post_proj", Tensor), ("embd", Tensor), ("output_norm", ctypes.c_void_p),
                ("blocks", ctypes.POINTER(AssistantBlock))]


def forward(ctx: int, batch: Batch, what: str) -> None:
    """Run one native forward of `batch`; out of scratch memory is a MemoryError and a batch the library
    refuses a ConfigError, both naming `what` ("native forward", "native MTP forward", ...)."""
    rc = lib().sk_forward(ctx, ctypes.byref(batch))
    if rc == -1:
        raise MemoryError(f"{what} of {batch.n_rows} rows: out of memory for its scratch buffers")
    if rc != 0:
        raise ConfigError(f"{what} rejected the batch (rc={rc})")


def ctx_config(ctx: int) -> Config:
    """A context's config as it runs: its token_embd, output and in_proj as prepared (packed weights
    point into memory the context owns)."""
    cfg = Config()
    lib().sk_ctx_config(ctx, ctypes.byref(cfg))
    return cfg


def library_path() -> Path:
    return extension_path(Path(__file__).resolve().parent, "_sk", "spekula's native kernels are",
                          ", or choose --backend torch")


@cache
def lib() -> ctypes.CDLL:
    so = ctypes.CDLL(str(library_path()))
    so.sk_kernel_name.restype = ctypes.c_char_p
    so.sk_kernel_name.argtypes = [ctypes.c_int]
    so.sk_ctx_new.restype = ctypes.c_void_p
    so.sk_ctx_new.argtypes = [ctypes.POINTER(Config), ctypes.c_int]
    so.sk_ctx_new_head_later.restype = ctypes.c_void_p
    so.sk_ctx_new_head_later.argtypes = [ctypes.POINTER(Config), ctypes.c_int]
    so.sk_ctx_pack_head.restype = None
    so.sk_ctx_pack_head.argtypes = [ctypes.c_void_p]
    so.sk_ctx_new_over.restype = ctypes.c_void_p
    so.sk_ctx_new_over.argtypes = [ctypes.POINTER(Config), ctypes.c_void_p]
    so.sk_ctx_config.restype = None
    so.sk_ctx_config.argtypes = [ctypes.c_void_p, ctypes.POINTER(Config)]
    so.sk_ctx_packed_bytes.restype = ctypes.c_int64
    so.sk_ctx_packed_bytes.argtypes = [ctypes.c_void_p]
    so.sk_ctx_free.restype = None
    so.sk_ctx_free.argtypes = [ctypes.c_void_p]
    so.sk_ctx_kernel_name.restype = ctypes.c_char_p
    so.sk_ctx_kernel_name.argtypes = [ctypes.c_void_p]
    so.sk_kv_alloc.restype = ctypes.c_int
    so.sk_kv_alloc.argtypes = [ctypes.c_void_p, ctypes.c_int]
    so.sk_kv_shift.restype = ctypes.c_int
    so.sk_kv_shift.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    so.sk_kv_release.restype = None
    so.sk_kv_release.argtypes = [ctypes.c_void_p, ctypes.c_int]
    so.sk_forward.restype = ctypes.c_int
    so.sk_forward.argtypes = [ctypes.c_void_p, ctypes.POINTER(Batch)]
    so.sk_asst_new.restype = ctypes.c_void_p
    so.sk_asst_new.argtypes = [ctypes.POINTER(Assistant), ctypes.c_void_p]
    so.sk_asst_free.restype = None
    so.sk_asst_free.argtypes = [ctypes.c_void_p]
    so.sk_asst_step.restype = ctypes.c_int
    so.sk_asst_step.argtypes = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 6
    so.sk_project_in.restype = ctypes.c_int
    so.sk_project_in.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    so.sk_inject_kv.restype = ctypes.c_int
    so.sk_inject_kv.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int32]
    so.sk_test_quantize.restype = None
    so.sk_test_quantize.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    so.sk_test_gemm.restype = ctypes.c_int
    so.sk_test_gemm.argtypes = [ctypes.POINTER(Tensor), ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
                                ctypes.c_int, ctypes.POINTER(ctypes.c_double)]
    so.sk_test_dequant.restype = None
    so.sk_test_dequant.argtypes = [ctypes.POINTER(Tensor), ctypes.c_int64, ctypes.c_void_p]
    so.sk_test_pack.restype = ctypes.c_int64
    so.sk_test_pack.argtypes = [ctypes.POINTER(Tensor), ctypes.c_int, ctypes.c_void_p]
    so.sk_test_attend.restype = ctypes.c_int
    so.sk_test_attend.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                  ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                  ctypes.POINTER(ctypes.c_double)]
    for name in ("sk_rs_checkpoint", "sk_rs_snapshot"):
        getattr(so, name).restype = ctypes.c_int
        getattr(so, name).argtypes = [ctypes.c_void_p, ctypes.c_int]
    so.sk_rs_truncate.restype = ctypes.c_int
    so.sk_rs_truncate.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
    so.sk_swa_floor.restype = ctypes.c_int64
    so.sk_swa_floor.argtypes = [ctypes.c_void_p, ctypes.c_int]
    so.sk_swa_truncate.restype = None
    so.sk_swa_truncate.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
    so.sk_swa_snapshot.restype = ctypes.c_int
    so.sk_swa_snapshot.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
    so.sk_swa_snapshot_at.restype = ctypes.c_int64
    so.sk_swa_snapshot_at.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
    so.sk_swa_restore.restype = ctypes.c_int
    so.sk_swa_restore.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
    so.sk_rs_restorable.restype = ctypes.c_int64
    so.sk_rs_restorable.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
    so.sk_rs_length.restype = ctypes.c_int64
    so.sk_rs_length.argtypes = [ctypes.c_void_p, ctypes.c_int]
    so.sk_rs_read.restype = ctypes.c_int64
    so.sk_rs_read.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64]
    so.sk_kv_state_elems.restype = ctypes.c_int64
    so.sk_kv_state_elems.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    so.sk_kv_copy.restype = ctypes.c_int64
    so.sk_kv_copy.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    so.sk_rs_state_floats.restype = ctypes.c_int64
    so.sk_rs_state_floats.argtypes = [ctypes.c_void_p]
    so.sk_rs_export.restype = ctypes.c_int64
    so.sk_rs_export.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64]
    so.sk_rs_import.restype = ctypes.c_int
    so.sk_rs_import.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    so.sk_swa_reset_slot.restype = None
    so.sk_swa_reset_slot.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
    so.sk_moe_experts_run.restype = ctypes.c_int64
    so.sk_moe_experts_run.argtypes = []
    so.sk_profile_report.restype = None
    so.sk_profile_report.argtypes = [ctypes.POINTER(ctypes.c_double), ctypes.c_int]
    so.sk_profile_phase_name.restype = ctypes.c_char_p
    so.sk_profile_phase_name.argtypes = [ctypes.c_int]
    return so


def profile_report() -> dict[str, float]:
    """Seconds per forward phase on thread 0 since the last report (SPEKULA_NATIVE_PROFILE=1 at start)."""
    names = []
    while (n := lib().sk_profile_phase_name(len(names))) is not None:
        names.append(n.decode())
    out = (ctypes.c_double * len(names))()
    lib().sk_profile_report(out, len(names))
    return dict(zip(names, out, strict=True))


def moe_experts_run() -> int:
    """Experts (shared ones included) run since the last call, summed over MoE blocks and forwards, all
    contexts of the process together: an expert that no row of a forward chose is not run."""
    return int(lib().sk_moe_experts_run())


# The most a context may use (sk.h's SK_KERNELS_*): the best this CPU runs, the portable C, or at most
# AVX2 (which tests select on AVX-512 machines so that path is checked too).
KERNEL_CAPS = {"best": 0, "generic": 1, "avx2": 2}
KERNELS_ENV = "SPEKULA_NATIVE_KERNELS"


def kernel_cap(choice: str) -> int:
    if choice not in KERNEL_CAPS:
        raise ConfigError(f"unknown native kernel choice {choice!r} (choose one of {', '.join(KERNEL_CAPS)})")
    return KERNEL_CAPS[choice]


def env_kernel_cap() -> int:
    """The cap named by SPEKULA_NATIVE_KERNELS (best when unset): how a whole process is pinned to one set."""
    choice = os.environ.get(KERNELS_ENV, "best") or "best"
    if choice not in KERNEL_CAPS:
        raise ConfigError(f"{KERNELS_ENV}={choice!r} is not a native kernel choice (choose one of "
                          f"{', '.join(KERNEL_CAPS)})")
    return KERNEL_CAPS[choice]


def kernel_name(kernels: str = "best") -> str:
    """Which kernel set this CPU gets under a cap: 'avx512-vnni', 'avx2' or 'generic'."""
    return str(lib().sk_kernel_name(kernel_cap(kernels)).decode())


def available_kernels() -> list[str]:
    """The kernel sets this CPU runs, the portable one first."""
    names = [kernel_name("generic"), kernel_name("avx2"), kernel_name("best")]
    return list(dict.fromkeys(names))


def ptr(a: np.ndarray | None) -> int | None:
    """Address of a C-contiguous array's first element (None for None)."""
    if a is None:
        return None
    if not a.flags.c_contiguous:
        raise ValueError("array must be C-contiguous")
    return int(a.ctypes.data)


def tensor(data: np.ndarray, type_name: str, n_rows: int, n_cols: int, bias: np.ndarray | None = None) -> Tensor:
    """Describe a weight whose rows are the rows of `data` (raw bytes or a typed array)."""
    if type_name not in TYPE_IDS:
        raise ConfigError(f"tensor type {type_name} has no native kernel")
    row_bytes = data.nbytes // n_rows if n_rows else 0
    return Tensor(ptr(data), TYPE_IDS[type_name], 0, n_rows, n_cols, row_bytes, ptr(bias))


def quantize_rows(x: np.ndarray, *, kernels: str = "best") -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The activation quantization the matmuls use: (q int8 [m, kp], d and s float32 [m, kp/32],
    qs16 int32 [m, kp/16]); kp = n_cols rounded up to 64."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    m, k = x.shape
    kp = -(-k // 64) * 64
    q = np.zeros((m, kp), np.int8)
    d, s, qs16 = np.zeros((m, kp // 32), np.float32), np.zeros((m, kp // 32), np.float32), np.zeros((m, kp // 16), np.int32)
    lib().sk_test_quantize(ptr(x), m, k, ptr(q), ptr(d), ptr(s), ptr(qs16), kernel_cap(kernels))
    return q, d, s, qs16


def matmul(w: Tensor, x: np.ndarray, *, kernels: str = "best") -> np.ndarray:
    """x [m, n_cols] times the weight transposed -> [m, n_rows], through the kernel the model uses."""
    return timed_matmul(w, x, kernels=kernels)[0]


def timed_matmul(w: Tensor, x: np.ndarray, *, kernels: str = "best", reps: int = 1) -> tuple[np.ndarray, float]:
    """matmul run `reps` times on one thread; also the seconds of one run (weight repacking excluded)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty((x.shape[0], w.n_rows), np.float32)
    seconds = ctypes.c_double(0.0)
    rc = lib().sk_test_gemm(ctypes.byref(w), ptr(x), x.shape[0], ptr(out), kernel_cap(kernels), reps, ctypes.byref(seconds))
    if rc != 0:
        raise ConfigError(f"no kernel for this tensor (rc={rc})")
    return out, seconds.value


def key_layout(keys: np.ndarray) -> np.ndarray:
    """float [n_keys, head_dim] -> the cache's float16 key layout [n_keys/16, head_dim, 16] (zero padded)."""
    n, hd = keys.shape
    nb = -(-n // KEY_BLOCK)
    padded = np.zeros((nb * KEY_BLOCK, hd), np.float16)
    padded[:n] = keys
    return np.ascontiguousarray(padded.reshape(nb, KEY_BLOCK, hd).transpose(0, 2, 1))


def attend(q: np.ndarray, keys: np.ndarray, values: np.ndarray, scale: float, *, kernels: str = "best",
           reps: int = 1) -> tuple[np.ndarray, float]:
    """Attention of query heads q [n_q, hd] over keys/values [n_keys, hd] (rounded to float16 as the
    cache holds them) through the model's kernel; also the seconds of one call."""
    q = np.ascontiguousarray(q, np.float32)
    k = key_layout(keys)
    v = np.ascontiguousarray(values, np.float16)
    out = np.empty_like(q)
    seconds = ctypes.c_double(0.0)
    rc = lib().sk_test_attend(ptr(q), q.shape[0], ptr(k), ptr(v), keys.shape[0], q.shape[1], scale, ptr(out),
                              kernel_cap(kernels), reps, ctypes.byref(seconds))
    if rc != 0:
        raise MemoryError("attention scratch")
    return out, seconds.value


def packed(w: Tensor, *, by_value: bool = False) -> np.ndarray:
    """A quantized weight in the SIMD kernels' packed layout (csrc/sk_pack.h), as loading packs it or,
    with `by_value`, through every value one by one (the reference the copying paths must equal)."""
    n_bytes = lib().sk_test_pack(ctypes.byref(w), int(by_value), None)
    if n_bytes <= 0:
        raise ConfigError("no packed layout for this tensor")
    out = np.empty(n_bytes, np.uint8)
    lib().sk_test_pack(ctypes.byref(w), int(by_value), ptr(out))
    return out


def dequant_row(w: Tensor, row: int) -> np.ndarray:
    out = np.empty(w.n_cols, np.float32)
    lib().sk_test_dequant(ctypes.byref(w), row, ptr(out))
    return out
