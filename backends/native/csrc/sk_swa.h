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

/* What the rings of each sequence hold: its floor (every written position from there up to its length is
 * in every sliding block's ring) and up to SK_SWA_SNAPS snapshots, copies of the window before a length
 * (the oldest replaced first) taken when a forward is about to overwrite it. `heads` below lists a sequence's rings: the key then value cache of every
 * kv head of every sliding block, in one fixed order. */
typedef struct sk_swa sk_swa;

sk_swa *sk_swa_new(int n_seq_max, int32_t window, int64_t ring);
void sk_swa_free(sk_swa *s);
int64_t sk_swa_floor_of(const sk_swa *s, int slot);
/* Whether one forward's rows (of each sequence in increasing position, a sequence's rows consecutive)
 * find every key their windows need, and, after it ran, the floors moved past what it overwrote. */
int sk_swa_rows_fit(const sk_swa *s, int64_t n_rows, const int32_t *pos, const int32_t *seq);
void sk_swa_rows_written(sk_swa *s, int64_t n_rows, const int32_t *pos, const int32_t *seq);
/* A truncate to n: the floor comes down to n (rows from n on are written again before read) and the
 * snapshots of longer lengths go (they are of the rows being replaced). */
void sk_swa_cut(sk_swa *s, int slot, int64_t n);
/* Keep the window before length n (0, -2 the rings no longer hold it). Nothing is copied yet: the rings
 * hold the window until a forward writes over it, and sk_swa_hold copies it out just before (-1: out of
 * memory then). Most snapshots never need the copy (a prompt cache's reuse point, reached again before
 * the sequence moved ring - window rows on), and a copy of Gemma 3 270M's window is ~8 MB a sequence. */
int sk_swa_keep(sk_swa *s, int slot, int64_t n);
/* Before rows up to position last_pos of the slot are written: copy out every kept window they would
 * overwrite (0, -1 out of memory). */
int sk_swa_hold(sk_swa *s, int slot, int64_t last_pos, uint16_t *const *heads, int n_heads, int head_dim);
/* A restored sequence: its rings hold what the saved ones did from `floor` on; every snapshot goes. */
void sk_swa_reset(sk_swa *s, int slot, int64_t floor);
/* The longest snapshot length <= n (-1: none); put the snapshot of length n back and cut to n (0, -2: none). */
int64_t sk_swa_kept_below(const sk_swa *s, int slot, int64_t n);
int sk_swa_bring_back(sk_swa *s, int slot, int64_t n, uint16_t *const *heads, int n_heads, int head_dim);

/* y = gelu_tanh(g) * u over n values (Gemma's gated FFN). */
void sk_geglu(const float *g, const float *u, int64_t n, float *y);

#endif
