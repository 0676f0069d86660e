/* Single-kernel entry points for tests and kernel benchmarks: quantization, a matmul, a row's dequantization,
 * packing, and one row's attention through the model's chunking and merge. */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "sk_ctx.h"
#include "sk_pack.h"
#include "sk_step.h"

static int64_t n_chunks(int64_t n_keys) { return (n_keys + SK_ATTN_CHUNK - 1) / SK_ATTN_CHUNK; }

SK_API void sk_test_quantize(const float *x, int64_t m, int64_t k, int8_t *q, float *d, float *s, int32_t *qs16,
                             int kernel_cap) {
    sk_act a = {q, d, s, qs16, sk_round_up(k, 64), m};
    skc_pick_kernels(kernel_cap)->quantize_rows(x, k, m, k, &a, 0);
}

/* out[m, w->n_rows] = x[m, n_cols] times w transposed, through the path the model would use. */
/* out[m, w->n_rows] = x[m, n_cols] times w transposed, through the path the model would use, `reps`
 * times (one thread); *seconds gets the time of one quantize + matmul, packing excluded. */
SK_API int sk_test_gemm(const sk_tensor *w_in, const float *x, int64_t m, float *out, int kernel_cap, int reps,
                        double *seconds) {
    const sk_kernels *base = skc_pick_kernels(kernel_cap);
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
    c.kern = skc_pick_kernels(kernel_cap);
    int32_t pos = (int32_t)(n_keys - 1), zero = 0;
    sk_batch b = {.n_rows = 1, .pos = &pos, .seq = &zero};
    float *scratch = xalloc((size_t)n_q * SK_ATTN_CHUNK * 4);
    int rc = scratch && skc_plan_attention(&c, &b) == 0 ? 0 : -1;
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
        skc_attention_merge_row(&c, &b);
    }
    if (seconds) *seconds = (now_s() - t0) / (reps > 0 ? reps : 1);
    free(scratch);
    free(c.att_prefix);
    free(c.att_wave_at);
    free(c.att_parts);
    free(c.att_order);
    return rc;
}
