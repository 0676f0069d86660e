/* The llama / qwen2 / qwen3 / qwen3moe / glm4moe / qwen35 / qwen35moe / gemma3 decoder forward pass over
 * GGUF blocks, on all threads of a pool (a MoE block's FFN is in sk_moe.c, the recurrence of a hybrid's
 * gated delta-net blocks and their per-sequence state in sk_deltanet.c; only attention blocks keep
 * keys and values; a sliding-window block keeps them in a ring, its key spans and ring state in sk_swa.c). A block with an attention output gate (Qwen3.5) reads [q | gate] per head from wq
 * and multiplies each head's attention output by sigmoid(gate).
 *
 * A context runs the blocks its config lists. With an input projection (multi-token-prediction
 * heads: one block of the file, fed a token and a hidden state per row) the rows enter as
 * in_proj . [rmsnorm(E[token], in_embd_norm); rmsnorm(hidden_in, in_hidden_norm)] instead of E[token].
 * With a wide input (EAGLE-3 heads: one block) the first block's attention reads that 2 n_embd wide
 * row itself in place of its attn_norm output, and the residual stream starts from hidden_in (or from
 * its normed copy); the output matrix may have fewer rows than the vocabulary (a reduced draft one).
 * With a context encoder (DFlash heads) the target's features never run through the blocks: sk_inject_kv
 * turns them into every block's keys and values at their positions, and a batch with key_end lets the
 * rows of a draft block attend to each other in both directions.
 * A context made with sk_ctx_new_over runs on another context's threads and may take weights that
 * context prepared (layout 1) as they are; it keeps that context alive until it is freed itself.
 *
 * One call runs every row of a batch (rows of several sequences, each at its own position) through
 * every block. All threads run `forward_job` and meet at barriers between phases: row-wise phases
 * (norms, quantization, rope) split rows, matmuls split output columns, attention splits
 * (row, kv head) pairs. Which thread computes an element never changes how it is computed (see
 * sk.h), so the result does not depend on the thread count either.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "sk.h"
#include "sk_assistant.h"
#include "sk_deltanet.h"
#include "sk_gemma4.h"
#include "sk_moe.h"
#include "sk_oai.h"
#include "sk_pack.h"
#include "sk_pool.h"
#include "sk_swa.h"
#include "sk_rope.h"

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

typedef struct {
    sk_ctx *c;
    const sk_batch *b;
} job;

/* Phase timing of thread 0 (SPEKULA_NATIVE_PROFILE=1): where a forward's time goes, for tuning. Thread 0's
 * waits at the barriers are a phase of their own ("wait"), so that one thread's share of a phase running
 * long shows as imbalance instead of being booked to whichever phase comes next. */
enum {
    PH_EMBED, PH_NORM, PH_QKV, PH_ROPE, PH_ATTN, PH_OPROJ, PH_DN_IN, PH_DN_CONV, PH_DN_RULE, PH_DN_NORM, PH_DN_OUT,
    PH_FFN_UP, PH_FFN_DOWN, PH_MOE, PH_HEAD, PH_WAIT, PH_N
};
static const char *const phase_names[PH_N] = {"embed", "norm+quant", "qkv", "rope+kv", "attention", "o-proj",
                                              "dn-in-proj", "dn-conv+gates", "dn-rule", "dn-gated-norm", "dn-out-proj",
                                              "gate+up", "down", "moe", "head", "wait"};
static double phase_seconds[PH_N];
static double waited; /* thread 0's barrier waits since its last phase() */
static int profiling = -1;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static inline void phase(int ith, int ph, double *t) {
    if (profiling != 1 || ith != 0) return;
    double n = now_s();
    phase_seconds[ph] += n - *t - waited;
    waited = 0.0;
    *t = n;
}

static void barrier(sk_pool *pool, int ith) {
    if (profiling != 1 || ith != 0) {
        sk_pool_barrier(pool);
        return;
    }
    double t0 = now_s();
    sk_pool_barrier(pool);
    double w = now_s() - t0;
    waited += w;
    phase_seconds[PH_WAIT] += w;
}

SK_API void sk_profile_report(double *out, int n) {
    for (int i = 0; i < n && i < PH_N; i++) out[i] = phase_seconds[i];
    memset(phase_seconds, 0, sizeof phase_seconds);
}

SK_API const char *sk_profile_phase_name(int i) { return i >= 0 && i < PH_N ? phase_names[i] : NULL; }

static const sk_kernels *pick_kernels(int cap) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (cap == SK_KERNELS_BEST && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma"))
        return &sk_avx512_kernels;
    if (cap != SK_KERNELS_GENERIC && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi2"))
        return &sk_avx2_kernels;
#endif
    (void)cap;
    return &sk_generic_kernels;
}

SK_API const char *sk_kernel_name(int cap) { return pick_kernels(cap)->name; }

/* 64-byte aligned memory (aligned_alloc wants the size rounded to the alignment). */
static void *xalloc(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

/* A block's head size: its own (Gemma 4) or the config's. */
static int hd_of(const sk_config *g, const sk_layer *L) { return L && L->head_dim ? L->head_dim : g->head_dim; }

/* A block's KV head count: its own (Gemma 4's global blocks) or the config's. */
static int nkv_of(const sk_config *g, const sk_layer *L) { return L && L->n_head_kv ? L->n_head_kv : g->n_head_kv; }

/* The block whose keys and values block `layer` attends (itself unless it shares another's). */
static int kv_owner(const sk_ctx *c, int layer) { return c->layers[layer].kv_shared ? c->layers[layer].kv_shared - 1 : layer; }

static int n_rot_swa(const sk_config *g) { return g->n_rot_swa ? g->n_rot_swa : g->n_rot; }

/* A block's q region in a qkv row: per head q, or q then its gate (head stride 2 head_dim). */
static int64_t q_stride(const sk_config *g, const sk_layer *L) { return (int64_t)hd_of(g, L) * (L->attn_gate ? 2 : 1); }
static int64_t q_width(const sk_config *g, const sk_layer *L) { return (int64_t)g->n_head * q_stride(g, L); }

static void free_scratch(sk_ctx *c) {
    free(c->x); free(c->h); free(c->qkv); free(c->rope); free(c->rope_swa); /* att and gu live in qkv's block */
    free(c->ple); free(c->ple_tmp); free(c->beside);
    c->ple = c->ple_tmp = c->beside = NULL;
    free(c->act.q); free(c->act.d); free(c->act.s); free(c->act.qs16);
    c->x = c->h = c->qkv = c->att = c->gu = c->rope = c->rope_swa = NULL;
    memset(&c->act, 0, sizeof c->act);
    c->cap_rows = 0;
}

/* Rows whose attention runs (and is merged) together: the chunk partials are held for this many rows. */
enum { ATT_WAVE_ROWS = 64 };
static int64_t n_waves(int64_t n_rows) { return (n_rows + ATT_WAVE_ROWS - 1) / ATT_WAVE_ROWS; }
/* The end (exclusive) of wave w's rows; it starts at w * ATT_WAVE_ROWS. */
static int64_t wave_end(const sk_batch *b, int64_t w) {
    return (w + 1) * ATT_WAVE_ROWS < b->n_rows ? (w + 1) * ATT_WAVE_ROWS : b->n_rows;
}

static int64_t n_chunks(int64_t n_keys) { return (n_keys + SK_ATTN_CHUNK - 1) / SK_ATTN_CHUNK; }

/* Keys row r of a batch attends to: its own position and those before it, or up to key_end. */
static inline int64_t row_keys(const sk_batch *b, int64_t r) { return b->key_end ? b->key_end[r] : b->pos[r] + 1; }

/* The first key row r of a block sees: 0, or the window's start in a sliding block. */
static inline int64_t row_first_key(const sk_config *g, const sk_batch *b, int64_t r, int sliding) {
    const int64_t lo = sliding ? (int64_t)b->pos[r] - g->swa_window + 1 : 0;
    return lo > 0 ? lo : 0;
}

/* First key piece of each row, and their total: a block's work items are (row, kv head, piece), so row r's
 * first is prefix[r] times the block's kv heads. */
static int64_t plan_spans(const sk_config *g, const sk_batch *b, int sliding, int64_t *prefix) {
    int64_t items = 0;
    for (int64_t r = 0; r < b->n_rows; r++) {
        prefix[r] = items;
        items += sk_span_pieces(row_first_key(g, b, r, sliding), row_keys(b, r));
    }
    prefix[b->n_rows] = items;
    return items;
}

/* The order of a block's (row, piece)s for attention: rows of one sequence that share their first key
 * (every row of a verification or a prompt chunk, outside a sliding window) go piece by piece, each
 * piece for all those rows in turn, so a piece's keys and values are read from memory once and then
 * from the core's cache for the other rows. Each (row, piece) is computed as alone: the order changes
 * what is cached, never a result. Returns the number of entries. */
static int64_t plan_order(const sk_config *g, const sk_batch *b, int sliding, const int64_t *prefix, sk_att_item *out,
                          int64_t r_begin, int64_t r_end) {
    int64_t n = 0;
    for (int64_t r0 = r_begin, r1; r0 < r_end; r0 = r1) {
        const int64_t lo = row_first_key(g, b, r0, sliding);
        int64_t pieces = prefix[r0 + 1] - prefix[r0];
        for (r1 = r0 + 1; r1 < r_end && b->seq[r1] == b->seq[r0] && row_first_key(g, b, r1, sliding) == lo; r1++)
            if (prefix[r1 + 1] - prefix[r1] > pieces) pieces = prefix[r1 + 1] - prefix[r1];
        for (int64_t k = 0; k < pieces; k++)
            for (int64_t r = r0; r < r1; r++)
                if (k < prefix[r + 1] - prefix[r]) out[n++] = (sk_att_item){(int32_t)r, (int32_t)k};
    }
    return n;
}

/* Orders of a batch's (row, piece)s wave by wave (rows [w W, (w + 1) W)), into wave_at; the most pieces
 * one wave holds. */
static int64_t plan_waves(const sk_config *g, const sk_batch *b, int sliding, const int64_t *prefix,
                          sk_att_item *order, int64_t *wave_at, int64_t waves) {
    int64_t at = 0, most = 0;
    for (int64_t w = 0; w < waves; w++) {
        const int64_t g0 = w * ATT_WAVE_ROWS, g1 = wave_end(b, w);
        wave_at[w] = at;
        at += plan_order(g, b, sliding, prefix, order + at, g0, g1);
        if (prefix[g1] - prefix[g0] > most) most = prefix[g1] - prefix[g0];
    }
    wave_at[waves] = at;
    return most;
}

/* Work items of a batch's attention: (row, kv head, key chunk), numbered row by row. They run in waves of
 * ATT_WAVE_ROWS rows, each merged before the next starts, so the chunk partials take one wave's rows: a
 * 256-row prompt chunk of Ministral 3 held 8.5 MB of them at once, now 2.1. Each item is computed as
 * alone, so the waves change no result. */
static int plan_attention(sk_ctx *c, const sk_batch *b) {
    const sk_config *g = &c->cfg;
    if (b->n_rows + 1 > c->att_rows_cap) {
        free(c->att_prefix);
        free(c->att_prefix_swa);
        free(c->att_wave_at);
        free(c->att_wave_at_swa);
        const size_t waves_cap = (size_t)(n_waves(b->n_rows) + 1);
        c->att_prefix = malloc(sizeof(int64_t) * (size_t)(b->n_rows + 1));
        c->att_prefix_swa = g->swa_window > 0 ? malloc(sizeof(int64_t) * (size_t)(b->n_rows + 1)) : NULL;
        c->att_wave_at = malloc(sizeof(int64_t) * waves_cap);
        c->att_wave_at_swa = g->swa_window > 0 ? malloc(sizeof(int64_t) * waves_cap) : NULL;
        c->att_rows_cap = c->att_prefix && c->att_wave_at &&
                          (g->swa_window <= 0 || (c->att_prefix_swa && c->att_wave_at_swa)) ? b->n_rows + 1 : 0;
        if (!c->att_rows_cap) return -1;
    }
    int64_t items = plan_spans(g, b, 0, c->att_prefix);
    if (g->swa_window > 0) {
        int64_t items_swa = plan_spans(g, b, 1, c->att_prefix_swa);
        if (items_swa > items) items = items_swa;
    }
    if (items > c->att_order_cap) {
        free(c->att_order);
        free(c->att_order_swa);
        c->att_order = malloc(sizeof(sk_att_item) * (size_t)items);
        c->att_order_swa = g->swa_window > 0 ? malloc(sizeof(sk_att_item) * (size_t)items) : NULL;
        c->att_order_cap = c->att_order && (g->swa_window <= 0 || c->att_order_swa) ? items : 0;
        if (!c->att_order_cap) return -1;
    }
    c->att_waves = n_waves(b->n_rows);
    int64_t wave_items = plan_waves(g, b, 0, c->att_prefix, c->att_order, c->att_wave_at, c->att_waves);
    if (g->swa_window > 0) {
        const int64_t swa_items = plan_waves(g, b, 1, c->att_prefix_swa, c->att_order_swa, c->att_wave_at_swa,
                                             c->att_waves);
        if (swa_items > wave_items) wave_items = swa_items;
    }
    const int64_t hd = c->max_hd > g->head_dim ? c->max_hd : g->head_dim; /* sk_test_attend sets only the latter */
    int64_t need = wave_items * g->n_head * (hd + 2); /* kv heads x their query heads: n_head partials per piece */
    if (need > c->att_parts_cap) {
        free(c->att_parts);
        c->att_parts = xalloc((size_t)need * 4);
        c->att_parts_cap = c->att_parts ? need : 0;
        if (!c->att_parts) return -1;
    }
    return 0;
}

static int ensure_scratch(sk_ctx *c, int64_t m) {
    if (m <= c->cap_rows) return 0;
    free_scratch(c);
    const sk_config *g = &c->cfg;
    /* h: a block's normed input, its attention output projected, ...; not the FFN's activation rows, which
     * replace their gate rows in gu (the quantized activations below still take n_ff) */
    int64_t qd = (int64_t)g->n_head * c->max_hd, wide = g->n_embd > qd ? g->n_embd : qd;
    if ((g->in_proj.data || g->wide_input) && 2 * (int64_t)g->n_embd > wide) wide = 2 * (int64_t)g->n_embd; /* [e; h] */
    if (g->wide_input && g->in_proj.data && g->in_proj.n_cols > wide) wide = g->in_proj.n_cols; /* the encoder's input */
    if (g->ctx_proj.data && g->ctx_proj.n_cols > wide) wide = g->ctx_proj.n_cols; /* the context encoder's input */
    for (int l = 0; l < g->n_layer; l++) /* a delta-net block's ssm_out input */
        if (g->layers[l].dn.out.n_cols > wide) wide = g->layers[l].dn.out.n_cols;
    c->x = malloc((size_t)(m * g->n_embd) * 4);
    c->h = malloc((size_t)(m * wide) * 4);
    /* gu (n_ff 0: every block is MoE; a post-normed FFN's down projection lands here too, n_embd wide) shares
     * one block with qkv and att: an FFN starts after the output projection's closing barrier, when no
     * thread reads a block's q/k/v or attention rows any more, and the next block's q/k/v projection writes
     * after the barrier that closes the FFN. ~40 KB a row less on Ministral 3's widths. Where the gate/up
     * rows are the wider, a long batch's dense FFN runs in passes of ffn_rows rows that fit the block (a
     * row's products do not depend on the rows beside it): Ministral 3's 256-row prompt chunk in two passes,
     * 8 MB less at its peak, and no pass split for a verification's rows. */
    const int64_t gu_w = 2 * g->n_ff > g->n_embd ? 2 * g->n_ff : g->n_embd;
    const int64_t qkv_att_w = c->qkvd + qd;
    int beside = 0; /* Gemma 4's dense half beside the experts runs over all rows at once */
    for (int l = 0; l < g->n_layer; l++) beside |= g->layers[l].moe_pre_norm != 0;
    c->ffn_rows = gu_w > qkv_att_w && !beside ? m * qkv_att_w / gu_w : m;
    if (c->ffn_rows < 1) c->ffn_rows = 1;
    const int64_t block_w = c->ffn_rows * gu_w > m * qkv_att_w ? c->ffn_rows * gu_w : m * qkv_att_w;
    /* the quantized activations: a block's input rows (wide), or one FFN pass's activation rows (n_ff) */
    const int64_t kp_in = sk_round_up(wide, 64), kp_ff = sk_round_up(g->n_ff, 64);
    const int64_t act_rows_kp = m * kp_in > c->ffn_rows * kp_ff ? m * kp_in : c->ffn_rows * kp_ff;
    c->qkv = malloc((size_t)block_w * 4);
    c->att = c->qkv ? c->qkv + m * c->qkvd : NULL;
    c->gu = c->qkv;
    c->rope = malloc((size_t)(m * g->n_rot) * 4);
    c->rope_swa = g->rope_inv_freq_swa ? malloc((size_t)(m * n_rot_swa(g)) * 4) : NULL;
    for (int l = 0; l < g->n_layer; l++)
        if (g->layers[l].moe_pre_norm && !c->beside && !(c->beside = malloc((size_t)(3 * m * g->n_embd) * 4))) {
            free_scratch(c);
            return -1;
        }
    const int64_t ple_w = (int64_t)g->n_layer * g->n_embd_per_layer;
    if (ple_w) {
        c->ple = malloc((size_t)(m * ple_w) * 4);
        c->ple_tmp = malloc((size_t)(m * ple_w) * 4);
        if (!c->ple || !c->ple_tmp) { free_scratch(c); return -1; }
    }
    c->act.q = xalloc((size_t)act_rows_kp);
    c->act.d = xalloc((size_t)(act_rows_kp / 8));
    c->act.s = xalloc((size_t)(act_rows_kp / 8));
    c->act.qs16 = xalloc((size_t)(act_rows_kp / 4));
    if (!c->x || !c->h || !c->qkv || !c->att || !c->gu || !c->rope || !c->act.q || !c->act.d || !c->act.s ||
        !c->act.qs16 || (g->rope_inv_freq_swa && !c->rope_swa)) {
        free_scratch(c);
        return -1;
    }
    c->cap_rows = m;
    return 0;
}

/* Drops the creator's reference; the memory goes once no context made over this one remains. */
SK_API void sk_ctx_free(sk_ctx *c) {
    if (!c || atomic_fetch_sub(&c->refs, 1) > 1) return;
    if (c->pool && !c->base) sk_pool_free(c->pool); /* a context over a base borrows the base's pool */
    if (c->kv)
        for (int s = 0; s < c->cfg.n_seq_max; s++) free(c->kv[s]);
    free(c->kv);
    if (c->att_scratch)
        for (int i = 0; i < c->cfg.n_threads; i++) free(c->att_scratch[i]);
    free(c->att_scratch);
    free(c->att_prefix);
    free(c->att_parts);
    if (c->packed) munmap(c->packed, c->packed_map);
    if (c->moe)
        for (int l = 0; l < c->cfg.n_layer; l++) sk_moe_free(c->moe[l]);
    free(c->moe);
    sk_moe_scratch_free(c->moe_scratch);
    sk_dn_ctx_free(c->dn);
    free(c->kv_layer);
    free(c->kv_off);
    free(c->kv_rows);
    free(c->att_prefix_swa);
    free(c->att_wave_at);
    free(c->att_wave_at_swa);
    free(c->att_order);
    free(c->att_order_swa);
    sk_swa_free(c->swa);
    free(c->swa_heads);
    free_scratch(c);
    free(c->layers);
    sk_ctx *base = c->base;
    free(c);
    sk_ctx_free(base);
}

/* Give back the pages of a mapped source range the process no longer reads (they stay in the page
 * cache; only this process's resident size shrinks). */
static void drop_pages(const void *start, size_t len) {
    long page = sysconf(_SC_PAGESIZE);
    uintptr_t a = ((uintptr_t)start + (uintptr_t)page - 1) & ~((uintptr_t)page - 1);
    uintptr_t b = ((uintptr_t)start + len) & ~((uintptr_t)page - 1);
    if (b > a) madvise((void *)a, b - a, MADV_DONTNEED);
}

/* Bytes a weight takes in the kernel table's layout, rounded to 64 for the next one's alignment (0: it
 * stays as it is); its packed row_bytes and exact size through the pointers when they are not NULL. */
static int64_t packed_footprint(const sk_ctx *c, const sk_tensor *w, int64_t *row_bytes, int64_t *size) {
    if (!w->data || w->layout != 0 || !c->kern->packed_size) return 0;
    int64_t rb = 0, sz = c->kern->packed_size(w, &rb);
    if (sz <= 0) return 0;
    if (row_bytes) *row_bytes = rb;
    if (size) *size = sz;
    return (sz + 63) / 64 * 64;
}

static int64_t size_tensor(sk_ctx *c, sk_tensor *w) { return packed_footprint(c, w, NULL, NULL); }

/* Rewrite a weight into the kernel table's layout when it has one, at the arena's next free bytes;
 * returns the bytes it took there. */
static int64_t pack_tensor(sk_ctx *c, sk_tensor *w) {
    if (w == &c->cfg.output && c->head_later) return 0; /* its footprint stays free at the arena's end */
    int64_t row_bytes = 0, size = 0, footprint = packed_footprint(c, w, &row_bytes, &size);
    if (footprint == 0) return 0;
    uint8_t *dst = c->packed + c->packed_used;
    c->packed_used += footprint;
    c->packed_bytes += size;
    /* In steps of ~1 MiB of source rows, giving their pages back as we go: the peak stays near the
     * packed size instead of packed + source. */
    const int64_t unit = c->kern->column_unit, units = (w->n_rows + unit - 1) / unit;
    const int64_t step = 1 + (1 << 20) / (unit * w->row_bytes);
    for (int64_t u = 0; u < units; u += step) {
        int64_t u1 = u + step < units ? u + step : units, r0 = u * unit, r1 = u1 * unit < w->n_rows ? u1 * unit : w->n_rows;
        c->kern->pack(w, u, u1, dst + u * row_bytes);
        drop_pages(w->data + r0 * w->row_bytes, (size_t)((r1 - r0) * w->row_bytes));
    }
    w->data = dst;
    w->row_bytes = row_bytes;
    w->layout = 1;
    return footprint;
}

/* Every weight the context packs, in one order for sizing and for packing; the sum of fn's results. */
static int64_t for_each_weight(sk_ctx *c, int64_t (*fn)(sk_ctx *, sk_tensor *)) {
    int64_t total = 0;
    for (int l = 0; l < c->cfg.n_layer; l++) {
        sk_layer *L = &c->layers[l];
        sk_tensor *ts[14] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down,
                             &L->dn.qkv, &L->dn.z, &L->dn.beta, &L->dn.alpha, &L->dn.out, &L->ple_gate, &L->ple_proj};
        for (int i = 0; i < 14; i++) total += fn(c, ts[i]);
        for (int64_t i = 0; c->moe[l] && i < sk_moe_n_tensors(c->moe[l]); i++) total += fn(c, sk_moe_tensor(c->moe[l], i));
    }
    return total + fn(c, &c->cfg.in_proj) + fn(c, &c->cfg.ctx_proj) + fn(c, &c->cfg.output) +
           fn(c, &c->cfg.ple_model_proj);
}

/* The packed weights live in one anonymous mapping that asks for transparent huge pages: a decode
 * step reads every weight once, and with 4 KiB pages that is tens of thousands of TLB entries for a
 * small model (the page walks show up in the step's time); 2 MiB pages need a few dozen. Where the
 * kernel gives no huge pages the mapping works as before, page by page. -1 when out of memory. */
static int pack_weights(sk_ctx *c) {
    const int64_t total = for_each_weight(c, size_tensor);
    if (total == 0) return 0;
    const size_t huge = (size_t)2 << 20, len = ((size_t)total + huge - 1) / huge * huge;
    /* Mapped with a huge page to spare and trimmed to a 2 MiB boundary: huge pages need aligned ranges. */
    uint8_t *raw = mmap(NULL, len + huge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return -1;
    uint8_t *arena = (uint8_t *)(((uintptr_t)raw + huge - 1) & ~(uintptr_t)(huge - 1));
    if (arena > raw) munmap(raw, (size_t)(arena - raw));
    munmap(arena + len, (size_t)(raw + huge - arena)); /* the tail: arena < raw + huge, so never empty */
#ifdef MADV_HUGEPAGE
    madvise(arena, len, MADV_HUGEPAGE);
#endif
    c->packed = arena;
    c->packed_map = len;
    for_each_weight(c, pack_tensor);
    return 0;
}

static int in_proj_fits(const sk_config *cfg) {
    const sk_tensor *p = &cfg->in_proj;
    const int64_t E2 = 2 * (int64_t)cfg->n_embd;
    if (cfg->wide_input) { /* one block whose separate q, k and v read the 2 n_embd wide row */
        const sk_layer *L = &cfg->layers[0];
        return (!p->data || p->n_rows == cfg->n_embd) && cfg->wide_input <= SK_WIDE_RESIDUAL_NORMED &&
               cfg->n_layer == 1 && cfg->in_embd_norm &&
               cfg->in_hidden_norm && L->wk.data && L->wq.n_cols == E2 && L->wk.n_cols == E2 && L->wv.n_cols == E2;
    }
    return !p->data || (p->n_rows == cfg->n_embd && p->n_cols == E2 && cfg->in_embd_norm && cfg->in_hidden_norm);
}

/* A context encoder writes keys and values of blocks with separate k and v projections, from n_embd rows. */
static int ctx_proj_fits(const sk_config *cfg) {
    if (!cfg->ctx_proj.data) return 1;
    if (cfg->ctx_proj.n_rows != cfg->n_embd || cfg->ctx_proj.n_cols < 1 || !cfg->ctx_norm || cfg->wide_input) return 0;
    for (int l = 0; l < cfg->n_layer; l++)
        if (!cfg->layers[l].wk.data || cfg->layers[l].wk.n_cols != cfg->n_embd || cfg->layers[l].wv.n_cols != cfg->n_embd)
            return 0;
    return 1;
}

/* Which blocks keep keys and values, the qkv row width, and the delta-net blocks' context; -1 when the
 * blocks do not fit together or out of memory. */
static int set_up_blocks(sk_ctx *c) {
    const sk_config *g = &c->cfg;
    const sk_dn **dn = calloc((size_t)g->n_layer, sizeof(sk_dn *));
    c->kv_layer = malloc(sizeof(int32_t) * (size_t)g->n_layer);
    c->kv_off = calloc((size_t)g->n_layer, sizeof(int64_t));
    c->kv_rows = calloc((size_t)g->n_layer, sizeof(int64_t));
    if (!dn || !c->kv_layer || !c->kv_off || !c->kv_rows) { free(dn); return -1; }
    c->qkvd = (int64_t)(g->n_head + 2 * g->n_head_kv) * g->head_dim;
    c->max_hd = g->head_dim;
    for (int l = 0; l < g->n_layer; l++) {
        const sk_layer *L = &c->layers[l];
        const int hd = hd_of(g, L);
        if (L->moe_pre_norm && (!L->moe || L->moe->shared_inp.data || !L->router_scale || !L->dense_post_norm ||
                                !L->moe_post_norm || !L->ffn_post_norm || !L->w_gate.data || g->n_ff < 1)) {
            free(dn);
            return -1;
        }
        if (hd > c->max_hd) c->max_hd = hd;
        const int nkv = nkv_of(g, L);
        if (nkv < 1 || g->n_head % nkv) { free(dn); return -1; }
        if (L->kv_shared) { /* another block's keys and values: an earlier one of the same kind and head size */
            const int o = L->kv_shared - 1;
            if (o >= l || L->dn.qkv.data || c->layers[o].kv_shared || c->layers[o].dn.qkv.data ||
                c->layers[o].sliding != L->sliding || hd_of(g, &c->layers[o]) != hd || L->attn_gate ||
                nkv_of(g, &c->layers[o]) != nkv_of(g, L)) { free(dn); return -1; }
            c->kv_layer[l] = c->kv_layer[o];
            if (q_width(g, L) > c->qkvd) c->qkvd = q_width(g, L);
            continue;
        }
        if (L->dn.qkv.data) {
            if (L->attn_gate || L->dn.qkv.n_cols != g->n_embd || L->dn.out.n_rows != g->n_embd) { free(dn); return -1; }
            dn[l] = &L->dn;
            c->kv_layer[l] = -1;
            continue;
        }
        c->kv_layer[l] = c->n_kv_layers++;
        if (L->sliding && (g->swa_window <= 0 || g->swa_row_cap <= 0 || !g->rope_inv_freq_swa)) { free(dn); return -1; }
        c->kv_rows[l] = L->sliding ? sk_swa_ring_rows(c->n_ctx_pad, g->swa_window, g->swa_row_cap) : c->n_ctx_pad;
        if (L->sliding) {
            if (c->swa_hd && c->swa_hd != hd) { free(dn); return -1; } /* one ring row size (sk_swa.h) */
            c->swa_hd = hd;
            c->swa_ring = c->kv_rows[l];
            c->n_swa_heads += 2 * nkv;
        }
        c->kv_off[l] = c->kv_slot_elems;
        c->kv_slot_elems += 2 * (int64_t)nkv * c->kv_rows[l] * hd;
        const int64_t w = q_width(g, L) + 2 * (int64_t)nkv * hd;
        if (L->attn_gate && (L->wq.n_rows != (L->wk.data ? q_width(g, L) : w) || g->wide_input)) { free(dn); return -1; }
        if (w > c->qkvd) c->qkvd = w;
    }
    int err = 0;
    c->dn = sk_dn_ctx_new(dn, g->n_layer, g->n_seq_max, g->rms_eps, &err);
    free(dn);
    return err;
}

/* base NULL: own threads (cfg->n_threads) and kernel table; else base's, and base lives on until this
 * context is freed (a weight of layout 1 in cfg is taken as prepared for that kernel table). */
static sk_ctx *ctx_new(const sk_config *cfg, sk_ctx *base, int kernel_cap, int head_later) {
    if ((!base && cfg->n_threads < 1) || cfg->n_ctx < 1 || cfg->n_seq_max < 1 || cfg->n_head_kv < 1 ||
        cfg->n_head % cfg->n_head_kv != 0 || cfg->n_layer < 1 || !in_proj_fits(cfg) ||
        !ctx_proj_fits(cfg))
        return NULL;
    sk_ctx *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    atomic_init(&c->refs, 1);
    c->cfg = *cfg;
    c->head_later = head_later;
    if (base) {
        atomic_fetch_add(&base->refs, 1);
        c->base = base;
        c->pool = base->pool;
        c->kern = base->kern;
        c->cfg.n_threads = sk_pool_size(base->pool);
    } else {
        c->kern = pick_kernels(kernel_cap);
    }
    c->layers = malloc(sizeof(sk_layer) * (size_t)cfg->n_layer);
    c->moe = calloc((size_t)cfg->n_layer, sizeof(sk_moe *));
    c->kv = calloc((size_t)cfg->n_seq_max, sizeof(uint16_t *));
    c->att_scratch = calloc((size_t)c->cfg.n_threads, sizeof(float *));
    c->n_ctx_pad = sk_round_up(cfg->n_ctx, SK_ATTN_CHUNK); /* whole chunks: a ring's pieces map to its rows */
    c->kv_head_elems = c->n_ctx_pad * cfg->head_dim;
    if (!c->layers || !c->moe || !c->kv || !c->att_scratch) { sk_ctx_free(c); return NULL; }
    memcpy(c->layers, cfg->layers, sizeof(sk_layer) * (size_t)cfg->n_layer);
    c->cfg.layers = c->layers;
    for (int l = 0; l < cfg->n_layer; l++) {
        if (!cfg->layers[l].moe) continue;
        if (!(c->moe[l] = sk_moe_clone(cfg->layers[l].moe, cfg->n_embd))) { sk_ctx_free(c); return NULL; }
        c->layers[l].moe = c->moe[l];
    }
    if (set_up_blocks(c) != 0) { sk_ctx_free(c); return NULL; }
    if (c->swa_ring && (!(c->swa = sk_swa_new(cfg->n_seq_max, cfg->swa_window, c->swa_ring)) ||
                        !(c->swa_heads = calloc((size_t)c->n_swa_heads, sizeof(uint16_t *))))) {
        sk_ctx_free(c);
        return NULL;
    }
    for (int i = 0; i < c->cfg.n_threads; i++) {
        c->att_scratch[i] = xalloc((size_t)cfg->n_head * SK_ATTN_CHUNK * 4); /* a block's group: up to n_head */
        if (!c->att_scratch[i]) { sk_ctx_free(c); return NULL; }
    }
    if (!base) c->pool = sk_pool_new(cfg->n_threads);
    if (!c->pool || sk_pool_size(c->pool) != c->cfg.n_threads || pack_weights(c) != 0) { sk_ctx_free(c); return NULL; }
    return c;
}

SK_API sk_ctx *sk_ctx_new(const sk_config *cfg, int kernel_cap) { return ctx_new(cfg, NULL, kernel_cap, 0); }

/* As sk_ctx_new, with the output head (a small model's largest weight: 170 of Gemma 3 270M's 235 MiB) left
 * unpacked until sk_ctx_pack_head, so a caller can put that growth after another load's peak (a tokenizer
 * built meanwhile). No forward before sk_ctx_pack_head. */
SK_API sk_ctx *sk_ctx_new_head_later(const sk_config *cfg, int kernel_cap) { return ctx_new(cfg, NULL, kernel_cap, 1); }

SK_API void sk_ctx_pack_head(sk_ctx *c) {
    if (!c->head_later) return;
    c->head_later = 0;
    pack_tensor(c, &c->cfg.output);
}

/* A context over base's threads and kernel table (see the top of this file); NULL as sk_ctx_new. */
SK_API sk_ctx *sk_ctx_new_over(const sk_config *cfg, sk_ctx *base) {
    return base ? ctx_new(cfg, base, 0, 0) : NULL;
}

/* The context's config as it runs: token_embd, output and in_proj as prepared (layers: its own copy). */
SK_API void sk_ctx_config(const sk_ctx *c, sk_config *out) { *out = c->cfg; }

/* Bytes of the weight copies this context made in its kernels' layout (none for the generic table). */
SK_API int64_t sk_ctx_packed_bytes(const sk_ctx *c) { return c->packed_bytes; }

SK_API const char *sk_ctx_kernel_name(const sk_ctx *c) { return c->kern->name; }

/* Keys and values of one sequence, all layers. calloc: pages become resident only when written. */
SK_API int sk_kv_alloc(sk_ctx *c, int slot) {
    if (slot < 0 || slot >= c->cfg.n_seq_max) return -1;
    if (c->kv[slot]) return 0;
    size_t n = (size_t)c->kv_slot_elems;
    c->kv[slot] = calloc(n > 0 ? n : 1, sizeof(uint16_t));
    if (c->swa) sk_swa_cut(c->swa, slot, 0);
    if (c->kv[slot] && c->dn && sk_dn_state_alloc(c->dn, slot) != 0) { free(c->kv[slot]); c->kv[slot] = NULL; }
    return c->kv[slot] ? 0 : -1;
}

SK_API void sk_kv_release(sk_ctx *c, int slot) {
    if (slot < 0 || slot >= c->cfg.n_seq_max) return;
    free(c->kv[slot]);
    c->kv[slot] = NULL;
    if (c->swa) sk_swa_cut(c->swa, slot, 0);
    if (c->dn) sk_dn_state_free(c->dn, slot);
}

/* A block's keys (then its values) of one slot: per kv head kv_rows[layer] rows (a ring in sliding blocks). */
static uint16_t *kcache(sk_ctx *c, int slot, int layer, int head) {
    const int o = kv_owner(c, layer), hd = hd_of(&c->cfg, &c->layers[o]);
    return c->kv[slot] + c->kv_off[o] + head * c->kv_rows[o] * hd;
}

static uint16_t *vcache(sk_ctx *c, int slot, int layer, int head) {
    const int o = kv_owner(c, layer);
    return kcache(c, slot, layer, head) + (int64_t)nkv_of(&c->cfg, &c->layers[o]) * c->kv_rows[o] * hd_of(&c->cfg, &c->layers[o]);
}

static void rope_head(float *v, const float *cs, int n_rot, int neox);

/* Context shift of one slot (a server's --context-shift): positions [n_keep, n_keep + n_discard) leave the
 * cache and positions [n_keep + n_discard, n_past) move down by n_discard. Keys are re-roped by -n_discard
 * (a pure rotation: angles add per frequency, and YaRN's magnitude is already in the stored keys), in
 * float32 from the stored float16 and rounded back once, as llama.cpp's K-shift does; values are moved.
 * Only full-context attention blocks: -1 for a model with sliding-window rings or a recurrent state,
 * a bad slot or bad bounds. */
SK_API int sk_kv_shift(sk_ctx *c, int slot, int64_t n_keep, int64_t n_discard, int64_t n_past) {
    const sk_config *g = &c->cfg;
    if (slot < 0 || slot >= g->n_seq_max || !c->kv[slot] || c->swa || c->dn) return -1;
    if (n_keep < 0 || n_discard < 0 || n_keep + n_discard > n_past || n_past > c->n_ctx_pad) return -1;
    if (n_discard == 0) return 0;
    const int n_rot = g->n_rot, half = n_rot / 2;
    float *cs = malloc(sizeof(float) * (size_t)(n_rot > 0 ? n_rot : 1)), *k = malloc(sizeof(float) * (size_t)c->max_hd);
    if (!cs || !k) { free(cs); free(k); return -1; }
    for (int i = 0; i < half; i++) { /* the same rotation for every moved row: cos and sin of -n_discard * freq */
        const double th = -(double)n_discard * g->rope_inv_freq[i];
        cs[i] = (float)cos(th);
        cs[half + i] = (float)sin(th);
    }
    for (int l = 0; l < g->n_layer; l++) {
        const sk_layer *L = &c->layers[l];
        if (L->kv_shared || L->dn.qkv.data) continue; /* another block's cache, or no cache */
        const int hd = hd_of(g, L), nkv = nkv_of(g, L);
        for (int h = 0; h < nkv; h++) {
            uint16_t *kc = kcache(c, slot, l, h), *vc = vcache(c, slot, l, h);
            for (int64_t t = n_keep + n_discard; t < n_past; t++) { /* ascending: a row moves below its source */
                const int64_t to = t - n_discard;
                uint16_t *ks = kc + (t / SK_KEY_BLOCK) * hd * SK_KEY_BLOCK + t % SK_KEY_BLOCK;
                uint16_t *kd = kc + (to / SK_KEY_BLOCK) * hd * SK_KEY_BLOCK + to % SK_KEY_BLOCK;
                for (int d = 0; d < hd; d++) k[d] = sk_f16_to_f32(ks[d * SK_KEY_BLOCK]);
                rope_head(k, cs, n_rot, g->rope_neox);
                for (int d = 0; d < hd; d++) kd[d * SK_KEY_BLOCK] = sk_f32_to_f16(k[d]);
                memmove(vc + to * hd, vc + t * hd, sizeof(uint16_t) * (size_t)hd);
            }
        }
    }
    free(cs);
    free(k);
    return 0;
}

static const sk_kernels *kern_for(const sk_ctx *c, const sk_tensor *w) {
    return c->kern->supports(w) ? c->kern : &sk_generic_kernels;
}

static void split(int64_t n, int ith, int nth, int64_t *a, int64_t *b) {
    *a = n * ith / nth;
    *b = n * (ith + 1) / nth;
}

/* x rows [r0, r1) of width k into the shared activation buffer (which then holds width k). */
static void quantize(sk_ctx *c, const float *x, int64_t ldx, int64_t k, int64_t r0, int64_t r1) {
    c->act.kp = sk_round_up(k, 64);
    if (r1 > r0) c->kern->quantize_rows(x + r0 * ldx, ldx, r1 - r0, k, &c->act, r0);
}

typedef struct {
    const sk_tensor *w;
    float *out;
    int64_t ldo;
    int accumulate;
} part;

/* This thread's share of several matmuls over the same input: whole units of output columns
 * (groups of 16: the kernels' layout, and no two threads write one cache line), split evenly. */
static void gemm_parts(sk_ctx *c, const part *parts, int np, const float *x, int64_t ldx, int64_t m, int ith, int nth) {
    const int64_t unit = c->kern->column_unit;
    int64_t total = 0;
    for (int i = 0; i < np; i++) total += (parts[i].w->n_rows + unit - 1) / unit;
    int64_t u0, u1, off = 0;
    split(total, ith, nth, &u0, &u1);
    for (int i = 0; i < np; i++) {
        const sk_tensor *w = parts[i].w;
        int64_t units = (w->n_rows + unit - 1) / unit;
        int64_t a = u0 > off ? u0 - off : 0, b = u1 - off < units ? u1 - off : units;
        if (b > a) {
            int64_t n0 = a * unit, n1 = b * unit < w->n_rows ? b * unit : w->n_rows;
            const sk_kernels *k = kern_for(c, w);
            if (sk_is_quant(w->type)) k->gemm_q(w, n0, n1, &c->act, m, parts[i].out, parts[i].ldo, parts[i].accumulate);
            else k->gemm_f(w, n0, n1, x, ldx, m, parts[i].out, parts[i].ldo, parts[i].accumulate);
        }
        off += units;
    }
}

static int any_quant(const part *parts, int np) {
    for (int i = 0; i < np; i++)
        if (sk_is_quant(parts[i].w->type)) return 1;
    return 0;
}

/* One projection step of a block: rows r0..r1 of x (k wide, ldx apart) quantized when a part needs int8
 * activations, then every part's matmul over all m rows; the time before the matmul counts as PH_NORM,
 * the matmul's as `ph`. Every thread calls it (it holds two barriers). */
static void project(sk_ctx *c, const part *parts, int np, const float *x, int64_t ldx, int64_t k, int64_t m,
                    int64_t r0, int64_t r1, int ith, int nth, int ph, double *t) {
    if (any_quant(parts, np)) quantize(c, x, ldx, k, r0, r1);
    barrier(c->pool, ith);
    phase(ith, PH_NORM, t);
    gemm_parts(c, parts, np, x, ldx, m, ith, nth);
    barrier(c->pool, ith);
    phase(ith, ph, t);
}

/* Row r's [cos | sin] table at position p. */
static void rope_table(const double *inv_freq, int n_rot, int64_t p, double mscale, float *cs) {
    for (int i = 0; i < n_rot / 2; i++) {
        double th = (double)p * inv_freq[i];
        cs[i] = (float)(cos(th) * mscale);
        cs[n_rot / 2 + i] = (float)(sin(th) * mscale);
    }
}

static void rope_angles(sk_ctx *c, int64_t p, int64_t r) {
    const sk_config *g = &c->cfg;
    const double ms = sk_rope_mscale(g->rope_mscale); /* YaRN's magnitude, the same in both tables */
    rope_table(g->rope_inv_freq, g->n_rot, p, ms, c->rope + r * g->n_rot);
    if (g->rope_inv_freq_swa) rope_table(g->rope_inv_freq_swa, n_rot_swa(g), p, ms, c->rope_swa + r * n_rot_swa(g));
}

/* Rope on one head: NORM pairs (2i, 2i+1) or NEOX pairs (i, i + n_rot/2); cs = [cos | sin] per pair. */
static void rope_head(float *v, const float *cs, int n_rot, int neox) {
    int half = n_rot / 2;
    for (int i = 0; i < half; i++) {
        int i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
        float x0 = v[i0], x1 = v[i1], co = cs[i], si = cs[half + i];
        v[i0] = x0 * co - x1 * si;
        v[i1] = x0 * si + x1 * co;
    }
}

/* Norms and rope of rows [r0, r1)'s heads from first_head on (n_head: keys only), then their keys and
 * values into the cache at the rows' positions. */
static void qkv_post(sk_ctx *c, const sk_batch *b, int layer, int first_head, int64_t r0, int64_t r1) {
    const sk_config *g = &c->cfg;
    const sk_layer *L = &c->layers[layer];
    const int hd = hd_of(g, L), n_rot = L->sliding ? n_rot_swa(g) : g->n_rot, nkv = nkv_of(g, L);
    const int64_t qkvd = c->qkvd, qs = q_stride(g, L), qw = q_width(g, L);
    for (int64_t r = r0; r < r1; r++) {
        float *row = c->qkv + r * qkvd, *cs = (L->sliding ? c->rope_swa : c->rope) + r * n_rot;
        const float temp = sk_attn_temperature(g->attn_temp_scale, g->attn_temp_floor, b->pos[r]);
        /* a block attending another's keys and values has queries only */
        for (int h = first_head; h < g->n_head + (L->kv_shared ? 0 : nkv); h++) {
            float *v = h < g->n_head ? row + h * qs : row + qw + (int64_t)(h - g->n_head) * hd;
            const float *nw = h < g->n_head ? L->q_norm : L->k_norm;
            if (nw) c->kern->rms_norm(v, nw, hd, g->rms_eps, v);
            rope_head(v, cs, n_rot, g->rope_neox);
            if (h < g->n_head && temp != 1.0f)
                for (int d = 0; d < hd; d++) v[d] *= temp;
        }
        if (L->kv_shared) continue;
        int slot = b->seq[r];
        int64_t t = b->pos[r] % c->kv_rows[layer]; /* a ring's row in sliding blocks */
        for (int h = 0; h < nkv; h++) {
            float *kv = row + qw + (int64_t)h * hd, *vv = kv + (int64_t)nkv * hd;
            if (L->value_norm) sk_value_norm(vv, hd, g->rms_eps);
            uint16_t *kd = kcache(c, slot, layer, h) + (t / SK_KEY_BLOCK) * hd * SK_KEY_BLOCK + t % SK_KEY_BLOCK;
            uint16_t *vd = vcache(c, slot, layer, h) + t * hd;
            for (int d = 0; d < hd; d++) {
                kd[d * SK_KEY_BLOCK] = sk_f32_to_f16(kv[d]);
                vd[d] = sk_f32_to_f16(vv[d]);
            }
        }
    }
}

/* Work items are (row, kv head, key chunk): the query heads of a kv head share its key and value
 * loads, and long contexts spread over every thread. Each item leaves one partial per query head. */
static void attention(sk_ctx *c, const sk_batch *b, int layer, int64_t wave, int ith, int nth) {
    const sk_config *g = &c->cfg;
    const int hd = hd_of(g, &c->layers[layer]), nkv = nkv_of(g, &c->layers[layer]), gq = g->n_head / nkv;
    const int sliding = c->layers[layer].sliding;
    const int64_t qkvd = c->qkvd, ldpart = hd + 2, qs = q_stride(g, &c->layers[layer]);
    const int64_t ring = c->kv_rows[kv_owner(c, layer)];
    const int64_t *prefix = sliding ? c->att_prefix_swa : c->att_prefix;
    const int64_t *wave_at = sliding ? c->att_wave_at_swa : c->att_wave_at;
    const sk_att_item *order = (sliding ? c->att_order_swa : c->att_order) + wave_at[wave];
    const int64_t n_order = wave_at[wave + 1] - wave_at[wave], first = prefix[wave * ATT_WAVE_ROWS];
    int64_t j0, j1;
    split(n_order * nkv, ith, nth, &j0, &j1);
    for (int64_t j = j0; j < j1; j++) {
        const int kvh = (int)(j / n_order);
        const sk_att_item e = order[j % n_order];
        const int64_t r = e.row;
        const int64_t lo = row_first_key(g, b, r, sliding), hi = row_keys(b, r), nc = prefix[r + 1] - prefix[r];
        /* the item's partials in the wave's, as attention_merge reads them */
        const int64_t i = (prefix[r] - first) * nkv + (int64_t)kvh * nc + e.piece;
        int64_t t0, t1;
        sk_span_piece(lo, hi, e.piece, &t0, &t1);
        const int64_t base = t0 - t0 % ring; /* a piece never crosses a multiple of the ring's rows */
        /* the SIMD kernels read whole key blocks; a window's unaligned first piece goes through the generic one */
        const sk_kernels *k = t0 % SK_KEY_BLOCK ? &sk_generic_kernels : c->kern;
        const float *q = c->qkv + r * qkvd + (int64_t)kvh * gq * qs;
        k->attend_part(q, gq, qs, kcache(c, b->seq[r], layer, kvh), vcache(c, b->seq[r], layer, kvh), t0 - base,
                       t1 - base, hd, g->attn_scale, c->att_parts + i * gq * ldpart, ldpart, c->att_scratch[ith]);
    }
}

/* Merge each (row, query head)'s chunk partials in key order: out = sum_c e^(m_c - M) o_c / sum_c e^(m_c - M) s_c,
 * times sigmoid(gate) when the block has an output gate. */
static void attention_merge(sk_ctx *c, const sk_batch *b, const sk_layer *L, int64_t wave, int ith, int nth) {
    const sk_config *g = &c->cfg;
    const int hd = hd_of(g, L), nkv = nkv_of(g, L), gq = g->n_head / nkv;
    const int64_t qd = (int64_t)g->n_head * hd, ldpart = hd + 2;
    const int64_t g0 = wave * ATT_WAVE_ROWS, g1 = wave_end(b, wave);
    int64_t i0, i1;
    split((g1 - g0) * g->n_head, ith, nth, &i0, &i1);
    const int64_t *prefix = L && L->sliding ? c->att_prefix_swa : c->att_prefix;
    for (int64_t i = i0; i < i1; i++) {
        const int64_t r = g0 + i / g->n_head, nc = prefix[r + 1] - prefix[r];
        const int h = (int)(i % g->n_head), kvh = h / gq;
        const float *p0 = c->att_parts + (((prefix[r] - prefix[g0]) * nkv + (int64_t)kvh * nc) * gq + h % gq) * ldpart;
        const int64_t step = gq * ldpart;
        float *out = c->att + r * qd + (int64_t)h * hd;
        const float sink = L && L->attn_sinks ? L->attn_sinks[h] : -INFINITY;  /* -inf: no sink */
        if (nc == 1 && sink == -INFINITY) {
            const float inv = 1.0f / p0[1];
            for (int d = 0; d < hd; d++) out[d] = p0[2 + d] * inv;
        } else {
            sk_oai_sink_merge(p0, nc, step, hd, sink, out);
        }
        if (L && L->attn_gate) {
            const float *gate = c->qkv + r * c->qkvd + (int64_t)h * 2 * hd + hd;
            for (int d = 0; d < hd; d++) out[d] *= 1.0f / (1.0f + expf(-gate[d]));
        }
    }
}

/* x += rmsnorm(h, w) for rows [r0, r1) (a post-normed sublayer output in h; the caller's barrier follows). */
static void add_post_normed(sk_ctx *c, const float *w, int64_t r0, int64_t r1) {
    const int64_t E = c->cfg.n_embd;
    for (int64_t r = r0; r < r1; r++) {
        float *h = c->h + r * E, *x = c->x + r * E;
        c->kern->rms_norm(h, w, E, c->cfg.rms_eps, h);
        for (int64_t i = 0; i < E; i++) x[i] += h[i];
    }
}

/* The attention half of block l: x += wo . attention(norm(x)), with the output gate when the block has one. */
static void attention_block(sk_ctx *c, const sk_batch *b, const sk_layer *L, int l, int64_t r0, int64_t r1, int ith,
                            int nth, double *tp) {
    const sk_config *g = &c->cfg;
    const int64_t m = b->n_rows, E = g->n_embd, qd = (int64_t)g->n_head * hd_of(g, L), qkvd = c->qkvd;
    const int64_t qw = q_width(g, L);
    double t = *tp;
    part qkv[3] = {{&L->wq, c->qkv, qkvd, 0}, {&L->wk, c->qkv + qw, qkvd, 0},
                   {&L->wv, c->qkv + qw + (int64_t)nkv_of(g, L) * hd_of(g, L), qkvd, 0}};
    int nq = L->wk.data ? 3 : 1;
    const int64_t in_w = g->wide_input && l == 0 ? 2 * E : E; /* a wide input is already in h */
    if (in_w == E)
        for (int64_t r = r0; r < r1; r++) c->kern->rms_norm(c->x + r * E, L->attn_norm, E, g->rms_eps, c->h + r * E);
    project(c, qkv, nq, c->h, in_w, in_w, m, r0, r1, ith, nth, PH_QKV, &t);
    qkv_post(c, b, l, 0, r0, r1);
    barrier(c->pool, ith);
    phase(ith, PH_ROPE, &t);
    for (int64_t w = 0; w < c->att_waves; w++) { /* a wave's partials are merged before the next reuses them */
        attention(c, b, l, w, ith, nth);
        barrier(c->pool, ith);
        attention_merge(c, b, L, w, ith, nth);
        barrier(c->pool, ith);
    }
    phase(ith, PH_ATTN, &t);
    part o = {&L->wo, L->attn_post_norm ? c->h : c->x, E, !L->attn_post_norm};
    project(c, &o, 1, c->att, qd, qd, m, r0, r1, ith, nth, PH_OPROJ, &t);
    if (L->attn_post_norm) add_post_normed(c, L->attn_post_norm, r0, r1);
    *tp = t;
}

/* The delta-net half of block l (sk_deltanet.h): x += ssm_out . gated_delta_net(norm(x)). */
static void delta_net_block(sk_ctx *c, const sk_layer *L, int l, int64_t m, int64_t r0, int64_t r1, int ith, int nth,
                            double *tp) {
    const sk_config *g = &c->cfg;
    const int64_t E = g->n_embd;
    const sk_dn_io io = sk_dn_buffers(c->dn);
    double t = *tp;
    part in[4] = {{&L->dn.qkv, io.qkv, io.ld_qkv, 0}, {&L->dn.z, io.z, io.ld_z, 0},
                  {&L->dn.beta, io.ba, io.ld_ba, 0}, {&L->dn.alpha, io.ba + L->dn.n_v_heads, io.ld_ba, 0}};
    for (int64_t r = r0; r < r1; r++) c->kern->rms_norm(c->x + r * E, L->attn_norm, E, g->rms_eps, c->h + r * E);
    project(c, in, 4, c->h, E, E, m, r0, r1, ith, nth, PH_DN_IN, &t);
    sk_dn_conv(c->dn, c->kern, l, r0, r1, ith, nth);
    barrier(c->pool, ith);
    phase(ith, PH_DN_CONV, &t);
    sk_dn_rule(c->dn, c->kern, l, ith, nth);
    phase(ith, PH_DN_RULE, &t);
    sk_dn_gate_norm(c->dn, c->kern, l, ith, nth);
    barrier(c->pool, ith);
    phase(ith, PH_DN_NORM, &t);
    part o = {&L->dn.out, c->x, E, 1};
    const int64_t vd = L->dn.out.n_cols;
    project(c, &o, 1, io.o, io.ld_o, vd, m, r0, r1, ith, nth, PH_DN_OUT, &t);
    *tp = t;
}

/* Gemma 4's per-layer inputs of the batch into c->ple (sk_gemma4.h), from the scaled embeddings in c->x. */
static void per_layer_inputs(sk_ctx *c, const sk_batch *b, int64_t r0, int64_t r1, int ith, int nth, double *t) {
    const sk_config *g = &c->cfg;
    const int P = g->n_embd_per_layer;
    const int64_t w = (int64_t)g->n_layer * P, E = g->n_embd;
    part proj = {&g->ple_model_proj, c->ple, w, 0};
    project(c, &proj, 1, c->x, E, E, b->n_rows, r0, r1, ith, nth, PH_EMBED, t);
    for (int64_t r = r0; r < r1; r++)
        sk_per_layer_inputs(c->ple + r * w, &g->ple_embd, b->tokens[r], g->ple_proj_norm, g->n_layer, P, (int)E,
                            g->rms_eps, c->ple_tmp + r * w);
}

/* Gemma 4's end of block l: x += rms_norm(proj(gelu(gate(x)) * input_l), norm), then x *= out_scale. */
static void block_tail(sk_ctx *c, const sk_batch *b, const sk_layer *L, int l, int64_t r0, int64_t r1, int ith,
                       int nth, double *t) {
    const sk_config *g = &c->cfg;
    const int64_t E = g->n_embd, m = b->n_rows;
    if (L->ple_gate.data) {
        const int P = g->n_embd_per_layer;
        const int64_t w = (int64_t)g->n_layer * P;
        part gate = {&L->ple_gate, c->ple_tmp, P, 0};
        project(c, &gate, 1, c->x, E, E, m, r0, r1, ith, nth, PH_FFN_UP, t);
        for (int64_t r = r0; r < r1; r++) sk_per_layer_gate(c->ple_tmp + r * P, c->ple + r * w + (int64_t)l * P, P);
        part proj = {&L->ple_proj, c->h, E, 0};
        project(c, &proj, 1, c->ple_tmp, P, P, m, r0, r1, ith, nth, PH_FFN_DOWN, t);
        add_post_normed(c, L->ple_norm, r0, r1);
    }
    if (L->out_scale != 0.0f)
        for (int64_t r = r0; r < r1; r++) sk_scale_row(c->x + r * E, E, L->out_scale);
}

/* Gemma 4's MoE FFN half (sk_gemma4.h): h = dense_post_norm(dense(h)) + moe_post_norm(experts(moe_pre_norm(x)))
 * with h = ffn_norm(x) on entry, then x += ffn_post_norm(h). */
static void dense_beside_experts(sk_ctx *c, const sk_batch *b, const sk_layer *L, int64_t r0, int64_t r1, int ith,
                                 int nth, double *t) {
    const sk_config *g = &c->cfg;
    const int64_t m = b->n_rows, E = g->n_embd, ff = L->w_down.n_cols;
    float *route = c->beside, *moe_in = c->beside + m * E, *moe_out = c->beside + 2 * m * E;
    for (int64_t r = r0; r < r1; r++) {
        sk_router_input(c->x + r * E, L->router_scale, E, g->rms_eps, route + r * E);
        c->kern->rms_norm(c->x + r * E, L->moe_pre_norm, E, g->rms_eps, moe_in + r * E);
        memset(moe_out + r * E, 0, (size_t)E * 4);
    }
    part gu[2] = {{&L->w_gate, c->gu, 2 * ff, 0}, {&L->w_up, c->gu + ff, 2 * ff, 0}};
    project(c, gu, 2, c->h, E, E, m, r0, r1, ith, nth, PH_FFN_UP, t);
    for (int64_t r = r0; r < r1; r++) { /* the activation in place of the gate row */
        float *gr = c->gu + r * 2 * ff;
        sk_geglu(gr, gr + ff, ff, gr);
    }
    part dn = {&L->w_down, c->h, E, 0};
    project(c, &dn, 1, c->gu, 2 * ff, ff, m, r0, r1, ith, nth, PH_FFN_DOWN, t);
    const sk_moe_env env = {c->kern, c->pool, c->moe_scratch};
    sk_moe_ffn_routed(&env, L->moe, route, moe_in, moe_out, E, m, ith, nth); /* set_up_blocks checked it fits */
    phase(ith, PH_MOE, t);
    for (int64_t r = r0; r < r1; r++) {
        float *d = c->h + r * E, *o = moe_out + r * E, *h = c->h + r * E;
        c->kern->rms_norm(d, L->dense_post_norm, E, g->rms_eps, d);
        c->kern->rms_norm(o, L->moe_post_norm, E, g->rms_eps, o);
        for (int64_t i = 0; i < E; i++) h[i] = d[i] + o[i];
    }
    add_post_normed(c, L->ffn_post_norm, r0, r1);
}

static void forward_job(void *arg, int ith, int nth) {
    job *j = arg;
    sk_ctx *c = j->c;
    const sk_batch *b = j->b;
    const sk_config *g = &c->cfg;
    const int64_t m = b->n_rows, E = g->n_embd;
    int64_t r0, r1;
    split(m, ith, nth, &r0, &r1);
    double t = profiling == 1 ? now_s() : 0.0;

    for (int64_t r = r0; r < r1; r++) {
        if (g->in_proj.data || g->wide_input) {
            float *e = c->h + r * 2 * E; /* [rmsnorm(E[token]); rmsnorm(hidden)]: what in_proj or q/k/v read */
            sk_dequant_row(&g->token_embd, b->tokens[r], e);
            c->kern->rms_norm(e, g->in_embd_norm, E, g->rms_eps, e);
            c->kern->rms_norm(b->hidden_in + r * E, g->in_hidden_norm, E, g->rms_eps, e + E);
            if (g->wide_input)
                memcpy(c->x + r * E, g->wide_input == SK_WIDE_RESIDUAL_NORMED ? e + E : b->hidden_in + r * E,
                       (size_t)E * 4);
        } else {
            float *x = c->x + r * E;
            sk_dequant_row(&g->token_embd, b->tokens[r], x);
            if (g->embd_scale != 0.0f)
                for (int64_t i = 0; i < E; i++) x[i] *= g->embd_scale;
        }
        rope_angles(c, b->pos[r], r);
    }
    if (g->in_proj.data && !g->wide_input) { /* with a wide input, in_proj is the encoder (sk_project_in) */
        part in = {&g->in_proj, c->x, E, 0};
        if (any_quant(&in, 1)) quantize(c, c->h, 2 * E, 2 * E, r0, r1);
        barrier(c->pool, ith);
        gemm_parts(c, &in, 1, c->h, 2 * E, m, ith, nth);
    }
    if (g->n_embd_per_layer) per_layer_inputs(c, b, r0, r1, ith, nth, &t);
    barrier(c->pool, ith);
    phase(ith, PH_EMBED, &t);

    for (int l = 0; l < g->n_layer; l++) {
        const sk_layer *L = &c->layers[l];
        if (b->capture && b->capture[l]) memcpy(b->capture[l] + r0 * E, c->x + r0 * E, (size_t)((r1 - r0) * E) * 4);
        if (L->dn.qkv.data) {
            delta_net_block(c, L, l, m, r0, r1, ith, nth, &t);
        } else {
            attention_block(c, b, L, l, r0, r1, ith, nth, &t);
        }
        for (int64_t r = r0; r < r1; r++) c->kern->rms_norm(c->x + r * E, L->ffn_norm, E, g->rms_eps, c->h + r * E);
        if (L->moe && L->moe_pre_norm) {
            dense_beside_experts(c, b, L, r0, r1, ith, nth, &t);
            block_tail(c, b, L, l, r0, r1, ith, nth, &t);
            continue;
        }
        if (L->moe) {
            const sk_moe_env env = {c->kern, c->pool, c->moe_scratch};
            sk_moe_ffn(&env, L->moe, c->h, c->x, E, m, ith, nth);
            phase(ith, PH_MOE, &t);
            continue;
        }
        const int64_t ff = L->w_down.n_cols; /* the block's own width (Gemma 4's may vary); g->n_ff: the widest */
        const int passes = m > c->ffn_rows;
        if (passes) barrier(c->pool, ith); /* a pass's rows were normed by other threads (r0..r1 above) */
        for (int64_t f0 = 0; f0 < m; f0 += c->ffn_rows) { /* gu holds one pass's rows; p0..p1: this thread's */
            const int64_t fm = m - f0 < c->ffn_rows ? m - f0 : c->ffn_rows;
            int64_t p0, p1;
            split(fm, ith, nth, &p0, &p1);
            part gu[2] = {{&L->w_gate, c->gu, 2 * ff, 0}, {&L->w_up, c->gu + ff, 2 * ff, 0}};
            project(c, gu, 2, c->h + f0 * E, E, E, fm, p0, p1, ith, nth, PH_FFN_UP, &t);
            for (int64_t r = p0; r < p1; r++) { /* the activation in place of the gate row (the kernels allow y == g) */
                float *gr = c->gu + r * 2 * ff;
                (g->ffn_geglu ? sk_geglu : c->kern->silu_mul)(gr, gr + ff, ff, gr);
            }
            if (L->ffn_post_norm) { /* down into h (the pass's input rows, read already), then normed into x */
                part dn = {&L->w_down, c->h + f0 * E, E, 0};
                project(c, &dn, 1, c->gu, 2 * ff, ff, fm, p0, p1, ith, nth, PH_FFN_DOWN, &t);
                add_post_normed(c, L->ffn_post_norm, f0 + p0, f0 + p1);
            } else {
                part dn = {&L->w_down, c->x + f0 * E, E, 1};
                project(c, &dn, 1, c->gu, 2 * ff, ff, fm, p0, p1, ith, nth, PH_FFN_DOWN, &t);
            }
        }
        if (passes && L->ffn_post_norm) barrier(c->pool, ith); /* block_tail and the next block read x by r0..r1 */
        block_tail(c, b, L, l, r0, r1, ith, nth, &t);
    }
    const sk_layer *last = &c->layers[g->n_layer - 1];
    if (last->ffn_post_norm || last->ple_gate.data || last->out_scale != 0.0f || last->moe_pre_norm)
        barrier(c->pool, ith); /* the head reads rows of every thread */
    if (b->capture && b->capture[g->n_layer])
        memcpy(b->capture[g->n_layer] + r0 * E, c->x + r0 * E, (size_t)((r1 - r0) * E) * 4);
    if (b->hidden_final)
        for (int64_t r = r0; r < r1; r++) c->kern->rms_norm(c->x + r * E, g->output_norm, E, g->rms_eps, b->hidden_final + r * E);
    if (b->n_out == 0) return;
    /* The logits rows, compacted: row i of this matmul is batch row out_rows[i]. */
    int64_t o0, o1;
    split(b->n_out, ith, nth, &o0, &o1);
    for (int64_t i = o0; i < o1; i++) c->kern->rms_norm(c->x + b->out_rows[i] * E, g->output_norm, E, g->rms_eps, c->h + i * E);
    part head = {&g->output, b->logits, g->output.n_rows, 0}; /* n_vocab columns, or a draft vocabulary's */
    if (any_quant(&head, 1)) quantize(c, c->h, E, E, o0, o1);
    barrier(c->pool, ith);
    gemm_parts(c, &head, 1, c->h, E, b->n_out, ith, nth);
    phase(ith, PH_HEAD, &t);
}

/* ---- the sliding blocks' rings of a sequence (sk_swa.h); -2 for a context without them or a bad slot --- */

/* c->swa_heads filled with the slot's rings, in sk_swa.h's order; their count. */
static int swa_heads(sk_ctx *c, int slot) {
    int n = 0;
    for (int l = 0; l < c->cfg.n_layer; l++)
        for (int h = 0; c->layers[l].sliding && !c->layers[l].kv_shared && h < nkv_of(&c->cfg, &c->layers[l]); h++) {
            c->swa_heads[n++] = kcache(c, slot, l, h);
            c->swa_heads[n++] = vcache(c, slot, l, h);
        }
    return n;
}

static int has_rings(const sk_ctx *c, int slot) { return c->swa && slot >= 0 && slot < c->cfg.n_seq_max && c->kv[slot]; }

/* Gemma 4's assistant (sk_assistant.c) reads the target's tables and caches through these two. */
int sk_assistant_target(const sk_ctx *c, sk_target_view *out) {
    const sk_config *g = &c->cfg;
    if (!g->rope_inv_freq || g->in_proj.data || g->wide_input || g->ctx_proj.data) return -1;
    *out = (sk_target_view){c->kern, c->pool, &g->token_embd, g->n_embd, g->n_vocab, g->n_seq_max, g->swa_window,
                            g->rope_neox, g->n_rot, n_rot_swa(g), g->rope_inv_freq,
                            g->rope_inv_freq_swa ? g->rope_inv_freq_swa : g->rope_inv_freq, g->rope_mscale};
    return 0;
}

int sk_assistant_kv(const sk_ctx *c, int slot, int layer, int64_t lo, int64_t hi, sk_kv_view *out) {
    if (slot < 0 || slot >= c->cfg.n_seq_max || !c->kv[slot] || layer < 0 || layer >= c->cfg.n_layer ||
        c->kv_layer[layer] < 0 || c->layers[layer].kv_shared)
        return -1;
    const sk_layer *L = &c->layers[layer];
    if (lo < 0 || hi <= lo || hi > c->n_ctx_pad || hi - lo > c->kv_rows[layer] ||
        (L->sliding && sk_swa_floor_of(c->swa, slot) > lo))
        return -2;
    const int hd = hd_of(&c->cfg, L), nkv = nkv_of(&c->cfg, L);
    uint16_t *k = kcache((sk_ctx *)c, slot, layer, 0);
    *out = (sk_kv_view){k, k + (int64_t)nkv * c->kv_rows[layer] * hd, c->kv_rows[layer] * hd, c->kv_rows[layer], hd, nkv};
    return 0;
}

SK_API int64_t sk_swa_floor(const sk_ctx *c, int slot) { return has_rings(c, slot) ? sk_swa_floor_of(c->swa, slot) : -2; }

SK_API void sk_swa_truncate(sk_ctx *c, int slot, int64_t n) {
    if (has_rings(c, slot)) sk_swa_cut(c->swa, slot, n);
}

SK_API int sk_swa_snapshot(sk_ctx *c, int slot, int64_t n) {
    return has_rings(c, slot) ? sk_swa_keep(c->swa, slot, n) : -2;
}

SK_API int64_t sk_swa_snapshot_at(const sk_ctx *c, int slot, int64_t n) {
    return has_rings(c, slot) ? sk_swa_kept_below(c->swa, slot, n) : -2;
}

SK_API int sk_swa_restore(sk_ctx *c, int slot, int64_t n) {
    return has_rings(c, slot) ? sk_swa_bring_back(c->swa, slot, n, c->swa_heads, swa_heads(c, slot), c->swa_hd) : -2;
}

/* 0 on success, -1 when scratch memory cannot be had, -2 for a bad batch (checked again here so a
 * caller's mistake cannot write out of bounds). */
SK_API int sk_forward(sk_ctx *c, const sk_batch *b) {
    const sk_config *g = &c->cfg;
    if (c->head_later || b->n_rows < 1 || b->n_out < 0 || b->n_out > b->n_rows ||
        ((g->in_proj.data || g->wide_input) && !b->hidden_in))
        return -2;
    for (int64_t r = 0; r < b->n_rows; r++) {
        if (b->tokens[r] < 0 || b->tokens[r] >= g->n_vocab || b->pos[r] < 0 || b->pos[r] >= g->n_ctx ||
            b->seq[r] < 0 || b->seq[r] >= g->n_seq_max || !c->kv[b->seq[r]])
            return -2;
    }
    for (int64_t i = 0; i < b->n_out; i++)
        if (b->out_rows[i] < 0 || b->out_rows[i] >= b->n_rows) return -2;
    for (int64_t r = 0; b->key_end && r < b->n_rows; r++) /* a row sees at least itself, never past n_ctx */
        if (b->key_end[r] <= b->pos[r] || b->key_end[r] > g->n_ctx) return -2;
    if (c->swa && (b->key_end || !sk_swa_rows_fit(c->swa, b->n_rows, b->pos, b->seq))) return -2;
    if (ensure_scratch(c, b->n_rows) != 0 || plan_attention(c, b) != 0 ||
        sk_moe_reserve(&c->moe_scratch, c->moe, g->n_layer, g->n_embd, b->n_rows) != 0)
        return -1;
    for (int64_t r0 = 0, r1; c->swa && r0 < b->n_rows; r0 = r1) { /* kept windows these rows overwrite: copied out first */
        for (r1 = r0 + 1; r1 < b->n_rows && b->seq[r1] == b->seq[r0]; r1++) {}
        const int slot = b->seq[r0];
        if (sk_swa_hold(c->swa, slot, b->pos[r1 - 1], c->swa_heads, swa_heads(c, slot), c->swa_hd) != 0) return -1;
    }
    if (c->dn) { /* rows continue their sequences' recurrent states: checked, and those states found */
        if (b->key_end) return -2;
        int rc = sk_dn_plan(c->dn, b->n_rows, b->pos, b->seq);
        if (rc != 0) return rc;
    }
    if (profiling < 0) {
        const char *env = getenv("SPEKULA_NATIVE_PROFILE");
        profiling = env && env[0] == '1';
    }
    job j = {c, b};
    sk_pool_run(c->pool, forward_job, &j);
    if (c->dn) sk_dn_commit(c->dn);
    if (c->swa) sk_swa_rows_written(c->swa, b->n_rows, b->pos, b->seq);
    return 0;
}

/* ---- the recurrent state of hybrid models (sk_deltanet.h); -2 for a context without one or a bad slot --- */

static int has_state(const sk_ctx *c, int slot) {
    return c->dn && slot >= 0 && slot < c->cfg.n_seq_max && sk_dn_has_state(c->dn, slot);
}

SK_API int sk_rs_checkpoint(sk_ctx *c, int slot) { return has_state(c, slot) ? sk_dn_checkpoint(c->dn, slot) : -2; }

SK_API int sk_rs_snapshot(sk_ctx *c, int slot) { return has_state(c, slot) ? sk_dn_snapshot(c->dn, c->kern, c->pool, slot) : -2; }

SK_API int64_t sk_rs_restorable(const sk_ctx *c, int slot, int64_t n) {
    return has_state(c, slot) ? sk_dn_restorable(c->dn, slot, n) : -2;
}

SK_API int sk_rs_truncate(sk_ctx *c, int slot, int64_t n) {
    return has_state(c, slot) ? sk_dn_truncate(c->dn, slot, n) : -2;
}

SK_API int64_t sk_rs_length(const sk_ctx *c, int slot) { return has_state(c, slot) ? sk_dn_length(c->dn, slot) : -2; }

/* ---- a sequence's state as a slot file carries it (backends/native/backend.py: export_seq / import_seq) ---- */

/* Rows [0, n) of a KV block as stored: whole groups of 16 keys (the key layout's), a ring whole once n passes it. */
static int64_t kv_rows_of(const sk_ctx *c, int layer, int64_t n) {
    const int64_t r = sk_round_up(n, 16);
    return r < c->kv_rows[layer] ? r : c->kv_rows[layer];
}

/* uint16 values sk_kv_copy moves for length n: every KV-owning block's keys then values, head by head. */
SK_API int64_t sk_kv_state_elems(const sk_ctx *c, int64_t n) {
    int64_t total = 0;
    for (int l = 0; l < c->cfg.n_layer; l++)
        if (c->kv_rows[l] > 0)
            total += 2 * (int64_t)nkv_of(&c->cfg, &c->layers[l]) * kv_rows_of(c, l, n) * hd_of(&c->cfg, &c->layers[l]);
    return total;
}

/* A slot's KV rows [0, n) into buf (to_buf) or from it: values moved, or -2 for a bad slot, n or size. */
SK_API int64_t sk_kv_copy(sk_ctx *c, int slot, int64_t n, uint16_t *buf, int64_t cap, int to_buf) {
    if (slot < 0 || slot >= c->cfg.n_seq_max || !c->kv[slot] || n < 0 || n > c->cfg.n_ctx ||
        cap != sk_kv_state_elems(c, n))
        return -2;
    int64_t o = 0;
    for (int l = 0; l < c->cfg.n_layer; l++) {
        if (c->kv_rows[l] <= 0) continue; /* a recurrent block, or one reading another block's KV */
        const int nkv = nkv_of(&c->cfg, &c->layers[l]);
        const int64_t rows = kv_rows_of(c, l, n), hd = hd_of(&c->cfg, &c->layers[l]);
        for (int h = 0; h < 2 * nkv; h++) { /* keys of every head, then values */
            uint16_t *at = c->kv[slot] + c->kv_off[l] + (int64_t)h * c->kv_rows[l] * hd;
            if (to_buf) memcpy(buf + o, at, sizeof(uint16_t) * (size_t)(rows * hd));
            else memcpy(at, buf + o, sizeof(uint16_t) * (size_t)(rows * hd));
            o += rows * hd;
        }
    }
    return o;
}

SK_API int64_t sk_rs_state_floats(const sk_ctx *c) { return c->dn ? sk_dn_state_floats(c->dn) : 0; }

SK_API int64_t sk_rs_export(sk_ctx *c, int slot, float *out, int64_t cap) {
    return has_state(c, slot) ? sk_dn_export(c->dn, c->kern, c->pool, slot, out, cap) : -2;
}

SK_API int sk_rs_import(sk_ctx *c, int slot, const float *in, int64_t n_floats, int64_t n) {
    return has_state(c, slot) ? sk_dn_import(c->dn, slot, in, n_floats, n) : -2;
}

SK_API void sk_swa_reset_slot(sk_ctx *c, int slot, int64_t floor) {
    if (c->swa && slot >= 0 && slot < c->cfg.n_seq_max && c->kv[slot]) sk_swa_reset(c->swa, slot, floor);
}

/* Block `layer`'s live state of a slot ([S | conv rows]) into out[cap], for tests: floats written or -1. */
SK_API int64_t sk_rs_read(sk_ctx *c, int slot, int layer, float *out, int64_t cap) {
    return has_state(c, slot) ? sk_dn_read_state(c->dn, c->kern, c->pool, slot, layer, out, cap) : -1;
}

typedef struct {
    sk_ctx *c;
    const float *x;
    int64_t m;
    float *out;
} project_job;

static void project_in_job(void *arg, int ith, int nth) {
    project_job *j = arg;
    sk_ctx *c = j->c;
    const sk_tensor *w = &c->cfg.in_proj;
    int64_t r0, r1;
    split(j->m, ith, nth, &r0, &r1);
    part p = {w, j->out, w->n_rows, 0};
    if (sk_is_quant(w->type)) quantize(c, j->x, w->n_cols, w->n_cols, r0, r1);
    barrier(c->pool, ith);
    gemm_parts(c, &p, 1, j->x, w->n_cols, j->m, ith, nth);
}

/* out[m, n_embd] = in_proj . x[m, in_proj.n_cols] for a context with a wide input and an encoder, on the
 * context's threads and kernels: 0, -1 out of memory, -2 no encoder or no rows. */
SK_API int sk_project_in(sk_ctx *c, const float *x, int64_t m, float *out) {
    if (!c->cfg.wide_input || !c->cfg.in_proj.data || m < 1) return -2;
    if (ensure_scratch(c, m) != 0) return -1;
    project_job j = {c, x, m, out};
    sk_pool_run(c->pool, project_in_job, &j);
    return 0;
}

typedef struct {
    sk_ctx *c;
    const float *features;
    const sk_batch *b; /* the rows' positions and sequence */
} inject_job;

/* ctx_norm(ctx_proj . features) per row, then for every block its k and v projections of that, keys
 * normed and roped, into the cache: the rows' queries, attention and FFN are never computed. */
static void inject_kv_job(void *arg, int ith, int nth) {
    inject_job *j = arg;
    sk_ctx *c = j->c;
    const sk_batch *b = j->b;
    const sk_config *g = &c->cfg;
    const int64_t m = b->n_rows, E = g->n_embd;
    const int64_t kvd = (int64_t)g->n_head_kv * g->head_dim, qkvd = c->qkvd, k_in = g->ctx_proj.n_cols;
    int64_t r0, r1;
    split(m, ith, nth, &r0, &r1);
    part enc = {&g->ctx_proj, c->x, E, 0};
    if (any_quant(&enc, 1)) quantize(c, j->features, k_in, k_in, r0, r1);
    barrier(c->pool, ith);
    gemm_parts(c, &enc, 1, j->features, k_in, m, ith, nth);
    barrier(c->pool, ith);
    for (int64_t r = r0; r < r1; r++) {
        c->kern->rms_norm(c->x + r * E, g->ctx_norm, E, g->rms_eps, c->h + r * E);
        rope_angles(c, b->pos[r], r);
    }
    int quant = 0; /* every block reads the same rows: quantized once */
    for (int l = 0; l < g->n_layer; l++)
        quant |= sk_is_quant(g->layers[l].wk.type) || sk_is_quant(g->layers[l].wv.type);
    if (quant) quantize(c, c->h, E, E, r0, r1);
    barrier(c->pool, ith);
    for (int l = 0; l < g->n_layer; l++) {
        const sk_layer *L = &c->layers[l];
        const int64_t qw = q_width(g, L);
        part kv[2] = {{&L->wk, c->qkv + qw, qkvd, 0}, {&L->wv, c->qkv + qw + kvd, qkvd, 0}};
        gemm_parts(c, kv, 2, c->h, E, m, ith, nth);
        barrier(c->pool, ith);
        qkv_post(c, b, l, g->n_head, r0, r1);
        barrier(c->pool, ith); /* the next block's products overwrite qkv */
    }
}

/* Context rows for one sequence: features [m, ctx_proj.n_cols] at positions start .. start + m - 1 become
 * every block's keys and values there. 0, -1 out of memory, -2 no context encoder or a bad range. */
SK_API int sk_inject_kv(sk_ctx *c, const float *features, int64_t m, int slot, int32_t start) {
    const sk_config *g = &c->cfg;
    if (!g->ctx_proj.data || c->swa_ring || m < 1 || slot < 0 || slot >= g->n_seq_max || !c->kv[slot] || start < 0 ||
        (int64_t)start + m > g->n_ctx)
        return -2;
    int32_t *pos = malloc(sizeof(int32_t) * (size_t)m), *seq = malloc(sizeof(int32_t) * (size_t)m);
    if (!pos || !seq || ensure_scratch(c, m) != 0) { free(pos); free(seq); return -1; }
    for (int64_t r = 0; r < m; r++) {
        pos[r] = start + (int32_t)r;
        seq[r] = slot;
    }
    sk_batch b = {.n_rows = m, .pos = pos, .seq = seq};
    inject_job j = {c, features, &b};
    sk_pool_run(c->pool, inject_kv_job, &j);
    free(pos);
    free(seq);
    return 0;
}

/* ---- single-kernel entry points for tests ----------------------------------------------------- */

SK_API void sk_test_quantize(const float *x, int64_t m, int64_t k, int8_t *q, float *d, float *s, int32_t *qs16,
                             int kernel_cap) {
    sk_act a = {q, d, s, qs16, sk_round_up(k, 64), m};
    pick_kernels(kernel_cap)->quantize_rows(x, k, m, k, &a, 0);
}

/* out[m, w->n_rows] = x[m, n_cols] times w transposed, through the path the model would use. */
/* out[m, w->n_rows] = x[m, n_cols] times w transposed, through the path the model would use, `reps`
 * times (one thread); *seconds gets the time of one quantize + matmul, packing excluded. */
SK_API int sk_test_gemm(const sk_tensor *w_in, const float *x, int64_t m, float *out, int kernel_cap, int reps,
                        double *seconds) {
    const sk_kernels *base = pick_kernels(kernel_cap);
    sk_tensor packed = *w_in;
    const sk_tensor *w = w_in;
    uint8_t *buf = NULL;
    int64_t row_bytes = 0, size = base->packed_size ? base->packed_size(w_in, &row_bytes) : 0;
    if (size > 0) {
        buf = xalloc((size_t)size);
        if (!buf) return -2;
        base->pack(w_in, 0, (w_in->n_rows + base->column_unit - 1) / base->column_unit, buf);
        packed.data = buf;
        packed.row_bytes = row_bytes;
        packed.layout = 1;
        w = &packed;
    }
    const sk_kernels *k = base->supports(w) ? base : &sk_generic_kernels;
    if (!k->supports(w)) { free(buf); return -1; }
    int64_t kp = sk_round_up(w->n_cols, 64);
    sk_act a = {xalloc((size_t)(m * kp)), xalloc((size_t)(m * kp / 8)),
                xalloc((size_t)(m * kp / 8)), xalloc((size_t)(m * kp / 4)), kp, m};
    int rc = 0;
    if (!a.q || !a.d || !a.s || !a.qs16) {
        rc = -2;
    } else {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        for (int i = 0; i < (reps > 0 ? reps : 1); i++) {
            if (sk_is_quant(w->type)) {
                base->quantize_rows(x, w->n_cols, m, w->n_cols, &a, 0);
                k->gemm_q(w, 0, w->n_rows, &a, m, out, w->n_rows, 0);
            } else {
                k->gemm_f(w, 0, w->n_rows, x, w->n_cols, m, out, w->n_rows, 0);
            }
        }
        clock_gettime(CLOCK_MONOTONIC, &t1);
        if (seconds) *seconds = ((double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec)) / (reps > 0 ? reps : 1);
    }
    free(a.q); free(a.d); free(a.s); free(a.qs16); free(buf);
    return rc;
}

SK_API void sk_test_dequant(const sk_tensor *w, int64_t row, float *out) { sk_dequant_row(w, row, out); }

/* w in the SIMD kernels' packed layout (sk_pack.h) into dst when it is not NULL, by the path loading
 * uses or (by_value) every value one by one; returns the layout's bytes (0: w has none). */
SK_API int64_t sk_test_pack(const sk_tensor *w, int by_value, uint8_t *dst) {
    const int64_t groups = (w->n_rows + SK_GROUP - 1) / SK_GROUP, bytes = groups * sk_packed_group_bytes(w);
    if (bytes > 0 && dst) (by_value ? sk_pack_groups_by_value : sk_pack_groups)(w, 0, groups, dst);
    return bytes;
}

/* One row's attention (keys in the cache layout) through the model's chunking and merge, `reps`
 * times; *seconds gets the time of one. */
SK_API int sk_test_attend(const float *q, int n_q, const uint16_t *k, const uint16_t *v, int64_t n_keys, int head_dim,
                          float scale, float *out, int kernel_cap, int reps, double *seconds) {
    sk_ctx c;
    memset(&c, 0, sizeof c);
    c.cfg.n_head = n_q;
    c.cfg.n_head_kv = 1;
    c.cfg.head_dim = head_dim;
    c.cfg.attn_scale = scale;
    c.kern = pick_kernels(kernel_cap);
    int32_t pos = (int32_t)(n_keys - 1), zero = 0;
    sk_batch b = {.n_rows = 1, .pos = &pos, .seq = &zero};
    float *scratch = xalloc((size_t)n_q * SK_ATTN_CHUNK * 4);
    int rc = scratch && plan_attention(&c, &b) == 0 ? 0 : -1;
    c.att_scratch = &scratch;
    c.att = out;
    double t0 = now_s();
    for (int i = 0; rc == 0 && i < (reps > 0 ? reps : 1); i++) {
        const int64_t nc = n_chunks(n_keys);
        for (int64_t ch = 0; ch < nc; ch++) {
            int64_t t1 = (ch + 1) * SK_ATTN_CHUNK < n_keys ? (ch + 1) * SK_ATTN_CHUNK : n_keys;
            c.kern->attend_part(q, n_q, head_dim, k, v, ch * SK_ATTN_CHUNK, t1, head_dim, scale,
                                c.att_parts + ch * n_q * (head_dim + 2), head_dim + 2, scratch);
        }
        attention_merge(&c, &b, NULL, 0, 0, 1);
    }
    if (seconds) *seconds = (now_s() - t0) / (reps > 0 ? reps : 1);
    free(scratch);
    free(c.att_prefix);
    free(c.att_wave_at);
    free(c.att_parts);
    free(c.att_order);
    return rc;
}
