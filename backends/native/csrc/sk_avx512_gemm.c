/* AVX-512 VNNI matmul over quantized weights, in a column-interleaved layout.
 *
 * Weights are packed at load (sk_pack.h) so that one 64-byte vector holds 4 consecutive values of
 * one 32-value block for each of 16 columns. One vpdpbusd then multiplies them with 4 activation bytes
 * broadcast to every lane, and after 8 of them each lane holds its column's exact integer dot
 * product for the block. Per output element and block, in block order:
 *
 *     isum = sum of the block's value * activation products            exact int32
 *     acc  = fma(float(isum - offset * qsum), dw * da, acc)             dw, da: weight, activation scale
 *     acc  = fma(mw, s, acc)              types with a minimum (s = da * sum of the block's activations)
 *
 * (Q6_K does the first step per 16 values, as its scales are per 16.) The codebook types (IQ4_NL,
 * IQ4_XS, MXFP4) keep their 4-bit codes and look each up in their 16-entry table with one byte shuffle
 * (the table's integers + 128, as Q8_0's bytes are), Q3_K keeps 3 bits and Q2_K 2 per value: the
 * integers multiplied, and so the sums, are the same as if they were stored as bytes. Each lane is one
 * element, and
 * tiles of up to 4 rows x 4 column groups only share loads, so the row count, the tile shape and
 * the thread split never change a bit of the result.
 */
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma,bmi2")
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#include "sk.h"
#include "sk_avx512.h"
#include "sk_codebooks.h"
#include "sk_pack.h"

#define INLINE static inline __attribute__((always_inline))

INLINE uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

enum { GROUP = SK_GROUP, NIB = SK_NIB, HB5 = SK_HB5, HB6 = SK_HB6, DVEC = SK_DVEC, KHDR = SK_KHDR, Q6HDR = SK_Q6HDR };

/* ---- kernels ----------------------------------------------------------------------------------- */

/* K_IQ4, K_MXFP4: nibble codes through their table; K_Q2: 2-bit values; K_Q3: 3-bit values (Q3_K's + 4). */
enum { K_NIB4, K_NIB5, K_BYTES, K_NIB6, K_IQ4, K_MXFP4, K_Q2, K_Q3 };

/* A 16-entry table of signed values as unsigned bytes (value + 128), in every 128-bit lane. */
INLINE __m512i table_u8(const int8_t *values) {
    return _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)values)), _mm512_set1_epi8((char)0x80));
}

/* Value groups j and j+4 of one block of one column group, as unsigned bytes. */
INLINE void pair(const int kind, const uint8_t *qp, const int j, __m512i *lo, __m512i *hi) {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    if (kind == K_BYTES) {
        *lo = _mm512_loadu_si512((const void *)(qp + 64 * j));
        *hi = _mm512_loadu_si512((const void *)(qp + 64 * (j + 4)));
        return;
    }
    if (kind == K_Q2 || kind == K_Q3) {
        /* bits 2j..2j+1 of each byte to bits 0..1 (16-bit shifts; the mask drops what crossed bytes) */
        const __m512i m3 = _mm512_set1_epi8(3);
        __m512i l = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512((const void *)qp), 2 * j), m3);
        __m512i h = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512((const void *)(qp + 64)), 2 * j), m3);
        if (kind == K_Q3) { /* the third bit: bit j (value 4j+i) and j+4 (value 16+4j+i) of the plane */
            const __m512i bits = _mm512_loadu_si512((const void *)(qp + HB6)), four = _mm512_set1_epi8(4);
            l = _mm512_or_si512(l, _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(bits, _mm512_set1_epi8((char)(1 << j))), four));
            h = _mm512_or_si512(h, _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(bits, _mm512_set1_epi8((char)(16 << j))), four));
        }
        *lo = l;
        *hi = h;
        return;
    }
    const int hb = kind == K_NIB5 ? HB5 : kind == K_NIB6 ? HB6 : 0;
    __m512i v = _mm512_loadu_si512((const void *)(qp + hb + 64 * j));
    __m512i l = _mm512_and_si512(v, m4), h = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    if (kind == K_NIB5) {
        __m512i bits = _mm512_loadu_si512((const void *)qp);
        const __m512i sixteen = _mm512_set1_epi8(16);
        l = _mm512_or_si512(l, _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(bits, _mm512_set1_epi8((char)(1 << j))), sixteen));
        h = _mm512_or_si512(h, _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(bits, _mm512_set1_epi8((char)(16 << j))), sixteen));
    } else if (kind == K_NIB6) {
        const __m512i m30 = _mm512_set1_epi8(0x30);
        __m512i p0 = _mm512_loadu_si512((const void *)qp), p1 = _mm512_loadu_si512((const void *)(qp + 64));
        /* bits 2j..2j+1 of each byte to bits 4..5 (16-bit shifts; the mask drops what crossed bytes) */
        if (j == 0) { p0 = _mm512_slli_epi16(p0, 4); p1 = _mm512_slli_epi16(p1, 4); }
        else if (j == 1) { p0 = _mm512_slli_epi16(p0, 2); p1 = _mm512_slli_epi16(p1, 2); }
        else if (j == 3) { p0 = _mm512_srli_epi16(p0, 2); p1 = _mm512_srli_epi16(p1, 2); }
        l = _mm512_or_si512(l, _mm512_and_si512(p0, m30));
        h = _mm512_or_si512(h, _mm512_and_si512(p1, m30));
    } else if (kind == K_IQ4 || kind == K_MXFP4) {
        const __m512i tab = table_u8(kind == K_IQ4 ? sk_iq4nl_values : sk_mxfp4_values);
        l = _mm512_shuffle_epi8(tab, l);
        h = _mm512_shuffle_epi8(tab, h);
    }
    *lo = l;
    *hi = h;
}

/* Integer dot products of one block for MR rows x NG column groups: values 0..15 into lo, 16..31 into hi. */
INLINE void dot_block(const int kind, const uint8_t *const qp[4], const sk_act *a, int64_t r0, int64_t b, const int MR,
                      const int NG, __m512i lo[4][4], __m512i hi[4][4]) {
    const int64_t kp = a->kp;
    for (int r = 0; r < MR; r++)
        for (int n = 0; n < NG; n++) lo[r][n] = hi[r][n] = _mm512_setzero_si512();
    for (int j = 0; j < 4; j++) {
        for (int n = 0; n < NG; n++) {
            __m512i wl, wh;
            pair(kind, qp[n], j, &wl, &wh);
            for (int r = 0; r < MR; r++) {
                const uint8_t *aq = (const uint8_t *)(a->q + (r0 + r) * kp + 32 * b);
                lo[r][n] = _mm512_dpbusd_epi32(lo[r][n], wl, _mm512_set1_epi32((int)rd32(aq + 4 * j)));
                hi[r][n] = _mm512_dpbusd_epi32(hi[r][n], wh, _mm512_set1_epi32((int)rd32(aq + 16 + 4 * j)));
            }
        }
    }
}

INLINE __m512 f16x16(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }

/* acc[r][n] += one block's contribution; OFF: unsigned offset of a symmetric type (0: has a minimum). */
INLINE void add_block(const int OFF, __m512i lo[4][4], __m512i hi[4][4], const __m512 dw[4], const __m512 mw[4],
                      const sk_act *a, int64_t r0, int64_t b, const int MR, const int NG, __m512 acc[4][4]) {
    const int64_t kb = a->kp / 32, k16 = a->kp / 16;
    for (int r = 0; r < MR; r++) {
        const int64_t row = r0 + r;
        const __m512 da = _mm512_set1_ps(a->d[row * kb + b]);
        const __m512 s = _mm512_set1_ps(a->s[row * kb + b]);
        const __m512i off = _mm512_set1_epi32(OFF * (a->qs16[row * k16 + 2 * b] + a->qs16[row * k16 + 2 * b + 1]));
        for (int n = 0; n < NG; n++) {
            __m512i is = _mm512_add_epi32(lo[r][n], hi[r][n]);
            if (OFF) is = _mm512_sub_epi32(is, off);
            acc[r][n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), _mm512_mul_ps(dw[n], da), acc[r][n]);
            if (!OFF) acc[r][n] = _mm512_fmadd_ps(mw[n], s, acc[r][n]);
        }
    }
}

/* Q6_K (OFF 32) and Q3_K (OFF 4): two 16-value halves with their own scales. */
INLINE void add_block6(const int OFF, __m512i lo[4][4], __m512i hi[4][4], const __m512 dw0[4], const __m512 dw1[4], const sk_act *a,
                       int64_t r0, int64_t b, const int MR, const int NG, __m512 acc[4][4]) {
    const int64_t kb = a->kp / 32, k16 = a->kp / 16;
    for (int r = 0; r < MR; r++) {
        const int64_t row = r0 + r;
        const __m512 da = _mm512_set1_ps(a->d[row * kb + b]);
        const __m512i off0 = _mm512_set1_epi32(OFF * a->qs16[row * k16 + 2 * b]);
        const __m512i off1 = _mm512_set1_epi32(OFF * a->qs16[row * k16 + 2 * b + 1]);
        for (int n = 0; n < NG; n++) {
            acc[r][n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(lo[r][n], off0)), _mm512_mul_ps(dw0[n], da), acc[r][n]);
            acc[r][n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(hi[r][n], off1)), _mm512_mul_ps(dw1[n], da), acc[r][n]);
        }
    }
}

/* Q2_K: two 16-value halves, each with its own scale and minimum (no offset: values 0..3). */
INLINE void add_block2(__m512i lo[4][4], __m512i hi[4][4], const __m512 dw[2][4], const __m512 mw[2][4], const sk_act *a,
                       int64_t r0, int64_t b, const int MR, const int NG, __m512 acc[4][4]) {
    const int64_t kb = a->kp / 32, k16 = a->kp / 16;
    for (int r = 0; r < MR; r++) {
        const int64_t row = r0 + r;
        const float daf = a->d[row * kb + b];
        const __m512 da = _mm512_set1_ps(daf);
        const __m512 s0 = _mm512_set1_ps(daf * (float)a->qs16[row * k16 + 2 * b]);
        const __m512 s1 = _mm512_set1_ps(daf * (float)a->qs16[row * k16 + 2 * b + 1]);
        for (int n = 0; n < NG; n++) {
            acc[r][n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo[r][n]), _mm512_mul_ps(dw[0][n], da), acc[r][n]);
            acc[r][n] = _mm512_fmadd_ps(mw[0][n], s0, acc[r][n]);
            acc[r][n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi[r][n]), _mm512_mul_ps(dw[1][n], da), acc[r][n]);
            acc[r][n] = _mm512_fmadd_ps(mw[1][n], s1, acc[r][n]);
        }
    }
}

INLINE __m512i u8x16i(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }

/* MXFP4's 16 E8M0 exponents as the floats sk_e8m0_half makes of them: 2^(e - 128), subnormal below e = 2. */
INLINE __m512 e8m0x16(const uint8_t *p) {
    const __m512i e = u8x16i(p);
    const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    const __m512i subnormal = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2)), normal, subnormal));
}

/* One tile: MR rows from r0, NG column groups from g (group base pointers g0 + n * gb). */
INLINE void tile(const int type, const uint8_t *g0, int64_t gb, int64_t k, const sk_act *a, int64_t r0, const int MR,
                 const int NG, __m512 acc[4][4]) {
    for (int r = 0; r < MR; r++)
        for (int n = 0; n < NG; n++) acc[r][n] = _mm512_setzero_ps();
    __m512i lo[4][4], hi[4][4];
    __m512 dw[4], mw[4];
    const uint8_t *qp[4];
    if (type == SK_Q4_K || type == SK_Q5_K || type == SK_Q6_K || type == SK_Q3_K) {
        const int six = type == SK_Q6_K || type == SK_Q3_K; /* Q3_K: Q6_K's scales, its own values */
        const int64_t st = sk_super_tile_bytes(type);
        const int64_t bt = type == SK_Q4_K ? NIB : type == SK_Q5_K ? HB5 + NIB : type == SK_Q3_K ? SK_Q3BLK : HB6 + NIB;
        const int kind = type == SK_Q4_K ? K_NIB4 : type == SK_Q5_K ? K_NIB5 : type == SK_Q3_K ? K_Q3 : K_NIB6;
        for (int64_t sb = 0; sb < k / 256; sb++) {
            const uint8_t *hdr[4];
            for (int n = 0; n < NG; n++) hdr[n] = g0 + n * gb + sb * st;
            for (int j = 0; j < 8; j++) {
                const int64_t b = sb * 8 + j;
                const int hl = six ? Q6HDR : KHDR;
                for (int n = 0; n < NG; n++) qp[n] = hdr[n] + hl + j * bt;
                dot_block(kind, qp, a, r0, b, MR, NG, lo, hi);
                if (six) {
                    __m512 dw1[4];
                    for (int n = 0; n < NG; n++) {
                        __m512 d = f16x16(hdr[n]);
                        const uint8_t *sc = hdr[n] + DVEC + GROUP * 2 * j;
                        dw[n] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)sc))));
                        dw1[n] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sc + GROUP)))));
                    }
                    add_block6(type == SK_Q3_K ? 4 : 32, lo, hi, dw, dw1, a, r0, b, MR, NG, acc);
                } else {
                    for (int n = 0; n < NG; n++) {
                        const uint8_t *sc = hdr[n] + 2 * DVEC + GROUP * j, *mn = sc + 8 * GROUP;
                        dw[n] = _mm512_mul_ps(f16x16(hdr[n]), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)sc))));
                        mw[n] = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(f16x16(hdr[n] + DVEC),
                                      _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)mn)))));
                    }
                    add_block(0, lo, hi, dw, mw, a, r0, b, MR, NG, acc);
                }
            }
        }
        return;
    }
    if (type == SK_Q2_K) { /* scales and minima per 16 values, 4 bits each in one byte */
        for (int64_t sb = 0; sb < k / 256; sb++) {
            const uint8_t *hdr[4];
            for (int n = 0; n < NG; n++) hdr[n] = g0 + n * gb + sb * sk_super_tile_bytes(type);
            for (int j = 0; j < 8; j++) {
                __m512 dw2[2][4], mw2[2][4];
                for (int n = 0; n < NG; n++) {
                    qp[n] = hdr[n] + SK_Q2HDR + j * SK_Q2BLK;
                    const __m512 d = f16x16(hdr[n]), dmin = f16x16(hdr[n] + DVEC);
                    for (int h = 0; h < 2; h++) {
                        const __m512i sm = u8x16i(hdr[n] + 2 * DVEC + GROUP * (2 * j + h));
                        const __m512 sc = _mm512_cvtepi32_ps(_mm512_and_si512(sm, _mm512_set1_epi32(15)));
                        dw2[h][n] = _mm512_mul_ps(d, sc);
                        mw2[h][n] = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_srli_epi32(sm, 4))));
                    }
                }
                dot_block(K_Q2, qp, a, r0, sb * 8 + j, MR, NG, lo, hi);
                add_block2(lo, hi, dw2, mw2, a, r0, sb * 8 + j, MR, NG, acc);
            }
        }
        return;
    }
    if (type == SK_IQ4_XS) { /* IQ4_NL's codes with a signed scale per block, d * sc */
        for (int64_t sb = 0; sb < k / 256; sb++) {
            const uint8_t *hdr[4];
            for (int n = 0; n < NG; n++) hdr[n] = g0 + n * gb + sb * sk_super_tile_bytes(type);
            for (int j = 0; j < 8; j++) {
                for (int n = 0; n < NG; n++) {
                    qp[n] = hdr[n] + SK_XSHDR + j * NIB;
                    const __m128i sc = _mm_loadu_si128((const __m128i *)(hdr[n] + DVEC + GROUP * j));
                    dw[n] = _mm512_mul_ps(f16x16(hdr[n]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
                }
                dot_block(K_IQ4, qp, a, r0, sb * 8 + j, MR, NG, lo, hi);
                add_block(128, lo, hi, dw, mw, a, r0, sb * 8 + j, MR, NG, acc);
            }
        }
        return;
    }
    const int asym = type == SK_Q4_1 || type == SK_Q5_1, mx = type == SK_MXFP4; /* MXFP4: E8M0 scales */
    const int kind = type == SK_Q8_0 ? K_BYTES : type == SK_IQ4_NL ? K_IQ4 : mx ? K_MXFP4
                   : (type == SK_Q5_0 || type == SK_Q5_1) ? K_NIB5 : K_NIB4;
    const int off = type == SK_Q4_0 ? 8 : type == SK_Q5_0 ? 16 : type == SK_Q8_0 || type == SK_IQ4_NL || mx ? 128 : 0;
    const int64_t bt = sk_block_tile_bytes(type);
    for (int64_t b = 0; b < k / 32; b++) {
        for (int n = 0; n < NG; n++) {
            const uint8_t *t = g0 + n * gb + b * bt;
            dw[n] = mx ? e8m0x16(t) : f16x16(t);
            if (asym) mw[n] = f16x16(t + DVEC);
            qp[n] = t + (mx ? SK_E8M0 : (asym ? 2 : 1) * DVEC);
        }
        dot_block(kind, qp, a, r0, b, MR, NG, lo, hi);
        add_block(off, lo, hi, dw, mw, a, r0, b, MR, NG, acc);
    }
}

INLINE __mmask16 cols_mask(int64_t left) { return left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1); }

INLINE void store(__m512 acc[4][4], int mr, int ng, int64_t r0, int64_t c0, int64_t n1, const float *bias, float *out,
                  int64_t ldo, int accumulate) {
    for (int n = 0; n < ng; n++) {
        int64_t c = c0 + 16 * n;
        if (c >= n1) break;
        __mmask16 k = cols_mask(n1 - c);
        __m512 bv = bias ? _mm512_maskz_loadu_ps(k, bias + c) : _mm512_setzero_ps();
        for (int r = 0; r < mr; r++) {
            float *o = out + (r0 + r) * ldo + c;
            __m512 v = bias ? _mm512_add_ps(acc[r][n], bv) : acc[r][n];
            if (accumulate) v = _mm512_add_ps(_mm512_maskz_loadu_ps(k, o), v);
            _mm512_mask_storeu_ps(o, k, v);
        }
    }
}

/* Rows in blocks of ROW_BLOCK so a block of activations stays in L2 while the weights stream past. */
enum { ROW_BLOCK = 64 };

#define DEF_GEMM(NAME, TYPE)                                                                                   \
    static void NAME(const sk_tensor *w, int64_t n0, int64_t n1, const sk_act *a, int64_t m, float *out,       \
                     int64_t ldo, int accumulate) {                                                            \
        const int64_t gb = w->row_bytes, ge = (n1 + 15) / 16;                                                  \
        __m512 acc[4][4];                                                                                      \
        for (int64_t m0 = 0; m0 < m; m0 += ROW_BLOCK) {                                                        \
            const int64_t m1 = m0 + ROW_BLOCK < m ? m0 + ROW_BLOCK : m;                                        \
            for (int64_t g = n0 / 16; g < ge;) {                                                               \
                const int64_t left = ge - g;                                                                   \
                const int ng = m1 - m0 == 1 ? (left >= 4 ? 4 : left >= 2 ? 2 : 1) : (left >= 2 ? 2 : 1);       \
                const uint8_t *g0 = w->data + g * gb;                                                          \
                for (int64_t r = m0; r < m1;) {                                                                \
                    const int mr = m1 - r >= 4 ? 4 : m1 - r >= 2 ? 2 : 1;                                      \
                    if (mr == 1 && ng == 4) tile(TYPE, g0, gb, w->n_cols, a, r, 1, 4, acc);                    \
                    else if (mr == 1 && ng == 2) tile(TYPE, g0, gb, w->n_cols, a, r, 1, 2, acc);               \
                    else if (mr == 1) tile(TYPE, g0, gb, w->n_cols, a, r, 1, 1, acc);                          \
                    else if (mr == 2 && ng == 2) tile(TYPE, g0, gb, w->n_cols, a, r, 2, 2, acc);               \
                    else if (mr == 2) tile(TYPE, g0, gb, w->n_cols, a, r, 2, 1, acc);                          \
                    else if (ng == 2) tile(TYPE, g0, gb, w->n_cols, a, r, 4, 2, acc);                          \
                    else tile(TYPE, g0, gb, w->n_cols, a, r, 4, 1, acc);                                       \
                    store(acc, mr, ng, r, g * 16, n1, w->bias, out, ldo, accumulate);                         \
                    r += mr;                                                                                   \
                }                                                                                              \
                g += ng;                                                                                       \
            }                                                                                                  \
        }                                                                                                      \
    }

DEF_GEMM(gemm_q4_0, SK_Q4_0)
DEF_GEMM(gemm_q4_1, SK_Q4_1)
DEF_GEMM(gemm_q5_0, SK_Q5_0)
DEF_GEMM(gemm_q5_1, SK_Q5_1)
DEF_GEMM(gemm_q8_0, SK_Q8_0)
DEF_GEMM(gemm_q4_k, SK_Q4_K)
DEF_GEMM(gemm_q5_k, SK_Q5_K)
DEF_GEMM(gemm_q6_k, SK_Q6_K)
DEF_GEMM(gemm_iq4_xs, SK_IQ4_XS)
DEF_GEMM(gemm_mxfp4, SK_MXFP4)
DEF_GEMM(gemm_q2_k, SK_Q2_K)
DEF_GEMM(gemm_q3_k, SK_Q3_K)
DEF_GEMM(gemm_iq4_nl, SK_IQ4_NL)

/* Columns [n0, n1) with n0 a multiple of 16 (the callers split work in whole groups). */
void sk_avx512_gemm_q(const sk_tensor *w, int64_t n0, int64_t n1, const sk_act *a, int64_t m, float *out, int64_t ldo,
                      int accumulate) {
    switch (w->type) {
    case SK_Q4_0: gemm_q4_0(w, n0, n1, a, m, out, ldo, accumulate); break;
    case SK_Q4_1: gemm_q4_1(w, n0, n1, a, m, out, ldo, accumulate); break;
    case SK_Q5_0: gemm_q5_0(w, n0, n1, a, m, out, ldo, accumulate); break;
    case SK_Q5_1: gemm_q5_1(w, n0, n1, a, m, out, ldo, accumulate); break;
    case SK_Q8_0: gemm_q8_0(w, n0, n1, a, m, out, ldo, accumulate); break;
    case SK_IQ4_NL: gemm_iq4_nl(w, n0, n1, a, m, out, ldo, accumulate); break;
    case SK_Q4_K: gemm_q4_k(w, n0, n1, a, m, out, ldo, accumulate); break;
    case SK_Q5_K: gemm_q5_k(w, n0, n1, a, m, out, ldo, accumulate); break;
    case SK_Q6_K: gemm_q6_k(w, n0, n1, a, m, out, ldo, accumulate); break;
    case SK_Q3_K: gemm_q3_k(w, n0, n1, a, m, out, ldo, accumulate); break;
    case SK_IQ4_XS: gemm_iq4_xs(w, n0, n1, a, m, out, ldo, accumulate); break;
    case SK_MXFP4: gemm_mxfp4(w, n0, n1, a, m, out, ldo, accumulate); break;
    case SK_Q2_K: gemm_q2_k(w, n0, n1, a, m, out, ldo, accumulate); break;
    default: break;
    }
}
