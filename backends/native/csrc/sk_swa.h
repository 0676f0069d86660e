/* Sliding-window attention's key spans and ring caches, and the Gemma-style block pieces (sk_swa.c).
 *
 * A row attends keys at positions [lo, hi): lo = 0 for a global block, max(0, p - window + 1) for a
 * sliding one, hi = p + 1 (or the batch's key_end). The span is cut into pieces by position alone: a
 * first piece up to the next multiple of SK_KEY_BLOCK when lo is not on one (the SIMD kernels read
 * whole key blocks; this piece goes through the generic kernel), then pieces ending at multiples of
 * SK_ATTN_CHUNK. For lo = 0 these are exactly the chunks of a global block. The pieces, their kernels
 * and their merge order depend on (lo, hi) only, so a row's result never depends on its batch.
 *
 * A sliding block keeps its keys and values in a ring of `ring` rows (a multiple of SK_ATTN_CHUNK, so
 * a piece maps to consecutive ring rows): position t lives in row t % ring. With ring >= window +
 * row_cap, one forward of up to row_cap rows per sequence never overwrites a key one of its rows still
 * reads, and a truncate back by up to ring - window + 1 rows finds the window it needs intact. */
#ifndef SK_SWA_H
#define SK_SWA_H

#include <stdint.h>

/* Ring rows of a sliding block: window + row_cap rounded up to SK_ATTN_CHUNK, at most n_ctx_pad. */
int64_t sk_swa_ring_rows(int64_t n_ctx_pad, int32_t window, int32_t row_cap);

/* Number of pieces of the span [lo, hi) (hi > lo), and piece k's positions [*t0, *t1). */
int64_t sk_span_pieces(int64_t lo, int64_t hi);
void sk_span_piece(int64_t lo, int64_t hi, int64_t k, int64_t *t0, int64_t *t1);

/* Positions [lo, hi) of one kv head's ring (keys in the key-block layout, values row by row, head_dim
 * wide) out to dst ([keys | values], (hi - lo) * head_dim each), or back in from src: a snapshot of the
 * window a prompt cache comes back to. */
void sk_swa_copy_out(const uint16_t *k, const uint16_t *v, int64_t ring, int head_dim, int64_t lo, int64_t hi,
                     uint16_t *dst);
void sk_swa_copy_in(uint16_t *k, uint16_t *v, int64_t ring, int head_dim, int64_t lo, int64_t hi, const uint16_t *src);

/* y = gelu_tanh(g) * u over n values (Gemma's gated FFN). */
void sk_geglu(const float *g, const float *u, int64_t n, float *y);

#endif
