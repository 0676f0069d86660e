"""How a file scales positions: rope scaling (linear or YaRN) and the queries' temperature by position.

Read as llama.cpp reads and computes them (numpy only; every backend takes the results from here).

**Linear** scaling divides every rope frequency by ``rope.scaling.factor``.

**YaRN** (``rope.scaling.type = yarn``) blends, per rotated pair ``i``, the interpolated frequency
(divided by the factor) with the original one (extrapolation)::

    corr(beta) = n_rot * ln(n_ctx_orig / (2 pi beta)) / (2 ln base)
    low, high  = max(0, floor(corr(beta_fast))), min(n_rot - 1, ceil(corr(beta_slow)))
    mix_i      = ext_factor * (1 - clamp((i - low) / max(0.001, high - low), 0, 1))
    inv_i      = inv_orig_i * (freq_scale * (1 - mix_i) + mix_i)

(``n_ctx_orig`` is ``rope.scaling.original_context_length``, else ``context_length``), and multiplies
the cos and sin of every rotated pair by one magnitude ``mscale``, so the rotated dims of q and k both
grow by it. llama.cpp splits ``mscale`` between the context's ``yarn_attn_factor`` and the rope kernel's
own ``1 + 0.1 ln(factor)``; their product is::

    get_mscale(s, m) = 1 if s <= 1 else 1 + 0.1 m ln(s)
    mscale = rope.scaling.attn_factor * (get_mscale(factor, 1) / get_mscale(factor, log_mul)  if log_mul != 0
                                         get_mscale(factor, 1)                                 otherwise)

with ``log_mul = rope.scaling.yarn_log_multiplier``. Which of the YaRN keys a file's graph reads is the
architecture's business (:data:`YARN_FILE_KEYS`; a key the architecture does not read keeps llama.cpp's
default even when the file has it): mistral3 reads the betas and the log multiplier, the llama and qwen
families none of them (beta_fast 32, beta_slow 1, ext_factor 1).

**Attention temperature** (mistral3, from Llama 4): each query row at position ``p`` is multiplied by
``1 + attention.temperature_scale * ln(floor(p / n_ctx_orig) + 1)`` after rope, so beyond the original
context the attention sharpens step by step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from spekula.core.errors import ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile

# YaRN keys an architecture's loader may read from the file (prefixed with "{arch}.rope.scaling.").
YARN_FILE_KEYS = frozenset({"yarn_beta_fast", "yarn_beta_slow", "yarn_log_multiplier", "yarn_ext_factor",
                            "yarn_attn_factor"})
_DEFAULTS = {"yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0, "yarn_log_multiplier": 0.0}


@dataclass(frozen=True)
class YarnParams:
    """One file's YaRN rope: the frequency blend and the magnitude of cos/sin."""

    freq_scale: float  # 1 / rope.scaling.factor
    n_ctx_orig: int  # the context the model was trained with before scaling
    beta_fast: float
    beta_slow: float
    ext_factor: float  # weight of extrapolation in the blend (1: the ramp as is; 0: plain linear scaling)
    mscale: float  # magnitude of every rotated pair's cos and sin

    def corr_dims(self, n_rot: int, base: float) -> tuple[float, float]:
        """The pair range [low, high] over which the blend ramps from extrapolation to interpolation."""
        def corr(beta: float) -> float:
            return n_rot * math.log(self.n_ctx_orig / (beta * 2.0 * math.pi)) / (2.0 * math.log(base))

        return max(0.0, math.floor(corr(self.beta_fast))), min(n_rot - 1.0, math.ceil(corr(self.beta_slow)))

    def blend(self, inv_orig: np.ndarray, n_rot: int, base: float) -> np.ndarray:
        """Per-pair frequencies (float64) from the unscaled ones ``inv_orig`` ([n_rot / 2])."""
        low, high = self.corr_dims(n_rot, base)
        i = np.arange(inv_orig.shape[0], dtype=np.float64)
        ramp = 1.0 - np.clip((i - low) / max(0.001, high - low), 0.0, 1.0)
        mix = ramp * self.ext_factor
        return inv_orig * (self.freq_scale * (1.0 - mix) + mix)


@dataclass(frozen=True)
class AttnTemperature:
    """Queries multiplied by ``1 + scale * ln(floor(p / floor_len) + 1)`` at position p (after rope)."""

    scale: float
    floor_len: int

    def factors(self, positions: np.ndarray) -> np.ndarray:
        """The multiplier of each position's query (float32, as llama.cpp feeds it to the graph)."""
        steps = np.floor(np.asarray(positions, dtype=np.float64) / self.floor_len)
        return (np.log(steps + 1.0) * self.scale + 1.0).astype(np.float32)


@dataclass(frozen=True)
class PositionScaling:
    """What a file's keys say about positions: rope frequency scale, YaRN, the query temperature."""

    freq_scale: float = 1.0  # linear: 1 / rope.scaling.factor (YaRN keeps its own in `yarn`)
    yarn: YarnParams | None = None
    attn_temperature: AttnTemperature | None = None

    @property
    def rope_mscale(self) -> float:
        return self.yarn.mscale if self.yarn is not None else 1.0

    def with_freq_scale(self, freq_scale: float) -> PositionScaling:
        """This scaling for blocks whose rope scales frequencies by `freq_scale` instead (sliding blocks with
        a rope of their own): as in llama.cpp, YaRN's ramp, betas and context factor stay the file's, and
        only the rope kernel's ``1 + 0.1 ln(1 / freq_scale)`` follows the block's scale."""
        y = self.yarn
        if y is None:
            return PositionScaling(freq_scale=freq_scale, attn_temperature=self.attn_temperature)

        def kernel(fs: float) -> float:
            return 1.0 + 0.1 * math.log(1.0 / fs) if y.ext_factor != 0.0 else 1.0

        mscale = y.mscale / kernel(y.freq_scale) * kernel(freq_scale)
        return PositionScaling(yarn=replace(y, freq_scale=freq_scale, mscale=mscale),
                               attn_temperature=self.attn_temperature)


def _get_mscale(scale: float, m: float) -> float:
    return 1.0 if scale <= 1.0 else 0.1 * m * math.log(scale) + 1.0


def _read_yarn(f: GGUFFile, opt: Callable[[str, Any], Any], factor: float, n_ctx_orig: int,
               yarn_keys: frozenset[str]) -> YarnParams:
    def key(name: str) -> float:
        return float(opt(f"rope.scaling.{name}", _DEFAULTS[name])) if name in yarn_keys else _DEFAULTS[name]

    ext = float(opt("rope.scaling.yarn_ext_factor", -1.0)) if "yarn_ext_factor" in yarn_keys else -1.0
    ext = 1.0 if ext < 0.0 else ext  # negative: not set, and YaRN means the full blend
    if ext != 0.0:  # llama.cpp's context factor times its rope kernel's 1 + 0.1 ln(factor)
        log_mul = key("yarn_log_multiplier")
        mscale = _get_mscale(factor, 1.0) / _get_mscale(factor, log_mul) if log_mul != 0.0 else _get_mscale(factor, 1.0)
    else:
        mscale = float(opt("rope.scaling.yarn_attn_factor", 1.0)) if "yarn_attn_factor" in yarn_keys else 1.0
    mscale *= float(opt("rope.scaling.attn_factor", 1.0) or 1.0)
    beta_fast, beta_slow = key("yarn_beta_fast"), key("yarn_beta_slow")
    if n_ctx_orig <= 0 or beta_fast <= 0.0 or beta_slow <= 0.0:
        raise ModelFileError(f.path, f"invalid YaRN parameters: original context {n_ctx_orig}, "
                                     f"beta_fast {beta_fast}, beta_slow {beta_slow}")
    return YarnParams(freq_scale=1.0 / factor, n_ctx_orig=n_ctx_orig, beta_fast=beta_fast, beta_slow=beta_slow,
                      ext_factor=ext, mscale=mscale)


def read_position_scaling(f: GGUFFile, opt: Callable[[str, Any], Any], n_ctx_train: int,
                          yarn_keys: frozenset[str], attn_temperature: bool) -> PositionScaling:
    """`f`'s rope scaling and query temperature; `opt(key, default)` reads ``{arch}.key``. `yarn_keys` are
    the YaRN keys the architecture reads, `attn_temperature` whether its graph scales queries by position.

    As in llama.cpp, a file without ``rope.scaling.type`` scales linearly by its factor (or the older
    ``rope.scale_linear``), and ``none`` never scales."""
    kind = opt("rope.scaling.type", None)
    if kind not in (None, "none", "linear", "yarn"):
        raise ModelFileError(f.path, f"unsupported rope scaling {kind!r} (supported: none, linear, yarn)")
    factor = float(opt("rope.scaling.factor", 0.0) or 0.0) or float(opt("rope.scale_linear", 0.0) or 0.0)
    if factor < 0.0:
        raise ModelFileError(f.path, f"invalid rope.scaling.factor {factor}")
    factor = 1.0 if factor == 0.0 or kind == "none" else factor
    n_ctx_orig = int(opt("rope.scaling.original_context_length", 0) or 0) or n_ctx_train
    yarn = _read_yarn(f, opt, factor, n_ctx_orig, yarn_keys) if kind == "yarn" else None
    temperature = None
    scale = float(opt("attention.temperature_scale", 0.0) or 0.0) if attn_temperature else 0.0
    if scale != 0.0:
        if n_ctx_orig <= 0:
            raise ModelFileError(f.path, "attention.temperature_scale needs rope.scaling.original_context_length > 0")
        temperature = AttnTemperature(scale=scale, floor_len=n_ctx_orig)
    return PositionScaling(freq_scale=1.0 if yarn is not None else 1.0 / factor, yarn=yarn,
                           attn_temperature=temperature)


def rope_frequencies(n_rot: int, base: float, scaling: PositionScaling, freq_factors: np.ndarray | None) -> np.ndarray:
    """Per-pair angular frequency (float64, [n_rot / 2]): theta_i(p) = p * inv[i], every scaling folded in
    (the llama3-style ``rope_freqs`` divisors first, as llama.cpp applies them before YaRN's blend)."""
    inv = base ** (-2.0 * np.arange(n_rot // 2, dtype=np.float64) / n_rot)
    if freq_factors is not None:
        inv = inv / np.asarray(freq_factors, dtype=np.float64).reshape(-1)
    if scaling.yarn is not None:
        return scaling.yarn.blend(inv, n_rot, base)
    return scaling.freq_scale * inv
