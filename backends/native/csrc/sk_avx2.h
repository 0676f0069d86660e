/* Entry points and helpers shared between the AVX2 files (both compiled for that target only). */
#ifndef SK_AVX2_H
#define SK_AVX2_H

#include <immintrin.h>

#include "sk.h"

void sk_avx2_gemm_q(const sk_tensor *w, int64_t n0, int64_t n1, const sk_act *a, int64_t m, float *out, int64_t ldo,
                    int accumulate);
/* sk_avx2_dn.c: the gated delta-net kernels (sk.h's dn_*). */
void sk_avx2_dn_conv(const float *const *x, const float *w, int K, int64_t n, float *out);
void sk_avx2_dn_l2norm(float *x, int64_t n, float eps, float scale);
void sk_avx2_dn_rule(const float *src, float *dst, int hk, int hv, int64_t n, const float *q, const float *k,
                     int64_t ld_qk, const float *v, int64_t ld_v, const float *beta, const float *decay,
                     int64_t ld_bg, float *o, int64_t ld_o);

/* e^x for x <= 0 and moderate positive x: 2^n * p(r), |r| <= ln2/2, degree-6 Taylor polynomial
 * (relative error ~1e-7), 2^n built in the exponent field (n in [-126, 127] after the clamp). */
static inline __attribute__((always_inline)) __m256 exp256(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

#endif
