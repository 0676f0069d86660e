/* AVX2 matmul over quantized weights, in the column-interleaved layout of sk_pack.h.
 *
 * The same arithmetic as the AVX-512 kernel, eight columns per register: each 64-byte vector of the
 * layout is read as two halves (columns 0-7 and 8-15 of its group), and each 32-bit lane holds one
 * column. AVX2 has no vpdpbusd, so a lane's integer dot product over 4 values is vpmaddubsw (pairs of
 * unsigned weight x signed activation bytes into 16 bits) followed by vpmaddwd with ones (pairs of
 * 16-bit sums into 32 bits). vpmaddubsw saturates, so 16-bit sums are only kept as long as they
 * provably fit: values below 16 (Q4 types) for a whole block, below 32 (Q5) for half a block,
 * below 64 (Q6_K) for two steps. Q8_0 values go through as signed bytes (|value| <= 128, the sign
 * moved onto the activation) and are widened at every step, as are the codebook types' (IQ4_NL, IQ4_XS,
 * MXFP4: their 4-bit codes looked up in the 16-entry table by one byte shuffle, the table's integers as
 * Q8_0's bytes). Q3_K (values + 4 below 8) and Q2_K (below 4) go as Q6_K, two steps at a time. The
 * integer sums are therefore exact,
 * the same integers the AVX-512 kernel computes, and what follows is the same per-lane sequence:
 *
 *     acc = fma(float(isum - offset * qsum), dw * da, acc);   acc = fma(mw, s, acc)  (types with a minimum)
 *
 * Tiles only share loads between rows and columns, so the result of one output element never
 * depends on the row count, the tile shape or the thread split.
 */
#pragma GCC target("avx2,fma,f16c,bmi2")
#include <immintrin.h>
#include <string.h>

#include "sk.h"
#include "sk_avx2.h"
#include "sk_codebooks.h"
#include "sk_pack.h"

#define INLINE static inline __attribute__((always_inline))

INLINE uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

enum { GROUP = SK_GROUP, NIB = SK_NIB, HB5 = SK_HB5, HB6 = SK_HB6, DVEC = SK_DVEC, KHDR = SK_KHDR, Q6HDR = SK_Q6HDR };
/* K_IQ4, K_MXFP4: nibble codes through their table (signed, as K_BYTES); K_Q2: 2-bit values; K_Q3: Q3_K's + 4. */
enum { K_NIB4, K_NIB5, K_BYTES, K_NIB6, K_IQ4, K_MXFP4, K_Q2, K_Q3 };
/* Halves of a tile: half n of a tile that starts on a group boundary is half (n & 1) of group n >> 1. */
enum { MAX_MR = 4, MAX_NH = 4 };

INLINE __m256i load32(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
INLINE __m256i shl16(__m256i v, int n) { return _mm256_sll_epi16(v, _mm_cvtsi32_si128(n)); }
INLINE __m256i shr16(__m256i v, int n) { return _mm256_srl_epi16(v, _mm_cvtsi32_si128(n)); }
INLINE int signed_bytes(int kind) { return kind == K_BYTES || kind == K_IQ4 || kind == K_MXFP4; }

/* Value groups j and j+4 of one block, half h of its column group, as bytes (Q8_0: signed). */
INLINE void pair(const int kind, const uint8_t *qp, const int h, const int j, __m256i *lo, __m256i *hi) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    if (kind == K_BYTES) {
        const __m256i flip = _mm256_set1_epi8((char)0x80);
        *lo = _mm256_xor_si256(load32(qp + 64 * j + 32 * h), flip);
        *hi = _mm256_xor_si256(load32(qp + 64 * (j + 4) + 32 * h), flip);
        return;
    }
    if (kind == K_Q2 || kind == K_Q3) {
        /* bits 2j..2j+1 of each byte to bits 0..1 (the mask drops what crossed bytes) */
        const __m256i m3 = _mm256_set1_epi8(3);
        __m256i l = _mm256_and_si256(shr16(load32(qp + 32 * h), 2 * j), m3);
        __m256i u = _mm256_and_si256(shr16(load32(qp + 64 + 32 * h), 2 * j), m3);
        if (kind == K_Q3) { /* the third bit: bit j (value 4j+i) and bit j+4 (value 16+4j+i) to bit 2 */
            const __m256i bits = load32(qp + HB6 + 32 * h), b2 = _mm256_set1_epi8(4);
            l = _mm256_or_si256(l, _mm256_and_si256(j <= 2 ? shl16(bits, 2 - j) : shr16(bits, 1), b2));
            u = _mm256_or_si256(u, _mm256_and_si256(shr16(bits, j + 2), b2));
        }
        *lo = l;
        *hi = u;
        return;
    }
    const int hb = kind == K_NIB5 ? HB5 : kind == K_NIB6 ? HB6 : 0;
    const __m256i v = load32(qp + hb + 64 * j + 32 * h);
    __m256i l = _mm256_and_si256(v, m4), u = _mm256_and_si256(shr16(v, 4), m4);
    if (kind == K_NIB5) {
        /* bit j (value 4j+i) and bit j+4 (value 16+4j+i) of each byte to bit 4; 16-bit shifts of at
         * most 4 places, so what crosses into the next byte never reaches its bit 4 */
        const __m256i bits = load32(qp + 32 * h), b4 = _mm256_set1_epi8(0x10);
        l = _mm256_or_si256(l, _mm256_and_si256(shl16(bits, 4 - j), b4));
        u = _mm256_or_si256(u, _mm256_and_si256(shr16(bits, j), b4));
    } else if (kind == K_NIB6) {
        const __m256i m30 = _mm256_set1_epi8(0x30);
        __m256i p0 = load32(qp + 32 * h), p1 = load32(qp + 64 + 32 * h);
        /* bits 2j..2j+1 of each byte to bits 4..5 (the mask drops what crossed bytes) */
        if (j == 0) { p0 = shl16(p0, 4); p1 = shl16(p1, 4); }
        else if (j == 1) { p0 = shl16(p0, 2); p1 = shl16(p1, 2); }
        else if (j == 3) { p0 = shr16(p0, 2); p1 = shr16(p1, 2); }
        l = _mm256_or_si256(l, _mm256_and_si256(p0, m30));
        u = _mm256_or_si256(u, _mm256_and_si256(p1, m30));
    } else if (kind == K_IQ4 || kind == K_MXFP4) {
        const __m256i tab = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(kind == K_IQ4 ? sk_iq4nl_values : sk_mxfp4_values)));
        l = _mm256_shuffle_epi8(tab, l);
        u = _mm256_shuffle_epi8(tab, u);
    }
    *lo = l;
    *hi = u;
}

/* 16-bit pair sums of weight bytes x activation bytes (Q8_0: the weight's sign moved to the activation). */
INLINE __m256i mul_bytes(const int kind, __m256i w, __m256i x) {
    if (signed_bytes(kind)) return _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
    return _mm256_maddubs_epi16(w, x);
}

INLINE __m256i widen(__m256i s16) { return _mm256_madd_epi16(s16, _mm256_set1_epi16(1)); }

INLINE __m256i act4(const sk_act *a, int64_t row, int64_t b, int off) {
    return _mm256_set1_epi32((int)rd32((const uint8_t *)(a->q + row * a->kp + 32 * b + off)));
}

/* Exact integer dot products of one block for MR rows x NH halves (qp: the block's values in each
 * half's group). isum gets values 0..31; Q6_K (per-16 scales) gets 0..15 in isum and 16..31 in ihi. */
INLINE void dot_block(const int kind, const uint8_t *const qp[MAX_NH], const sk_act *a, int64_t r0, int64_t b,
                      const int MR, const int NH, __m256i isum[MAX_MR][MAX_NH], __m256i ihi[MAX_MR][MAX_NH]) {
    __m256i t16[MAX_MR][MAX_NH], u16[MAX_MR][MAX_NH];
    for (int r = 0; r < MR; r++)
        for (int n = 0; n < NH; n++) {
            isum[r][n] = ihi[r][n] = _mm256_setzero_si256();
            t16[r][n] = u16[r][n] = _mm256_setzero_si256();
        }
    for (int j = 0; j < 4; j++) {
        for (int n = 0; n < NH; n++) {
            __m256i wl, wh;
            pair(kind, qp[n], n & 1, j, &wl, &wh);
            for (int r = 0; r < MR; r++) {
                const __m256i pl = mul_bytes(kind, wl, act4(a, r0 + r, b, 4 * j));
                const __m256i ph = mul_bytes(kind, wh, act4(a, r0 + r, b, 16 + 4 * j));
                if (signed_bytes(kind)) { /* pair sums up to 2 * 128 * 127: widen at once */
                    isum[r][n] = _mm256_add_epi32(isum[r][n], _mm256_add_epi32(widen(pl), widen(ph)));
                } else if (kind == K_NIB6 || kind == K_Q3 || kind == K_Q2) { /* up to 2 * 63 * 127 per pair sum: two steps fit */
                    t16[r][n] = _mm256_add_epi16(t16[r][n], pl);
                    u16[r][n] = _mm256_add_epi16(u16[r][n], ph);
                    if (j & 1) {
                        isum[r][n] = _mm256_add_epi32(isum[r][n], widen(t16[r][n]));
                        ihi[r][n] = _mm256_add_epi32(ihi[r][n], widen(u16[r][n]));
                        t16[r][n] = u16[r][n] = _mm256_setzero_si256();
                    }
                } else { /* Q4: 8 x 2 * 15 * 127 fits 16 bits for the whole block; Q5: 4 x 2 * 31 * 127 */
                    t16[r][n] = _mm256_add_epi16(t16[r][n], _mm256_add_epi16(pl, ph));
                    if (j == 3 || (kind == K_NIB5 && j == 1)) {
                        isum[r][n] = _mm256_add_epi32(isum[r][n], widen(t16[r][n]));
                        t16[r][n] = _mm256_setzero_si256();
                    }
                }
            }
        }
    }
}

INLINE __m256 f16x8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
INLINE __m256i u8x8i(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
INLINE __m256 u8x8(const uint8_t *p) { return _mm256_cvtepi32_ps(u8x8i(p)); }

/* MXFP4's 8 E8M0 exponents as the floats sk_e8m0_half makes of them: 2^(e - 128), subnormal below e = 2. */
INLINE __m256 e8m0x8(const uint8_t *p) {
    const __m256i e = u8x8i(p);
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i subnormal = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, subnormal, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
}
INLINE __m256 i8x8(const uint8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))); }

/* acc += one block; OFF: unsigned offset of a symmetric type (0 with MIN: a type with a minimum). */
INLINE void add_block(const int OFF, const int MIN, __m256i isum[MAX_MR][MAX_NH], const __m256 dw[MAX_NH],
                      const __m256 mw[MAX_NH], const sk_act *a, int64_t r0, int64_t b, const int MR, const int NH,
                      __m256 acc[MAX_MR][MAX_NH]) {
    const int64_t kb = a->kp / 32, k16 = a->kp / 16;
    for (int r = 0; r < MR; r++) {
        const int64_t row = r0 + r;
        const __m256 da = _mm256_set1_ps(a->d[row * kb + b]);
        const __m256 s = _mm256_set1_ps(a->s[row * kb + b]);
        const __m256i off = _mm256_set1_epi32(OFF * (a->qs16[row * k16 + 2 * b] + a->qs16[row * k16 + 2 * b + 1]));
        for (int n = 0; n < NH; n++) {
            __m256i is = isum[r][n];
            if (OFF) is = _mm256_sub_epi32(is, off);
            acc[r][n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_mul_ps(dw[n], da), acc[r][n]);
            if (MIN) acc[r][n] = _mm256_fmadd_ps(mw[n], s, acc[r][n]);
        }
    }
}

/* Q6_K (OFF 32) and Q3_K (OFF 4): two 16-value halves with their own scales. */
INLINE void add_block6(const int OFF, __m256i lo[MAX_MR][MAX_NH], __m256i hi[MAX_MR][MAX_NH], const __m256 dw0[MAX_NH],
                       const __m256 dw1[MAX_NH], const sk_act *a, int64_t r0, int64_t b, const int MR, const int NH,
                       __m256 acc[MAX_MR][MAX_NH]) {
    const int64_t kb = a->kp / 32, k16 = a->kp / 16;
    for (int r = 0; r < MR; r++) {
        const int64_t row = r0 + r;
        const __m256 da = _mm256_set1_ps(a->d[row * kb + b]);
        const __m256i off0 = _mm256_set1_epi32(OFF * a->qs16[row * k16 + 2 * b]);
        const __m256i off1 = _mm256_set1_epi32(OFF * a->qs16[row * k16 + 2 * b + 1]);
        for (int n = 0; n < NH; n++) {
            acc[r][n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(lo[r][n], off0)), _mm256_mul_ps(dw0[n], da), acc[r][n]);
            acc[r][n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(hi[r][n], off1)), _mm256_mul_ps(dw1[n], da), acc[r][n]);
        }
    }
}

/* Q2_K: two 16-value halves, each with its own scale and minimum (no offset: values 0..3). */
INLINE void add_block2(__m256i lo[MAX_MR][MAX_NH], __m256i hi[MAX_MR][MAX_NH], const __m256 dw[2][MAX_NH],
                       const __m256 mw[2][MAX_NH], const sk_act *a, int64_t r0, int64_t b, const int MR, const int NH,
                       __m256 acc[MAX_MR][MAX_NH]) {
    const int64_t kb = a->kp / 32, k16 = a->kp / 16;
    for (int r = 0; r < MR; r++) {
        const int64_t row = r0 + r;
        const float daf = a->d[row * kb + b];
        const __m256 da = _mm256_set1_ps(daf);
        const __m256 s0 = _mm256_set1_ps(daf * (float)a->qs16[row * k16 + 2 * b]);
        const __m256 s1 = _mm256_set1_ps(daf * (float)a->qs16[row * k16 + 2 * b + 1]);
        for (int n = 0; n < NH; n++) {
            acc[r][n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo[r][n]), _mm256_mul_ps(dw[0][n], da), acc[r][n]);
            acc[r][n] = _mm256_fmadd_ps(mw[0][n], s0, acc[r][n]);
            acc[r][n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi[r][n]), _mm256_mul_ps(dw[1][n], da), acc[r][n]);
            acc[r][n] = _mm256_fmadd_ps(mw[1][n], s1, acc[r][n]);
        }
    }
}

/* One tile: MR rows from r0, NH halves from the start of the group at g0 (groups gb bytes apart). */
INLINE void tile(const int type, const uint8_t *g0, int64_t gb, int64_t k, const sk_act *a, int64_t r0, const int MR,
                 const int NH, __m256 acc[MAX_MR][MAX_NH]) {
    for (int r = 0; r < MR; r++)
        for (int n = 0; n < NH; n++) acc[r][n] = _mm256_setzero_ps();
    __m256i isum[MAX_MR][MAX_NH], ihi[MAX_MR][MAX_NH];
    __m256 dw[MAX_NH], mw[MAX_NH];
    const uint8_t *qp[MAX_NH];
    if (type == SK_Q4_K || type == SK_Q5_K || type == SK_Q6_K || type == SK_Q3_K) {
        const int six = type == SK_Q6_K || type == SK_Q3_K; /* Q3_K: Q6_K's scales, its own values */
        const int64_t st = sk_super_tile_bytes(type);
        const int64_t bt = type == SK_Q4_K ? NIB : type == SK_Q5_K ? HB5 + NIB : type == SK_Q3_K ? SK_Q3BLK : HB6 + NIB;
        const int kind = type == SK_Q4_K ? K_NIB4 : type == SK_Q5_K ? K_NIB5 : type == SK_Q3_K ? K_Q3 : K_NIB6;
        const int hl = six ? Q6HDR : KHDR;
        for (int64_t sb = 0; sb < k / 256; sb++) {
            const uint8_t *hdr[MAX_NH];
            for (int n = 0; n < NH; n++) hdr[n] = g0 + (n >> 1) * gb + sb * st;
            for (int j = 0; j < 8; j++) {
                const int64_t b = sb * 8 + j;
                for (int n = 0; n < NH; n++) qp[n] = hdr[n] + hl + j * bt;
                dot_block(kind, qp, a, r0, b, MR, NH, isum, ihi);
                if (six) {
                    __m256 dw1[MAX_NH];
                    for (int n = 0; n < NH; n++) {
                        const __m256 d = f16x8(hdr[n] + 16 * (n & 1));
                        const uint8_t *sc = hdr[n] + DVEC + GROUP * 2 * j + 8 * (n & 1);
                        dw[n] = _mm256_mul_ps(d, i8x8(sc));
                        dw1[n] = _mm256_mul_ps(d, i8x8(sc + GROUP));
                    }
                    add_block6(type == SK_Q3_K ? 4 : 32, isum, ihi, dw, dw1, a, r0, b, MR, NH, acc);
                } else {
                    for (int n = 0; n < NH; n++) {
                        const uint8_t *sc = hdr[n] + 2 * DVEC + GROUP * j + 8 * (n & 1), *mn = sc + 8 * GROUP;
                        dw[n] = _mm256_mul_ps(f16x8(hdr[n] + 16 * (n & 1)), u8x8(sc));
                        mw[n] = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(f16x8(hdr[n] + DVEC + 16 * (n & 1)), u8x8(mn)));
                    }
                    add_block(0, 1, isum, dw, mw, a, r0, b, MR, NH, acc);
                }
            }
        }
        return;
    }
    if (type == SK_Q2_K) { /* scales and minima per 16 values, 4 bits each in one byte */
        for (int64_t sb = 0; sb < k / 256; sb++) {
            const uint8_t *hdr[MAX_NH];
            for (int n = 0; n < NH; n++) hdr[n] = g0 + (n >> 1) * gb + sb * sk_super_tile_bytes(type);
            for (int j = 0; j < 8; j++) {
                __m256 dw2[2][MAX_NH], mw2[2][MAX_NH];
                for (int n = 0; n < NH; n++) {
                    qp[n] = hdr[n] + SK_Q2HDR + j * SK_Q2BLK;
                    const __m256 d = f16x8(hdr[n] + 16 * (n & 1)), dmin = f16x8(hdr[n] + DVEC + 16 * (n & 1));
                    for (int h = 0; h < 2; h++) {
                        const __m256i sm = u8x8i(hdr[n] + 2 * DVEC + GROUP * (2 * j + h) + 8 * (n & 1));
                        const __m256 sc = _mm256_cvtepi32_ps(_mm256_and_si256(sm, _mm256_set1_epi32(15)));
                        dw2[h][n] = _mm256_mul_ps(d, sc);
                        mw2[h][n] = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_srli_epi32(sm, 4))));
                    }
                }
                dot_block(K_Q2, qp, a, r0, sb * 8 + j, MR, NH, isum, ihi);
                add_block2(isum, ihi, dw2, mw2, a, r0, sb * 8 + j, MR, NH, acc);
            }
        }
        return;
    }
    if (type == SK_IQ4_XS) { /* IQ4_NL's codes with a signed scale per block, d * sc */
        for (int64_t sb = 0; sb < k / 256; sb++) {
            const uint8_t *hdr[MAX_NH];
            for (int n = 0; n < NH; n++) hdr[n] = g0 + (n >> 1) * gb + sb * sk_super_tile_bytes(type);
            for (int j = 0; j < 8; j++) {
                for (int n = 0; n < NH; n++) {
                    qp[n] = hdr[n] + SK_XSHDR + j * NIB;
                    dw[n] = _mm256_mul_ps(f16x8(hdr[n] + 16 * (n & 1)), i8x8(hdr[n] + DVEC + GROUP * j + 8 * (n & 1)));
                }
                dot_block(K_IQ4, qp, a, r0, sb * 8 + j, MR, NH, isum, ihi);
                add_block(0, 0, isum, dw, mw, a, r0, sb * 8 + j, MR, NH, acc);
            }
        }
        return;
    }
    const int asym = type == SK_Q4_1 || type == SK_Q5_1, mx = type == SK_MXFP4; /* MXFP4: E8M0 scales */
    const int kind = type == SK_Q8_0 ? K_BYTES : type == SK_IQ4_NL ? K_IQ4 : mx ? K_MXFP4
                   : (type == SK_Q5_0 || type == SK_Q5_1) ? K_NIB5 : K_NIB4;
    /* Q8_0 and the codebook types go through signed, so they need no offset */
    const int off = type == SK_Q4_0 ? 8 : type == SK_Q5_0 ? 16 : 0;
    const int64_t bt = sk_block_tile_bytes(type);
    for (int64_t b = 0; b < k / 32; b++) {
        for (int n = 0; n < NH; n++) {
            const uint8_t *t = g0 + (n >> 1) * gb + b * bt;
            dw[n] = mx ? e8m0x8(t + 8 * (n & 1)) : f16x8(t + 16 * (n & 1));
            if (asym) mw[n] = f16x8(t + DVEC + 16 * (n & 1));
            qp[n] = t + (mx ? SK_E8M0 : (asym ? 2 : 1) * DVEC);
        }
        dot_block(kind, qp, a, r0, b, MR, NH, isum, ihi);
        add_block(off, asym, isum, dw, mw, a, r0, b, MR, NH, acc);
    }
}

INLINE void store(__m256 acc[MAX_MR][MAX_NH], int mr, int nh, int64_t r0, int64_t c0, int64_t n1, const float *bias,
                  float *out, int64_t ldo, int accumulate) {
    for (int n = 0; n < nh; n++) {
        const int64_t c = c0 + 8 * n;
        if (c >= n1) break;
        const int64_t cols = n1 - c >= 8 ? 8 : n1 - c;
        for (int r = 0; r < mr; r++) {
            float v[8], *o = out + (r0 + r) * ldo + c;
            _mm256_storeu_ps(v, acc[r][n]);
            for (int i = 0; i < cols; i++) {
                float x = bias ? v[i] + bias[c + i] : v[i];
                o[i] = accumulate ? o[i] + x : x;
            }
        }
    }
}

/* Rows in blocks of ROW_BLOCK so a block of activations stays in L2 while the weights stream past. */
enum { ROW_BLOCK = 64 };

#define DEF_GEMM(NAME, TYPE)                                                                                   \
    static void NAME(const sk_tensor *w, int64_t n0, int64_t n1, const sk_act *a, int64_t m, float *out,       \
                     int64_t ldo, int accumulate) {                                                            \
        const int64_t gb = w->row_bytes, he = (n1 + 7) / 8;                                                    \
        __m256 acc[MAX_MR][MAX_NH];                                                                            \
        for (int64_t m0 = 0; m0 < m; m0 += ROW_BLOCK) {                                                        \
            const int64_t m1 = m0 + ROW_BLOCK < m ? m0 + ROW_BLOCK : m;                                        \
            for (int64_t h = n0 / 8; h < he;) { /* h is even: tiles start on a group */                        \
                const int64_t left = he - h;                                                                   \
                const int nh = m1 - m0 == 1 ? (left >= 4 ? 4 : left >= 2 ? 2 : 1) : (left >= 2 ? 2 : 1);       \
                const uint8_t *g0 = w->data + (h / 2) * gb;                                                    \
                for (int64_t r = m0; r < m1;) {                                                                \
                    const int mr = m1 - r >= 4 ? 4 : m1 - r >= 2 ? 2 : 1;                                      \
                    if (mr == 1 && nh == 4) tile(TYPE, g0, gb, w->n_cols, a, r, 1, 4, acc);                    \
                    else if (mr == 1 && nh == 2) tile(TYPE, g0, gb, w->n_cols, a, r, 1, 2, acc);               \
                    else if (mr == 1) tile(TYPE, g0, gb, w->n_cols, a, r, 1, 1, acc);                          \
                    else if (mr == 2 && nh == 2) tile(TYPE, g0, gb, w->n_cols, a, r, 2, 2, acc);               \
                    else if (mr == 2) tile(TYPE, g0, gb, w->n_cols, a, r, 2, 1, acc);                          \
                    else if (nh == 2) tile(TYPE, g0, gb, w->n_cols, a, r, 4, 2, acc);                          \
                    else tile(TYPE, g0, gb, w->n_cols, a, r, 4, 1, acc);                                       \
                    store(acc, mr, nh, r, h * 8, n1, w->bias, out, ldo, accumulate);                          \
                    r += mr;                                                                                   \
                }                                                                                              \
                h += nh;                                                                                       \
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
void sk_avx2_gemm_q(const sk_tensor *w, int64_t n0, int64_t n1, const sk_act *a, int64_t m, float *out, int64_t ldo,
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
