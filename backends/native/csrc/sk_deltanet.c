/* Gated delta-net blocks: the context and the forward (see sk_deltanet.h); the recurrent-state contract
 * is in sk_dn_state.c. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "sk_dn_internal.h"

static inline float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

/* ---- context and state ------------------------------------------------------------------------ */

static int same_shape(const sk_dn *a, const sk_dn *b) {
    return a->n_k_heads == b->n_k_heads && a->n_v_heads == b->n_v_heads && a->head_k_dim == b->head_k_dim &&
           a->head_v_dim == b->head_v_dim && a->conv_kernel == b->conv_kernel;
}

static int block_fits(const sk_dn *b) {
    const int64_t kd = (int64_t)b->n_k_heads * b->head_k_dim, vd = (int64_t)b->n_v_heads * b->head_v_dim;
    const int64_t cd = 2 * kd + vd, E = b->qkv.n_cols;
    return b->n_k_heads > 0 && b->n_v_heads % b->n_k_heads == 0 && b->head_k_dim > 0 && b->head_v_dim > 0 &&
           b->conv_kernel >= 2 && b->qkv.n_rows == cd && b->z.data && b->z.n_rows == vd && b->z.n_cols == E &&
           b->beta.data && b->beta.n_rows == b->n_v_heads && b->beta.n_cols == E && b->alpha.data &&
           b->alpha.n_rows == b->n_v_heads && b->alpha.n_cols == E && b->out.data && b->out.n_rows == E &&
           b->out.n_cols == vd && b->conv_w && b->dt_bias && b->a && b->norm;
}

static void free_scratch(sk_dn_ctx *d) {
    free(d->qkv); free(d->z); free(d->ba); free(d->cv); free(d->o); free(d->run_of); free(d->runs);
    d->qkv = d->z = d->ba = d->cv = d->o = NULL;
    d->run_of = NULL;
    d->runs = NULL;
    d->cap_rows = d->cap_runs = 0;
}

void sk_dn_ctx_free(sk_dn_ctx *d) {
    if (!d) return;
    for (int s = 0; d->rs && s < d->n_seq_max; s++) sk_dn_state_free(d, s);
    free(d->rs); free(d->rec); free(d->rec_index); free(d->seen); free(d->pcv);
    free_scratch(d);
    free(d);
}

sk_dn_ctx *sk_dn_ctx_new(const sk_dn *const *blocks, int n_layer, int n_seq_max, float eps, int *err) {
    *err = 0;
    const sk_dn *first = NULL;
    int n_rec = 0;
    for (int l = 0; l < n_layer; l++) {
        if (!blocks[l]) continue;
        if (!block_fits(blocks[l]) || (first && !same_shape(first, blocks[l]))) { *err = -1; return NULL; }
        if (!first) first = blocks[l];
        n_rec++;
    }
    if (!first) return NULL;
    *err = -1;
    sk_dn_ctx *d = calloc(1, sizeof *d);
    if (!d) return NULL;
    d->n_layer = n_layer;
    d->n_rec = n_rec;
    d->n_seq_max = n_seq_max;
    d->n_k = first->n_k_heads;
    d->n_v = first->n_v_heads;
    d->hk = first->head_k_dim;
    d->hv = first->head_v_dim;
    d->K = first->conv_kernel;
    d->key_dim = (int64_t)d->n_k * d->hk;
    d->value_dim = (int64_t)d->n_v * d->hv;
    d->conv_dim = 2 * d->key_dim + d->value_dim;
    d->s_floats = d->value_dim * d->hk;
    d->conv_floats = (int64_t)(d->K - 1) * d->conv_dim;
    d->block_floats = d->s_floats + d->conv_floats;
    d->state_floats = d->block_floats * n_rec;
    d->log_floats = d->conv_dim + 2 * (int64_t)d->n_v;
    d->eps = eps;
    d->rec = malloc(sizeof(sk_dn *) * (size_t)n_rec);
    d->rec_index = malloc(sizeof(int) * (size_t)n_layer);
    d->rs = calloc((size_t)n_seq_max, sizeof(rs_state));
    d->seen = calloc((size_t)n_seq_max, sizeof(int32_t));
    if (!d->rec || !d->rec_index || !d->rs || !d->seen) { sk_dn_ctx_free(d); return NULL; }
    for (int l = 0, j = 0; l < n_layer; l++) {
        d->rec_index[l] = blocks[l] ? j : -1;
        if (blocks[l]) d->rec[j++] = blocks[l];
    }
    *err = 0;
    return d;
}

int sk_dn_state_alloc(sk_dn_ctx *d, int slot) {
    rs_state *st = &d->rs[slot];
    if (st->buf[0]) return 0;
    memset(st, 0, sizeof *st);
    /* calloc: the second buffer's pages become resident only once a checkpoint makes a forward write it. */
    st->buf[0] = calloc((size_t)d->state_floats, sizeof(float));
    st->buf[1] = calloc((size_t)d->state_floats, sizeof(float));
    if (!st->buf[0] || !st->buf[1]) { sk_dn_state_free(d, slot); return -1; }
    st->ckpt_len = -1;
    for (int i = 0; i < SK_DN_SNAPSHOTS; i++) st->snap_len[i] = -1;
    return 0;
}

void sk_dn_state_free(sk_dn_ctx *d, int slot) {
    rs_state *st = &d->rs[slot];
    free(st->buf[0]); free(st->buf[1]); free(st->log[0]); free(st->log[1]);
    for (int i = 0; i < SK_DN_SNAPSHOTS; i++) free(st->snap[i]);
    memset(st, 0, sizeof *st);
}

int sk_dn_has_state(const sk_dn_ctx *d, int slot) { return d->rs[slot].buf[0] != NULL; }

static int reserve(sk_dn_ctx *d, int64_t m, int64_t runs) {
    if (m > d->cap_rows) {
        free(d->qkv); free(d->z); free(d->ba); free(d->cv); free(d->o); free(d->run_of);
        d->qkv = malloc(sizeof(float) * (size_t)(m * d->conv_dim));
        d->cv = malloc(sizeof(float) * (size_t)(m * d->conv_dim));
        d->z = malloc(sizeof(float) * (size_t)(m * d->value_dim));
        d->o = malloc(sizeof(float) * (size_t)(m * d->value_dim));
        d->ba = malloc(sizeof(float) * (size_t)(m * 2 * d->n_v));
        d->run_of = malloc(sizeof(int32_t) * (size_t)m);
        d->cap_rows = m;
        if (!d->qkv || !d->cv || !d->z || !d->o || !d->ba || !d->run_of) { free_scratch(d); return -1; }
    }
    if (runs > d->cap_runs) {
        free(d->runs);
        d->runs = malloc(sizeof(dn_run) * (size_t)runs);
        d->cap_runs = d->runs ? runs : 0;
        if (!d->runs) return -1;
    }
    return 0;
}

int dn_reserve_pcv(sk_dn_ctx *d, int64_t n) {
    if (n <= d->cap_pcv) return 0;
    free(d->pcv);
    d->pcv = malloc(sizeof(float) * (size_t)n);
    d->cap_pcv = d->pcv ? n : 0;
    return d->pcv ? 0 : -1;
}

sk_dn_io sk_dn_buffers(const sk_dn_ctx *d) {
    return (sk_dn_io){d->qkv, d->z, d->ba, d->o, d->conv_dim, d->value_dim, 2 * (int64_t)d->n_v, d->value_dim};
}

/* ---- the forward ------------------------------------------------------------------------------ */

int sk_dn_plan(sk_dn_ctx *d, int64_t n_rows, const int32_t *pos, const int32_t *seq) {
    int64_t n_runs = 0;
    for (int64_t r = 0; r < n_rows; r++) n_runs += r == 0 || seq[r] != seq[r - 1];
    if (reserve(d, n_rows, n_runs) != 0) return -1;
    if (++d->stamp == 0) { memset(d->seen, 0, sizeof(int32_t) * (size_t)d->n_seq_max); d->stamp = 1; }
    /* Check everything first: a refused batch changes no state. */
    n_runs = 0;
    int64_t n_pend = 0;
    for (int64_t r = 0; r < n_rows; r++) {
        if (r > 0 && seq[r] == seq[r - 1]) {
            if (pos[r] != pos[r - 1] + 1) return -2;
            d->runs[n_runs - 1].r1 = r + 1;
        } else {
            const rs_state *st = &d->rs[seq[r]];
            if (!st->buf[0] || pos[r] != st->len || d->seen[seq[r]] == d->stamp) return -2;
            d->seen[seq[r]] = d->stamp;
            d->runs[n_runs++] = (dn_run){.slot = seq[r], .r0 = r, .r1 = r + 1, .n_pend = st->len - st->base,
                                         .pcv0 = n_pend};
            n_pend += st->len - st->base;
        }
        d->run_of[r] = (int32_t)(n_runs - 1);
    }
    if (dn_reserve_pcv(d, n_pend * d->conv_dim) != 0) return -1;
    d->n_runs = n_runs;
    d->n_pend = n_pend;
    const int64_t row_floats = d->n_rec * d->log_floats;
    for (int64_t i = 0; i < n_runs; i++) {
        dn_run *u = &d->runs[i];
        rs_state *st = &d->rs[u->slot];
        const int64_t start = pos[u->r0], end = pos[u->r1 - 1] + 1;
        /* A checkpoint taken while rows were pending moves to its length in this forward. */
        int moving = st->ckpt_len >= 0 && u->n_pend > 0 && st->ckpt_len == st->len;
        if (st->ckpt_len >= 0 && end - (moving ? st->ckpt_len : st->ckpt_base) > SK_DN_LOG_ROWS) {
            st->ckpt_len = -1; /* beyond what is logged */
            moving = 0;
        }
        u->plog = st->log[st->cur];
        u->src = st->buf[st->live];
        u->mid = NULL;
        u->dst_buf = st->live;
        u->log = NULL;
        if (moving) { /* the state after the pending rows becomes the checkpoint; the new rows start a log */
            u->mid_buf = 1 - st->live;
            u->mid = st->buf[u->mid_buf];
            u->log = st->log[1 - st->cur];
        } else if (st->ckpt_len >= 0) {
            if (st->live == st->ckpt_buf) u->dst_buf = 1 - st->live; /* keep the checkpoint's buffer */
            u->log = st->log[st->cur] + (start - st->ckpt_base) * row_floats;
        }
        u->dst = st->buf[u->dst_buf];
        for (int k = 0; k < SK_DN_SNAPSHOTS; k++) /* positions a snapshot covers are being rewritten */
            if (st->snap_len[k] > start) st->snap_len[k] = -1;
    }
    return 0;
}

void sk_dn_commit(sk_dn_ctx *d) {
    for (int64_t i = 0; i < d->n_runs; i++) {
        const dn_run *u = &d->runs[i];
        rs_state *st = &d->rs[u->slot];
        st->live = u->dst_buf;
        st->len += u->r1 - u->r0;
        st->base = st->len;
        if (u->mid) {
            st->ckpt_buf = u->mid_buf;
            st->ckpt_base = st->ckpt_len;
            st->cur = 1 - st->cur;
        }
    }
    d->n_runs = 0;
}

static inline const float *hist_row(const sk_dn_ctx *d, const dn_hist *h, int64_t idx) {
    if (idx < d->K - 1) return h->state + idx * d->conv_dim;
    idx -= d->K - 1;
    return idx < h->n_logged ? h->logged + idx * h->ld_logged : h->rows + (idx - h->n_logged) * h->ld_rows;
}

/* Conv output i: conv over inputs i .. i + K - 1 of the history, SiLU, q and k heads L2-normalised, q
 * scaled: out [conv_dim]. */
void dn_conv_row(const sk_dn_ctx *d, const sk_kernels *kern, const sk_dn *b, const dn_hist *h, int64_t i, float *out) {
    const float *x[d->K];
    for (int w = 0; w < d->K; w++) x[w] = hist_row(d, h, i + w);
    kern->dn_conv(x, b->conv_w, d->K, d->conv_dim, out);
    const float q_scale = 1.0f / sqrtf((float)d->hk);
    for (int k = 0; k < 2 * d->n_k; k++) /* q heads, then k heads */
        kern->dn_l2norm(out + (int64_t)k * d->hk, d->hk, d->eps, k < d->n_k ? q_scale : 1.0f);
}

/* beta and alpha of a row (in place): [beta logits | alpha] -> [beta | decay = exp(g)]. */
static void gates_row(const sk_dn_ctx *d, const sk_dn *b, float *ba) {
    for (int h = 0; h < d->n_v; h++) {
        const float x = ba[d->n_v + h] + b->dt_bias[h];
        const float softplus = x > 20.0f ? x : log1pf(expf(x));
        ba[h] = sigmoid(ba[h]);
        ba[d->n_v + h] = expf(softplus * b->a[h]);
    }
}

/* The delta rule of v head h over n rows (the kernel's dn_rule): the state [hv][hk] goes from src to dst;
 * cv rows are conv outputs, bg rows [beta | decay]; o (NULL: not wanted) gets S q per row. */
void dn_rule_head(const sk_dn_ctx *d, const sk_kernels *kern, int h, const float *src, float *dst, const float *cv,
                  int64_t ld_cv, const float *bg, int64_t ld_bg, int64_t n, float *o, int64_t ld_o) {
    const float *q = cv + (int64_t)(h % d->n_k) * d->hk;
    kern->dn_rule(src, dst, d->hk, d->hv, n, q, q + d->key_dim, ld_cv, cv + 2 * d->key_dim + (int64_t)h * d->hv, ld_cv,
                  bg + h, bg + d->n_v + h, ld_bg, o, ld_o);
}

/* The conv rows after the history's first n inputs past its state: inputs n .. n + K - 2. dst may be
 * the history's state: row i reads input n + i > i, never one this loop already wrote. */
void dn_conv_advance(const sk_dn_ctx *d, const dn_hist *h, int64_t n, float *dst) {
    for (int64_t i = 0; i < d->K - 1; i++) memcpy(dst + i * d->conv_dim, hist_row(d, h, n + i), sizeof(float) * (size_t)d->conv_dim);
}

static dn_hist run_hist(const sk_dn_ctx *d, const dn_run *u, int j) {
    return (dn_hist){u->src + (int64_t)j * d->block_floats + d->s_floats, u->plog + j * d->log_floats,
                     d->qkv + u->r0 * d->conv_dim, u->n_pend, d->n_rec * d->log_floats, d->conv_dim};
}

void sk_dn_conv(sk_dn_ctx *d, const sk_kernels *kern, int layer, int64_t r0, int64_t r1, int ith, int nth) {
    const int j = d->rec_index[layer];
    const sk_dn *b = d->rec[j];
    const int64_t cd = d->conv_dim, ldba = 2 * (int64_t)d->n_v, lf = d->log_floats;
    int64_t p0, p1;
    dn_split(d->n_pend, ith, nth, &p0, &p1);
    for (int64_t g = p0, i = 0; g < p1; g++) { /* pending rows, shared out like the batch's */
        while (g >= d->runs[i].pcv0 + d->runs[i].n_pend) i++;
        const dn_hist h = run_hist(d, &d->runs[i], j);
        dn_conv_row(d, kern, b, &h, g - d->runs[i].pcv0, d->pcv + g * cd);
    }
    for (int64_t r = r0; r < r1; r++) {
        const dn_run *u = &d->runs[d->run_of[r]];
        const int64_t i = r - u->r0;
        const dn_hist h = run_hist(d, u, j);
        dn_conv_row(d, kern, b, &h, u->n_pend + i, d->cv + r * cd);
        gates_row(d, b, d->ba + r * ldba);
        if (u->log) {
            float *lg = u->log + (i * d->n_rec + j) * lf;
            memcpy(lg, d->qkv + r * cd, sizeof(float) * (size_t)cd);
            memcpy(lg + cd, d->ba + r * ldba, sizeof(float) * (size_t)ldba);
        }
    }
}

void sk_dn_rule(sk_dn_ctx *d, const sk_kernels *kern, int layer, int ith, int nth) {
    const int j = d->rec_index[layer];
    const int64_t cd = d->conv_dim, vd = d->value_dim, ldba = 2 * (int64_t)d->n_v, ld_log = d->n_rec * d->log_floats;
    const int64_t s_off = (int64_t)j * d->block_floats, c_off = s_off + d->s_floats;
    int64_t i0, i1;
    dn_split(d->n_runs * d->n_v, ith, nth, &i0, &i1);
    for (int64_t it = i0; it < i1; it++) {
        const dn_run *u = &d->runs[it / d->n_v];
        const int h = (int)(it % d->n_v);
        const int64_t n = u->r1 - u->r0, hs = s_off + (int64_t)h * d->hv * d->hk;
        const float *s = u->src + hs;
        if (u->n_pend > 0) { /* the pending rows first, while this head's state is in cache */
            float *t = (u->mid ? u->mid : u->dst) + hs;
            dn_rule_head(d, kern, h, s, t, d->pcv + u->pcv0 * cd, cd, u->plog + j * d->log_floats + cd, ld_log,
                         u->n_pend, NULL, 0);
            s = t;
        }
        dn_rule_head(d, kern, h, s, u->dst + hs, d->cv + u->r0 * cd, cd, d->ba + u->r0 * ldba, ldba, n,
                     d->o + u->r0 * vd + (int64_t)h * d->hv, vd);
        if (h == 0) {
            const dn_hist hist = run_hist(d, u, j);
            if (u->mid) dn_conv_advance(d, &hist, u->n_pend, u->mid + c_off); /* before dst: it may be src */
            dn_conv_advance(d, &hist, u->n_pend + n, u->dst + c_off);
        }
    }
}

void sk_dn_gate_norm(sk_dn_ctx *d, const sk_kernels *kern, int layer, int ith, int nth) {
    const sk_dn *b = d->rec[d->rec_index[layer]];
    const int64_t vd = d->value_dim;
    int64_t i0, i1;
    dn_split(d->n_runs * d->n_v, ith, nth, &i0, &i1);
    for (int64_t it = i0; it < i1; it++) { /* the rule's items: these rows of o are this thread's own */
        const dn_run *u = &d->runs[it / d->n_v];
        const int64_t off = (it % d->n_v) * d->hv;
        for (int64_t r = u->r0; r < u->r1; r++) { /* RMS norm of the head's output times silu(z) */
            float *y = d->o + r * vd + off;
            kern->rms_norm(y, b->norm, d->hv, d->eps, y);
            kern->silu_mul(d->z + r * vd + off, y, d->hv, y);
        }
    }
}
