/* AVX2 (with FMA and F16C) kernels: float-weight matmuls, activation quantization, norms, activations
 * and attention (the quantized matmuls are in sk_avx2_gemm.c). The CPUs most people run, AMD's
 * before Zen 4 and Intel's client parts, have these and not AVX-512. Compiled for that target only;
 * sk_ctx.c picks them only after checking the CPU has it. Same structure as sk_avx512.c, eight
 * lanes per register; every result element follows an operation order fixed by its own inputs. */
#pragma GCC target("avx2,fma,f16c,bmi2")
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "sk.h"
#include "sk_avx2.h"
#include "sk_pack.h"

#define INLINE static inline __attribute__((always_inline))

/* Lanes [0, left) set (left clamped to 0..8), for masked loads of a row's tail. */
INLINE __m256i tail_mask(int64_t left) {
    const int n = left >= 8 ? 8 : left <= 0 ? 0 : (int)left;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* Horizontal sum and max of 8 lanes, in one fixed order. */
INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

INLINE float hmax(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

INLINE int hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

INLINE void store_tile(float res[2][2], int mr, int nr, int64_t r0, int64_t n0, const float *bias, float *out,
                       int64_t ldo, int accumulate) {
    for (int r = 0; r < mr; r++)
        for (int n = 0; n < nr; n++) {
            float v = res[r][n];
            if (bias) v += bias[n0 + n];
            float *o = out + (r0 + r) * ldo + n0 + n;
            *o = accumulate ? *o + v : v;
        }
}

enum { ROW_BLOCK = 64 };

/* ---- float weights (F32, F16, BF16) with float activations ------------------------------------ */

INLINE __m256 load_w8(int type, const uint8_t *row, int64_t c) {
    if (type == SK_F32) return _mm256_loadu_ps((const float *)row + 8 * c);
    __m128i h = _mm_loadu_si128((const __m128i *)(row + 16 * c));
    if (type == SK_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* MR rows x NR weight rows over 16-column steps: two 8-lane fma chains per output element (columns
 * 16c..16c+7 and 16c+8..16c+15), added and reduced as the AVX-512 kernel reduces its 16 lanes, so both
 * sets compute float matmuls to the same bits. */
INLINE void tile_f(int type, const uint8_t *w0, int64_t rb, int64_t nc, const float *x, int64_t ldx, int64_t r0,
                   const int MR, const int NR, float res[2][2]) {
    __m256 lo[2][2], hi[2][2];
    for (int r = 0; r < MR; r++)
        for (int n = 0; n < NR; n++) lo[r][n] = hi[r][n] = _mm256_setzero_ps();
    for (int64_t c = 0; c < nc; c++) {
        __m256 wl[2], wh[2];
        for (int n = 0; n < NR; n++) {
            wl[n] = load_w8(type, w0 + n * rb, 2 * c);
            wh[n] = load_w8(type, w0 + n * rb, 2 * c + 1);
        }
        for (int r = 0; r < MR; r++) {
            const __m256 xl = _mm256_loadu_ps(x + (r0 + r) * ldx + 16 * c), xh = _mm256_loadu_ps(x + (r0 + r) * ldx + 16 * c + 8);
            for (int n = 0; n < NR; n++) {
                lo[r][n] = _mm256_fmadd_ps(wl[n], xl, lo[r][n]);
                hi[r][n] = _mm256_fmadd_ps(wh[n], xh, hi[r][n]);
            }
        }
    }
    for (int r = 0; r < MR; r++)
        for (int n = 0; n < NR; n++) res[r][n] = hsum(_mm256_add_ps(hi[r][n], lo[r][n]));
}

#define DEF_FGEMM(NAME, TYPE)                                                                                 \
    static void NAME(const sk_tensor *w, int64_t n0, int64_t n1, const float *x, int64_t ldx, int64_t m,      \
                     float *out, int64_t ldo, int accumulate) {                                               \
        const int64_t nc = w->n_cols / 16, rb = w->row_bytes;                                                 \
        float res[2][2];                                                                                      \
        for (int64_t m0 = 0; m0 < m; m0 += ROW_BLOCK) {                                                       \
            const int64_t m1 = m0 + ROW_BLOCK < m ? m0 + ROW_BLOCK : m;                                       \
            for (int64_t n = n0; n < n1;) {                                                                   \
                const int nr = n1 - n >= 2 ? 2 : 1;                                                           \
                const uint8_t *w0 = w->data + n * rb;                                                         \
                for (int64_t r = m0; r < m1;) {                                                               \
                    const int mr = m1 - r >= 2 ? 2 : 1;                                                       \
                    if (nr == 2 && mr == 2) tile_f(TYPE, w0, rb, nc, x, ldx, r, 2, 2, res);                    \
                    else if (nr == 2) tile_f(TYPE, w0, rb, nc, x, ldx, r, 1, 2, res);                          \
                    else if (mr == 2) tile_f(TYPE, w0, rb, nc, x, ldx, r, 2, 1, res);                          \
                    else tile_f(TYPE, w0, rb, nc, x, ldx, r, 1, 1, res);                                       \
                    store_tile(res, mr, nr, r, n, w->bias, out, ldo, accumulate);                             \
                    r += mr;                                                                                  \
                }                                                                                             \
                n += nr;                                                                                      \
            }                                                                                                 \
        }                                                                                                     \
    }

DEF_FGEMM(gemm_f32, SK_F32)
DEF_FGEMM(gemm_f16, SK_F16)
DEF_FGEMM(gemm_bf16, SK_BF16)

static void gemm_f(const sk_tensor *w, int64_t n0, int64_t n1, const float *x, int64_t ldx, int64_t m, float *out,
                   int64_t ldo, int accumulate) {
    if (w->type == SK_F32) gemm_f32(w, n0, n1, x, ldx, m, out, ldo, accumulate);
    else if (w->type == SK_F16) gemm_f16(w, n0, n1, x, ldx, m, out, ldo, accumulate);
    else gemm_bf16(w, n0, n1, x, ldx, m, out, ldo, accumulate);
}

static int supports(const sk_tensor *w) {
    if (sk_is_quant(w->type)) return sk_packed_supported(w);
    return w->layout == 0 && w->n_cols % 16 == 0; /* as AVX-512: other widths go to the portable kernel on both */
}

static int64_t packed_size(const sk_tensor *w, int64_t *row_bytes) {
    int64_t gb = sk_packed_group_bytes(w);
    *row_bytes = gb;
    return gb * ((w->n_rows + 15) / 16);
}

static void pack(const sk_tensor *w, int64_t u0, int64_t u1, uint8_t *dst) { sk_pack_groups(w, u0, u1, dst); }

/* ---- activation quantization (bitwise the same numbers as the generic version) ----------------- */

static void quantize_rows(const float *x, int64_t ldx, int64_t m, int64_t k, sk_act *a, int64_t r0) {
    const int64_t kp = a->kp;
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    /* packs_epi32 then packs_epi16 interleave 128-bit lanes; this puts the 32 bytes back in order */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t r = 0; r < m; r++) {
        const float *xr = x + r * ldx;
        const int64_t row = r0 + r;
        int8_t *q = a->q + row * kp;
        for (int64_t b = 0; b < kp / 32; b++) {
            const int64_t i0 = 32 * b;
            __m256 v[4];
            __m256 amax = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                v[i] = _mm256_maskload_ps(xr + i0 + 8 * i, tail_mask(k - i0 - 8 * i));
                amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], abs_mask));
            }
            float d = hmax(amax) / 127.0f, id = sk_act_inverse_scale(d);
            const __m256 vid = _mm256_set1_ps(id);
            __m256i qi[4];
            for (int i = 0; i < 4; i++) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vid));
            const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
            _mm256_storeu_si256((__m256i *)(q + i0), _mm256_permutevar8x32_epi32(p, order));
            const int s0 = hsum_i32(_mm256_add_epi32(qi[0], qi[1])), s1 = hsum_i32(_mm256_add_epi32(qi[2], qi[3]));
            a->d[row * (kp / 32) + b] = sk_act_round(d); /* float16, as the generic version */
            a->s[row * (kp / 32) + b] = sk_act_round(d * (float)(s0 + s1));
            a->qs16[row * (kp / 16) + 2 * b] = s0;
            a->qs16[row * (kp / 16) + 2 * b + 1] = s1;
        }
    }
}

/* ---- elementwise ------------------------------------------------------------------------------- */

/* The sum of squares runs in 16 lanes (two 8-lane halves) and reduces as the AVX-512 kernel's does, so
 * both sets normalize to the same bits. */
static void rms_norm(const float *x, const float *w, int64_t n, float eps, float *y) {
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        const __m256 a = _mm256_maskload_ps(x + i, tail_mask(n - i)), b = _mm256_maskload_ps(x + i + 8, tail_mask(n - i - 8));
        lo = _mm256_fmadd_ps(a, a, lo);
        hi = _mm256_fmadd_ps(b, b, hi);
    }
    const float scale = 1.0f / sqrtf(hsum(_mm256_add_ps(hi, lo)) / (float)n + eps);
    const __m256 vs = _mm256_set1_ps(scale);
    for (int64_t i = 0; i < n; i += 8) {
        const __m256i k = tail_mask(n - i);
        __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_maskload_ps(x + i, k), vs), _mm256_maskload_ps(w + i, k));
        _mm256_maskstore_ps(y + i, k, v);
    }
}

static void silu_mul(const float *g, const float *u, int64_t n, float *y) {
    for (int64_t i = 0; i < n; i += 8) {
        const __m256i k = tail_mask(n - i);
        __m256 vg = _mm256_maskload_ps(g + i, k);
        __m256 s = _mm256_div_ps(vg, _mm256_add_ps(_mm256_set1_ps(1.0f), exp256(_mm256_sub_ps(_mm256_setzero_ps(), vg))));
        _mm256_maskstore_ps(y + i, k, _mm256_mul_ps(s, _mm256_maskload_ps(u + i, k)));
    }
}

/* ---- attention --------------------------------------------------------------------------------- */

enum { HEADS_PER_PASS = 4, PV_HEADS = 2 };

INLINE __m256 f16x8(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* Scores of one 16-key block for G heads: an fma chain over the head dimension per key, masked to
 * -inf past the last key; the running maxima take both 8-key halves. */
INLINE void qk_block(const int G, const float *const *qh, const uint16_t *kb, const uint16_t *vb, int head_dim,
                     int64_t b, int64_t n_keys, __m256 vscale, float *const *sh, __m256 *vmax) {
    __m256 lo[HEADS_PER_PASS], hi[HEADS_PER_PASS];
    for (int h = 0; h < G; h++) lo[h] = hi[h] = _mm256_setzero_ps();
    /* As in the AVX-512 kernel: the next block's keys and this block's values are asked for while
     * these scores are summed (32 bytes of each per dimension; no result changes, no fault). */
    const char *next_k = (const char *)(kb + head_dim * 16), *these_v = (const char *)vb;
    for (int d = 0; d < head_dim; d++) {
        if (!(d & 1)) {
            _mm_prefetch(next_k + d * 32, _MM_HINT_T0);
            _mm_prefetch(these_v + d * 32, _MM_HINT_T0);
        }
        const __m256 kl = f16x8(kb + d * 16), kh = f16x8(kb + d * 16 + 8);
        for (int h = 0; h < G; h++) {
            const __m256 qd = _mm256_set1_ps(qh[h][d]);
            lo[h] = _mm256_fmadd_ps(qd, kl, lo[h]);
            hi[h] = _mm256_fmadd_ps(qd, kh, hi[h]);
        }
    }
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    const __m256 live_lo = _mm256_castsi256_ps(tail_mask(n_keys - b * 16));
    const __m256 live_hi = _mm256_castsi256_ps(tail_mask(n_keys - b * 16 - 8));
    for (int h = 0; h < G; h++) {
        const __m256 sl = _mm256_blendv_ps(ninf, _mm256_mul_ps(lo[h], vscale), live_lo);
        const __m256 su = _mm256_blendv_ps(ninf, _mm256_mul_ps(hi[h], vscale), live_hi);
        vmax[h] = _mm256_max_ps(vmax[h], _mm256_max_ps(sl, su));
        _mm256_storeu_ps(sh[h] + b * 16, sl);
        _mm256_storeu_ps(sh[h] + b * 16 + 8, su);
    }
}

/* Weighted values for G heads over 16 dimensions from d0: even and odd keys in two running sums. */
INLINE void pv_dims(const int G, const uint16_t *v, int head_dim, int d0, int64_t n_keys, float *const *sh,
                    float *const *po) {
    __m256 even[PV_HEADS][2], odd[PV_HEADS][2];
    for (int h = 0; h < G; h++)
        for (int i = 0; i < 2; i++) even[h][i] = odd[h][i] = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + 1 < n_keys; t += 2) {
        __m256 ve[2], vo[2];
        for (int i = 0; i < 2; i++) {
            ve[i] = f16x8(v + t * head_dim + d0 + 8 * i);
            vo[i] = f16x8(v + (t + 1) * head_dim + d0 + 8 * i);
        }
        for (int h = 0; h < G; h++) {
            const __m256 we = _mm256_set1_ps(sh[h][t]), wo = _mm256_set1_ps(sh[h][t + 1]);
            for (int i = 0; i < 2; i++) {
                even[h][i] = _mm256_fmadd_ps(we, ve[i], even[h][i]);
                odd[h][i] = _mm256_fmadd_ps(wo, vo[i], odd[h][i]);
            }
        }
    }
    if (t < n_keys) {
        for (int i = 0; i < 2; i++) {
            const __m256 ve = f16x8(v + t * head_dim + d0 + 8 * i);
            for (int h = 0; h < G; h++) even[h][i] = _mm256_fmadd_ps(_mm256_set1_ps(sh[h][t]), ve, even[h][i]);
        }
    }
    for (int h = 0; h < G; h++)
        for (int i = 0; i < 2; i++) _mm256_storeu_ps(po[h] + d0 + 8 * i, _mm256_add_ps(even[h][i], odd[h][i]));
}

INLINE void attend_heads(const int G, const float *const *qh, const uint16_t *k, const uint16_t *v, int64_t n_keys,
                         int head_dim, __m256 vscale, float *const *sh, float *const *po, float *mxs, float *sums) {
    const int64_t nb = (n_keys + 15) / 16;
    __m256 vmax[HEADS_PER_PASS];
    for (int h = 0; h < G; h++) vmax[h] = _mm256_set1_ps(-INFINITY);
    for (int64_t b = 0; b < nb; b++)
        qk_block(G, qh, k + b * head_dim * 16, v + b * 16 * head_dim, head_dim, b, n_keys, vscale, sh, vmax);
    for (int h = 0; h < G; h++) {
        mxs[h] = hmax(vmax[h]);
        const __m256 mx = _mm256_set1_ps(mxs[h]);
        /* 16 running sums (one per key lane of a block), reduced as the AVX-512 kernel reduces its own. */
        __m256 vsum[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t b = 0; b < nb; b++)
            for (int half = 0; half < 2; half++) {
                float *s = sh[h] + b * 16 + 8 * half;
                const __m256 live = _mm256_castsi256_ps(tail_mask(n_keys - b * 16 - 8 * half));
                const __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(_mm256_loadu_ps(s), mx)), live);
                _mm256_storeu_ps(s, e);
                vsum[half] = _mm256_add_ps(vsum[half], e);
            }
        sums[h] = hsum(_mm256_add_ps(vsum[1], vsum[0]));
    }
    for (int h = 0; h < G; h += PV_HEADS)
        for (int d0 = 0; d0 < head_dim; d0 += 16) {
            if (G - h >= 2) pv_dims(2, v, head_dim, d0, n_keys, sh + h, po + h);
            else pv_dims(1, v, head_dim, d0, n_keys, sh + h, po + h);
        }
}

static void attend_part(const float *q, int n_q, int64_t ldq, const uint16_t *k, const uint16_t *v, int64_t t0,
                        int64_t t1, int head_dim, float scale, float *part, int64_t ldpart, float *scratch) {
    if (head_dim % 16 != 0) {
        sk_generic_kernels.attend_part(q, n_q, ldq, k, v, t0, t1, head_dim, scale, part, ldpart, scratch);
        return;
    }
    const int64_t n_keys = t1 - t0, stride = (n_keys + 15) / 16 * 16;
    k += (t0 / 16) * head_dim * 16;
    v += t0 * head_dim;
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int h0 = 0; h0 < n_q; h0 += HEADS_PER_PASS) {
        const int G = n_q - h0 < HEADS_PER_PASS ? n_q - h0 : HEADS_PER_PASS;
        const float *qh[HEADS_PER_PASS];
        float *sh[HEADS_PER_PASS], *po[HEADS_PER_PASS], mxs[HEADS_PER_PASS], sums[HEADS_PER_PASS];
        for (int h = 0; h < G; h++) {
            qh[h] = q + (h0 + h) * ldq;
            sh[h] = scratch + h * stride;
            po[h] = part + (h0 + h) * ldpart + 2;
        }
        switch (G) {
        case 4: attend_heads(4, qh, k, v, n_keys, head_dim, vscale, sh, po, mxs, sums); break;
        case 3: attend_heads(3, qh, k, v, n_keys, head_dim, vscale, sh, po, mxs, sums); break;
        case 2: attend_heads(2, qh, k, v, n_keys, head_dim, vscale, sh, po, mxs, sums); break;
        default: attend_heads(1, qh, k, v, n_keys, head_dim, vscale, sh, po, mxs, sums); break;
        }
        for (int h = 0; h < G; h++) {
            part[(h0 + h) * ldpart] = mxs[h];
            part[(h0 + h) * ldpart + 1] = sums[h];
        }
    }
}

const sk_kernels sk_avx2_kernels = {
    .name = "avx2",
    .quantize_rows = quantize_rows,
    .gemm_q = sk_avx2_gemm_q,
    .gemm_f = gemm_f,
    .supports = supports,
    .packed_size = packed_size,
    .pack = pack,
    .column_unit = 16,
    .attend_part = attend_part,
    .rms_norm = rms_norm,
    .silu_mul = silu_mul,
    .dn_conv = sk_avx2_dn_conv,
    .dn_l2norm = sk_avx2_dn_l2norm,
    .dn_rule = sk_avx2_dn_rule,
};
