/* Sliding-window spans and Gemma-style block pieces: see sk_swa.h. */
#include "sk_swa.h"

#include <math.h>

#include "sk.h"

int64_t sk_swa_ring_rows(int64_t n_ctx_pad, int32_t window, int32_t row_cap) {
    const int64_t ring = sk_round_up((int64_t)window + row_cap, SK_ATTN_CHUNK);
    return ring < n_ctx_pad ? ring : n_ctx_pad;
}

/* Where the aligned pieces start: lo itself, or past the generic first piece. */
static int64_t aligned_start(int64_t lo, int64_t hi) {
    const int64_t a = sk_round_up(lo, SK_KEY_BLOCK);
    return a < hi ? a : hi;
}

int64_t sk_span_pieces(int64_t lo, int64_t hi) {
    const int64_t a = aligned_start(lo, hi), head = a > lo;
    return head + (hi > a ? (hi - 1) / SK_ATTN_CHUNK - a / SK_ATTN_CHUNK + 1 : 0);
}

void sk_span_piece(int64_t lo, int64_t hi, int64_t k, int64_t *t0, int64_t *t1) {
    const int64_t a = aligned_start(lo, hi);
    if (a > lo) {
        if (k == 0) {
            *t0 = lo;
            *t1 = a;
            return;
        }
        k--;
    }
    const int64_t first = a / SK_ATTN_CHUNK + k;
    const int64_t s = first * SK_ATTN_CHUNK, e = s + SK_ATTN_CHUNK;
    *t0 = s > a ? s : a;
    *t1 = e < hi ? e : hi;
}

/* Where position t's dimension d lives in a ring's key layout ([t / 16][head_dim][16]). */
static int64_t key_at(int64_t ring, int head_dim, int64_t t, int d) {
    const int64_t r = t % ring;
    return (r / SK_KEY_BLOCK) * head_dim * SK_KEY_BLOCK + (int64_t)d * SK_KEY_BLOCK + r % SK_KEY_BLOCK;
}

void sk_swa_copy_out(const uint16_t *k, const uint16_t *v, int64_t ring, int head_dim, int64_t lo, int64_t hi,
                     uint16_t *dst) {
    uint16_t *dv = dst + (hi - lo) * head_dim;
    for (int64_t t = lo; t < hi; t++)
        for (int d = 0; d < head_dim; d++) {
            dst[(t - lo) * head_dim + d] = k[key_at(ring, head_dim, t, d)];
            dv[(t - lo) * head_dim + d] = v[(t % ring) * head_dim + d];
        }
}

void sk_swa_copy_in(uint16_t *k, uint16_t *v, int64_t ring, int head_dim, int64_t lo, int64_t hi, const uint16_t *src) {
    const uint16_t *sv = src + (hi - lo) * head_dim;
    for (int64_t t = lo; t < hi; t++)
        for (int d = 0; d < head_dim; d++) {
            k[key_at(ring, head_dim, t, d)] = src[(t - lo) * head_dim + d];
            v[(t % ring) * head_dim + d] = sv[(t - lo) * head_dim + d];
        }
}

/* tanh-approximated GELU as llama.cpp's graph and transformers' gelu_pytorch_tanh compute it, in float
 * with tanhf: one scalar sequence per value, the same wherever the row sits. */
void sk_geglu(const float *g, const float *u, int64_t n, float *y) {
    const float c = 0.7978845608028654f; /* sqrt(2 / pi) */
    for (int64_t i = 0; i < n; i++) {
        const float x = g[i];
        y[i] = 0.5f * x * (1.0f + tanhf(c * (x + 0.044715f * x * x * x))) * u[i];
    }
}
