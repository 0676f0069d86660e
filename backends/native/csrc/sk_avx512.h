/* Entry points and helpers shared between the AVX-512 files (both compiled for that target only). */
#ifndef SK_AVX512_H
#define SK_AVX512_H

#include <immintrin.h>

#include "sk.h"

void sk_avx512_gemm_q(const sk_tensor *w, int64_t n0, int64_t n1, const sk_act *a, int64_t m, float *out, int64_t ldo,
                      int accumulate);
/* sk_avx512_dn.c: the gated delta-net kernels (sk.h's dn_*). */
void sk_avx512_dn_conv(const float *const *x, const float *w, int K, int64_t n, float *out);
void sk_avx512_dn_l2norm(float *x, int64_t n, float eps, float scale);
void sk_avx512_dn_rule(const float *src, float *dst, int hk, int hv, int64_t n, const float *q, const float *k,
                       int64_t ld_qk, const float *v, int64_t ld_v, const float *beta, const float *decay,
                       int64_t ld_bg, float *o, int64_t ld_o);

/* e^x for x <= 0 and moderate positive x: 2^n * p(r), |r| <= ln2/2, degree-6 Taylor polynomial
 * (relative error ~1e-7). Fixed operation sequence, so deterministic. */
static inline __attribute__((always_inline)) __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

#endif
