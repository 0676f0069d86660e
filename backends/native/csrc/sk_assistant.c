/* Gemma 4's assistant drafter over a native target's cache (sk_assistant.h describes the step). */
#define _GNU_SOURCE
#include "sk_assistant.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "sk_oai.h"
#include "sk_rope.h"
#include "sk_swa.h"

struct sk_asst {
    sk_assistant a;
    sk_asst_block *blocks; /* its own copy, weights in the target's kernel layout where it has one */
    sk_target_view t;
    sk_ctx *target;
    int max_hd;
    int64_t wide;           /* the widest matmul input */
    uint8_t **packed;       /* the packed copies this runtime owns */
    int n_packed;
    float *in, *x, *h, *q, *att, *gu, *parts, *scratch, *cs;
    int64_t parts_cap;
    sk_act act;
};

static void *xalloc(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

/* A quantized weight copied into the kernel table's layout when the table has one (the forward's own
 * packing, sk_ctx.c's pack_tensor, reads the same two table entries); 0, or -1 out of memory. */
static int pack(sk_asst *s, sk_tensor *w) {
    const sk_kernels *k = s->t.kern;
    if (!w->data || w->layout != 0 || !k->packed_size || !sk_is_quant(w->type)) return 0;
    int64_t rb = 0, size = k->packed_size(w, &rb);
    if (size <= 0) return 0;
    uint8_t *dst = xalloc((size_t)size);
    if (!dst) return -1;
    s->packed[s->n_packed++] = dst;
    k->pack(w, 0, (w->n_rows + k->column_unit - 1) / k->column_unit, dst);
    w->data = dst;
    w->row_bytes = rb;
    w->layout = 1;
    return 0;
}

SK_API void sk_asst_free(sk_asst *s) {
    if (!s) return;
    for (int i = 0; i < s->n_packed; i++) free(s->packed[i]);
    free(s->packed);
    free(s->blocks);
    free(s->in); free(s->x); free(s->h); free(s->q); free(s->att); free(s->gu); free(s->parts); free(s->scratch);
    free(s->cs);
    free(s->act.q); free(s->act.d); free(s->act.s); free(s->act.qs16);
    free(s);
}

static int64_t max_of(int64_t a, int64_t b) { return a > b ? a : b; }

SK_API sk_asst *sk_asst_new(const sk_assistant *a, sk_ctx *target) {
    sk_asst *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->a = *a;
    s->target = target;
    const int64_t E = a->n_embd;
    if (sk_assistant_target(target, &s->t) != 0 || a->n_layer < 1 || a->n_head < 1 ||
        a->pre_proj.n_rows != E || a->pre_proj.n_cols != 2 * (int64_t)s->t.n_embd || a->post_proj.n_cols != E ||
        a->post_proj.n_rows != s->t.n_embd || a->embd.n_cols != E || a->embd.n_rows != s->t.n_vocab) {
        free(s);
        return NULL;
    }
    s->blocks = malloc(sizeof(sk_asst_block) * (size_t)a->n_layer);
    s->packed = calloc((size_t)(5 * a->n_layer + 3), sizeof(uint8_t *));
    if (!s->blocks || !s->packed) { sk_asst_free(s); return NULL; }
    memcpy(s->blocks, a->blocks, sizeof(sk_asst_block) * (size_t)a->n_layer);
    s->a.blocks = s->blocks;
    int64_t ff = 0;
    for (int l = 0; l < a->n_layer; l++) {
        sk_asst_block *b = &s->blocks[l];
        const int64_t qd = b->wq.n_rows, hd = qd / a->n_head;
        if (qd % a->n_head || b->wq.n_cols != E || b->wo.n_cols != qd || b->wo.n_rows != E || b->w_gate.n_cols != E ||
            b->w_up.n_rows != b->w_gate.n_rows || b->w_down.n_cols != b->w_gate.n_rows || b->w_down.n_rows != E) {
            sk_asst_free(s);
            return NULL;
        }
        if (hd > s->max_hd) s->max_hd = (int)hd;
        ff = max_of(ff, b->w_gate.n_rows);
        if (pack(s, &b->wq) || pack(s, &b->wo) || pack(s, &b->w_gate) || pack(s, &b->w_up) || pack(s, &b->w_down)) {
            sk_asst_free(s);
            return NULL;
        }
    }
    if (pack(s, &s->a.pre_proj) || pack(s, &s->a.post_proj) || pack(s, &s->a.embd)) { sk_asst_free(s); return NULL; }
    const int64_t qd = (int64_t)a->n_head * s->max_hd;
    s->wide = max_of(max_of(2 * (int64_t)s->t.n_embd, qd), max_of(ff, E));
    const int64_t kp = sk_round_up(s->wide, 64);
    s->in = malloc((size_t)(2 * s->t.n_embd) * 4);
    s->x = malloc((size_t)E * 4);
    s->h = malloc((size_t)s->wide * 4);
    s->q = malloc((size_t)qd * 4);
    s->att = malloc((size_t)qd * 4);
    s->gu = malloc((size_t)(2 * max_of(ff, E)) * 4);
    s->scratch = xalloc((size_t)a->n_head * SK_ATTN_CHUNK * 4);
    s->cs = malloc((size_t)max_of(s->t.n_rot, s->t.n_rot_swa) * 4);
    s->act.q = xalloc((size_t)kp);
    s->act.d = xalloc((size_t)kp / 8);
    s->act.s = xalloc((size_t)kp / 8);
    s->act.qs16 = xalloc((size_t)kp / 4);
    if (!s->in || !s->x || !s->h || !s->q || !s->att || !s->gu || !s->scratch || !s->cs || !s->act.q || !s->act.d ||
        !s->act.s || !s->act.qs16) {
        sk_asst_free(s);
        return NULL;
    }
    return s;
}

/* One matmul of the step, out[n] = w row n . x: x quantized by thread 0 when w needs int8 activations, then
 * every thread's share of whole column units (the forward's split). Every thread calls it. */
typedef struct {
    sk_asst *s;
    int64_t n_rows;
    const int32_t *tokens, *pos, *slots;
    const float *hidden;
    float *logits, *hidden_out;
    int rc;
} step_job;

static void matmul(sk_asst *s, const sk_tensor *w, const float *x, float *out, int ith, int nth) {
    const sk_kernels *k = s->t.kern->supports(w) ? s->t.kern : &sk_generic_kernels;
    if (ith == 0 && sk_is_quant(w->type)) {
        s->act.kp = sk_round_up(w->n_cols, 64);
        s->t.kern->quantize_rows(x, w->n_cols, 1, w->n_cols, &s->act, 0);
    }
    sk_pool_barrier(s->t.pool);
    const int64_t unit = s->t.kern->column_unit, units = (w->n_rows + unit - 1) / unit;
    const int64_t u0 = units * ith / nth, u1 = units * (ith + 1) / nth;
    const int64_t n0 = u0 * unit, n1 = u1 * unit < w->n_rows ? u1 * unit : w->n_rows;
    if (n1 > n0) {
        if (sk_is_quant(w->type)) k->gemm_q(w, n0, n1, &s->act, 1, out, w->n_rows, 0);
        else k->gemm_f(w, n0, n1, x, w->n_cols, 1, out, w->n_rows, 0);
    }
    sk_pool_barrier(s->t.pool);
}

static void rope_head(float *v, const float *cs, int n_rot, int neox) {
    const int half = n_rot / 2;
    for (int i = 0; i < half; i++) {
        const int i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
        const float x0 = v[i0], x1 = v[i1], co = cs[i], si = cs[half + i];
        v[i0] = x0 * co - x1 * si;
        v[i1] = x0 * si + x1 * co;
    }
}

/* The target's [cos | sin] of position p for a block kind, as its forward computes them for its keys. */
static void rope_table(const sk_target_view *t, int sliding, int64_t p, float *cs) {
    const double *inv = sliding ? t->rope_inv_freq_swa : t->rope_inv_freq;
    const int n_rot = sliding ? t->n_rot_swa : t->n_rot;
    const double ms = sk_rope_mscale(t->rope_mscale);
    for (int i = 0; i < n_rot / 2; i++) {
        const double th = (double)p * inv[i];
        cs[i] = (float)(cos(th) * ms);
        cs[n_rot / 2 + i] = (float)(sin(th) * ms);
    }
}

/* Attention of the step's query heads (in s->q) over keys [lo, hi) of one cache: per kv head, its query
 * group over the span's pieces (sk_swa.h: cut by position alone), merged in key order into s->att. */
static int attend(sk_asst *s, const sk_kv_view *kv, int hd, int64_t lo, int64_t hi) {
    const int nh = s->a.n_head, gq = nh / kv->n_head_kv;
    const int64_t nc = sk_span_pieces(lo, hi), ldpart = hd + 2, need = nc * gq * ldpart;
    if (need > s->parts_cap) {
        free(s->parts);
        s->parts = xalloc((size_t)need * 4);
        s->parts_cap = s->parts ? need : 0;
        if (!s->parts) return -1;
    }
    for (int kvh = 0; kvh < kv->n_head_kv; kvh++) {
        const uint16_t *k = kv->k + kvh * kv->head_stride, *v = kv->v + kvh * kv->head_stride;
        for (int64_t c = 0; c < nc; c++) {
            int64_t t0, t1;
            sk_span_piece(lo, hi, c, &t0, &t1);
            const int64_t base = t0 - t0 % kv->ring; /* a piece never crosses a multiple of the ring's rows */
            const sk_kernels *kn = t0 % SK_KEY_BLOCK ? &sk_generic_kernels : s->t.kern;
            kn->attend_part(s->q + (int64_t)kvh * gq * hd, gq, hd, k, v, t0 - base, t1 - base, hd, 1.0f,
                            s->parts + c * gq * ldpart, ldpart, s->scratch);
        }
        for (int j = 0; j < gq; j++) {
            const float *p0 = s->parts + j * ldpart;
            float *out = s->att + (int64_t)(kvh * gq + j) * hd;
            if (nc == 1) {
                const float inv = 1.0f / p0[1];
                for (int d = 0; d < hd; d++) out[d] = p0[2 + d] * inv;
            } else {
                sk_oai_sink_merge(p0, nc, gq * ldpart, hd, -INFINITY, out);
            }
        }
    }
    return 0;
}

static void add_normed(const sk_asst *s, float *x, float *h, const float *w) {
    s->t.kern->rms_norm(h, w, s->a.n_embd, s->a.rms_eps, h);
    for (int64_t i = 0; i < s->a.n_embd; i++) x[i] += h[i];
}

/* Block l of row r on every thread; thread 0 runs the scalar steps between the matmuls' barriers. */
static int block(sk_asst *s, const sk_asst_block *b, const step_job *j, int64_t r, int ith, int nth) {
    const sk_kernels *kern = s->t.kern;
    const int64_t E = s->a.n_embd, p = j->pos[r];
    const int nh = s->a.n_head, hd = (int)(b->wq.n_rows / nh);
    int rc = 0;
    if (ith == 0) kern->rms_norm(s->x, b->attn_norm, E, s->a.rms_eps, s->h);
    matmul(s, &b->wq, s->h, s->q, ith, nth);
    if (ith == 0) {
        sk_kv_view kv;
        const int64_t lo = b->sliding && p - s->t.swa_window + 1 > 0 ? p - s->t.swa_window + 1 : 0;
        rc = sk_assistant_kv(s->target, j->slots[r], b->kv_layer, lo, p, &kv);
        if (rc == 0 && (kv.head_dim != hd || nh % kv.n_head_kv)) rc = -2;
        if (rc == 0) {
            const int n_rot = b->sliding ? s->t.n_rot_swa : s->t.n_rot;
            rope_table(&s->t, b->sliding, p, s->cs);
            for (int h = 0; h < nh; h++) {
                float *qh = s->q + (int64_t)h * hd;
                kern->rms_norm(qh, b->q_norm, hd, s->a.rms_eps, qh);
                rope_head(qh, s->cs, n_rot, s->t.rope_neox);
            }
            rc = attend(s, &kv, hd, lo, p);
        }
        if (rc != 0) memset(s->att, 0, (size_t)nh * hd * 4); /* the step fails; the matmuls still meet */
    }
    matmul(s, &b->wo, s->att, s->h, ith, nth);
    if (ith == 0) {
        add_normed(s, s->x, s->h, b->attn_post_norm);
        kern->rms_norm(s->x, b->ffn_norm, E, s->a.rms_eps, s->h);
    }
    const int64_t ff = b->w_gate.n_rows;
    matmul(s, &b->w_gate, s->h, s->gu, ith, nth);
    matmul(s, &b->w_up, s->h, s->gu + ff, ith, nth);
    if (ith == 0) sk_geglu(s->gu, s->gu + ff, ff, s->h);
    matmul(s, &b->w_down, s->h, s->gu, ith, nth);
    if (ith == 0) {
        add_normed(s, s->x, s->gu, b->ffn_post_norm);
        for (int64_t i = 0; i < E; i++) s->x[i] *= b->out_scale;
    }
    return rc;
}

static void step_job_run(void *arg, int ith, int nth) {
    step_job *j = arg;
    sk_asst *s = j->s;
    const int64_t E = s->a.n_embd, Et = s->t.n_embd;
    for (int64_t r = 0; r < j->n_rows; r++) {
        if (ith == 0) {
            sk_dequant_row(s->t.token_embd, j->tokens[r], s->in);
            for (int64_t i = 0; i < Et; i++) s->in[i] *= s->a.embd_scale;
            memcpy(s->in + Et, j->hidden + r * Et, (size_t)Et * 4);
        }
        matmul(s, &s->a.pre_proj, s->in, s->x, ith, nth);
        for (int l = 0; l < s->a.n_layer; l++) {
            const int rc = block(s, &s->blocks[l], j, r, ith, nth);
            if (ith == 0 && rc != 0 && j->rc == 0) j->rc = rc;
        }
        if (ith == 0) s->t.kern->rms_norm(s->x, s->a.output_norm, E, s->a.rms_eps, s->h);
        matmul(s, &s->a.embd, s->h, j->logits + r * s->a.embd.n_rows, ith, nth);
        matmul(s, &s->a.post_proj, s->h, j->hidden_out + r * Et, ith, nth);
    }
}

SK_API int sk_asst_step(sk_asst *s, int64_t n_rows, const int32_t *tokens, const int32_t *pos, const int32_t *slots,
                        const float *hidden, float *logits, float *hidden_out) {
    for (int64_t r = 0; r < n_rows; r++) {
        sk_kv_view kv;
        if (pos[r] < 1 || tokens[r] < 0 || tokens[r] >= s->t.n_vocab) return -2;
        for (int l = 0; l < s->a.n_layer; l++) { /* checked before the pool runs: no thread leaves early */
            const sk_asst_block *b = &s->blocks[l];
            const int64_t lo = b->sliding && pos[r] - s->t.swa_window + 1 > 0 ? pos[r] - s->t.swa_window + 1 : 0;
            if (sk_assistant_kv(s->target, slots[r], b->kv_layer, lo, pos[r], &kv) != 0) return -2;
        }
    }
    step_job j = {s, n_rows, tokens, pos, slots, hidden, logits, hidden_out, 0};
    sk_pool_run(s->t.pool, step_job_run, &j);
    return j.rc;
}
