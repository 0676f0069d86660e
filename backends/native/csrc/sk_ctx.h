/* What the native decoder's files share: the config and batch (backends/native/lib.py mirrors them), the
 * context, and the small helpers every file reads (static inline: each caller keeps them inlined).
 *
 *   sk_model.c      the forward pass (sk_forward) and its per-block steps
 *   sk_ctx.c        a context's life cycle: checks, block set-up, weight packing into one arena
 *   sk_plan.c       scratch sizing and the attention plan (waves of ATT_WAVE_ROWS rows, FFN passes)
 *   sk_seq_state.c  a sequence's keys, values and recurrent state: slots, context shift, rings, export
 *   sk_encode.c     the encoders' entry points (sk_project_in, sk_inject_kv)
 *   sk_test_entry.c single-kernel entry points for tests
 *
 * Not an API: the functions declared here are hidden in the library and named skc_*; the public entry
 * points are the SK_API functions of those files. */
#ifndef SK_CTX_H
#define SK_CTX_H

#include <stdatomic.h>
#include <stdlib.h>

#include "sk.h"
#include "sk_deltanet.h"
#include "sk_moe.h"
#include "sk_pool.h"
#include "sk_swa.h"

/* Internal to the library: not exported, and called directly (a hidden function cannot be interposed). */
#define SKC_HIDDEN __attribute__((visibility("hidden")))

typedef struct {
    const float *attn_norm, *ffn_norm, *q_norm, *k_norm; /* q_norm / k_norm: NULL unless the arch has them */
    sk_tensor wq, wk, wv, wo, w_gate, w_up, w_down;       /* wk.data == NULL: wq is a fused [q; k; v] */
    const sk_moe *moe;                                    /* non-NULL: a MoE FFN replaces w_gate/up/down */
    int32_t attn_gate; /* wq yields [q | gate] per head; the attention output is multiplied by sigmoid(gate) */
    sk_dn dn;          /* dn.qkv.data non-NULL: a gated delta-net block in place of attention (sk_deltanet.h) */
    const float *attn_post_norm, *ffn_post_norm; /* non-NULL: RMS-normed sublayer outputs before the add (Gemma) */
    int32_t sliding;   /* attends through the config's window, ropes with rope_inv_freq_swa, KV in a ring (sk_swa.h) */
    const float *attn_sinks; /* [n_head]: a sink logit per query head in every softmax (gpt-oss), or NULL */
    /* Gemma 4 (sk_gemma4.h): the block's head size (0: the config's); 1 + the block whose keys and values it
     * attends (0: its own; else wq projects queries only); values RMS-normed without weight; the output times
     * out_scale (0: none); its per-layer input's gate, projection and norm (ple_gate.data NULL: none); its KV
     * head count (0: the config's; a sharing block has its owner's). */
    int32_t head_dim, kv_shared, value_norm, n_head_kv;
    float out_scale;
    sk_tensor ple_gate, ple_proj;
    const float *ple_norm;
    /* Gemma 4's MoE blocks (moe_pre_norm non-NULL): the dense FFN beside the experts, post-normed by dense_post_norm;
     * the experts read moe_pre_norm(x), are routed on sk_router_input(x, router_scale), post-normed by moe_post_norm. */
    const float *moe_pre_norm, *router_scale, *dense_post_norm, *moe_post_norm;
} sk_layer;

typedef struct {
    int32_t n_vocab, n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff, n_rot;
    int32_t rope_neox, n_ctx, n_seq_max, n_threads;
    float rms_eps, attn_scale;
    const double *rope_inv_freq; /* [n_rot / 2], scaling folded in */
    const float *output_norm;
    sk_tensor token_embd, output;
    const sk_layer *layers;
    /* Input projection [n_embd, 2 n_embd] (embedding columns first) and its two norms; data NULL: none. */
    sk_tensor in_proj;
    const float *in_embd_norm, *in_hidden_norm;
    /* SK_WIDE_*: whether block 0's q/k/v read [rmsnorm(E[token]); rmsnorm(hidden_in)] (the two norms
     * above) and what the residual stream starts from. There in_proj, if any, is the encoder that makes
     * hidden_in rows out of wider inputs (EAGLE-3's fc over the target's features): sk_project_in. */
    int32_t wide_input;
    /* Context encoder [n_embd, k] and its output norm (DFlash: fc over k = target layers x their width);
     * data NULL: none. Only sk_inject_kv reads it. */
    sk_tensor ctx_proj;
    const float *ctx_norm;
    /* Sliding blocks (sk_swa.h): window > 0, their rope table, and the most rows one forward adds to a
     * sequence (which sizes their rings). Gemma-style blocks: embeddings times embd_scale (0: 1), FFN
     * gate through GELU (tanh) instead of SiLU. */
    const double *rope_inv_freq_swa;
    int32_t swa_window, swa_row_cap, ffn_geglu;
    float embd_scale;
    /* sk_rope.h: YaRN's cos/sin magnitude and the queries' temperature by position (0: none) */
    float rope_mscale, attn_temp_scale;
    int32_t attn_temp_floor;
    /* Gemma 4: the sliding blocks' rope width (0: n_rot); per-layer inputs of n_embd_per_layer values per block
     * (0: none) from ple_embd [n_vocab rows of n_layer P] and ple_model_proj [n_layer P, n_embd] with its norm. */
    int32_t n_rot_swa, n_embd_per_layer;
    sk_tensor ple_embd, ple_model_proj;
    const float *ple_proj_norm;
} sk_config;

enum { SK_WIDE_NONE = 0, SK_WIDE_RESIDUAL_HIDDEN = 1, SK_WIDE_RESIDUAL_NORMED = 2 };

typedef struct {
    int64_t n_rows;
    const int32_t *tokens, *pos, *seq; /* [n_rows]; rows of one sequence in increasing position */
    int64_t n_out;
    const int32_t *out_rows; /* [n_out] rows whose logits are wanted */
    float *logits;           /* [n_out, output.n_rows]: n_vocab, or a reduced draft vocabulary */
    float *const *capture;   /* NULL or [n_layer + 1]: residual entering block l, [n_rows, n_embd] each (or NULL) */
    float *hidden_final;     /* NULL or [n_rows, n_embd]: after output_norm */
    const float *hidden_in;  /* [n_rows, n_embd] when the config has in_proj or a wide input, else unused */
    const int32_t *key_end;  /* NULL: row r attends keys [0, pos[r]] (causal); else [0, key_end[r]) */
} sk_batch;

/* One (row, key piece) of a block's attention, in the order the threads take them (plan_order). */
typedef struct {
    int32_t row, piece;
} sk_att_item;

typedef struct sk_ctx sk_ctx;
struct sk_ctx {
    sk_config cfg;
    sk_layer *layers;
    const sk_kernels *kern;
    sk_pool *pool;
    int64_t n_ctx_pad, kv_head_elems; /* per kv head: n_ctx_pad * head_dim */
    uint16_t **kv;                    /* [n_seq_max]: keys then values, all layers; NULL until allocated */
    int64_t cap_rows;                 /* scratch sized for this many rows */
    int64_t ffn_rows;                 /* rows per pass of a dense FFN (its gate/up rows fit qkv + att's block) */
    float *x, *h, *qkv, *att, *gu, *rope;
    sk_act act;
    float **att_scratch;  /* per thread: scores of one chunk for every query head of a kv group */
    int64_t *att_prefix;  /* [rows + 1]: first key piece of each row (plan_spans) */
    float *att_parts;     /* per work item and query head: [max, sum, values] of one key chunk */
    int64_t att_rows_cap, att_parts_cap;
    uint8_t *packed;     /* weight copies in the kernels' own layout, one arena freed with the context */
    size_t packed_map;   /* the arena's mapped length */
    int64_t packed_bytes, packed_used;
    int head_later;      /* the output head is packed by sk_ctx_pack_head, not with the other weights */
    sk_moe **moe;        /* [n_layer]: this context's copy of each MoE block's description, or NULL */
    sk_moe_scratch *moe_scratch;
    sk_ctx *base;        /* the context whose threads (and possibly prepared weights) this one uses, or NULL */
    sk_dn_ctx *dn;       /* the delta-net blocks' state and scratch, or NULL */
    int32_t *kv_layer;   /* [n_layer]: a block's index among those with a KV cache (delta-net blocks: -1) */
    int32_t n_kv_layers;
    int64_t qkvd;        /* row width of qkv: [q (| gate) per head | k | v] of the widest block */
    int64_t *kv_off, *kv_rows; /* [n_layer]: a KV block's offset in a slot's buffer and its rows (ring or n_ctx_pad) */
    int64_t kv_slot_elems;     /* uint16 values of one slot's buffer */
    int64_t *att_prefix_swa;   /* like att_prefix, for the sliding blocks' spans (NULL: none slide) */
    sk_att_item *att_order;    /* [pieces]: the order attention takes a block's (row, piece)s in (plan_order) */
    sk_att_item *att_order_swa; /* the same for the sliding blocks */
    int64_t att_order_cap;
    /* [waves + 1]: where each wave of ATT_WAVE_ROWS rows starts in att_order / att_order_swa */
    int64_t *att_wave_at, *att_wave_at_swa;
    int64_t att_waves;
    int64_t swa_ring;          /* rows of a sliding block's ring (0: no block slides) */
    sk_swa *swa;               /* the sequences' ring floors and window snapshots (NULL: no block slides) */
    uint16_t **swa_heads;      /* scratch [2 sliding blocks' kv heads]: a slot's rings (sk_swa.h) */
    int n_swa_heads;
    float *rope_swa;           /* per row [cos | sin] of the sliding blocks' rope */
    int32_t max_hd, swa_hd;    /* the widest block's head size; the sliding blocks' (their rings' rows) */
    float *ple, *ple_tmp;      /* per row: the per-layer inputs [n_layer P] and a block's gate [n_layer P] */
    float *beside;             /* per row [router input | experts' input | experts' output] (Gemma 4's MoE blocks) */
    atomic_int refs;     /* 1 for the creator, 1 per context made over this one */
};

/* 64-byte aligned memory (aligned_alloc wants the size rounded to the alignment). */
static inline void *xalloc(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

/* A block's head size: its own (Gemma 4) or the config's. */
static inline int hd_of(const sk_config *g, const sk_layer *L) { return L && L->head_dim ? L->head_dim : g->head_dim; }

/* A block's KV head count: its own (Gemma 4's global blocks) or the config's. */
static inline int nkv_of(const sk_config *g, const sk_layer *L) { return L && L->n_head_kv ? L->n_head_kv : g->n_head_kv; }

/* The block whose keys and values block `layer` attends (itself unless it shares another's). */
static inline int kv_owner(const sk_ctx *c, int layer) { return c->layers[layer].kv_shared ? c->layers[layer].kv_shared - 1 : layer; }

static inline int n_rot_swa(const sk_config *g) { return g->n_rot_swa ? g->n_rot_swa : g->n_rot; }

/* A block's q region in a qkv row: per head q, or q then its gate (head stride 2 head_dim). */
static inline int64_t q_stride(const sk_config *g, const sk_layer *L) { return (int64_t)hd_of(g, L) * (L->attn_gate ? 2 : 1); }
static inline int64_t q_width(const sk_config *g, const sk_layer *L) { return (int64_t)g->n_head * q_stride(g, L); }

/* A block's keys (then its values) of one slot: per kv head kv_rows[layer] rows (a ring in sliding blocks). */
static inline uint16_t *kcache(sk_ctx *c, int slot, int layer, int head) {
    const int o = kv_owner(c, layer), hd = hd_of(&c->cfg, &c->layers[o]);
    return c->kv[slot] + c->kv_off[o] + head * c->kv_rows[o] * hd;
}

static inline uint16_t *vcache(sk_ctx *c, int slot, int layer, int head) {
    const int o = kv_owner(c, layer);
    return kcache(c, slot, layer, head) + (int64_t)nkv_of(&c->cfg, &c->layers[o]) * c->kv_rows[o] * hd_of(&c->cfg, &c->layers[o]);
}

/* Rows whose attention runs (and is merged) together: the chunk partials are held for this many rows. */
enum { ATT_WAVE_ROWS = 64 };
/* The end (exclusive) of wave w's rows; it starts at w * ATT_WAVE_ROWS. */
static inline int64_t wave_end(const sk_batch *b, int64_t w) {
    return (w + 1) * ATT_WAVE_ROWS < b->n_rows ? (w + 1) * ATT_WAVE_ROWS : b->n_rows;
}

/* Keys row r of a batch attends to: its own position and those before it, or up to key_end. */
static inline int64_t row_keys(const sk_batch *b, int64_t r) { return b->key_end ? b->key_end[r] : b->pos[r] + 1; }

/* The first key row r of a block sees: 0, or the window's start in a sliding block. */
static inline int64_t row_first_key(const sk_config *g, const sk_batch *b, int64_t r, int sliding) {
    const int64_t lo = sliding ? (int64_t)b->pos[r] - g->swa_window + 1 : 0;
    return lo > 0 ? lo : 0;
}

/* sk_ctx.c: the kernel table for a capability (SK_KERNELS_*). */
SKC_HIDDEN const sk_kernels *skc_pick_kernels(int cap);

/* sk_plan.c: scratch for m rows (0, -1 out of memory) and its release; a batch's attention plan (0, -1). */
SKC_HIDDEN int skc_ensure_scratch(sk_ctx *c, int64_t m);
SKC_HIDDEN void skc_free_scratch(sk_ctx *c);
SKC_HIDDEN int skc_plan_attention(sk_ctx *c, const sk_batch *b);

/* sk_seq_state.c: c->swa_heads filled with the slot's rings, in sk_swa.h's order; their count. */
SKC_HIDDEN int skc_swa_heads(sk_ctx *c, int slot);

#endif
