/* AVX-512 kernels of the gated delta-net blocks (sk.h's dn_*, called by sk_deltanet.c): the depthwise
 * conv with SiLU, the L2 norm of a q or k head and the delta rule. Compiled for that target only;
 * sk_ctx.c picks them only after checking the CPU has it.
 *
 * The delta rule carries one state row (head_k_dim floats: 8 registers for 128) through all the
 * tokens of a call before the next row, so a row is loaded and stored once per forward whatever its
 * number of tokens; two rows are interleaved so one's reductions overlap the other's. Every element's
 * operations are fixed by its own inputs (not by the token count, the row grouping or the caller), so
 * the forward and the replay of logged rows compute bitwise the same state. */
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma,bmi2")
#include <immintrin.h>
#include <math.h>

#include "sk.h"
#include "sk_avx512.h"

#define INLINE static inline __attribute__((always_inline))

INLINE __mmask16 lanes(int64_t left) { return left >= 16 ? 0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1); }

/* The sum of the 16 lanes, in every lane (pairs swapped and added: both lanes of a pair get the same bits). */
INLINE __m512 sum_bcast(__m512 v) {
    v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(1, 0, 3, 2)));
    v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(2, 3, 0, 1)));
    v = _mm512_add_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm512_add_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(2, 3, 0, 1)));
}

void sk_avx512_dn_conv(const float *const *x, const float *w, int K, int64_t n, float *out) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t c = 0; c < n; c += 16) {
        const __mmask16 m = lanes(n - c);
        __m512 acc = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x[0] + c), _mm512_maskz_loadu_ps(m, w + c));
        for (int t = 1; t < K; t++)
            acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x[t] + c), _mm512_maskz_loadu_ps(m, w + t * n + c), acc);
        const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), acc));
        _mm512_mask_storeu_ps(out + c, m, _mm512_div_ps(acc, _mm512_add_ps(one, e)));
    }
}

void sk_avx512_dn_l2norm(float *x, int64_t n, float eps, float scale) {
    __m512 ss = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
        const __m512 v = _mm512_maskz_loadu_ps(lanes(n - j), x + j);
        ss = _mm512_fmadd_ps(v, v, ss);
    }
    const __m512 f = _mm512_set1_ps(scale / sqrtf(_mm512_reduce_add_ps(ss) + eps));
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 m = lanes(n - j);
        _mm512_mask_storeu_ps(x + j, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + j), f));
    }
}

/* s . x over NC vectors (x read from memory, hk floats): four chains, a fixed tree, in every lane. */
INLINE __m512 dot_bcast(const int NC, const int hk, const __m512 *s, const float *x) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int c = 0; c < NC; c++) {
        const __m512 xc = _mm512_maskz_loadu_ps(lanes(hk - 16 * c), x + 16 * c);
        acc[c % 4] = c < 4 ? _mm512_mul_ps(s[c], xc) : _mm512_fmadd_ps(s[c], xc, acc[c % 4]);
    }
    return sum_bcast(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
}

/* State rows [i, i + R) through n tokens; s.k is decay * (s_old . k), so the dot need not wait for the decay. */
INLINE void rule_rows(const int R, const int NC, const int hk, int i, const float *src, float *dst, int64_t n,
                      const float *q, const float *k, int64_t ld_qk, const float *v, int64_t ld_v, const float *beta,
                      const float *decay, int64_t ld_bg, float *o, int64_t ld_o) {
    __m512 s[R][NC];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NC; c++)
            s[r][c] = _mm512_maskz_loadu_ps(lanes(hk - 16 * c), src + (int64_t)(i + r) * hk + 16 * c);
    for (int64_t t = 0; t < n; t++) {
        const float *kt = k + t * ld_qk;
        const __m512 dc = _mm512_set1_ps(decay[t * ld_bg]), bt = _mm512_set1_ps(beta[t * ld_bg]);
        for (int r = 0; r < R; r++) {
            const __m512 sk = _mm512_mul_ps(dc, dot_bcast(NC, hk, s[r], kt));
            const __m512 delta = _mm512_mul_ps(_mm512_sub_ps(_mm512_set1_ps(v[t * ld_v + i + r]), sk), bt);
            for (int c = 0; c < NC; c++)
                s[r][c] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes(hk - 16 * c), kt + 16 * c), delta,
                                          _mm512_mul_ps(s[r][c], dc));
            if (o) o[t * ld_o + i + r] = _mm512_cvtss_f32(dot_bcast(NC, hk, s[r], q + t * ld_qk));
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NC; c++)
            _mm512_mask_storeu_ps(dst + (int64_t)(i + r) * hk + 16 * c, lanes(hk - 16 * c), s[r][c]);
}

void sk_avx512_dn_rule(const float *src, float *dst, int hk, int hv, int64_t n, const float *q, const float *k,
                    int64_t ld_qk, const float *v, int64_t ld_v, const float *beta, const float *decay, int64_t ld_bg,
                    float *o, int64_t ld_o) {
    int i = 0;
    if (hk == 128) { /* Qwen3.5's head size: the row stays in registers */
        for (; i + 2 <= hv; i += 2) rule_rows(2, 8, 128, i, src, dst, n, q, k, ld_qk, v, ld_v, beta, decay, ld_bg, o, ld_o);
        for (; i < hv; i++) rule_rows(1, 8, 128, i, src, dst, n, q, k, ld_qk, v, ld_v, beta, decay, ld_bg, o, ld_o);
        return;
    }
    const int nc = (hk + 15) / 16;
    for (; i < hv; i++) rule_rows(1, nc, hk, i, src, dst, n, q, k, ld_qk, v, ld_v, beta, decay, ld_bg, o, ld_o);
}
