/* The forward's steps that other files run too (sk_encode.c's encoders, sk_seq_state.c's context shift,
 * sk_test_entry.c's attention): the small ones static inline, so the forward keeps them inlined; the
 * larger ones defined in sk_model.c, hidden. Not an API. */
#ifndef SK_STEP_H
#define SK_STEP_H

#include <math.h>
#include <time.h>

#include "sk_ctx.h"

static inline double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static inline void split(int64_t n, int ith, int nth, int64_t *a, int64_t *b) {
    *a = n * ith / nth;
    *b = n * (ith + 1) / nth;
}

/* x rows [r0, r1) of width k into the shared activation buffer (which then holds width k). */
static inline void quantize(sk_ctx *c, const float *x, int64_t ldx, int64_t k, int64_t r0, int64_t r1) {
    c->act.kp = sk_round_up(k, 64);
    if (r1 > r0) c->kern->quantize_rows(x + r0 * ldx, ldx, r1 - r0, k, &c->act, r0);
}

typedef struct {
    const sk_tensor *w;
    float *out;
    int64_t ldo;
    int accumulate;
} part;

static inline int any_quant(const part *parts, int np) {
    for (int i = 0; i < np; i++)
        if (sk_is_quant(parts[i].w->type)) return 1;
    return 0;
}

/* Rope on one head: NORM pairs (2i, 2i+1) or NEOX pairs (i, i + n_rot/2); cs = [cos | sin] per pair. */
static inline void rope_head(float *v, const float *cs, int n_rot, int neox) {
    int half = n_rot / 2;
    for (int i = 0; i < half; i++) {
        int i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
        float x0 = v[i0], x1 = v[i1], co = cs[i], si = cs[half + i];
        v[i0] = x0 * co - x1 * si;
        v[i1] = x0 * si + x1 * co;
    }
}

/* sk_model.c: a barrier of the pool's threads (thread 0's wait timed when profiling); this thread's share
 * of several matmuls over one input; the rope tables of row r at position p; norms and rope of rows
 * [r0, r1)'s heads from first_head on, their keys and values into the cache; the merge of a one-row
 * batch's attention partials on one thread (sk_test_attend), a block without sinks or gate. */
SKC_HIDDEN void skc_barrier(sk_pool *pool, int ith);
SKC_HIDDEN void skc_gemm_parts(sk_ctx *c, const part *parts, int np, const float *x, int64_t ldx, int64_t m, int ith,
                               int nth);
SKC_HIDDEN void skc_rope_angles(sk_ctx *c, int64_t p, int64_t r);
SKC_HIDDEN void skc_qkv_post(sk_ctx *c, const sk_batch *b, int layer, int first_head, int64_t r0, int64_t r1);
SKC_HIDDEN void skc_attention_merge_row(sk_ctx *c, const sk_batch *b);

#endif
