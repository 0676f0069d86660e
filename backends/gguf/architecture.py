"""What a GGUF model's decoder is: one recipe per architecture, read once into one description.

gguf/recipes.py's ``ARCHITECTURES`` maps a file's ``general.architecture`` to its ``BlockRecipe``
(what its blocks compute). :func:`read_hparams` reads a file's hyper-parameters and resolves its
recipe against the file into one :class:`ModelHParams`, with :class:`DeltaNetParams` and
:class:`MoEParams` for hybrid and MoE blocks. Every backend (native, torch, onnx) builds its forward
from that description and never looks at the architecture's name; an architecture missing from the
table, or a recipe option no backend implements yet, is one :class:`ModelFileError` naming what is
unsupported, and :func:`required_features` names the recipes' operations (``FEATURES``) a file needs,
which a backend must implement. Over 400 lines: the description and its reading are one job, and
each of the reading's checks sits beside the field it fills.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from spekula.backends.gguf.block_layout import BlockLayout, read_block_layout
from spekula.backends.gguf.encoder import ENCODER_ARCHS
from spekula.backends.gguf.recipes import (
    ARCHITECTURES,
    FEATURE_ATTN_GATE,
    FEATURE_ATTN_SINKS,
    FEATURE_ATTN_TEMPERATURE,
    FEATURE_BLOCK_HEAD_DIMS,
    FEATURE_DELTA_NET,
    FEATURE_DENSE_BESIDE_EXPERTS,
    FEATURE_EMBD_SCALE,
    FEATURE_FINAL_SOFTCAP,
    FEATURE_GEGLU,
    FEATURE_OAI_EXPERTS,
    FEATURE_OUT_SCALE,
    FEATURE_PER_LAYER_INPUTS,
    FEATURE_POST_NORMS,
    FEATURE_ROPE_MSCALE,
    FEATURE_SHARED_GATE,
    FEATURE_SHARED_KV,
    FEATURE_SLIDING_WINDOW,
    FEATURE_VALUE_NORM,
    BlockRecipe,
    ExpertActivation,
    Gating,
    MoERecipe,
    Presence,
)
from spekula.backends.gguf.rope_scaling import AttnTemperature, PositionScaling, read_position_scaling
from spekula.core.errors import ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile

_GATING_IDS: dict[int, Gating] = {1: "softmax", 2: "sigmoid"}



@dataclass(frozen=True)
class DeltaNetParams:
    """One hybrid file's gated delta-net sizes and which trunk blocks are recurrent."""

    conv_kernel: int  # ssm.conv_kernel: width of the causal conv1d over the qkv channels
    n_k_heads: int  # ssm.group_count: heads of q and k
    n_v_heads: int  # ssm.time_step_rank: heads of v, the state and the output (a multiple of n_k_heads)
    head_k_dim: int  # ssm.state_size
    head_v_dim: int  # ssm.inner_size / n_v_heads
    recurrent: tuple[bool, ...]  # per trunk block: gated delta-net (True) or full attention

    @property
    def key_dim(self) -> int:
        return self.n_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.n_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:  # qkv channels: [q (key_dim) | k (key_dim) | v (value_dim)]
        return 2 * self.key_dim + self.value_dim

    @property
    def state_floats(self) -> int:
        """Floats of one block's recurrent state of one sequence: the delta-rule state and the conv rows."""
        return self.n_v_heads * self.head_v_dim * self.head_k_dim + (self.conv_kernel - 1) * self.conv_dim

    def is_recurrent(self, layer: int) -> bool:
        return layer < len(self.recurrent) and self.recurrent[layer]


@dataclass(frozen=True)
class MoEParams:
    """One file's MoE routing and expert sizes (its recipe resolved against its keys)."""

    n_expert: int
    n_expert_used: int
    n_ff_exp: int  # rows of one expert's gate/up matrices
    n_expert_shared: int  # 0: no shared expert
    n_dense_lead: int  # blocks [0, n_dense_lead) use the dense FFN
    gating: Gating
    norm_weights: bool
    weights_scale: float  # 1.0: none
    selection_bias: bool  # blk.N.exp_probs_b.bias present
    shared_ff: int = 0  # rows of the shared expert when the file gives them (0: n_ff_exp * n_expert_shared)
    shared_gate: bool = False  # the shared expert's output is gated by sigmoid(x @ ffn_gate_inp_shexp)
    expert_bias: bool = False  # the router and the expert matrices have biases
    activation: ExpertActivation = "swiglu"
    beside_dense: bool = False  # Gemma 4's dense FFN beside the experts (MoERecipe.beside_dense)

    @property
    def n_ff_shexp(self) -> int:
        return self.shared_ff or self.n_ff_exp * self.n_expert_shared

    def is_moe(self, layer: int) -> bool:
        return layer >= self.n_dense_lead


@dataclass(frozen=True)
class ModelHParams:
    """One file's decoder: its hyper-parameters and its architecture's recipe resolved against it."""

    arch: str
    recipe: BlockRecipe
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    rope_base: float
    n_rot: int
    rms_eps: float
    n_ctx_train: int
    rope_scale: float  # 1 / rope.scaling.factor (linear); 1.0 if absent or YaRN (see `scaling`)
    has_qkv_bias: bool
    has_qk_norm: bool
    tied_output: bool  # no output.weight: the head is token_embd
    kq_scale: float = 0.0  # attention score scale; 0.0 means 1/sqrt(head_dim)
    moe: MoEParams | None = None  # None: every block has the dense FFN
    n_nextn: int = 0  # MTP blocks stored after the trunk (blk.{n_layer} ..)
    sliding_window: int = 0  # W > 0: a sliding block's query at p sees keys (p - W, p]; 0: no block slides
    swa_layers: tuple[bool, ...] = ()  # per trunk block: slides (empty: none)
    rope_base_swa: float = 0.0  # the sliding blocks' rope base and scaling (used only by them)
    scaling_swa: PositionScaling = PositionScaling()
    embd_scale: float = 1.0  # token embeddings are multiplied by this
    attn_softcap: float = 0.0  # 0.0: attention scores are not soft-capped
    final_softcap: float = 0.0  # 0.0: logits are not soft-capped
    delta_net: DeltaNetParams | None = None  # hybrid files: the recurrent blocks' sizes
    scaling: PositionScaling = PositionScaling()  # YaRN and the queries' temperature (gguf/rope_scaling.py)
    layout: BlockLayout = BlockLayout()  # per-block head sizes, shared KV, per-layer inputs (gguf/block_layout.py)

    def block_n_ff(self, layer: int) -> int:
        """Dense FFN width of block `layer` (Gemma 4's may vary by block; n_ff is then the widest)."""
        blocks = self.layout.n_ff_blocks
        return blocks[layer] if layer < len(blocks) else self.n_ff

    def block_n_head_kv(self, layer: int) -> int:
        """KV head count of block `layer` (Gemma 4's global blocks may have fewer; n_head_kv is then the most)."""
        blocks = self.layout.n_head_kv_blocks
        return blocks[layer] if layer < len(blocks) else self.n_head_kv

    def block_head_dim(self, layer: int) -> int:
        """Head size (keys, values and queries) of trunk block `layer`."""
        return self.layout.head_dim_swa if self.layout.head_dim_swa and self.is_sliding(layer) else self.head_dim

    @property
    def max_head_dim(self) -> int:
        return max(self.head_dim, self.layout.head_dim_swa)

    @property
    def n_rot_swa(self) -> int:
        """Rope width of the sliding blocks."""
        return self.layout.n_rot_swa or self.n_rot

    @property
    def rope_mscale(self) -> float:
        """Magnitude of every rotated pair's cos and sin (YaRN; 1.0 otherwise)."""
        return self.scaling.rope_mscale

    @property
    def attn_temperature(self) -> AttnTemperature | None:
        return self.scaling.attn_temperature

    @property
    def is_hybrid(self) -> bool:
        return self.delta_net is not None

    def is_recurrent(self, layer: int) -> bool:
        """Whether trunk block `layer` is a gated delta-net block (False for attention and MTP blocks)."""
        return self.delta_net is not None and self.delta_net.is_recurrent(layer)

    def is_sliding(self, layer: int) -> bool:
        """Whether trunk block `layer` attends through the sliding window (False for MTP blocks)."""
        return self.sliding_window > 0 and layer < len(self.swa_layers) and self.swa_layers[layer]

    @property
    def post_norms(self) -> bool:
        return self.recipe.post_norms

    @property
    def geglu(self) -> bool:
        return self.recipe.activation == "geglu"

    @property
    def attn_scale(self) -> float:
        return self.kq_scale if self.kq_scale > 0.0 else 1.0 / math.sqrt(self.head_dim)

    @property
    def rope_neox(self) -> bool:
        return self.recipe.rope_neox

    @property
    def ffn_norm_name(self) -> str:
        return self.recipe.ffn_norm


def required_features(hp: ModelHParams) -> frozenset[str]:
    """The operations of :data:`FEATURES` that `hp`'s blocks need."""
    out = set[str]()
    if hp.delta_net is not None:
        out.add(FEATURE_DELTA_NET)
    if hp.recipe.attn_output_gate:
        out.add(FEATURE_ATTN_GATE)
    if hp.moe is not None and hp.moe.shared_gate and hp.moe.n_expert_shared:
        out.add(FEATURE_SHARED_GATE)
    if hp.rope_mscale != 1.0:
        out.add(FEATURE_ROPE_MSCALE)
    if hp.attn_temperature is not None:
        out.add(FEATURE_ATTN_TEMPERATURE)
    if any(hp.swa_layers):
        out.add(FEATURE_SLIDING_WINDOW)
    if hp.recipe.post_norms:
        out.add(FEATURE_POST_NORMS)
    if hp.recipe.activation == "geglu":
        out.add(FEATURE_GEGLU)
    if hp.embd_scale != 1.0:
        out.add(FEATURE_EMBD_SCALE)
    if hp.final_softcap:
        out.add(FEATURE_FINAL_SOFTCAP)
    if hp.recipe.attn_sinks:
        out.add(FEATURE_ATTN_SINKS)
    if hp.moe is not None and (hp.moe.expert_bias or hp.moe.activation == "swiglu_oai" or hp.moe.gating == "softmax_weight"):
        out.add(FEATURE_OAI_EXPERTS)
    lay = hp.layout
    if lay.head_dim_swa and any(hp.swa_layers):
        out.add(FEATURE_BLOCK_HEAD_DIMS)
    if lay.kv_source:
        out.add(FEATURE_SHARED_KV)
    if lay.n_embd_per_layer:
        out.add(FEATURE_PER_LAYER_INPUTS)
    if lay.out_scale:
        out.add(FEATURE_OUT_SCALE)
    if hp.recipe.value_norm:
        out.add(FEATURE_VALUE_NORM)
    if hp.moe is not None and hp.moe.beside_dense:
        out.add(FEATURE_DENSE_BESIDE_EXPERTS)
    return frozenset(out)


def unsupported_options(hp: ModelHParams) -> list[str]:
    """The parts of `hp`'s recipe that no backend implements yet (empty: every backend runs it)."""
    r, out = hp.recipe, list[str]()
    if r.norm != "rms":
        out.append(f"{r.norm} norm")
    if hp.attn_softcap:
        out.append(f"attention logit soft-capping ({hp.attn_softcap})")
    if hp.moe is not None and not hp.moe.beside_dense and (r.post_norms or r.activation != "swiglu"):
        out.append("post-norms or a GELU-gated FFN in mixture-of-experts blocks")
    if hp.sliding_window and (hp.delta_net is not None or hp.n_nextn):
        out.append("sliding-window attention with recurrent or MTP blocks")
    return out


def _recipe_of(f: GGUFFile) -> BlockRecipe:
    """The recipe of `f`'s architecture; an architecture not in the table is a ModelFileError."""
    recipe = ARCHITECTURES.get(f.architecture)
    if recipe is None and f.architecture in ENCODER_ARCHS:
        raise ModelFileError(f.path, f"encoder architecture {f.architecture!r} (embeddings only) runs on the torch "
                                     "backend only: use --backend torch")
    if recipe is None:
        raise ModelFileError(f.path, f"unsupported architecture {f.architecture!r} (supported: {', '.join(ARCHITECTURES)})")
    return recipe


def _uniform(f: GGUFFile, key: str, value: Any) -> int:
    """Per-layer arrays are allowed by the format; we support them only when all entries agree."""
    if isinstance(value, list):
        if not value or any(v != value[0] for v in value):
            raise ModelFileError(f.path, f"per-layer varying {key!r} is not supported")
        value = value[0]
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ModelFileError(f.path, f"metadata {key!r} is not an integer: {value!r}") from None


def _per_block_widths(f: GGUFFile, key: str, values: list[Any], n_layer: int) -> tuple[int, ...]:
    """A per-block array of positive integers, one per trunk block."""
    if len(values) != n_layer or any(not isinstance(v, int) or v <= 0 for v in values):
        raise ModelFileError(f.path, f"invalid per-block {key!r}: {values!r} (one positive integer per block of {n_layer})")
    return tuple(int(v) for v in values)


def _present(f: GGUFFile, presence: Presence, *names: str) -> bool:
    return presence == "always" or (presence == "optional" and any(f.has_tensor(n) for n in names))


def _read_moe_params(f: GGUFFile, moe: MoERecipe) -> MoEParams:
    """The MoE hyper-parameters of `f`: expert counts from its keys, routing from `moe` and the keys it names."""
    arch = f.architecture

    def opt(key: str, default: Any) -> Any:
        return f.get(f"{arch}.{key}", default) if key in moe.file_keys else default

    def count(key: str, default: Any) -> int:
        return _uniform(f, key, opt(key, default))

    n_expert = _uniform(f, "expert_count", f.require(f"{arch}.expert_count"))
    n_used = _uniform(f, "expert_used_count", f.require(f"{arch}.expert_used_count"))
    if n_expert <= 0 or not 0 < n_used <= n_expert:
        raise ModelFileError(f.path, f"invalid expert counts: expert_count={n_expert} expert_used_count={n_used}")
    n_ff_exp = _uniform(f, "expert_feed_forward_length", f.get(f"{arch}.expert_feed_forward_length", 0))
    if n_ff_exp <= 0:
        n_ff_exp = _uniform(f, "feed_forward_length", f.require(f"{arch}.feed_forward_length")) // n_used
    gating = moe.gating
    if "expert_gating_func" in moe.file_keys:
        gating_id = _uniform(f, "expert_gating_func", f.get(f"{arch}.expert_gating_func", 0))
        if gating_id != 0:  # 0 ("none") keeps the architecture's gating, as llama.cpp does
            if gating_id not in _GATING_IDS:
                raise ModelFileError(f.path, f"unsupported expert_gating_func {gating_id} "
                                             "(supported: 1 softmax, 2 sigmoid)")
            gating = _GATING_IDS[gating_id]
    scale = float(opt("expert_weights_scale", 0.0) or 0.0)
    shared_ff, n_shared = 0, count("expert_shared_count", 0)
    if moe.shared == "tensors":
        first = next((i for i in range(_uniform(f, "block_count", f.require(f"{arch}.block_count")))
                      if f.has_tensor(f"blk.{i}.ffn_gate_inp.weight")), 0)
        n_shared = int(f.has_tensor(f"blk.{first}.ffn_up_shexp.weight"))
        shared_ff = _uniform(f, "expert_shared_feed_forward_length",
                             f.get(f"{arch}.expert_shared_feed_forward_length", n_ff_exp)) if n_shared else 0
    return MoEParams(
        n_expert=n_expert,
        n_expert_used=n_used,
        n_ff_exp=n_ff_exp,
        n_expert_shared=n_shared,
        n_dense_lead=count("leading_dense_block_count", 0),
        gating=gating,
        norm_weights=bool(opt("expert_weights_norm", moe.norm_weights)),
        weights_scale=scale if scale not in (0.0, 1.0) else 1.0,
        selection_bias=moe.selection_bias,
        shared_ff=shared_ff,
        shared_gate=moe.shared == "tensors",
        expert_bias=moe.expert_bias,
        activation=moe.activation,
        beside_dense=moe.beside_dense,
    )


def _read_delta_net(f: GGUFFile, n_layer: int, n_nextn: int) -> DeltaNetParams:
    """The gated delta-net sizes and the recurrent-block pattern of hybrid file `f`."""
    arch = f.architecture

    def size(key: str) -> int:
        v = _uniform(f, key, f.require(f"{arch}.{key}"))
        if v <= 0:
            raise ModelFileError(f.path, f"invalid {arch}.{key} = {v}")
        return v

    conv, n_k, n_v, d_k, inner = (size("ssm.conv_kernel"), size("ssm.group_count"), size("ssm.time_step_rank"),
                                  size("ssm.state_size"), size("ssm.inner_size"))
    if n_v % n_k or inner % n_v:
        raise ModelFileError(f.path, f"inconsistent gated delta-net sizes: ssm.time_step_rank {n_v} must be a multiple "
                                     f"of ssm.group_count {n_k} and divide ssm.inner_size {inner}")
    if conv < 2:
        raise ModelFileError(f.path, f"invalid {arch}.ssm.conv_kernel = {conv} (at least 2)")
    flags = f.get(f"{arch}.attention.recurrent_layers", None)
    if flags is not None:
        if not isinstance(flags, list) or len(flags) not in (n_layer, n_layer + n_nextn):
            raise ModelFileError(f.path, f"{arch}.attention.recurrent_layers must list one flag per block "
                                         f"({n_layer} or {n_layer + n_nextn}), got {flags!r}")
        recurrent = tuple(bool(x) for x in flags[:n_layer])
        if any(bool(x) for x in flags[n_layer:]):
            raise ModelFileError(f.path, f"{arch}.attention.recurrent_layers marks an MTP block recurrent")
    else:
        interval = _uniform(f, "full_attention_interval", f.get(f"{arch}.full_attention_interval", 4))
        if interval <= 0:
            raise ModelFileError(f.path, f"invalid {arch}.full_attention_interval = {interval}")
        recurrent = tuple((i + 1) % interval != 0 for i in range(n_layer))
    return DeltaNetParams(conv_kernel=conv, n_k_heads=n_k, n_v_heads=n_v, head_k_dim=d_k, head_v_dim=inner // n_v,
                          recurrent=recurrent)


def _read_swa_layers(f: GGUFFile, recipe: BlockRecipe, n_layer: int, window: int) -> tuple[bool, ...]:
    """Which trunk blocks of `f` slide: its attention.sliding_window_pattern (flags or a period), else the
    recipe's period (llama.cpp's rule, see the module docstring)."""
    if window <= 0:
        return ()
    key = f"{f.architecture}.attention.sliding_window_pattern"
    pattern = f.get(key, None)
    if isinstance(pattern, list):
        if len(pattern) < n_layer or not all(isinstance(x, (bool, int)) for x in pattern):
            raise ModelFileError(f.path, f"{key} must list one flag per block ({n_layer}), got {pattern!r}")
        return tuple(bool(x) for x in pattern[:n_layer])
    period = recipe.swa_period if pattern is None else _uniform(f, key, pattern)
    if period < 0:
        raise ModelFileError(f.path, f"invalid {key} = {period}")
    if period == 0:
        return (True,) * n_layer
    if recipe.swa_dense_first:
        return tuple(i % period != 0 for i in range(n_layer))
    return tuple(i % period < period - 1 for i in range(n_layer))


def read_hparams(f: GGUFFile, implements: frozenset[str] = frozenset(), runtime: str = "this backend") -> ModelHParams:
    """`f`'s decoder description; anything missing, malformed or unsupported is one ModelFileError.

    `implements` lists the :data:`FEATURES` the caller (`runtime`) runs: a file that needs another is refused."""
    recipe = _recipe_of(f)
    arch = f.architecture

    def req(key: str) -> Any:
        return f.require(f"{arch}.{key}")

    def opt(key: str, default: Any) -> Any:
        return f.get(f"{arch}.{key}", default)

    n_embd = _uniform(f, "embedding_length", req("embedding_length"))
    n_head = _uniform(f, "attention.head_count", req("attention.head_count"))
    n_nextn = _uniform(f, "nextn_predict_layers", opt("nextn_predict_layers", 0))
    n_layer = _uniform(f, "block_count", req("block_count")) - n_nextn
    n_head_kv_key = opt("attention.head_count_kv", n_head)
    n_head_kv_blocks: tuple[int, ...] = ()
    if recipe.block_layout and isinstance(n_head_kv_key, list) and len(set(n_head_kv_key)) > 1:
        # Gemma 4's num_global_key_value_heads: the global blocks have their own KV head count
        n_head_kv_blocks = _per_block_widths(f, "attention.head_count_kv", n_head_kv_key, n_layer)
        if any(n_head % n for n in n_head_kv_blocks):
            raise ModelFileError(f.path, f"invalid per-block head_count_kv {list(n_head_kv_blocks)} for {n_head} heads")
        n_head_kv = max(n_head_kv_blocks)
    else:
        n_head_kv = _uniform(f, "attention.head_count_kv", n_head_kv_key)
    moe = recipe.moe
    has_moe = moe is not None and (not moe.optional or f"{arch}.expert_count" in f.metadata)
    # An all-MoE model needs no dense FFN width (qwen3moe files may still carry one); Gemma 4's does.
    dense_ff = not has_moe or (moe is not None and moe.beside_dense)
    n_ff_key = req("feed_forward_length") if dense_ff else opt("feed_forward_length", 0)
    n_ff_blocks: tuple[int, ...] = ()
    if recipe.block_layout and isinstance(n_ff_key, list) and len(set(n_ff_key)) > 1:  # Gemma 4's double-wide blocks
        n_ff_blocks = _per_block_widths(f, "feed_forward_length", n_ff_key, n_layer)
        n_ff = max(n_ff_blocks)
    else:
        n_ff = _uniform(f, "feed_forward_length", n_ff_key)
    if n_head <= 0 or n_head_kv <= 0 or n_head % n_head_kv != 0 or n_layer <= 0:
        raise ModelFileError(f.path, f"invalid head counts n_head={n_head} n_head_kv={n_head_kv} or n_layer={n_layer}")
    head_dim = _uniform(f, "attention.key_length", opt("attention.key_length", n_embd // n_head))
    v_dim = _uniform(f, "attention.value_length", opt("attention.value_length", head_dim))
    if v_dim != head_dim:
        raise ModelFileError(f.path, f"key_length {head_dim} != value_length {v_dim} is not supported")
    n_rot = _uniform(f, "rope.dimension_count", opt("rope.dimension_count", head_dim))
    n_ctx_train = _uniform(f, "context_length", opt("context_length", 4096))
    scaling = read_position_scaling(f, opt, n_ctx_train, recipe.yarn_keys, recipe.attn_temperature)
    if n_rot <= 0 or n_rot > head_dim or n_rot % 2:
        raise ModelFileError(f.path, f"invalid rope.dimension_count {n_rot} for head_dim {head_dim}")

    if not f.has_tensor("token_embd.weight"):
        raise ModelFileError(f.path, "missing tensor 'token_embd.weight'")
    window_key = req("attention.sliding_window") if recipe.swa_required else opt("attention.sliding_window", 0)
    window = _uniform(f, "attention.sliding_window", window_key) if recipe.sliding_window else 0
    if window < 0:
        raise ModelFileError(f.path, f"invalid {arch}.attention.sliding_window = {window}")
    if recipe.block_layout:
        req("attention.sliding_window_pattern")  # llama.cpp requires the flags for these files
    swa_layers = _read_swa_layers(f, recipe, n_layer, window)
    layout = BlockLayout()
    if recipe.block_layout:
        layout = read_block_layout(f, opt, lambda key, v: _uniform(f, key, v), n_layer, swa_layers, head_dim, n_rot,
                                   n_ff_blocks, n_head_kv_blocks)
    rope_base = float(opt("rope.freq_base", 10000.0))
    own = recipe.swa_rope == "own"
    scaling_swa = scaling.with_freq_scale(1.0) if own else scaling
    kq_scale = float(opt("attention.scale", 0.0) or 0.0)
    if recipe.kq_scale_rule is not None:
        kq_scale = recipe.kq_scale_rule(n_layer, n_embd, n_head, head_dim)
    n_vocab = f.tensor("token_embd.weight").shape[0]
    # An MTP-only file (llama.cpp's --mtp output) has no trunk blocks: probe the first block it has.
    b = f"blk.{0 if f.has_tensor('blk.0.attn_norm.weight') else n_layer}."
    hp = ModelHParams(
        arch=arch,
        recipe=recipe,
        n_vocab=int(n_vocab),
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_ff=n_ff,
        rope_base=rope_base,
        n_rot=n_rot,
        rms_eps=float(req("attention.layer_norm_rms_epsilon")),
        n_ctx_train=n_ctx_train,
        rope_scale=scaling.freq_scale,
        has_qkv_bias=_present(f, recipe.attn_bias, b + "attn_q.bias", b + "attn_qkv.bias"),
        has_qk_norm=_present(f, recipe.qk_norm, b + "attn_q_norm.weight"),
        tied_output=not f.has_tensor("output.weight"),
        kq_scale=kq_scale,
        moe=_read_moe_params(f, recipe.moe) if has_moe else None,
        n_nextn=n_nextn,
        sliding_window=window,
        swa_layers=swa_layers,
        rope_base_swa=float(opt("rope.freq_base_swa", 10000.0 if own else rope_base)),
        scaling_swa=scaling_swa,
        embd_scale=math.sqrt(n_embd) if recipe.embd_scale_sqrt else 1.0,
        attn_softcap=float(opt("attn_logit_softcapping", 0.0) or 0.0) if recipe.logit_softcap else 0.0,
        final_softcap=float(opt("final_logit_softcapping", 0.0) or 0.0) if recipe.logit_softcap else 0.0,
        delta_net=_read_delta_net(f, n_layer, n_nextn) if recipe.delta_net else None,
        scaling=scaling,
        layout=layout,
    )
    if any(hp.swa_layers) and scaling_swa.rope_mscale != scaling.rope_mscale:  # one magnitude per context
        raise ModelFileError(f.path, f"YaRN with a sliding-window rope of its own is not supported ({arch})")
    missing = unsupported_options(hp)
    if missing:
        raise ModelFileError(f.path, f"architecture {arch!r} needs what no backend implements yet: {', '.join(missing)}")
    lacking = sorted(required_features(hp) - implements)
    if lacking:
        raise ModelFileError(f.path, f"architecture {arch!r} needs what {runtime} does not implement: {', '.join(lacking)}")
    return hp
