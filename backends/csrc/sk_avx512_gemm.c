/* AVX-512 VNNI matmul over quantized weights, in a column-interleaved layout.
 *
 * At load, each quantized weight is rewritten (losslessly: the same integers and scales, moved) so
 * that 16 output columns sit side by side: one 64-byte vector holds 4 consecutive values of one
 * 32-value block for each of 16 columns. One vpdpbusd then multiplies them with 4 activation bytes
 * broadcast to every lane, and after 8 of them each lane holds its column's exact integer dot
 * product for the block. Per output element and block, in block order:
 *
 *     isum = sum of the block's value * activation products            exact int32
 *     acc  = fma(float(isum - offset * qsum), dw * da, acc)             dw, da: weight, activation scale
 *     acc  = fma(mw, s, acc)              types with a minimum (s = da * sum of the block's activations)
 *
 * (Q6_K does the first step per 16 values, as its scales are per 16.) Each lane is one element, and
 * tiles of up to 4 rows x 4 column groups only share loads, so the row count, the tile shape and
 * the thread split never change a bit of the result.
 *
 * Layout per group of 16 columns (columns past the tensor's end are zero), `row_bytes` = one group:
 *   Q4_0 block: [16 f16 d] [4 x 64 B nibbles]              Q4_1: [16 d] [16 m] [4 x 64 B]
 *   Q5_0 block: [16 d] [64 B high bits] [4 x 64 B]         Q5_1: [16 d] [16 m] [64 B] [4 x 64 B]
 *   Q8_0 block: [16 d] [8 x 64 B bytes, value + 128]
 *   Q4_K / Q5_K super-block: [16 d] [16 dmin] [8 x 16 sc] [8 x 16 mn], then 8 blocks as Q4_0 / Q5_0
 *                            without the d
 *   Q6_K super-block: [16 d] [16 x 16 int8 sc], then 8 blocks of [2 x 64 B high bits] [4 x 64 B nibbles]
 * Nibble vector j: lane c byte i = value 4j+i | value 16+4j+i << 4 (low nibbles: group j, high: j+4,
 * group t = values 4t..4t+3). High bits (Q5): lane c byte i bit t = bit 4 of value 4t+i. High bits
 * (Q6): plane p, lane c byte i, bits 2u..2u+1 = bits 4-5 of value 4(4p+u)+i.
 */
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma,bmi2")
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#include "sk.h"
#include "sk_avx512.h"

#define INLINE static inline __attribute__((always_inline))

INLINE uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
INLINE uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

enum { GROUP = 16, NIB = 256, HB5 = 64, HB6 = 128, BYTES8 = 512, DVEC = 32 };

static void kscale(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* ---- layout sizes ------------------------------------------------------------------------------ */

static int64_t block_tile_bytes(int type) {
    switch (type) {
    case SK_Q4_0: return DVEC + NIB;
    case SK_Q4_1: return 2 * DVEC + NIB;
    case SK_Q5_0: return DVEC + HB5 + NIB;
    case SK_Q5_1: return 2 * DVEC + HB5 + NIB;
    case SK_Q8_0: return DVEC + BYTES8;
    default: return 0;
    }
}

enum { KHDR = 2 * DVEC + 2 * 8 * GROUP, Q6HDR = DVEC + 16 * GROUP };

static int64_t super_tile_bytes(int type) {
    switch (type) {
    case SK_Q4_K: return KHDR + 8 * NIB;
    case SK_Q5_K: return KHDR + 8 * (HB5 + NIB);
    case SK_Q6_K: return Q6HDR + 8 * (HB6 + NIB);
    default: return 0;
    }
}

int64_t sk_avx512_packed_group_bytes(const sk_tensor *w) {
    int64_t sb = super_tile_bytes(w->type), bb = block_tile_bytes(w->type);
    if (sb) return w->n_cols % 256 == 0 ? sb * (w->n_cols / 256) : 0;
    if (bb) return w->n_cols % 64 == 0 ? bb * (w->n_cols / 32) : 0;
    return 0;
}

int sk_avx512_quant_supported(const sk_tensor *w) {
    return w->layout == 1 && sk_avx512_packed_group_bytes(w) > 0;
}

/* ---- packing ----------------------------------------------------------------------------------- */

/* Values of GGUF block b (32 values) of one row as unsigned integers (Q8_0: value + 128). */
static void gguf_values(int type, const uint8_t *row, int64_t b, uint8_t v[32]) {
    const uint8_t *p, *qs;
    uint32_t qh = 0;
    switch (type) {
    case SK_Q4_0: p = row + b * 18; qs = p + 2; break;
    case SK_Q4_1: p = row + b * 20; qs = p + 4; break;
    case SK_Q5_0: p = row + b * 22; memcpy(&qh, p + 2, 4); qs = p + 6; break;
    case SK_Q5_1: p = row + b * 24; memcpy(&qh, p + 4, 4); qs = p + 8; break;
    case SK_Q8_0:
        p = row + b * 34;
        for (int l = 0; l < 32; l++) v[l] = (uint8_t)(p[2 + l] ^ 0x80);
        return;
    case SK_Q4_K:
    case SK_Q5_K: {
        int five = type == SK_Q5_K, j = (int)(b % 8);
        p = row + (b / 8) * (five ? 176 : 144);
        const uint8_t *kq = p + (five ? 48 : 16) + 32 * (j / 2);
        for (int l = 0; l < 32; l++) {
            int q = (j & 1) ? kq[l] >> 4 : kq[l] & 15;
            if (five && ((p[16 + l] >> j) & 1)) q += 16;
            v[l] = (uint8_t)q;
        }
        return;
    }
    default: { /* Q6_K */
        p = row + (b / 8) * 210;
        int j = (int)(b % 8), n = j / 4, jj = j % 4;
        const uint8_t *ql = p + 64 * n + ((jj & 1) ? 32 : 0), *h = p + 128 + 32 * n;
        for (int l = 0; l < 32; l++) {
            int lo = (jj & 2) ? ql[l] >> 4 : ql[l] & 15;
            v[l] = (uint8_t)(lo | (((h[l] >> (2 * jj)) & 3) << 4));
        }
        return;
    }
    }
    for (int l = 0; l < 16; l++) {
        v[l] = (uint8_t)((qs[l] & 15) | (((qh >> l) & 1) << 4));
        v[l + 16] = (uint8_t)((qs[l] >> 4) | (((qh >> (l + 16)) & 1) << 4));
    }
}

static void put_nibbles(uint8_t *dst, uint8_t v[GROUP][32]) {
    for (int j = 0; j < 4; j++)
        for (int c = 0; c < GROUP; c++)
            for (int i = 0; i < 4; i++)
                dst[64 * j + 4 * c + i] = (uint8_t)((v[c][4 * j + i] & 15) | ((v[c][16 + 4 * j + i] & 15) << 4));
}

static void put_high5(uint8_t *dst, uint8_t v[GROUP][32]) {
    for (int c = 0; c < GROUP; c++)
        for (int i = 0; i < 4; i++) {
            int byte = 0;
            for (int t = 0; t < 8; t++) byte |= ((v[c][4 * t + i] >> 4) & 1) << t;
            dst[4 * c + i] = (uint8_t)byte;
        }
}

static void put_high6(uint8_t *dst, uint8_t v[GROUP][32]) {
    for (int p = 0; p < 2; p++)
        for (int c = 0; c < GROUP; c++)
            for (int i = 0; i < 4; i++) {
                int byte = 0;
                for (int u = 0; u < 4; u++) byte |= ((v[c][4 * (4 * p + u) + i] >> 4) & 3) << (2 * u);
                dst[64 * p + 4 * c + i] = (uint8_t)byte;
            }
}

static void put_bytes(uint8_t *dst, uint8_t v[GROUP][32]) {
    for (int t = 0; t < 8; t++)
        for (int c = 0; c < GROUP; c++)
            for (int i = 0; i < 4; i++) dst[64 * t + 4 * c + i] = v[c][4 * t + i];
}

/* The block's quantized values after its scales, as the kernels read them. */
static uint8_t *put_values(int type, uint8_t *dst, uint8_t v[GROUP][32]) {
    switch (type) {
    case SK_Q8_0: put_bytes(dst, v); return dst + BYTES8;
    case SK_Q5_0: case SK_Q5_1: case SK_Q5_K: put_high5(dst, v); put_nibbles(dst + HB5, v); return dst + HB5 + NIB;
    case SK_Q6_K: put_high6(dst, v); put_nibbles(dst + HB6, v); return dst + HB6 + NIB;
    default: put_nibbles(dst, v); return dst + NIB;
    }
}

/* f16 scale fields at byte offset `off` of the GGUF block / super-block of each column of a group. */
static void put_f16s(uint8_t *dst, const sk_tensor *w, int64_t col0, int64_t blk_bytes, int64_t blk, int off) {
    for (int c = 0; c < GROUP; c++) {
        uint16_t h = 0;
        if (col0 + c < w->n_rows) memcpy(&h, w->data + (col0 + c) * w->row_bytes + blk * blk_bytes + off, 2);
        memcpy(dst + 2 * c, &h, 2);
    }
}

static void gather_values(const sk_tensor *w, int64_t col0, int64_t b, uint8_t v[GROUP][32]) {
    for (int c = 0; c < GROUP; c++) {
        if (col0 + c < w->n_rows) gguf_values(w->type, w->data + (col0 + c) * w->row_bytes, b, v[c]);
        else memset(v[c], w->type == SK_Q8_0 ? 0x80 : 0, 32); /* zero weights (Q8_0 stores value + 128) */
    }
}

static void pack_group32(const sk_tensor *w, int64_t col0, uint8_t *dst) {
    static const int16_t bytes_of[] = {[SK_Q4_0] = 18, [SK_Q4_1] = 20, [SK_Q5_0] = 22, [SK_Q5_1] = 24, [SK_Q8_0] = 34};
    const int asym = w->type == SK_Q4_1 || w->type == SK_Q5_1;
    const int64_t bb = bytes_of[w->type];
    uint8_t v[GROUP][32];
    for (int64_t b = 0; b < w->n_cols / 32; b++) {
        put_f16s(dst, w, col0, bb, b, 0);
        if (asym) put_f16s(dst + DVEC, w, col0, bb, b, 2);
        gather_values(w, col0, b, v);
        dst = put_values(w->type, dst + (asym ? 2 : 1) * DVEC, v);
    }
}

static void pack_group_k(const sk_tensor *w, int64_t col0, uint8_t *dst) {
    const int six = w->type == SK_Q6_K;
    const int64_t sbb = six ? 210 : w->type == SK_Q5_K ? 176 : 144;
    uint8_t v[GROUP][32];
    for (int64_t sb = 0; sb < w->n_cols / 256; sb++) {
        if (six) {
            put_f16s(dst, w, col0, sbb, sb, 208);
            for (int s = 0; s < 16; s++)
                for (int c = 0; c < GROUP; c++)
                    dst[DVEC + GROUP * s + c] = col0 + c < w->n_rows ? w->data[(col0 + c) * w->row_bytes + sb * sbb + 192 + s] : 0;
            dst += Q6HDR;
        } else {
            put_f16s(dst, w, col0, sbb, sb, 0);
            put_f16s(dst + DVEC, w, col0, sbb, sb, 2);
            for (int j = 0; j < 8; j++)
                for (int c = 0; c < GROUP; c++) {
                    int sc = 0, mn = 0;
                    if (col0 + c < w->n_rows) kscale(w->data + (col0 + c) * w->row_bytes + sb * sbb + 4, j, &sc, &mn);
                    dst[2 * DVEC + GROUP * j + c] = (uint8_t)sc;
                    dst[2 * DVEC + 8 * GROUP + GROUP * j + c] = (uint8_t)mn;
                }
            dst += KHDR;
        }
        for (int j = 0; j < 8; j++) {
            gather_values(w, col0, sb * 8 + j, v);
            dst = put_values(w->type, dst, v);
        }
    }
}

/* Columns [16 g0, 16 g1) (in groups of 16) into dst, one group after another. */
void sk_avx512_pack_groups(const sk_tensor *w, int64_t g0, int64_t g1, uint8_t *dst) {
    int64_t gb = sk_avx512_packed_group_bytes(w);
    for (int64_t g = g0; g < g1; g++, dst += gb) {
        if (super_tile_bytes(w->type)) pack_group_k(w, g * GROUP, dst);
        else pack_group32(w, g * GROUP, dst);
    }
}

/* ---- kernels ----------------------------------------------------------------------------------- */

enum { K_NIB4, K_NIB5, K_BYTES, K_NIB6 };

/* Value groups j and j+4 of one block of one column group, as unsigned bytes. */
INLINE void pair(const int kind, const uint8_t *qp, const int j, __m512i *lo, __m512i *hi) {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    if (kind == K_BYTES) {
        *lo = _mm512_loadu_si512((const void *)(qp + 64 * j));
        *hi = _mm512_loadu_si512((const void *)(qp + 64 * (j + 4)));
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

/* Q6_K: two 16-value halves with their own scales; offset 32. */
INLINE void add_block6(__m512i lo[4][4], __m512i hi[4][4], const __m512 dw0[4], const __m512 dw1[4], const sk_act *a,
                       int64_t r0, int64_t b, const int MR, const int NG, __m512 acc[4][4]) {
    const int64_t kb = a->kp / 32, k16 = a->kp / 16;
    for (int r = 0; r < MR; r++) {
        const int64_t row = r0 + r;
        const __m512 da = _mm512_set1_ps(a->d[row * kb + b]);
        const __m512i off0 = _mm512_set1_epi32(32 * a->qs16[row * k16 + 2 * b]);
        const __m512i off1 = _mm512_set1_epi32(32 * a->qs16[row * k16 + 2 * b + 1]);
        for (int n = 0; n < NG; n++) {
            acc[r][n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(lo[r][n], off0)), _mm512_mul_ps(dw0[n], da), acc[r][n]);
            acc[r][n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(hi[r][n], off1)), _mm512_mul_ps(dw1[n], da), acc[r][n]);
        }
    }
}

/* One tile: MR rows from r0, NG column groups from g (group base pointers g0 + n * gb). */
INLINE void tile(const int type, const uint8_t *g0, int64_t gb, int64_t k, const sk_act *a, int64_t r0, const int MR,
                 const int NG, __m512 acc[4][4]) {
    for (int r = 0; r < MR; r++)
        for (int n = 0; n < NG; n++) acc[r][n] = _mm512_setzero_ps();
    __m512i lo[4][4], hi[4][4];
    __m512 dw[4], mw[4];
    const uint8_t *qp[4];
    if (type == SK_Q4_K || type == SK_Q5_K || type == SK_Q6_K) {
        const int64_t st = super_tile_bytes(type), bt = type == SK_Q4_K ? NIB : type == SK_Q5_K ? HB5 + NIB : HB6 + NIB;
        const int kind = type == SK_Q4_K ? K_NIB4 : type == SK_Q5_K ? K_NIB5 : K_NIB6;
        for (int64_t sb = 0; sb < k / 256; sb++) {
            const uint8_t *hdr[4];
            for (int n = 0; n < NG; n++) hdr[n] = g0 + n * gb + sb * st;
            for (int j = 0; j < 8; j++) {
                const int64_t b = sb * 8 + j;
                const int hl = type == SK_Q6_K ? Q6HDR : KHDR;
                for (int n = 0; n < NG; n++) qp[n] = hdr[n] + hl + j * bt;
                dot_block(kind, qp, a, r0, b, MR, NG, lo, hi);
                if (type == SK_Q6_K) {
                    __m512 dw1[4];
                    for (int n = 0; n < NG; n++) {
                        __m512 d = f16x16(hdr[n]);
                        const uint8_t *sc = hdr[n] + DVEC + GROUP * 2 * j;
                        dw[n] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)sc))));
                        dw1[n] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sc + GROUP)))));
                    }
                    add_block6(lo, hi, dw, dw1, a, r0, b, MR, NG, acc);
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
    const int asym = type == SK_Q4_1 || type == SK_Q5_1;
    const int kind = type == SK_Q8_0 ? K_BYTES : (type == SK_Q5_0 || type == SK_Q5_1) ? K_NIB5 : K_NIB4;
    const int off = type == SK_Q4_0 ? 8 : type == SK_Q5_0 ? 16 : type == SK_Q8_0 ? 128 : 0;
    const int64_t bt = block_tile_bytes(type);
    for (int64_t b = 0; b < k / 32; b++) {
        for (int n = 0; n < NG; n++) {
            const uint8_t *t = g0 + n * gb + b * bt;
            dw[n] = f16x16(t);
            if (asym) mw[n] = f16x16(t + DVEC);
            qp[n] = t + (asym ? 2 : 1) * DVEC;
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

/* Columns [n0, n1) with n0 a multiple of 16 (the callers split work in whole groups). */
void sk_avx512_gemm_q(const sk_tensor *w, int64_t n0, int64_t n1, const sk_act *a, int64_t m, float *out, int64_t ldo,
                      int accumulate) {
    switch (w->type) {
    case SK_Q4_0: gemm_q4_0(w, n0, n1, a, m, out, ldo, accumulate); break;
    case SK_Q4_1: gemm_q4_1(w, n0, n1, a, m, out, ldo, accumulate); break;
    case SK_Q5_0: gemm_q5_0(w, n0, n1, a, m, out, ldo, accumulate); break;
    case SK_Q5_1: gemm_q5_1(w, n0, n1, a, m, out, ldo, accumulate); break;
    case SK_Q8_0: gemm_q8_0(w, n0, n1, a, m, out, ldo, accumulate); break;
    case SK_Q4_K: gemm_q4_k(w, n0, n1, a, m, out, ldo, accumulate); break;
    case SK_Q5_K: gemm_q5_k(w, n0, n1, a, m, out, ldo, accumulate); break;
    case SK_Q6_K: gemm_q6_k(w, n0, n1, a, m, out, ldo, accumulate); break;
    default: break;
    }
}
