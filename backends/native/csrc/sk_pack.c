/* Packing quantized weights into the SIMD kernels' column-interleaved layout (sk_pack.h). Portable C:
 * it runs once per weight at load, on whichever kernel set the CPU gets. */
#include <string.h>

#include "sk.h"
#include "sk_pack.h"
#include "sk_codebooks.h"

static void kscale(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

int64_t sk_packed_group_bytes(const sk_tensor *w) {
    int64_t sb = sk_super_tile_bytes(w->type), bb = sk_block_tile_bytes(w->type);
    if (sb) return w->n_cols % 256 == 0 ? sb * (w->n_cols / 256) : 0;
    if (bb) return w->n_cols % 64 == 0 ? bb * (w->n_cols / 32) : 0;
    return 0;
}

int sk_packed_supported(const sk_tensor *w) {
    return w->layout == 1 && sk_packed_group_bytes(w) > 0;
}

/* ---- packing ----------------------------------------------------------------------------------- */

/* Values of GGUF block b (32 values) of one row as unsigned integers (Q8_0: value + 128; IQ4_NL, IQ4_XS,
 * MXFP4: their 4-bit codes; Q3_K: value + 4). */
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
    case SK_IQ4_NL: qs = row + b * 18 + 2; break;
    case SK_MXFP4: qs = row + b * 17 + 1; break;
    case SK_IQ4_XS: qs = row + (b / 8) * 136 + 8 + 16 * (b % 8); break;
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
    case SK_Q2_K: {
        int j = (int)(b % 8);
        qs = row + (b / 8) * 84 + 16 + 32 * (j / 4);
        for (int l = 0; l < 32; l++) v[l] = (uint8_t)((qs[l] >> (2 * (j % 4))) & 3);
        return;
    }
    case SK_Q3_K: { /* -4..3, plus 4: 2 low bits in qs, the third (set: no -4) in hmask */
        p = row + (b / 8) * 110;
        int j = (int)(b % 8);
        qs = p + 32 + 32 * (j / 4);
        for (int l = 0; l < 32; l++) v[l] = (uint8_t)(((qs[l] >> (2 * (j % 4))) & 3) | (((p[l] >> j) & 1) << 2));
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

static void put_nibbles(uint8_t *dst, uint8_t v[SK_GROUP][32]) {
    for (int j = 0; j < 4; j++)
        for (int c = 0; c < SK_GROUP; c++)
            for (int i = 0; i < 4; i++)
                dst[64 * j + 4 * c + i] = (uint8_t)((v[c][4 * j + i] & 15) | ((v[c][16 + 4 * j + i] & 15) << 4));
}

/* Bit `bit` of each value as Q5's high bits (Q3_K: its third bit). */
static void put_bit_plane(uint8_t *dst, uint8_t v[SK_GROUP][32], int bit) {
    for (int c = 0; c < SK_GROUP; c++)
        for (int i = 0; i < 4; i++) {
            int byte = 0;
            for (int t = 0; t < 8; t++) byte |= ((v[c][4 * t + i] >> bit) & 1) << t;
            dst[4 * c + i] = (uint8_t)byte;
        }
}

/* Bits `bit`, `bit` + 1 of each value in two planes (Q6_K's high bits; Q2_K's and Q3_K's low bits). */
static void put_2bit_planes(uint8_t *dst, uint8_t v[SK_GROUP][32], int bit) {
    for (int p = 0; p < 2; p++)
        for (int c = 0; c < SK_GROUP; c++)
            for (int i = 0; i < 4; i++) {
                int byte = 0;
                for (int u = 0; u < 4; u++) byte |= ((v[c][4 * (4 * p + u) + i] >> bit) & 3) << (2 * u);
                dst[64 * p + 4 * c + i] = (uint8_t)byte;
            }
}

static void put_bytes(uint8_t *dst, uint8_t v[SK_GROUP][32]) {
    for (int t = 0; t < 8; t++)
        for (int c = 0; c < SK_GROUP; c++)
            for (int i = 0; i < 4; i++) dst[64 * t + 4 * c + i] = v[c][4 * t + i];
}

/* The block's quantized values after its scales, as the kernels read them. */
static uint8_t *put_values(int type, uint8_t *dst, uint8_t v[SK_GROUP][32]) {
    switch (type) {
    case SK_Q8_0: put_bytes(dst, v); return dst + SK_BYTES8;
    case SK_Q5_0: case SK_Q5_1: case SK_Q5_K: put_bit_plane(dst, v, 4); put_nibbles(dst + SK_HB5, v); return dst + SK_HB5 + SK_NIB;
    case SK_Q6_K: put_2bit_planes(dst, v, 4); put_nibbles(dst + SK_HB6, v); return dst + SK_HB6 + SK_NIB;
    case SK_Q2_K: put_2bit_planes(dst, v, 0); return dst + SK_Q2BLK;
    case SK_Q3_K: put_2bit_planes(dst, v, 0); put_bit_plane(dst + SK_HB6, v, 2); return dst + SK_Q3BLK;
    default: put_nibbles(dst, v); return dst + SK_NIB;
    }
}

/* f16 scale fields at byte offset `off` of the GGUF block / super-block of each column of a group. */
static void put_f16s(uint8_t *dst, const sk_tensor *w, int64_t col0, int64_t blk_bytes, int64_t blk, int off) {
    for (int c = 0; c < SK_GROUP; c++) {
        uint16_t h = 0;
        if (col0 + c < w->n_rows) memcpy(&h, w->data + (col0 + c) * w->row_bytes + blk * blk_bytes + off, 2);
        memcpy(dst + 2 * c, &h, 2);
    }
}

static void gather_values(const sk_tensor *w, int64_t col0, int64_t b, uint8_t v[SK_GROUP][32]) {
    for (int c = 0; c < SK_GROUP; c++) {
        if (col0 + c < w->n_rows) gguf_values(w->type, w->data + (col0 + c) * w->row_bytes, b, v[c]);
        else memset(v[c], w->type == SK_Q8_0 ? 0x80 : 0, 32); /* zero scales; Q8_0's bytes store value + 128 */
    }
}

/* Q4_0, Q4_1, Q8_0 and the codebook types (IQ4_NL, IQ4_XS, MXFP4) store a block's values in the order
 * the layout reads them, 4 bytes at a time:
 * nibble vector j, lane c holds the block's quant bytes 4j..4j+3 (value 4j+i low, 16+4j+i high), and
 * Q8_0's byte vector t, lane c its bytes 4t..4t+3 (+ 128). So their values are copied 4 bytes per
 * column (`flip` 0x80808080 adds Q8_0's 128) instead of unpacked and repacked one by one: the same
 * bytes as put_values, several times faster at load. Columns past the end are zero weights. */
static uint8_t *copy_values(const sk_tensor *w, int64_t col0, int64_t blk_bytes, int64_t b, int qs_off, int n_vec,
                            uint32_t flip, uint8_t *dst) {
    for (int c = 0; c < SK_GROUP; c++) {
        const uint8_t *qs = col0 + c < w->n_rows ? w->data + (col0 + c) * w->row_bytes + b * blk_bytes + qs_off : NULL;
        for (int j = 0; j < n_vec; j++) {
            uint32_t x = 0;
            if (qs) memcpy(&x, qs + 4 * j, 4);
            x ^= flip;
            memcpy(dst + 64 * j + 4 * c, &x, 4);
        }
    }
    return dst + 64 * n_vec;
}

static void pack_group32(const sk_tensor *w, int64_t col0, uint8_t *dst, int by_value) {
    static const int16_t bytes_of[] = {[SK_Q4_0] = 18, [SK_Q4_1] = 20, [SK_Q5_0] = 22, [SK_Q5_1] = 24, [SK_Q8_0] = 34, [SK_IQ4_NL] = 18, [SK_MXFP4] = 17};
    const int asym = w->type == SK_Q4_1 || w->type == SK_Q5_1;
    const int64_t bb = bytes_of[w->type];
    const int copy = !by_value && w->type != SK_Q5_0 && w->type != SK_Q5_1;
    uint8_t v[SK_GROUP][32];
    for (int64_t b = 0; b < w->n_cols / 32; b++) {
        if (w->type == SK_MXFP4) { /* the exponent bytes (the kernels make them floats) */
            for (int c = 0; c < SK_GROUP; c++) dst[c] = col0 + c < w->n_rows ? w->data[(col0 + c) * w->row_bytes + b * bb] : 0;
            dst += SK_E8M0;
        } else {
            put_f16s(dst, w, col0, bb, b, 0);
            if (asym) put_f16s(dst + SK_DVEC, w, col0, bb, b, 2);
            dst += (asym ? 2 : 1) * SK_DVEC;
        }
        if (copy && w->type == SK_Q8_0) {
            dst = copy_values(w, col0, bb, b, 2, SK_BYTES8 / 64, 0x80808080u, dst);
        } else if (copy) {
            dst = copy_values(w, col0, bb, b, asym ? 4 : w->type == SK_MXFP4 ? 1 : 2, SK_NIB / 64, 0, dst);
        } else {
            gather_values(w, col0, b, v);
            dst = put_values(w->type, dst, v);
        }
    }
}

static void pack_group_k(const sk_tensor *w, int64_t col0, uint8_t *dst, int by_value) {
    const int six = w->type == SK_Q6_K, xs = w->type == SK_IQ4_XS, q3 = w->type == SK_Q3_K, q2 = w->type == SK_Q2_K;
    const int64_t sbb = six ? 210 : xs ? 136 : q3 ? 110 : q2 ? 84 : w->type == SK_Q5_K ? 176 : 144;
    uint8_t v[SK_GROUP][32];
    for (int64_t sb = 0; sb < w->n_cols / 256; sb++) {
        if (xs) {
            put_f16s(dst, w, col0, sbb, sb, 0);
            for (int j = 0; j < 8; j++)
                for (int c = 0; c < SK_GROUP; c++)
                    dst[SK_DVEC + SK_GROUP * j + c] = col0 + c < w->n_rows
                        ? (uint8_t)(int8_t)sk_iq4xs_scale(w->data + (col0 + c) * w->row_bytes + sb * sbb, j) : 0;
            dst += SK_XSHDR;
        } else if (q2) {
            put_f16s(dst, w, col0, sbb, sb, 80);
            put_f16s(dst + SK_DVEC, w, col0, sbb, sb, 82);
            for (int s = 0; s < 16; s++)
                for (int c = 0; c < SK_GROUP; c++)
                    dst[2 * SK_DVEC + SK_GROUP * s + c] = col0 + c < w->n_rows ? w->data[(col0 + c) * w->row_bytes + sb * sbb + s] : 0;
            dst += SK_Q2HDR;
        } else if (q3) { /* as Q6_K's: its d and 16 int8 scales */
            put_f16s(dst, w, col0, sbb, sb, 108);
            for (int s = 0; s < 16; s++)
                for (int c = 0; c < SK_GROUP; c++)
                    dst[SK_DVEC + SK_GROUP * s + c] = col0 + c < w->n_rows
                        ? (uint8_t)(int8_t)sk_q3k_scale(w->data + (col0 + c) * w->row_bytes + sb * sbb + 96, s) : 0;
            dst += SK_Q6HDR;
        } else if (six) {
            put_f16s(dst, w, col0, sbb, sb, 208);
            for (int s = 0; s < 16; s++)
                for (int c = 0; c < SK_GROUP; c++)
                    dst[SK_DVEC + SK_GROUP * s + c] = col0 + c < w->n_rows ? w->data[(col0 + c) * w->row_bytes + sb * sbb + 192 + s] : 0;
            dst += SK_Q6HDR;
        } else {
            put_f16s(dst, w, col0, sbb, sb, 0);
            put_f16s(dst + SK_DVEC, w, col0, sbb, sb, 2);
            for (int j = 0; j < 8; j++)
                for (int c = 0; c < SK_GROUP; c++) {
                    int sc = 0, mn = 0;
                    if (col0 + c < w->n_rows) kscale(w->data + (col0 + c) * w->row_bytes + sb * sbb + 4, j, &sc, &mn);
                    dst[2 * SK_DVEC + SK_GROUP * j + c] = (uint8_t)sc;
                    dst[2 * SK_DVEC + 8 * SK_GROUP + SK_GROUP * j + c] = (uint8_t)mn;
                }
            dst += SK_KHDR;
        }
        for (int j = 0; j < 8; j++) {
            if (xs && !by_value) { /* its codes copied as IQ4_NL's (see copy_values) */
                dst = copy_values(w, col0, sbb, sb, 8 + 16 * j, SK_NIB / 64, 0, dst);
                continue;
            }
            gather_values(w, col0, sb * 8 + j, v);
            dst = put_values(w->type, dst, v);
        }
    }
}

static void pack_groups(const sk_tensor *w, int64_t g0, int64_t g1, uint8_t *dst, int by_value) {
    int64_t gb = sk_packed_group_bytes(w);
    for (int64_t g = g0; g < g1; g++, dst += gb) {
        if (sk_super_tile_bytes(w->type)) pack_group_k(w, g * SK_GROUP, dst, by_value);
        else pack_group32(w, g * SK_GROUP, dst, by_value);
    }
}

void sk_pack_groups(const sk_tensor *w, int64_t g0, int64_t g1, uint8_t *dst) { pack_groups(w, g0, g1, dst, 0); }

void sk_pack_groups_by_value(const sk_tensor *w, int64_t g0, int64_t g1, uint8_t *dst) { pack_groups(w, g0, g1, dst, 1); }
