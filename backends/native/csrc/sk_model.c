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
 *
 * One call runs every row of a batch (rows of several sequences, each at its own position) through
 * every block. All threads run `forward_job` and meet at barriers between phases: row-wise phases
 * (norms, quantization, rope) split rows, matmuls split output columns, attention splits
 * (row, kv head) pairs. Which thread computes an element never changes how it is computed (see
 * sk.h), so the result does not depend on the thread count either.
 *
 * The context around the forward (its life cycle, its plan, a sequence's state calls) and the encoders are
 * in the files sk_ctx.h lists. This file keeps every step the forward runs per row or per block, so that
 * they stay inlined into forward_job (the build has no link-time optimization): hence its ~530 lines.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "sk.h"
#include "sk_ctx.h"
#include "sk_deltanet.h"
#include "sk_gemma4.h"
#include "sk_moe.h"
#include "sk_oai.h"
#include "sk_pool.h"
#include "sk_rope.h"
#include "sk_step.h"
#include "sk_swa.h"

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

static const sk_kernels *kern_for(const sk_ctx *c, const sk_tensor *w) {
    return c->kern->supports(w) ? c->kern : &sk_generic_kernels;
}

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
static inline void attention_merge(sk_ctx *c, const sk_batch *b, const sk_layer *L, int64_t wave, int ith, int nth) {
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
    if (skc_ensure_scratch(c, b->n_rows) != 0 || skc_plan_attention(c, b) != 0 ||
        sk_moe_reserve(&c->moe_scratch, c->moe, g->n_layer, g->n_embd, b->n_rows) != 0)
        return -1;
    for (int64_t r0 = 0, r1; c->swa && r0 < b->n_rows; r0 = r1) { /* kept windows these rows overwrite: copied out first */
        for (r1 = r0 + 1; r1 < b->n_rows && b->seq[r1] == b->seq[r0]; r1++) {}
        const int slot = b->seq[r0];
        if (sk_swa_hold(c->swa, slot, b->pos[r1 - 1], c->swa_heads, skc_swa_heads(c, slot), c->swa_hd) != 0) return -1;
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

/* The steps sk_step.h lends the other files, as wrappers: the forward calls the static functions above, which
 * the compiler inlines and specializes within this file (there is no link-time optimization) as it did when
 * the encoders and tests lived here. attention_merge is marked inline so that its call in attention_block
 * stays inlined beside this second caller. */
SKC_HIDDEN void skc_barrier(sk_pool *pool, int ith) { barrier(pool, ith); }

SKC_HIDDEN void skc_gemm_parts(sk_ctx *c, const part *parts, int np, const float *x, int64_t ldx, int64_t m, int ith,
                               int nth) {
    gemm_parts(c, parts, np, x, ldx, m, ith, nth);
}

SKC_HIDDEN void skc_rope_angles(sk_ctx *c, int64_t p, int64_t r) { rope_angles(c, p, r); }

SKC_HIDDEN void skc_qkv_post(sk_ctx *c, const sk_batch *b, int layer, int first_head, int64_t r0, int64_t r1) {
    qkv_post(c, b, layer, first_head, r0, r1);
}

SKC_HIDDEN void skc_attention_merge_row(sk_ctx *c, const sk_batch *b) { attention_merge(c, b, NULL, 0, 0, 1); }
