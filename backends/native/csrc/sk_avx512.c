/* AVX-512 (F, BW, VL, DQ, VNNI) kernels: float-weight matmuls, activation quantization, norms,
 * activations and attention (the quantized matmuls are in sk_avx512_gemm.c). Compiled for that target
 * only; sk_ctx.c picks them only after checking the CPU has it. */
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma,bmi2")
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "sk.h"
#include "sk_avx512.h"
#include "sk_pack.h"

#define INLINE static inline __attribute__((always_inline))


INLINE void store_tile(float res[4][4], int mr, int nr, int64_t r0, int64_t n0, const float *bias, float *out,
                       int64_t ldo, int accumulate) {
    for (int r = 0; r < mr; r++)
        for (int n = 0; n < nr; n++) {
            float v = res[r][n];
            if (bias) v += bias[n0 + n];
            float *o = out + (r0 + r) * ldo + n0 + n;
            *o = accumulate ? *o + v : v;
        }
}

/* Rows in blocks of ROW_BLOCK so a block of activations stays in L2 while the weights stream past. */
enum { ROW_BLOCK = 64 };

/* ---- float weights (F32, F16, BF16) with float activations ------------------------------------ */

INLINE __m512 load_w16(int type, const uint8_t *row, int64_t c) {
    if (type == SK_F32) return _mm512_loadu_ps((const float *)row + 16 * c);
    __m256i h = _mm256_loadu_si256((const __m256i *)(row + 32 * c));
    if (type == SK_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

INLINE void tile_f(int type, const uint8_t *w0, int64_t rb, int64_t nc, const float *x, int64_t ldx, int64_t r0,
                   const int MR, const int NR, float res[4][4]) {
    __m512 acc[4][4];
    for (int r = 0; r < MR; r++)
        for (int n = 0; n < NR; n++) acc[r][n] = _mm512_setzero_ps();
    for (int64_t c = 0; c < nc; c++) {
        __m512 W[4];
        for (int n = 0; n < NR; n++) W[n] = load_w16(type, w0 + n * rb, c);
        for (int r = 0; r < MR; r++) {
            __m512 X = _mm512_loadu_ps(x + (r0 + r) * ldx + 16 * c);
            for (int n = 0; n < NR; n++) acc[r][n] = _mm512_fmadd_ps(W[n], X, acc[r][n]);
        }
    }
    for (int r = 0; r < MR; r++)
        for (int n = 0; n < NR; n++) res[r][n] = _mm512_reduce_add_ps(acc[r][n]);
}

#define DEF_FGEMM(NAME, TYPE)                                                                                 \
    static void NAME(const sk_tensor *w, int64_t n0, int64_t n1, const float *x, int64_t ldx, int64_t m,      \
                     float *out, int64_t ldo, int accumulate) {                                               \
        const int64_t nc = w->n_cols / 16, rb = w->row_bytes;                                                 \
        float res[4][4];                                                                                      \
        for (int64_t m0 = 0; m0 < m; m0 += ROW_BLOCK) {                                                       \
            const int64_t m1 = m0 + ROW_BLOCK < m ? m0 + ROW_BLOCK : m;                                       \
            for (int64_t n = n0; n < n1;) {                                                                   \
                const int nr = n1 - n >= 4 ? 4 : 1;                                                           \
                const uint8_t *w0 = w->data + n * rb;                                                         \
                for (int64_t r = m0; r < m1;) {                                                               \
                    const int mr = m1 - r >= 4 ? 4 : 1;                                                       \
                    if (nr == 4 && mr == 4) tile_f(TYPE, w0, rb, nc, x, ldx, r, 4, 4, res);                    \
                    else if (nr == 4) tile_f(TYPE, w0, rb, nc, x, ldx, r, 1, 4, res);                          \
                    else if (mr == 4) tile_f(TYPE, w0, rb, nc, x, ldx, r, 4, 1, res);                          \
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
    return w->layout == 0 && w->n_cols % 16 == 0;
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
    for (int64_t r = 0; r < m; r++) {
        const float *xr = x + r * ldx;
        const int64_t row = r0 + r;
        int8_t *q = a->q + row * kp;
        for (int64_t b = 0; b < kp / 32; b++) {
            int64_t i0 = 32 * b;
            __mmask16 k0 = i0 >= k ? 0 : (k - i0 >= 16 ? 0xffff : (__mmask16)((1u << (k - i0)) - 1));
            __mmask16 k1 = i0 + 16 >= k ? 0 : (k - i0 - 16 >= 16 ? 0xffff : (__mmask16)((1u << (k - i0 - 16)) - 1));
            __m512 v0 = _mm512_maskz_loadu_ps(k0, xr + i0), v1 = _mm512_maskz_loadu_ps(k1, xr + i0 + 16);
            float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            float d = amax / 127.0f, id = sk_act_inverse_scale(d);
            __m512 vid = _mm512_set1_ps(id);
            __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, vid)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, vid));
            _mm_storeu_si128((__m128i *)(q + i0), _mm512_cvtepi32_epi8(q0));
            _mm_storeu_si128((__m128i *)(q + i0 + 16), _mm512_cvtepi32_epi8(q1));
            int s0 = _mm512_reduce_add_epi32(q0), s1 = _mm512_reduce_add_epi32(q1);
            a->d[row * (kp / 32) + b] = sk_act_round(d);  /* float16, as the generic version */
            a->s[row * (kp / 32) + b] = sk_act_round(d * (float)(s0 + s1));
            a->qs16[row * (kp / 16) + 2 * b] = s0;
            a->qs16[row * (kp / 16) + 2 * b + 1] = s1;
        }
    }
}

/* ---- elementwise ------------------------------------------------------------------------------- */

INLINE __mmask16 tail_mask(int64_t left) { return left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1); }

static void rms_norm(const float *x, const float *w, int64_t n, float eps, float *y) {
    __m512 ss = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        __m512 v = _mm512_maskz_loadu_ps(tail_mask(n - i), x + i);
        ss = _mm512_fmadd_ps(v, v, ss);
    }
    float scale = 1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)n + eps);
    __m512 vs = _mm512_set1_ps(scale);
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 k = tail_mask(n - i);
        __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + i), vs), _mm512_maskz_loadu_ps(k, w + i));
        _mm512_mask_storeu_ps(y + i, k, v);
    }
}

static void silu_mul(const float *g, const float *u, int64_t n, float *y) {
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 k = tail_mask(n - i);
        __m512 vg = _mm512_maskz_loadu_ps(k, g + i);
        __m512 s = _mm512_div_ps(vg, _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), vg))));
        _mm512_mask_storeu_ps(y + i, k, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(k, u + i)));
    }
}

/* ---- attention --------------------------------------------------------------------------------- */

enum { HEADS_PER_PASS = 4, KEY_BLOCKS_PER_PASS = 4, PV_HEADS = 2 };

/* Scores per 16-key block as an fma chain over the head dimension, max, exponentials masked to an
 * exact 0 past t1, and values accumulated key by key into two running sums (even and odd keys) added
 * at the end. Several key blocks and heads are processed side by side only so that independent
 * chains overlap; each score and each sum follows an order fixed by the key index alone, never by how
 * many rows, heads or blocks run together. */
/* Scores of NB 16-key blocks for G heads (compile-time counts, so the accumulators live in registers). */
INLINE void qk_blocks(const int G, const int NB, const float *const *qh, const uint16_t *kb, const uint16_t *vb,
                      int head_dim, int64_t b0, int64_t n_keys, __m512 vscale, float *const *sh, __m512 *vmax) {
    __m512 acc[HEADS_PER_PASS][KEY_BLOCKS_PER_PASS];
    for (int h = 0; h < G; h++)
        for (int j = 0; j < NB; j++) acc[h][j] = _mm512_setzero_ps();
    /* A long context's keys and values come from memory: while these blocks' scores are summed, the next
     * blocks' keys and these blocks' values are asked for (as many bytes each as the pass reads), so the
     * value pass and the next pass find them cached. Prefetches change no result and never fault. */
    const char *next_k = (const char *)(kb + (int64_t)NB * head_dim * 16), *these_v = (const char *)vb;
    const int pass_bytes = NB * 32;
    for (int d = 0; d < head_dim; d++) {
        for (int off = (d * pass_bytes + 63) & ~63; off < (d + 1) * pass_bytes; off += 64) {
            _mm_prefetch(next_k + off, _MM_HINT_T0);
            _mm_prefetch(these_v + off, _MM_HINT_T0);
        }
        __m512 kv[KEY_BLOCKS_PER_PASS];
        for (int j = 0; j < NB; j++)
            kv[j] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(kb + (j * head_dim + d) * 16)));
        for (int h = 0; h < G; h++) {
            const __m512 qd = _mm512_set1_ps(qh[h][d]);
            for (int j = 0; j < NB; j++) acc[h][j] = _mm512_fmadd_ps(qd, kv[j], acc[h][j]);
        }
    }
    for (int j = 0; j < NB; j++) {
        const int64_t b = b0 + j;
        const __mmask16 live = tail_mask(n_keys - b * 16);
        for (int h = 0; h < G; h++) {
            __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, _mm512_mul_ps(acc[h][j], vscale));
            vmax[h] = _mm512_max_ps(vmax[h], s);
            _mm512_storeu_ps(sh[h] + b * 16, s);
        }
    }
}

/* Weighted values for G heads over 16 * ND dimensions from d0: even and odd keys in two running sums. */
INLINE void pv_dims(const int G, const int ND, const uint16_t *v, int head_dim, int d0, int64_t n_keys,
                    float *const *sh, float *const *po) {
    __m512 even[PV_HEADS][4], odd[PV_HEADS][4];
    for (int h = 0; h < G; h++)
        for (int i = 0; i < ND; i++) even[h][i] = odd[h][i] = _mm512_setzero_ps();
    int64_t t = 0;
    for (; t + 1 < n_keys; t += 2) {
        __m512 ve[4], vo[4];
        for (int i = 0; i < ND; i++) {
            ve[i] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(v + t * head_dim + d0 + 16 * i)));
            vo[i] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(v + (t + 1) * head_dim + d0 + 16 * i)));
        }
        for (int h = 0; h < G; h++) {
            const __m512 we = _mm512_set1_ps(sh[h][t]), wo = _mm512_set1_ps(sh[h][t + 1]);
            for (int i = 0; i < ND; i++) {
                even[h][i] = _mm512_fmadd_ps(we, ve[i], even[h][i]);
                odd[h][i] = _mm512_fmadd_ps(wo, vo[i], odd[h][i]);
            }
        }
    }
    if (t < n_keys) {
        for (int i = 0; i < ND; i++) {
            const __m512 ve = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(v + t * head_dim + d0 + 16 * i)));
            for (int h = 0; h < G; h++) even[h][i] = _mm512_fmadd_ps(_mm512_set1_ps(sh[h][t]), ve, even[h][i]);
        }
    }
    for (int h = 0; h < G; h++)
        for (int i = 0; i < ND; i++) _mm512_storeu_ps(po[h] + d0 + 16 * i, _mm512_add_ps(even[h][i], odd[h][i]));
}

INLINE void pv_heads(const int G, const uint16_t *v, int head_dim, int64_t n_keys, float *const *sh, float *const *po) {
    int d0 = 0;
    for (; d0 + 64 <= head_dim; d0 += 64) pv_dims(G, 4, v, head_dim, d0, n_keys, sh, po);
    switch ((head_dim - d0) / 16) {
    case 3: pv_dims(G, 3, v, head_dim, d0, n_keys, sh, po); break;
    case 2: pv_dims(G, 2, v, head_dim, d0, n_keys, sh, po); break;
    case 1: pv_dims(G, 1, v, head_dim, d0, n_keys, sh, po); break;
    default: break;
    }
}

INLINE void attend_heads(const int G, const float *const *qh, const uint16_t *k, const uint16_t *v, int64_t n_keys,
                         int head_dim, __m512 vscale, float *const *sh, float *const *po, float *mxs, float *sums) {
    const int64_t nb = (n_keys + 15) / 16;
    __m512 vmax[HEADS_PER_PASS], vsum[HEADS_PER_PASS];
    for (int h = 0; h < G; h++) vmax[h] = _mm512_set1_ps(-INFINITY);
    int64_t b0 = 0;
    for (; b0 + KEY_BLOCKS_PER_PASS <= nb; b0 += KEY_BLOCKS_PER_PASS)
        qk_blocks(G, KEY_BLOCKS_PER_PASS, qh, k + b0 * head_dim * 16, v + b0 * 16 * head_dim, head_dim, b0, n_keys,
                  vscale, sh, vmax);
    switch (nb - b0) {
    case 3: qk_blocks(G, 3, qh, k + b0 * head_dim * 16, v + b0 * 16 * head_dim, head_dim, b0, n_keys, vscale, sh, vmax); break;
    case 2: qk_blocks(G, 2, qh, k + b0 * head_dim * 16, v + b0 * 16 * head_dim, head_dim, b0, n_keys, vscale, sh, vmax); break;
    case 1: qk_blocks(G, 1, qh, k + b0 * head_dim * 16, v + b0 * 16 * head_dim, head_dim, b0, n_keys, vscale, sh, vmax); break;
    default: break;
    }
    for (int h = 0; h < G; h++) {
        mxs[h] = _mm512_reduce_max_ps(vmax[h]);
        const __m512 mx = _mm512_set1_ps(mxs[h]);
        vsum[h] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            float *s = sh[h] + b * 16;
            __m512 e = _mm512_maskz_mov_ps(tail_mask(n_keys - b * 16), exp512(_mm512_sub_ps(_mm512_loadu_ps(s), mx)));
            _mm512_storeu_ps(s, e);
            vsum[h] = _mm512_add_ps(vsum[h], e);
        }
        sums[h] = _mm512_reduce_add_ps(vsum[h]);
    }
    for (int h = 0; h < G; h += PV_HEADS) {
        if (G - h >= 2) pv_heads(2, v, head_dim, n_keys, sh + h, po + h);
        else pv_heads(1, v, head_dim, n_keys, sh + h, po + h);
    }
}

/* Scores per 16-key block as an fma chain over the head dimension, max, exponentials masked to an
 * exact 0 past t1, and values accumulated key by key into two running sums (even and odd keys) added
 * at the end. Key blocks and heads are processed side by side only so that independent chains
 * overlap; each score and each sum follows an order fixed by the key index alone, never by how many
 * rows, heads or blocks run together. */
static void attend_part(const float *q, int n_q, int64_t ldq, const uint16_t *k, const uint16_t *v, int64_t t0,
                        int64_t t1, int head_dim, float scale, float *part, int64_t ldpart, float *scratch) {
    if (head_dim % 16 != 0) {
        sk_generic_kernels.attend_part(q, n_q, ldq, k, v, t0, t1, head_dim, scale, part, ldpart, scratch);
        return;
    }
    const int64_t n_keys = t1 - t0, stride = (n_keys + 15) / 16 * 16;
    k += (t0 / 16) * head_dim * 16;
    v += t0 * head_dim;
    const __m512 vscale = _mm512_set1_ps(scale);
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

const sk_kernels sk_avx512_kernels = {
    .name = "avx512-vnni",
    .quantize_rows = quantize_rows,
    .gemm_q = sk_avx512_gemm_q,
    .gemm_f = gemm_f,
    .supports = supports,
    .packed_size = packed_size,
    .pack = pack,
    .column_unit = 16,
    .attend_part = attend_part,
    .rms_norm = rms_norm,
    .silu_mul = silu_mul,
    .dn_conv = sk_avx512_dn_conv,
    .dn_l2norm = sk_avx512_dn_l2norm,
    .dn_rule = sk_avx512_dn_rule,
};
