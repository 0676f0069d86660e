/* Portable C kernels: the fallback on CPUs without AVX2, and the place where each block
 * format's meaning is written down plainly (the SIMD kernels must agree with these to rounding). */
#include <math.h>
#include <string.h>

#include "sk.h"
#include "sk_codebooks.h"

static inline uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

/* The 6-bit scale and minimum of sub-block j (0..7) of a Q4_K / Q5_K super-block. */
static inline void kscale(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Block b (32 values) of a quantized row: integer values v and, per 16-value half, the scale and the
 * minimum, so that weight = dw[h] * v + mw[h]. Returns 0 for an unsupported type. */
static int unpack32(int type, const uint8_t *row, int64_t b, int v[32], float dw[2], float mw[2]) {
    mw[0] = mw[1] = 0.0f;
    switch (type) {
    case SK_Q4_0: {
        const uint8_t *p = row + b * 18;
        dw[0] = dw[1] = sk_f16_to_f32(rd16(p));
        for (int l = 0; l < 16; l++) { v[l] = (p[2 + l] & 15) - 8; v[l + 16] = (p[2 + l] >> 4) - 8; }
        return 1;
    }
    case SK_Q4_1: {
        const uint8_t *p = row + b * 20;
        dw[0] = dw[1] = sk_f16_to_f32(rd16(p));
        mw[0] = mw[1] = sk_f16_to_f32(rd16(p + 2));
        for (int l = 0; l < 16; l++) { v[l] = p[4 + l] & 15; v[l + 16] = p[4 + l] >> 4; }
        return 1;
    }
    case SK_Q5_0: {
        const uint8_t *p = row + b * 22;
        dw[0] = dw[1] = sk_f16_to_f32(rd16(p));
        uint32_t qh = rd32(p + 2);
        for (int l = 0; l < 16; l++) {
            v[l] = ((p[6 + l] & 15) | (((qh >> l) & 1) << 4)) - 16;
            v[l + 16] = ((p[6 + l] >> 4) | (((qh >> (l + 16)) & 1) << 4)) - 16;
        }
        return 1;
    }
    case SK_Q5_1: {
        const uint8_t *p = row + b * 24;
        dw[0] = dw[1] = sk_f16_to_f32(rd16(p));
        mw[0] = mw[1] = sk_f16_to_f32(rd16(p + 2));
        uint32_t qh = rd32(p + 4);
        for (int l = 0; l < 16; l++) {
            v[l] = (p[8 + l] & 15) | (((qh >> l) & 1) << 4);
            v[l + 16] = (p[8 + l] >> 4) | (((qh >> (l + 16)) & 1) << 4);
        }
        return 1;
    }
    case SK_Q8_0: {
        const uint8_t *p = row + b * 34;
        dw[0] = dw[1] = sk_f16_to_f32(rd16(p));
        for (int l = 0; l < 32; l++) v[l] = (int8_t)p[2 + l];
        return 1;
    }
    case SK_IQ4_NL: {
        const uint8_t *p = row + b * 18;
        dw[0] = dw[1] = sk_f16_to_f32(rd16(p));
        for (int l = 0; l < 16; l++) { v[l] = sk_iq4nl_values[p[2 + l] & 15]; v[l + 16] = sk_iq4nl_values[p[2 + l] >> 4]; }
        return 1;
    }
    case SK_MXFP4: {
        const uint8_t *p = row + b * 17;
        dw[0] = dw[1] = sk_e8m0_half(p[0]);
        for (int l = 0; l < 16; l++) { v[l] = sk_mxfp4_values[p[1 + l] & 15]; v[l + 16] = sk_mxfp4_values[p[1 + l] >> 4]; }
        return 1;
    }
    case SK_IQ4_XS: {
        const uint8_t *p = row + (b / 8) * 136, *qs = p + 8 + 16 * (b % 8);
        dw[0] = dw[1] = sk_f16_to_f32(rd16(p)) * (float)sk_iq4xs_scale(p, (int)(b % 8));
        for (int l = 0; l < 16; l++) { v[l] = sk_iq4nl_values[qs[l] & 15]; v[l + 16] = sk_iq4nl_values[qs[l] >> 4]; }
        return 1;
    }
    case SK_Q4_K:
    case SK_Q5_K: {
        int five = type == SK_Q5_K;
        const uint8_t *p = row + (b / 8) * (five ? 176 : 144);
        int j = (int)(b % 8), sc, mn;
        kscale(p + 4, j, &sc, &mn);
        float d = sk_f16_to_f32(rd16(p)), dmin = sk_f16_to_f32(rd16(p + 2));
        dw[0] = dw[1] = d * (float)sc;
        mw[0] = mw[1] = -(dmin * (float)mn);
        const uint8_t *qh = p + 16, *qs = p + (five ? 48 : 16) + 32 * (j / 2);
        for (int l = 0; l < 32; l++) {
            int q = (j & 1) ? qs[l] >> 4 : qs[l] & 15;
            if (five && (qh[l] >> j) & 1) q += 16;
            v[l] = q;
        }
        return 1;
    }
    case SK_Q2_K: { /* 2-bit values, a 4-bit scale and minimum per 16 */
        const uint8_t *p = row + (b / 8) * 84;
        int j = (int)(b % 8), shift = 2 * (j % 4);
        const uint8_t *qs = p + 16 + 32 * (j / 4);
        float d = sk_f16_to_f32(rd16(p + 80)), dmin = sk_f16_to_f32(rd16(p + 82));
        for (int h = 0; h < 2; h++) {
            dw[h] = d * (float)(p[2 * j + h] & 15);
            mw[h] = -(dmin * (float)(p[2 * j + h] >> 4));
        }
        for (int l = 0; l < 32; l++) v[l] = (qs[l] >> shift) & 3;
        return 1;
    }
    case SK_Q3_K: { /* 2 low bits in qs, the third (set: no -4) in hmask, as Q6_K's planes */
        const uint8_t *p = row + (b / 8) * 110;
        int j = (int)(b % 8), shift = 2 * (j % 4);
        const uint8_t *qs = p + 32 + 32 * (j / 4);
        float d = sk_f16_to_f32(rd16(p + 108));
        dw[0] = d * (float)sk_q3k_scale(p + 96, 2 * j);
        dw[1] = d * (float)sk_q3k_scale(p + 96, 2 * j + 1);
        for (int l = 0; l < 32; l++) v[l] = ((qs[l] >> shift) & 3) - (((p[l] >> j) & 1) ? 0 : 4);
        return 1;
    }
    case SK_Q6_K: {
        const uint8_t *p = row + (b / 8) * 210;
        int j = (int)(b % 8), n = j / 4, jj = j % 4;
        const uint8_t *ql = p + 64 * n + ((jj & 1) ? 32 : 0), *qh = p + 128 + 32 * n;
        const int8_t *sc = (const int8_t *)(p + 192) + 8 * n;
        float d = sk_f16_to_f32(rd16(p + 208));
        dw[0] = d * (float)sc[2 * jj];
        dw[1] = d * (float)sc[2 * jj + 1];
        for (int l = 0; l < 32; l++) {
            int lo = (jj & 2) ? ql[l] >> 4 : ql[l] & 15;
            int hi = (qh[l] >> (2 * jj)) & 3;
            v[l] = (lo | (hi << 4)) - 32;
        }
        return 1;
    }
    default:
        return 0;
    }
}

static int block_elems(int type) {
    switch (type) {
    case SK_Q2_K: case SK_Q3_K: case SK_Q4_K: case SK_Q5_K: case SK_Q6_K: case SK_IQ4_XS: return 256;
    case SK_F32: case SK_F16: case SK_BF16: return 1;
    default: return 32;
    }
}

void sk_dequant_row(const sk_tensor *w, int64_t row, float *out) {
    const uint8_t *r = w->data + row * w->row_bytes;
    int64_t k = w->n_cols;
    if (w->type == SK_F32) { memcpy(out, r, (size_t)k * 4); return; }
    if (w->type == SK_F16) { for (int64_t i = 0; i < k; i++) out[i] = sk_f16_to_f32(rd16(r + 2 * i)); return; }
    if (w->type == SK_BF16) { for (int64_t i = 0; i < k; i++) out[i] = sk_bf16_to_f32(rd16(r + 2 * i)); return; }
    int v[32];
    float dw[2], mw[2];
    for (int64_t b = 0; b < k / 32; b++) {
        unpack32(w->type, r, b, v, dw, mw);
        for (int l = 0; l < 32; l++) out[32 * b + l] = dw[l / 16] * (float)v[l] + mw[l / 16];
    }
}

/* Per 32 values: d = max|x| / 127, q = round-to-nearest-even(x * (1 / d)), d then rounded to float16.
 * The AVX-512 version computes the same numbers bit for bit (tests check it). */
static void quantize_rows(const float *x, int64_t ldx, int64_t m, int64_t k, sk_act *a, int64_t r0) {
    int64_t kp = a->kp;
    for (int64_t r = 0; r < m; r++) {
        const float *xr = x + r * ldx;
        int64_t row = r0 + r;
        int8_t *q = a->q + row * kp;
        for (int64_t b = 0; b < kp / 32; b++) {
            float amax = 0.0f, xs[32];
            for (int l = 0; l < 32; l++) {
                int64_t i = 32 * b + l;
                xs[l] = i < k ? xr[i] : 0.0f;
                float ax = fabsf(xs[l]);
                amax = ax > amax ? ax : amax;
            }
            float d = amax / 127.0f, id = sk_act_inverse_scale(d);
            int sum[2] = {0, 0};
            for (int l = 0; l < 32; l++) {
                q[32 * b + l] = (int8_t)(int)nearbyintf(xs[l] * id);
                sum[l / 16] += q[32 * b + l];
            }
            /* The scale and the block sum are kept as float16 values, as llama.cpp's q8_0/q8_1 blocks
             * keep them, so products with the weights round the way llama.cpp's do. */
            a->d[row * (kp / 32) + b] = sk_act_round(d);
            a->s[row * (kp / 32) + b] = sk_act_round(d * (float)(sum[0] + sum[1]));
            a->qs16[row * (kp / 16) + 2 * b] = sum[0];
            a->qs16[row * (kp / 16) + 2 * b + 1] = sum[1];
        }
    }
}

static void gemm_q(const sk_tensor *w, int64_t n0, int64_t n1, const sk_act *a, int64_t m, float *out,
                   int64_t ldo, int accumulate) {
    int64_t nb = w->n_cols / 32, kp = a->kp;
    int v[32];
    float dw[2], mw[2];
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w->data + n * w->row_bytes;
        for (int64_t r = 0; r < m; r++) {
            const int8_t *q = a->q + r * kp;
            const float *da = a->d + r * (kp / 32);
            const int32_t *qs16 = a->qs16 + r * (kp / 16);
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                unpack32(w->type, row, b, v, dw, mw);
                for (int h = 0; h < 2; h++) {
                    int isum = 0;
                    for (int l = 16 * h; l < 16 * h + 16; l++) isum += v[l] * q[32 * b + l];
                    acc += (dw[h] * da[b]) * (float)isum;
                    acc += mw[h] * (da[b] * (float)qs16[2 * b + h]);
                }
            }
            if (w->bias) acc += w->bias[n];
            float *o = out + r * ldo + n;
            *o = accumulate ? *o + acc : acc;
        }
    }
}

static inline float wval(const sk_tensor *w, const uint8_t *row, int64_t i) {
    if (w->type == SK_F32) { float f; memcpy(&f, row + 4 * i, 4); return f; }
    if (w->type == SK_F16) return sk_f16_to_f32(rd16(row + 2 * i));
    return sk_bf16_to_f32(rd16(row + 2 * i));
}

static void gemm_f(const sk_tensor *w, int64_t n0, int64_t n1, const float *x, int64_t ldx, int64_t m,
                   float *out, int64_t ldo, int accumulate) {
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w->data + n * w->row_bytes;
        for (int64_t r = 0; r < m; r++) {
            float acc = 0.0f;
            for (int64_t i = 0; i < w->n_cols; i++) acc += wval(w, row, i) * x[r * ldx + i];
            if (w->bias) acc += w->bias[n];
            float *o = out + r * ldo + n;
            *o = accumulate ? *o + acc : acc;
        }
    }
}

static int supports(const sk_tensor *w) {
    if (w->layout != 0) return 0;
    if (sk_is_quant(w->type)) {
        int v[32];
        float dw[2], mw[2];
        return w->n_cols % block_elems(w->type) == 0 && unpack32(w->type, w->data, 0, v, dw, mw);
    }
    return 1;
}

static inline float kget(const uint16_t *k, int64_t t, int d, int head_dim) {
    return sk_f16_to_f32(k[(t / SK_KEY_BLOCK) * head_dim * SK_KEY_BLOCK + d * SK_KEY_BLOCK + t % SK_KEY_BLOCK]);
}

static void attend_part(const float *q, int n_q, int64_t ldq, const uint16_t *k, const uint16_t *v, int64_t t0,
                        int64_t t1, int head_dim, float scale, float *part, int64_t ldpart, float *scratch) {
    for (int h = 0; h < n_q; h++) {
        const float *qh = q + h * ldq;
        float mx = -INFINITY;
        for (int64_t t = t0; t < t1; t++) {
            float s = 0.0f;
            for (int d = 0; d < head_dim; d++) s += qh[d] * kget(k, t, d, head_dim);
            scratch[t - t0] = s * scale;
            mx = scratch[t - t0] > mx ? scratch[t - t0] : mx;
        }
        float sum = 0.0f, *o = part + h * ldpart + 2;
        for (int64_t t = t0; t < t1; t++) { scratch[t - t0] = expf(scratch[t - t0] - mx); sum += scratch[t - t0]; }
        for (int d = 0; d < head_dim; d++) o[d] = 0.0f;
        for (int64_t t = t0; t < t1; t++)
            for (int d = 0; d < head_dim; d++) o[d] += scratch[t - t0] * sk_f16_to_f32(v[t * head_dim + d]);
        part[h * ldpart] = mx;
        part[h * ldpart + 1] = sum;
    }
}

static void rms_norm(const float *x, const float *w, int64_t n, float eps, float *y) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    float scale = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) y[i] = (x[i] * scale) * w[i];
}

static void silu_mul(const float *g, const float *u, int64_t n, float *y) {
    for (int64_t i = 0; i < n; i++) y[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

/* ---- gated delta-net (see sk.h) --------------------------------------------------------------- */

/* A sum of products in a fixed order: 8 running sums, then a fixed tree. */
static float dot8(const float *a, const float *b, int64_t n) {
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int u = 0; u < 8; u++) acc[u] += a[j + u] * b[j + u];
    for (int u = 0; j + u < n; u++) acc[u] += a[j + u] * b[j + u];
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

static void dn_conv(const float *const *x, const float *w, int K, int64_t n, float *out) {
    for (int64_t c = 0; c < n; c++) out[c] = x[0][c] * w[c];
    for (int t = 1; t < K; t++)
        for (int64_t c = 0; c < n; c++) out[c] += x[t][c] * w[t * n + c];
    for (int64_t c = 0; c < n; c++) out[c] = out[c] / (1.0f + expf(-out[c]));
}

static void dn_l2norm(float *x, int64_t n, float eps, float scale) {
    const float f = scale / sqrtf(dot8(x, x, n) + eps);
    for (int64_t j = 0; j < n; j++) x[j] *= f;
}

static void dn_rule(const float *src, float *dst, int hk, int hv, int64_t n, const float *q, const float *k,
                    int64_t ld_qk, const float *v, int64_t ld_v, const float *beta, const float *decay, int64_t ld_bg,
                    float *o, int64_t ld_o) {
    for (int i = 0; i < hv; i++) {
        float *row = dst + (int64_t)i * hk;
        if (src != dst) memcpy(row, src + (int64_t)i * hk, sizeof(float) * (size_t)hk);
        for (int64_t t = 0; t < n; t++) {
            const float *kt = k + t * ld_qk, dc = decay[t * ld_bg];
            for (int j = 0; j < hk; j++) row[j] *= dc;
            const float delta = (v[t * ld_v + i] - dot8(row, kt, hk)) * beta[t * ld_bg];
            for (int j = 0; j < hk; j++) row[j] += kt[j] * delta;
            if (o) o[t * ld_o + i] = dot8(row, q + t * ld_qk, hk);
        }
    }
}

const sk_kernels sk_generic_kernels = {
    .name = "generic",
    .quantize_rows = quantize_rows,
    .gemm_q = gemm_q,
    .gemm_f = gemm_f,
    .supports = supports,
    .packed_size = NULL,
    .pack = NULL,
    .column_unit = 16,
    .attend_part = attend_part,
    .rms_norm = rms_norm,
    .silu_mul = silu_mul,
    .dn_conv = dn_conv,
    .dn_l2norm = dn_l2norm,
    .dn_rule = dn_rule,
};
