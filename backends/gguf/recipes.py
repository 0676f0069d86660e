"""What each architecture's decoder blocks compute: one :class:`BlockRecipe` per architecture.

:data:`ARCHITECTURES` maps a file's ``general.architecture`` to its recipe: the norm, the activation,
the rope pairing, which optional tensors (q/k norm, attention biases) a block has, the options later
architectures need (post-sublayer norms, sliding windows, attention sinks, logit soft-capping) and, for
mixture-of-experts models, how tokens are routed (:class:`MoERecipe`). gguf/architecture.py reads a
file's hyper-parameters against its recipe.

Rope pairing is fixed per architecture in llama.cpp (``llama_model_rope_type``), not stored in the
file: llama's Q/K rows stay as its converter permuted them for interleaved (NORM) rope, the qwen
and GLM families rotate halves (NEOX). Rope scaling (linear or YaRN, with the YaRN keys the recipe's
graph reads) and the queries' temperature by position (mistral3) are read by gguf/rope_scaling.py into
:attr:`ModelHParams.scaling`.

MoE routing, as llama.cpp computes it: ``probs = softmax(logits)`` or ``sigmoid(logits)``; the
``n_expert_used`` experts with the largest ``probs + exp_probs_b`` are chosen (the bias only steers
the choice: GLM's "expert score correction"); their weights are the unbiased ``probs``, divided by
their sum when ``norm_weights`` (clamped below, see gguf/moe.py), then multiplied by
``weights_scale`` when != 1; the block's output is ``sum_e weight_e * expert_e(x)`` plus the shared
expert's output (times ``sigmoid(x @ ffn_gate_inp_shexp)`` where the recipe gates it: Qwen3.5-MoE).
Blocks ``[0, n_dense_lead)`` keep the dense FFN. gpt-oss routes otherwise (``softmax_weight``): the
``n_expert_used`` largest logits (the router has a bias) are chosen and their weights are a softmax over
those logits alone; its experts have biases and the clamped SwiGLU ``swiglu_oai``.

Hybrid models (Qwen3.5) interleave gated delta-net blocks with full-attention blocks: the file marks
which blocks are recurrent (``attention.recurrent_layers``, else every ``full_attention_interval``-th
block is attention). A delta-net block projects ``qkv`` (one fused matrix, conv channels
``[q | k | v]``) and the gate ``z``, runs a depthwise causal conv1d of width ``ssm.conv_kernel`` over
the qkv channels (its state: the last ``conv_kernel - 1`` rows), SiLU, L2-normalises q and k per head,
and advances a per-head state ``S [head_v_dim x head_k_dim]`` by the gated delta rule with
``g = softplus(alpha + dt_bias) * ssm_a`` (``ssm_a = -exp(A_log)``) and ``beta = sigmoid(b)``;
its output is RMS-normed per head, multiplied by ``silu(z)`` and projected by ``ssm_out``.
:class:`DeltaNetParams` holds the sizes. Qwen3.5's attention blocks are gated: ``attn_q`` yields a
query and a gate per head (``[q | gate]`` per head), the attention output is multiplied by
``sigmoid(gate)`` before ``attn_output``. Backends declare which of these operations they run
(:data:`FEATURES`); :func:`read_hparams` refuses a file whose blocks need one the caller lacks.

Sliding-window attention (Gemma 3, gpt-oss), as llama.cpp sets it: a file with a positive
``attention.sliding_window`` W has sliding blocks, where a query at position p sees the keys at
positions ``(p - W, p]``. Which blocks slide is ``attention.sliding_window_pattern`` when the file has
it (one flag per block, or a period n), else the architecture's period n (:attr:`BlockRecipe.swa_period`):
block i slides unless ``i % n == n - 1`` (every n-th block, counting from the first, is global; with
``swa_dense_first`` it is ``i % n == 0`` instead); n = 0 means every block slides. Sliding blocks rope
with ``rope.freq_base_swa`` when the file has it, else with the architecture's own default
(:attr:`BlockRecipe.swa_rope`). Gemma-style blocks (Gemma 3) scale the token embedding by sqrt(n_embd),
RMS-norm the attention and FFN outputs before each residual add (``attn_post_norm``,
``ffn_post_norm``), gate their FFN with GELU (tanh approximation), and scale attention scores by
:attr:`BlockRecipe.kq_scale_rule`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

NormKind = Literal["rms", "layer"]
Activation = Literal["swiglu", "geglu"]
RopeKind = Literal["norm", "neox"]  # NORM: pairs (2i, 2i+1); NEOX: pairs (i, i + n_rot/2)
# softmax_weight (gpt-oss): the top-k of the raw logits are chosen, their weights a softmax over those k.
Gating = Literal["softmax", "sigmoid", "softmax_weight"]
# swiglu: silu(gate) * up; swiglu_oai (gpt-oss): min(gate, 7) * sigmoid(1.702 min(gate, 7)) * (clamp(up, +-7) + 1).
ExpertActivation = Literal["swiglu", "swiglu_oai", "geglu"]
# Whether a block has an optional group of tensors: never (ignored if the file has them), when the
# file has them (probed on the first block), or always (a missing one is a missing-tensor error).
Presence = Literal["never", "optional", "always"]

# Routing keys an architecture's graph may take from the file (prefixed with the architecture).
MOE_FILE_KEYS = frozenset({"expert_gating_func", "expert_weights_norm", "expert_weights_scale",
                           "expert_shared_count", "leading_dense_block_count"})
# llama.cpp's expert_gating_func enum as stored in GGUF (0, "none", means the architecture's default).

@dataclass(frozen=True)
class MoERecipe:
    """How an architecture's MoE blocks route tokens. The routing keys named in ``file_keys`` are read
    from the file (absent ones keep these defaults); the rest are fixed by the architecture's graph."""

    gating: Gating
    norm_weights: bool
    selection_bias: bool  # every MoE block has exp_probs_b, the bias that steers the choice
    file_keys: frozenset[str] = frozenset()
    # The shared expert: "count" (expert_shared_count experts of expert_feed_forward_length rows) or
    # "tensors" (one shared expert when the blocks have ffn_up_shexp, expert_shared_feed_forward_length
    # rows, its output gated by sigmoid(x @ ffn_gate_inp_shexp)).
    shared: Literal["count", "tensors"] = "count"
    # The router and every expert matrix have biases (ffn_gate_inp.bias, ffn_{gate,up,down}_exps.bias).
    expert_bias: bool = False
    activation: ExpertActivation = "swiglu"
    # Gemma 4: the block's dense FFN runs beside the experts, each half with its own norms; the router reads
    # rms_norm(x) / sqrt(n_embd) * ffn_gate_inp.scale of the residual x, and each expert's output is multiplied
    # by its ffn_down_exps.scale where the file has one (gguf/block_layout.py).
    beside_dense: bool = False
    optional: bool = False  # only files with expert_count have MoE blocks (else every block is dense)


@dataclass(frozen=True)
class BlockRecipe:
    """How one architecture builds its decoder blocks (the row of :data:`ARCHITECTURES`)."""

    rope: RopeKind
    qk_norm: Presence = "never"  # per-head RMSNorm of q and k before rope (attn_{q,k}_norm)
    attn_bias: Presence = "optional"  # attn_{q,k,v}.bias
    ffn_norm: str = "ffn_norm"  # name of the norm before the FFN (GLM-4.5: post_attention_norm)
    norm: NormKind = "rms"  # pre-attention and pre-FFN norm kind
    activation: Activation = "swiglu"  # act(gate) * up
    post_norms: bool = False  # norms of the attention and FFN outputs before the residual add (Gemma 2/3)
    sliding_window: bool = False  # the file's attention.sliding_window limits what a query sees
    attn_sinks: bool = False  # a learned per-head sink logit in every softmax (gpt-oss: attn_sinks)
    logit_softcap: bool = False  # the file's attn_logit_softcapping / final_logit_softcapping apply
    attn_output_gate: bool = False  # attn_q yields [q | gate] per head; output *= sigmoid(gate) (Qwen3.5)
    delta_net: bool = False  # hybrid: the file's recurrent blocks are gated delta-net (Qwen3.5)
    moe: MoERecipe | None = None  # None: every block has the dense FFN
    # YaRN keys of rope_scaling.YARN_FILE_KEYS the graph reads from the file (others keep llama.cpp's defaults)
    yarn_keys: frozenset[str] = frozenset()
    attn_temperature: bool = False  # queries scaled by position (attention.temperature_scale; mistral3)
    # Sliding blocks when the file has a window: block i slides unless i % swa_period == swa_period - 1
    # (swa_dense_first: unless i % swa_period == 0); 0: every block. attention.sliding_window_pattern overrides.
    swa_period: int = 0
    swa_dense_first: bool = False
    swa_required: bool = False  # the graph needs attention.sliding_window (gpt-oss); else a file may omit it
    # Sliding blocks' rope without rope.freq_base_swa: "own" (base 10000, no scaling: llama.cpp's defaults,
    # Gemma 3) or "shared" (the global blocks' base and scaling: gpt-oss).
    swa_rope: Literal["own", "shared"] = "shared"
    embd_scale_sqrt: bool = False  # token embeddings times sqrt(n_embd) (Gemma)
    # Attention score scale from (n_layer, n_embd, n_head, head_dim) where the graph fixes it (0: the file's
    # attention.scale, else 1/sqrt(head_dim)).
    kq_scale_rule: Callable[[int, int, int, int], float] | None = None
    # Gemma 4 (gguf/block_layout.py): per-block head sizes, shared KV, per-layer inputs, output scales, read
    # from the file (which must carry attention.sliding_window_pattern); rope_freqs only in the global blocks.
    block_layout: bool = False
    value_norm: bool = False  # values RMS-normed per head (no weight) before they are cached

    @property
    def rope_neox(self) -> bool:
        return self.rope == "neox"


def _gemma3_kq_scale(n_layer: int, n_embd: int, n_head: int, head_dim: int) -> float:
    """Gemma 3's query scale as llama.cpp fixes it: 1/sqrt(n_embd / n_head) for the 27B shape (62 blocks),
    else 1/sqrt(head_dim) (the file carries no query_pre_attn_scalar)."""
    return 1.0 / math.sqrt(n_embd // n_head if n_layer == 62 else head_dim)


def _unit_kq_scale(n_layer: int, n_embd: int, n_head: int, head_dim: int) -> float:
    """Gemma 4's attention scale: 1 (its q/k norms set the scores' magnitude)."""
    return 1.0


ARCHITECTURES: dict[str, BlockRecipe] = {
    "llama": BlockRecipe(rope="norm"),
    "qwen2": BlockRecipe(rope="neox", attn_bias="always"),
    "qwen3": BlockRecipe(rope="neox", qk_norm="always"),
    # qwen3moe's graph always softmax-gates and normalises the top-k weights; no shared expert or bias.
    "qwen3moe": BlockRecipe(rope="neox", qk_norm="always", moe=MoERecipe("softmax", True, False)),
    # glm4moe: q/k norm when the file has it (use_qk_norm); llama.cpp requires exp_probs_b in every MoE block.
    "glm4moe": BlockRecipe(rope="neox", qk_norm="optional", ffn_norm="post_attention_norm",
                           moe=MoERecipe("sigmoid", False, True, MOE_FILE_KEYS)),
    # qwen35: interleaved M-RoPE over rope.dimension_sections, which for text (every section at the
    # token's position) is NEOX rope over the first rope.dimension_count dims.
    "qwen35": BlockRecipe(rope="neox", qk_norm="always", attn_bias="never", ffn_norm="post_attention_norm",
                          attn_output_gate=True, delta_net=True),
    "qwen35moe": BlockRecipe(rope="neox", qk_norm="always", attn_bias="never", ffn_norm="post_attention_norm",
                             attn_output_gate=True, delta_net=True,
                             moe=MoERecipe("softmax", True, False, frozenset({"expert_weights_scale"}), "tensors")),
    # gemma3: every 6th block global, the rest slide (when the file has a window); q/k norms; post-norms.
    "gemma3": BlockRecipe(rope="neox", qk_norm="always", attn_bias="never", activation="geglu", post_norms=True,
                          sliding_window=True, logit_softcap=True, swa_period=6, swa_rope="own", embd_scale_sqrt=True,
                          kq_scale_rule=_gemma3_kq_scale),
    # gemma4: gemma3's block with the file's sliding pattern, per-block head sizes, shared KV, per-layer inputs and
    # output scales (gguf/block_layout.py), value norms and attention scale 1; files with experts run them beside
    # the dense FFN (softmax over all, top-k, weights renormalised, GELU-gated experts).
    "gemma4": BlockRecipe(rope="neox", qk_norm="always", attn_bias="never", activation="geglu", post_norms=True,
                          sliding_window=True, logit_softcap=True, swa_rope="own", embd_scale_sqrt=True,
                          kq_scale_rule=_unit_kq_scale, block_layout=True, value_norm=True, swa_required=True,
                          moe=MoERecipe("softmax", True, False, activation="geglu", beside_dense=True, optional=True)),
    # mistral3 (Ministral 3): llama's block, YaRN with the file's betas and log multiplier, and the queries'
    # temperature by position (llama.cpp's dense branch; its MoE branch is not described here).
    "mistral3": BlockRecipe(rope="norm",
                            yarn_keys=frozenset({"yarn_beta_fast", "yarn_beta_slow", "yarn_log_multiplier"}),
                            attn_temperature=True),
    # gpt-oss: biased q/k/v/o, a sink logit per head, alternating sliding-window / full blocks (block 0
    # slides), the FFN norm named post_attention_norm, biased experts routed by a softmax over the top-k logits.
    "gpt-oss": BlockRecipe(rope="neox", attn_bias="always", ffn_norm="post_attention_norm", sliding_window=True,
                           swa_period=2, swa_required=True, attn_sinks=True,
                           moe=MoERecipe("softmax_weight", False, False, frozenset({"expert_weights_scale"}),
                                         expert_bias=True, activation="swiglu_oai")),
}

# Operations beyond the llama-style block that a backend runs only if it says so (read_hparams' `implements`).
FEATURE_DELTA_NET = "gated delta-net blocks"
FEATURE_ATTN_GATE = "gated attention output"
FEATURE_SHARED_GATE = "gated shared expert"
FEATURE_ROPE_MSCALE = "YaRN rope magnitude scaling"
FEATURE_ATTN_TEMPERATURE = "attention temperature scaling by position"
FEATURE_SLIDING_WINDOW = "sliding-window attention"
FEATURE_POST_NORMS = "norms after the attention and FFN outputs"
FEATURE_GEGLU = "GELU-gated FFN"
FEATURE_EMBD_SCALE = "scaled token embeddings"
FEATURE_FINAL_SOFTCAP = "final logit soft-capping"
FEATURE_ATTN_SINKS = "attention sinks"
FEATURE_OAI_EXPERTS = "biased experts with the clamped SwiGLU (swiglu_oai) and softmax over the chosen logits"
FEATURE_BLOCK_HEAD_DIMS = "per-block head sizes"
FEATURE_SHARED_KV = "keys and values shared between blocks"
FEATURE_PER_LAYER_INPUTS = "per-layer token embeddings"
FEATURE_VALUE_NORM = "value norms"
FEATURE_OUT_SCALE = "per-block output scales"
FEATURE_DENSE_BESIDE_EXPERTS = "a dense FFN beside the experts (Gemma 4's mixture-of-experts blocks)"
# Gemma 4's operations (gguf/block_layout.py), which the native backend does not run yet.
BLOCK_LAYOUT_FEATURES = frozenset({FEATURE_BLOCK_HEAD_DIMS, FEATURE_SHARED_KV, FEATURE_PER_LAYER_INPUTS,
                                   FEATURE_VALUE_NORM, FEATURE_OUT_SCALE})
FEATURES = frozenset({FEATURE_DELTA_NET, FEATURE_ATTN_GATE, FEATURE_SHARED_GATE, FEATURE_SLIDING_WINDOW,
                      FEATURE_POST_NORMS, FEATURE_GEGLU, FEATURE_EMBD_SCALE, FEATURE_FINAL_SOFTCAP, FEATURE_ATTN_SINKS,
                      FEATURE_OAI_EXPERTS,
                      FEATURE_ROPE_MSCALE, FEATURE_ATTN_TEMPERATURE, FEATURE_DENSE_BESIDE_EXPERTS}) | BLOCK_LAYOUT_FEATURES
