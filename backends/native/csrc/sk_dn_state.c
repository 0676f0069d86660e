/* The recurrent-state contract of the gated delta-net blocks (core/backend.py), per slot: checkpoints,
 * truncates, snapshots; see sk_dn_internal.h for how a state, its checkpoint and its pending rows lie. */
#include <stdlib.h>
#include <string.h>

#include "sk_dn_internal.h"

int64_t sk_dn_length(const sk_dn_ctx *d, int slot) { return d->rs[slot].len; }

int sk_dn_checkpoint(sk_dn_ctx *d, int slot) {
    rs_state *st = &d->rs[slot];
    for (int i = 0; i < 2; i++) /* malloc: a log's pages become resident as rows are written */
        if (!st->log[i] && !(st->log[i] = malloc(sizeof(float) * (size_t)(SK_DN_LOG_ROWS * d->n_rec * d->log_floats))))
            return -1;
    st->ckpt_buf = st->live;
    st->ckpt_base = st->base; /* pending rows stay in log[cur]: this checkpoint lies past them */
    st->ckpt_len = st->len;
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
 * block's convs first (they read only the log and the source's conv rows), one barrier, then all
 * (block, head) rules split between the threads. */
static void replay(void *arg, int ith, int nth) {
    const replay_job *rj = arg;
    sk_dn_ctx *d = rj->d;
    const int64_t cd = d->conv_dim, ld = d->n_rec * d->log_floats, n = rj->n;
    int64_t a, z;
    dn_split(d->n_rec * n, ith, nth, &a, &z);
    for (int64_t it = a; it < z; it++) { /* item: (block j, row i), pcv row j * n + i */
        const int j = (int)(it / n);
        const dn_hist h = {rj->src + (int64_t)j * d->block_floats + d->s_floats, rj->log + j * d->log_floats, NULL,
                           n, ld, 0};
        dn_conv_row(d, rj->kern, d->rec[j], &h, it % n, d->pcv + it * cd);
    }
    sk_pool_barrier(rj->pool);
    dn_split(d->n_rec * (int64_t)d->n_v, ith, nth, &a, &z);
    for (int64_t it = a; it < z; it++) {
        const int j = (int)(it / d->n_v), h = (int)(it % d->n_v);
        const float *rows = rj->log + j * d->log_floats;
        const int64_t s_off = (int64_t)j * d->block_floats, hs = (int64_t)h * d->hv * d->hk;
        dn_rule_head(d, rj->kern, h, rj->src + s_off + hs, rj->dst + s_off + hs, d->pcv + j * n * cd, cd, rows + cd, ld,
                     n, NULL, 0);
        if (h == 0) {
            const dn_hist hist = {rj->src + s_off + d->s_floats, rows, NULL, n, ld, 0};
            dn_conv_advance(d, &hist, n, rj->dst + s_off + d->s_floats);
        }
    }
}

/* Run a slot's pending rows now (a snapshot or a read needs the state itself): 0, or -1 out of memory. */
static int settle(sk_dn_ctx *d, const sk_kernels *kern, sk_pool *pool, int slot) {
    rs_state *st = &d->rs[slot];
    const int64_t n = st->len - st->base;
    if (n == 0) return 0;
    if (dn_reserve_pcv(d, d->n_rec * n * d->conv_dim) != 0) return -1;
    replay_job rj = {d, kern, pool, st->log[st->cur], st->buf[st->live], st->buf[1 - st->live], n};
    sk_pool_run(pool, replay, &rj);
    st->live = 1 - st->live; /* the checkpoint keeps the other buffer, unless it lies at len */
    st->base = st->len;
    if (st->ckpt_len == st->len) {
        st->ckpt_buf = st->live;
        st->ckpt_base = st->len;
    }
    return 0;
}

int sk_dn_snapshot(sk_dn_ctx *d, const sk_kernels *kern, sk_pool *pool, int slot) {
    if (settle(d, kern, pool, slot) != 0) return -1;
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

int sk_dn_truncate(sk_dn_ctx *d, int slot, int64_t n) {
    rs_state *st = &d->rs[slot];
    if (n >= st->len) return 0;
    if (n < 0) return -2;
    if (st->ckpt_len >= 0 && n >= st->ckpt_len) { /* O(1): the rows after the checkpoint's base become pending */
        st->live = st->ckpt_buf;
        st->base = st->ckpt_base;
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
    st->base = st->len = n;
    return 0;
}

int64_t sk_dn_read_state(sk_dn_ctx *d, const sk_kernels *kern, sk_pool *pool, int slot, int layer, float *out,
                         int64_t cap) {
    if (slot < 0 || slot >= d->n_seq_max || layer < 0 || layer >= d->n_layer || d->rec_index[layer] < 0 ||
        !d->rs[slot].buf[0] || cap < d->block_floats || settle(d, kern, pool, slot) != 0)
        return -1;
    const rs_state *st = &d->rs[slot];
    memcpy(out, st->buf[st->live] + (int64_t)d->rec_index[layer] * d->block_floats,
           sizeof(float) * (size_t)d->block_floats);
    return d->block_floats;
}

int64_t sk_dn_state_floats(const sk_dn_ctx *d) { return d->state_floats; }

int64_t sk_dn_export(sk_dn_ctx *d, const sk_kernels *kern, sk_pool *pool, int slot, float *out, int64_t cap) {
    if (slot < 0 || slot >= d->n_seq_max || !d->rs[slot].buf[0] || cap < d->state_floats ||
        settle(d, kern, pool, slot) != 0)
        return -1;
    const rs_state *st = &d->rs[slot];
    memcpy(out, st->buf[st->live], sizeof(float) * (size_t)d->state_floats);
    return d->state_floats;
}

int sk_dn_import(sk_dn_ctx *d, int slot, const float *in, int64_t n_floats, int64_t n) {
    if (slot < 0 || slot >= d->n_seq_max || !d->rs[slot].buf[0] || n_floats != d->state_floats || n < 0) return -2;
    rs_state *st = &d->rs[slot];
    memcpy(st->buf[st->live], in, sizeof(float) * (size_t)d->state_floats);
    st->base = st->len = n;
    st->ckpt_len = -1; /* what was kept describes the replaced state */
    for (int i = 0; i < SK_DN_SNAPSHOTS; i++) st->snap_len[i] = -1;
    return 0;
}
