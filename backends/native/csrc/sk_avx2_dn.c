/* AVX2 kernels of the gated delta-net blocks (sk.h's dn_*, called by sk_deltanet.c): the depthwise
 * conv with SiLU, the L2 norm of a q or k head and the delta rule. Compiled for that target only;
 * sk_ctx.c picks them only after checking the CPU has it. Same structure as sk_avx512_dn.c, eight
 * lanes per register: a state row is carried through all the tokens of a call (held in registers as
 * far as 16 of them allow, else in L1) before the next; every element's operations are fixed by its
 * own inputs, so the forward and the replay of logged rows compute bitwise the same state. */
#pragma GCC target("avx2,fma,f16c,bmi2")
#include <immintrin.h>
#include <math.h>

#include "sk.h"
#include "sk_avx2.h"

#define INLINE static inline __attribute__((always_inline))

/* Lanes [0, left) set (left clamped to 0..8), for masked loads and stores of a row's tail. */
INLINE __m256i lanes(int64_t left) {
    const int n = left >= 8 ? 8 : left <= 0 ? 0 : (int)left;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

INLINE __m256 load(const float *p, int64_t left) {
    return left >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lanes(left));
}

INLINE void store(float *p, int64_t left, __m256 v) {
    if (left >= 8) _mm256_storeu_ps(p, v);
    else _mm256_maskstore_ps(p, lanes(left), v);
}

/* The sum of the 8 lanes, in every lane (pairs swapped and added: both lanes of a pair get the same bits). */
INLINE __m256 sum_bcast(__m256 v) {
    v = _mm256_add_ps(v, _mm256_permute2f128_ps(v, v, 0x01));
    v = _mm256_add_ps(v, _mm256_permute_ps(v, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm256_add_ps(v, _mm256_permute_ps(v, _MM_SHUFFLE(2, 3, 0, 1)));
}

void sk_avx2_dn_conv(const float *const *x, const float *w, int K, int64_t n, float *out) {
    const __m256 one = _mm256_set1_ps(1.0f);
    for (int64_t c = 0; c < n; c += 8) {
        __m256 acc = _mm256_mul_ps(load(x[0] + c, n - c), load(w + c, n - c));
        for (int t = 1; t < K; t++) acc = _mm256_fmadd_ps(load(x[t] + c, n - c), load(w + t * n + c, n - c), acc);
        const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), acc));
        store(out + c, n - c, _mm256_div_ps(acc, _mm256_add_ps(one, e)));
    }
}

void sk_avx2_dn_l2norm(float *x, int64_t n, float eps, float scale) {
    __m256 ss = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j += 8) {
        const __m256 v = load(x + j, n - j);
        ss = _mm256_fmadd_ps(v, v, ss);
    }
    const __m256 f = _mm256_set1_ps(scale / sqrtf(_mm256_cvtss_f32(sum_bcast(ss)) + eps));
    for (int64_t j = 0; j < n; j += 8) store(x + j, n - j, _mm256_mul_ps(load(x + j, n - j), f));
}

/* s . x over NC vectors (x read from memory, hk floats): four chains, a fixed tree, in every lane. */
INLINE __m256 dot_bcast(const int NC, const int hk, const __m256 *s, const float *x) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int c = 0; c < NC; c++) {
        const __m256 xc = load(x + 8 * c, hk - 8 * c);
        acc[c % 4] = c < 4 ? _mm256_mul_ps(s[c], xc) : _mm256_fmadd_ps(s[c], xc, acc[c % 4]);
    }
    return sum_bcast(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
}

/* State row i through n tokens; s.k is decay * (s_old . k), so the dot need not wait for the decay. */
INLINE void rule_row(const int NC, const int hk, int i, const float *src, float *dst, int64_t n, const float *q,
                     const float *k, int64_t ld_qk, const float *v, int64_t ld_v, const float *beta,
                     const float *decay, int64_t ld_bg, float *o, int64_t ld_o) {
    __m256 s[NC];
    for (int c = 0; c < NC; c++) s[c] = load(src + (int64_t)i * hk + 8 * c, hk - 8 * c);
    for (int64_t t = 0; t < n; t++) {
        const float *kt = k + t * ld_qk;
        const __m256 dc = _mm256_set1_ps(decay[t * ld_bg]), bt = _mm256_set1_ps(beta[t * ld_bg]);
        const __m256 sk = _mm256_mul_ps(dc, dot_bcast(NC, hk, s, kt));
        const __m256 delta = _mm256_mul_ps(_mm256_sub_ps(_mm256_set1_ps(v[t * ld_v + i]), sk), bt);
        for (int c = 0; c < NC; c++)
            s[c] = _mm256_fmadd_ps(load(kt + 8 * c, hk - 8 * c), delta, _mm256_mul_ps(s[c], dc));
        if (o) o[t * ld_o + i] = _mm256_cvtss_f32(dot_bcast(NC, hk, s, q + t * ld_qk));
    }
    for (int c = 0; c < NC; c++) store(dst + (int64_t)i * hk + 8 * c, hk - 8 * c, s[c]);
}

void sk_avx2_dn_rule(const float *src, float *dst, int hk, int hv, int64_t n, const float *q, const float *k,
                     int64_t ld_qk, const float *v, int64_t ld_v, const float *beta, const float *decay,
                     int64_t ld_bg, float *o, int64_t ld_o) {
    if (hk == 128) { /* Qwen3.5's head size: fully unrolled */
        for (int i = 0; i < hv; i++) rule_row(16, 128, i, src, dst, n, q, k, ld_qk, v, ld_v, beta, decay, ld_bg, o, ld_o);
        return;
    }
    const int nc = (hk + 7) / 8;
    for (int i = 0; i < hv; i++) rule_row(nc, hk, i, src, dst, n, q, k, ld_qk, v, ld_v, beta, decay, ld_bg, o, ld_o);
}
