/* Gated delta-net blocks and their sequences' recurrent state: see sk_deltanet.h. */
#include "sk_deltanet.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    float *buf[2];      /* the state, twice: the live one and the one a checkpoint keeps */
    int live, ckpt_buf; /* which buffer holds the state at len; which one the checkpoint's (at ckpt_len) */
    int64_t len, ckpt_len; /* ckpt_len -1: no checkpoint */
    float *log;            /* [SK_DN_LOG_ROWS][n_rec][log_floats]: rows after the checkpoint; NULL until one */
    float *snap[SK_DN_SNAPSHOTS];
    int64_t snap_len[SK_DN_SNAPSHOTS]; /* -1: none */
    int snap_oldest;
} rs_state;

typedef struct { /* rows [r0, r1) of a batch: one sequence's, continuing its state */
    int slot;
    int64_t r0, r1;
    const float *src; /* the state they start from */
    float *dst;       /* where their state goes (src, or the other buffer when src is a checkpoint's) */
    float *log;       /* log row of r0 (NULL: not logged) */
    int dst_buf;
} dn_run;

struct sk_dn_ctx {
    int n_layer, n_rec, n_seq_max, n_k, n_v, hk, hv, K;
    int64_t conv_dim, key_dim, value_dim, s_floats, conv_floats, block_floats, state_floats, log_floats;
    float eps;
    const sk_dn **rec;   /* [n_rec]: the recurrent blocks in order */
    int *rec_index;      /* [n_layer]: index among the recurrent blocks, -1 for attention blocks */
    rs_state *rs;        /* [n_seq_max]: buf[0] NULL while the slot has no state */
    int64_t cap_rows, cap_runs, n_runs;
    float *qkv, *z, *ba, *cv, *o; /* scratch of cap_rows rows: see sk_dn_io; cv holds the conv outputs */
    float *rcv;                   /* a replay's conv outputs, [n_rec][rows][conv_dim] */
    int64_t cap_rcv;              /* floats */
    int32_t *run_of;              /* [cap_rows] */
    dn_run *runs;                 /* [cap_runs] */
    int32_t *seen;                /* [n_seq_max]: plan's check that a sequence has one run */
    int32_t stamp;
};

static void split(int64_t n, int ith, int nth, int64_t *a, int64_t *b) {
    *a = n * ith / nth;
    *b = n * (ith + 1) / nth;
}

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
    free(d->rs); free(d->rec); free(d->rec_index); free(d->seen); free(d->rcv);
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
    free(st->buf[0]); free(st->buf[1]); free(st->log);
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
    for (int64_t r = 0; r < n_rows; r++) {
        if (r > 0 && seq[r] == seq[r - 1]) {
            if (pos[r] != pos[r - 1] + 1) return -2;
            d->runs[n_runs - 1].r1 = r + 1;
        } else {
            const rs_state *st = &d->rs[seq[r]];
            if (!st->buf[0] || pos[r] != st->len || d->seen[seq[r]] == d->stamp) return -2;
            d->seen[seq[r]] = d->stamp;
            d->runs[n_runs++] = (dn_run){.slot = seq[r], .r0 = r, .r1 = r + 1};
        }
        d->run_of[r] = (int32_t)(n_runs - 1);
    }
    d->n_runs = n_runs;
    for (int64_t i = 0; i < n_runs; i++) {
        dn_run *u = &d->runs[i];
        rs_state *st = &d->rs[u->slot];
        const int64_t start = pos[u->r0], end = pos[u->r1 - 1] + 1;
        if (st->ckpt_len >= 0 && end - st->ckpt_len > SK_DN_LOG_ROWS) st->ckpt_len = -1; /* beyond what is logged */
        const int keep = st->ckpt_len >= 0 && st->live == st->ckpt_buf; /* the live buffer is the checkpoint's */
        u->src = st->buf[st->live];
        u->dst_buf = keep ? 1 - st->live : st->live;
        u->dst = st->buf[u->dst_buf];
        u->log = st->ckpt_len >= 0 ? st->log + (start - st->ckpt_len) * d->n_rec * d->log_floats : NULL;
        for (int k = 0; k < SK_DN_SNAPSHOTS; k++) /* positions a snapshot covers are being rewritten */
            if (st->snap_len[k] > start) st->snap_len[k] = -1;
    }
    return 0;
}

void sk_dn_commit(sk_dn_ctx *d) {
    for (int64_t i = 0; i < d->n_runs; i++) {
        rs_state *st = &d->rs[d->runs[i].slot];
        st->live = d->runs[i].dst_buf;
        st->len += d->runs[i].r1 - d->runs[i].r0;
    }
    d->n_runs = 0;
}

/* Row i of a run: conv over rows i .. i + K - 1 of [conv state (K - 1 rows) | the run's qkv rows (ld
 * apart)], SiLU, q and k heads L2-normalised, q scaled: out [conv_dim]. */
static void conv_row(const sk_dn_ctx *d, const sk_kernels *kern, const sk_dn *b, const float *conv_state,
                     const float *rows, int64_t ld, int64_t i, float *out) {
    const int64_t cd = d->conv_dim;
    const float *x[d->K];
    for (int w = 0; w < d->K; w++) {
        const int64_t idx = i + w;
        x[w] = idx < d->K - 1 ? conv_state + idx * cd : rows + (idx - (d->K - 1)) * ld;
    }
    kern->dn_conv(x, b->conv_w, d->K, cd, out);
    const float q_scale = 1.0f / sqrtf((float)d->hk);
    for (int h = 0; h < 2 * d->n_k; h++) /* q heads, then k heads */
        kern->dn_l2norm(out + (int64_t)h * d->hk, d->hk, d->eps, h < d->n_k ? q_scale : 1.0f);
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
static void rule(const sk_dn_ctx *d, const sk_kernels *kern, int h, const float *src, float *dst, const float *cv,
                 int64_t ld_cv, const float *bg, int64_t ld_bg, int64_t n, float *o, int64_t ld_o) {
    const float *q = cv + (int64_t)(h % d->n_k) * d->hk;
    kern->dn_rule(src, dst, d->hk, d->hv, n, q, q + d->key_dim, ld_cv, cv + 2 * d->key_dim + (int64_t)h * d->hv, ld_cv,
                  bg + h, bg + d->n_v + h, ld_bg, o, ld_o);
}

/* The conv rows after n more rows: the last K - 1 of [src's conv rows | rows]; src may be dst. */
static void conv_advance(const sk_dn_ctx *d, const float *src, float *dst, const float *rows, int64_t ld, int64_t n) {
    for (int64_t i = 0; i < d->K - 1; i++) { /* reads row n + i > i: never one this loop already wrote */
        const int64_t idx = n + i;
        const float *x = idx < d->K - 1 ? src + idx * d->conv_dim : rows + (idx - (d->K - 1)) * ld;
        memcpy(dst + i * d->conv_dim, x, sizeof(float) * (size_t)d->conv_dim);
    }
}

void sk_dn_conv(sk_dn_ctx *d, const sk_kernels *kern, int layer, int64_t r0, int64_t r1) {
    const int j = d->rec_index[layer];
    const sk_dn *b = d->rec[j];
    const int64_t cd = d->conv_dim, ldba = 2 * (int64_t)d->n_v, lf = d->log_floats;
    const int64_t c_off = (int64_t)j * d->block_floats + d->s_floats;
    for (int64_t r = r0; r < r1; r++) {
        const dn_run *u = &d->runs[d->run_of[r]];
        const int64_t i = r - u->r0;
        conv_row(d, kern, b, u->src + c_off, d->qkv + u->r0 * cd, cd, i, d->cv + r * cd);
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
    const int64_t cd = d->conv_dim, vd = d->value_dim, ldba = 2 * (int64_t)d->n_v;
    const int64_t s_off = (int64_t)j * d->block_floats, c_off = s_off + d->s_floats;
    int64_t i0, i1;
    split(d->n_runs * d->n_v, ith, nth, &i0, &i1);
    for (int64_t it = i0; it < i1; it++) {
        const dn_run *u = &d->runs[it / d->n_v];
        const int h = (int)(it % d->n_v);
        const int64_t n = u->r1 - u->r0, hs = (int64_t)h * d->hv * d->hk;
        rule(d, kern, h, u->src + s_off + hs, u->dst + s_off + hs, d->cv + u->r0 * cd, cd, d->ba + u->r0 * ldba, ldba,
             n, d->o + u->r0 * vd + (int64_t)h * d->hv, vd);
        if (h == 0) conv_advance(d, u->src + c_off, u->dst + c_off, d->qkv + u->r0 * cd, cd, n);
    }
}

void sk_dn_gate_norm(sk_dn_ctx *d, const sk_kernels *kern, int layer, int ith, int nth) {
    const sk_dn *b = d->rec[d->rec_index[layer]];
    const int64_t vd = d->value_dim;
    int64_t i0, i1;
    split(d->n_runs * d->n_v, ith, nth, &i0, &i1);
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

/* ---- the state contract ----------------------------------------------------------------------- */

int64_t sk_dn_length(const sk_dn_ctx *d, int slot) { return d->rs[slot].len; }

int sk_dn_checkpoint(sk_dn_ctx *d, int slot) {
    rs_state *st = &d->rs[slot];
    if (!st->log) {
        st->log = malloc(sizeof(float) * (size_t)(SK_DN_LOG_ROWS * d->n_rec * d->log_floats));
        if (!st->log) return -1;
    }
    st->ckpt_buf = st->live;
    st->ckpt_len = st->len;
    return 0;
}

int sk_dn_snapshot(sk_dn_ctx *d, int slot) {
    rs_state *st = &d->rs[slot];
    int k = st->snap_oldest;
    for (int i = 0; i < SK_DN_SNAPSHOTS; i++)
        if (st->snap_len[i] == st->len) k = i;
    if (!st->snap[k] && !(st->snap[k] = malloc(sizeof(float) * (size_t)d->state_floats))) return -1;
    memcpy(st->snap[k], st->buf[st->live], sizeof(float) * (size_t)d->state_floats);
    if (k == st->snap_oldest && st->snap_len[k] != st->len) st->snap_oldest = (k + 1) % SK_DN_SNAPSHOTS;
    st->snap_len[k] = st->len;
    return 0;
}

int64_t sk_dn_restorable(const sk_dn_ctx *d, int slot, int64_t n) {
    const rs_state *st = &d->rs[slot];
    if (n >= st->len) return st->len;
    if (st->ckpt_len >= 0 && n >= st->ckpt_len) return n;
    int64_t best = 0;
    for (int i = 0; i < SK_DN_SNAPSHOTS; i++)
        if (st->snap_len[i] <= n && st->snap_len[i] > best) best = st->snap_len[i];
    return best;
}

typedef struct {
    sk_dn_ctx *d;
    const sk_kernels *kern;
    sk_pool *pool;
    const float *log, *src;
    float *dst;
    int64_t n;
} replay_job;

/* Rows [0, n) of the log through conv and rule: the forward's operations without its outputs. Every
 * block's convs first (they read only the log and the checkpoint's conv rows), one barrier, then all
 * (block, head) rules split between the threads: one barrier in all, where a block-by-block replay
 * needs two per block. */
static void replay(void *arg, int ith, int nth) {
    const replay_job *rj = arg;
    sk_dn_ctx *d = rj->d;
    const int64_t cd = d->conv_dim, ld = d->n_rec * d->log_floats, n = rj->n;
    int64_t a, z;
    split(d->n_rec * n, ith, nth, &a, &z);
    for (int64_t it = a; it < z; it++) { /* item: (block j, row i), cv row j * n + i */
        const int j = (int)(it / n);
        const float *rows = rj->log + j * d->log_floats;
        conv_row(d, rj->kern, d->rec[j], rj->src + (int64_t)j * d->block_floats + d->s_floats, rows, ld, it % n,
                 d->rcv + it * cd);
    }
    sk_pool_barrier(rj->pool);
    split(d->n_rec * (int64_t)d->n_v, ith, nth, &a, &z);
    for (int64_t it = a; it < z; it++) {
        const int j = (int)(it / d->n_v), h = (int)(it % d->n_v);
        const float *rows = rj->log + j * d->log_floats;
        const int64_t s_off = (int64_t)j * d->block_floats, hs = (int64_t)h * d->hv * d->hk;
        rule(d, rj->kern, h, rj->src + s_off + hs, rj->dst + s_off + hs, d->rcv + j * n * cd, cd, rows + cd, ld, n,
             NULL, 0);
        if (h == 0)
            conv_advance(d, rj->src + s_off + d->s_floats, rj->dst + s_off + d->s_floats, rows, ld, n);
    }
}

int sk_dn_truncate(sk_dn_ctx *d, const sk_kernels *kern, sk_pool *pool, int slot, int64_t n) {
    rs_state *st = &d->rs[slot];
    if (n >= st->len) return 0;
    if (n < 0) return -2;
    if (st->ckpt_len >= 0 && n >= st->ckpt_len) {
        if (n > st->ckpt_len) {
            const int64_t need = d->n_rec * (n - st->ckpt_len) * d->conv_dim;
            if (need > d->cap_rcv) {
                free(d->rcv);
                d->rcv = malloc(sizeof(float) * (size_t)need);
                d->cap_rcv = d->rcv ? need : 0;
                if (!d->rcv) return -1;
            }
            replay_job rj = {d, kern, pool, st->log, st->buf[st->ckpt_buf], st->buf[1 - st->ckpt_buf], n - st->ckpt_len};
            sk_pool_run(pool, replay, &rj);
        }
        st->live = n > st->ckpt_len ? 1 - st->ckpt_buf : st->ckpt_buf;
        st->len = n;
        return 0;
    }
    int k = -1;
    for (int i = 0; i < SK_DN_SNAPSHOTS; i++)
        if (st->snap_len[i] == n && n > 0) k = i;
    if (n != 0 && k < 0) return -2;
    st->ckpt_len = -1; /* it lies beyond n */
    if (k >= 0) memcpy(st->buf[st->live], st->snap[k], sizeof(float) * (size_t)d->state_floats);
    else memset(st->buf[st->live], 0, sizeof(float) * (size_t)d->state_floats);
    st->len = n;
    return 0;
}

int64_t sk_dn_read_state(const sk_dn_ctx *d, int slot, int layer, float *out, int64_t cap) {
    if (slot < 0 || slot >= d->n_seq_max || layer < 0 || layer >= d->n_layer || d->rec_index[layer] < 0 ||
        !d->rs[slot].buf[0] || cap < d->block_floats)
        return -1;
    const rs_state *st = &d->rs[slot];
    memcpy(out, st->buf[st->live] + (int64_t)d->rec_index[layer] * d->block_floats,
           sizeof(float) * (size_t)d->block_floats);
    return d->block_floats;
}
