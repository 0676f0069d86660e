/* spekula's native CPU kernels: the shared types.
 *
 * Weights stay in their GGUF block layout (the file is memory-mapped; tensors point into it).
 * Activations entering a quantized matmul are quantized per 32 values to int8 with one float scale
 * (the scheme llama.cpp uses), in the layout `sk_act` below.
 *
 * Exactness rule for every kernel here: the value written for one output element depends only on
 * that element's inputs (its weight row, its activation row, its position's keys and values), and is
 * computed by the same instruction sequence whatever the number of rows, columns or threads. So a
 * row's logits are bitwise independent of the other rows of the forward, of how a sequence was
 * chunked, and of the thread count. Compile with -ffp-contract=off: no silent fusing of a*b+c.
 */
#ifndef SK_H
#define SK_H

#include <stddef.h>
#include <stdint.h>

#define SK_API __attribute__((visibility("default")))

/* ggml type ids, as stored in GGUF. */
enum {
    SK_F32 = 0, SK_F16 = 1, SK_Q4_0 = 2, SK_Q4_1 = 3, SK_Q5_0 = 6, SK_Q5_1 = 7, SK_Q8_0 = 8,
    SK_Q4_K = 12, SK_Q5_K = 13, SK_Q6_K = 14, SK_BF16 = 30,
};
/* Block types whose codes index a 16-value table (IQ4_NL, IQ4_XS, MXFP4) or with 16-value sub-blocks
 * (Q2_K, Q3_K). */
enum { SK_Q2_K = 10, SK_Q3_K = 11, SK_IQ4_NL = 20, SK_IQ4_XS = 23, SK_MXFP4 = 39 };

/* One 2-D weight: n_rows outputs of n_cols inputs each, rows row_bytes apart (in a kernel table's own
 * layout, row_bytes is that layout's stride: see the table). */
typedef struct {
    const uint8_t *data;
    int32_t type;
    int32_t layout; /* 0: GGUF blocks as stored; 1: repacked by the kernel table's pack_rows */
    int64_t n_rows;
    int64_t n_cols;
    int64_t row_bytes;
    const float *bias; /* [n_rows] or NULL */
} sk_tensor;

/* Quantized activation rows (kp = n_cols rounded up to 64, zero padded). Per row:
 *   q[kp]        int8 values
 *   d[kp/32]     the scale of each 32-block
 *   s[kp/32]     d * sum(q) of each 32-block (what a block's minimum multiplies)
 *   qs16[kp/16]  sum of q per 16 values (exact integer offsets for the symmetric types)
 */
typedef struct {
    int8_t *q;
    float *d;
    float *s;
    int32_t *qs16;
    int64_t kp;
    int64_t n_rows;
} sk_act;

/* Kernel table: one implementation per instruction set, chosen once per process. */
typedef struct {
    const char *name;
    void (*quantize_rows)(const float *x, int64_t ldx, int64_t m, int64_t k, sk_act *a, int64_t r0);
    /* out[r][n] (+)= dot(w row n, act row r) (+ bias[n]) for r in [0, m), n in [n0, n1). */
    void (*gemm_q)(const sk_tensor *w, int64_t n0, int64_t n1, const sk_act *a, int64_t m, float *out,
                   int64_t ldo, int accumulate);
    void (*gemm_f)(const sk_tensor *w, int64_t n0, int64_t n1, const float *x, int64_t ldx, int64_t m,
                   float *out, int64_t ldo, int accumulate);
    /* Whether gemm_q/gemm_f of this table handle this tensor (else the generic table does). */
    int (*supports)(const sk_tensor *w);
    /* The table's own layout for this tensor: total bytes (0: it reads the GGUF blocks as they are)
     * and the row_bytes field that layout uses, which covers `column_unit` output columns; pack
     * writes units [u0, u1) of it (the same values, moved: lossless). Work is split between threads
     * in whole units too. */
    int64_t (*packed_size)(const sk_tensor *w, int64_t *row_bytes);
    void (*pack)(const sk_tensor *w, int64_t u0, int64_t u1, uint8_t *dst);
    int column_unit;
    /* Attention of n_q query heads (sharing one kv head) over keys [t0, t1) of the cache (t0 a multiple
     * of SK_ATTN_CHUNK): per head h, part + h * ldpart = [max score m, sum of exp(score - m),
     * sum of exp(score - m) * value (head_dim)]. sk_model.c merges a row's chunks in key order, so the
     * result depends on the key count alone, not on how the work was split. */
    void (*attend_part)(const float *q, int n_q, int64_t ldq, const uint16_t *k, const uint16_t *v, int64_t t0,
                        int64_t t1, int head_dim, float scale, float *part, int64_t ldpart, float *scratch);
    void (*rms_norm)(const float *x, const float *w, int64_t n, float eps, float *y);
    void (*silu_mul)(const float *g, const float *u, int64_t n, float *y);
    /* Gated delta-net pieces (sk_deltanet.h); the forward and the replay of logged rows call the same
     * ones, so a replayed state is bitwise the forward's.
     * dn_conv: out[c] = silu(sum_w x[w][c] * w[w * n + c]) for c in [0, n), over K taps.
     * dn_l2norm: x *= scale / sqrt(sum x^2 + eps) over n values.
     * dn_rule: the delta rule of one v head over n tokens: the state [hv][hk] goes from src to dst (the
     * same buffer or another); token t reads q, k (+ t * ld_qk, hk values), v (+ t * ld_v, hv values),
     * beta[t * ld_bg], decay[t * ld_bg]; per state row i: s = s * decay; s += k * ((v[i] - s.k) * beta);
     * o[t * ld_o + i] = s.q (o NULL: not wanted). Rows are independent, so each is carried through
     * every token before the next (in registers where it fits). */
    void (*dn_conv)(const float *const *x, const float *w, int K, int64_t n, float *out);
    void (*dn_l2norm)(float *x, int64_t n, float eps, float scale);
    void (*dn_rule)(const float *src, float *dst, int hk, int hv, int64_t n, const float *q, const float *k,
                    int64_t ld_qk, const float *v, int64_t ld_v, const float *beta, const float *decay,
                    int64_t ld_bg, float *o, int64_t ld_o);
} sk_kernels;

extern const sk_kernels sk_generic_kernels;
#if defined(__x86_64__)
extern const sk_kernels sk_avx2_kernels;
extern const sk_kernels sk_avx512_kernels;
#endif

/* Which kernel table a context may use at most (sk_ctx_new, the test entry points): the best this CPU
 * runs, the portable C, or at most AVX2 (so that path is tested on AVX-512 machines too). */
enum { SK_KERNELS_BEST = 0, SK_KERNELS_GENERIC = 1, SK_KERNELS_AVX2 = 2 };

/* True for the types whose blocks go through the int8 path. */
static inline int sk_is_quant(int type) {
    return type != SK_F32 && type != SK_F16 && type != SK_BF16;
}

/* Key cache layout: [kv head][key / 16][head_dim][16] f16, so 16 consecutive keys of one dimension
 * are contiguous. Value cache layout: [kv head][key][head_dim] f16. */
#define SK_KEY_BLOCK 16
/* Keys per attention work item: long contexts split into chunks that threads share. */
#define SK_ATTN_CHUNK 256

static inline int64_t sk_round_up(int64_t n, int64_t k) { return (n + k - 1) / k * k; }

/* IEEE half <-> float, scalar (the SIMD paths use F16C instructions with the same rounding). */
static inline float sk_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            man &= 0x3ff;
            bits = sign | (exp << 23) | (man << 13);
        }
    } else if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    union { uint32_t u; float f; } v = {bits};
    return v.f;
}

/* Round to nearest even, as vcvtps2ph with rounding mode 0. */
static inline uint16_t sk_f32_to_f16(float f) {
    union { float f; uint32_t u; } v = {f};
    uint32_t x = v.u, sign = (x >> 16) & 0x8000;
    int32_t exp = (int32_t)((x >> 23) & 0xff) - 127 + 15;
    uint32_t man = x & 0x7fffff;
    if (((x >> 23) & 0xff) == 0xff) return (uint16_t)(sign | 0x7c00 | (man ? 0x200 : 0));
    if (exp >= 0x1f) return (uint16_t)(sign | 0x7c00);
    if (exp <= 0) {
        if (exp < -10) return (uint16_t)sign;
        man |= 0x800000;
        uint32_t shift = (uint32_t)(14 - exp);
        uint32_t half = man >> shift, rem = man & ((1u << shift) - 1), mid = 1u << (shift - 1);
        if (rem > mid || (rem == mid && (half & 1))) half++;
        return (uint16_t)(sign | half);
    }
    uint32_t half = (uint32_t)(exp << 10) | (man >> 13), rem = man & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (half & 1))) half++;
    return (uint16_t)(sign | half);
}

/* An activation block's scale or scaled sum, rounded to float16 as llama.cpp stores them; a finite value
 * beyond float16's range (a block of activations summing past 65504 times its scale) stays float32
 * instead of turning into an infinity that would poison every output of the row. */
static inline float sk_act_round(float f) {
    const float r = sk_f16_to_f32(sk_f32_to_f16(f));
    return __builtin_isinf(r) && __builtin_isfinite(f) ? f : r;
}

/* 1 / d for an activation block's scale d = max|x| / 127, or 0 where there is nothing to scale: d == 0,
 * or a block of subnormal values whose d is so small that 1 / d overflows. There x / d would be an
 * infinity or NaN, whose conversion to an integer is undefined in C and differs between instruction
 * sets; such a block's float16 scale is 0, so quantizing it to zeros changes no product. */
static inline float sk_act_inverse_scale(float d) {
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    return __builtin_isfinite(id) ? id : 0.0f;
}

static inline float sk_bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}

/* Dequantize one weight row to float (embedding lookups, tests). */
void sk_dequant_row(const sk_tensor *w, int64_t row, float *out);

#endif
