/* What the two halves of the gated delta-net code share: sk_deltanet.c (the context and the forward)
 * and sk_dn_state.c (the recurrent-state contract: checkpoints, truncates, snapshots). Not an API. */
#ifndef SK_DN_INTERNAL_H
#define SK_DN_INTERNAL_H

#include "sk_deltanet.h"

/* One sequence's state. buf[live] holds it at length `base`; rows [base, len) are pending: logged, not
 * yet run (a truncate back into the rows after a checkpoint only says so; the next forward runs them
 * first, head by head while each head's state is in cache). The checkpoint is buf[ckpt_buf] at
 * ckpt_base plus the logged rows [ckpt_base, ckpt_len); log[cur] row i holds position ckpt_base + i.
 * Rows pending imply a checkpoint with live == ckpt_buf and base == ckpt_base. A checkpoint taken while
 * rows are pending (ckpt_len > ckpt_base) moves to ckpt_len when the next forward writes the state
 * after the pending rows into the other buffer, and its rows go on in the other log. */
typedef struct {
    float *buf[2];
    int live, ckpt_buf, cur;
    int64_t base, len, ckpt_base, ckpt_len; /* ckpt_len -1: no checkpoint */
    float *log[2]; /* [SK_DN_LOG_ROWS][n_rec][log_floats] each; NULL until a checkpoint */
    float *snap[SK_DN_SNAPSHOTS];
    int64_t snap_len[SK_DN_SNAPSHOTS]; /* -1: none */
    int snap_oldest;
} rs_state;

typedef struct { /* rows [r0, r1) of a batch: one sequence's, continuing its state */
    int slot;
    int64_t r0, r1;
    int64_t n_pend, pcv0; /* pending rows run first (plog rows [0, n_pend)); their conv outputs: pcv rows pcv0.. */
    const float *plog;
    const float *src; /* the state at base */
    float *mid;       /* NULL, or where the state after the pending rows goes (the checkpoint moving there) */
    float *dst;       /* where the state after the run goes (src itself, or the buffer the checkpoint does not use) */
    float *log;       /* log row of r0 (NULL: not logged) */
    int dst_buf, mid_buf;
} dn_run;

struct sk_dn_ctx {
    int n_layer, n_rec, n_seq_max, n_k, n_v, hk, hv, K;
    int64_t conv_dim, key_dim, value_dim, s_floats, conv_floats, block_floats, state_floats, log_floats;
    float eps;
    const sk_dn **rec;   /* [n_rec]: the recurrent blocks in order */
    int *rec_index;      /* [n_layer]: index among the recurrent blocks, -1 for attention blocks */
    rs_state *rs;        /* [n_seq_max]: buf[0] NULL while the slot has no state */
    int64_t cap_rows, cap_runs, n_runs, n_pend;
    float *qkv, *z, *ba, *cv, *o; /* scratch of cap_rows rows: see sk_dn_io; cv holds the conv outputs */
    float *pcv;                   /* pending rows' conv outputs, [n_rec][rows][conv_dim] when replaying */
    int64_t cap_pcv;              /* floats */
    int32_t *run_of;              /* [cap_rows] */
    dn_run *runs;                 /* [cap_runs] */
    int32_t *seen;                /* [n_seq_max]: plan's check that a sequence has one run */
    int32_t stamp;
};

/* Where a block's conv reads its inputs: the K - 1 rows of a conv state, then n_logged logged rows, then
 * rows (each set ld apart). */
typedef struct {
    const float *state, *logged, *rows;
    int64_t n_logged, ld_logged, ld_rows;
} dn_hist;

static inline void dn_split(int64_t n, int ith, int nth, int64_t *a, int64_t *b) {
    *a = n * ith / nth;
    *b = n * (ith + 1) / nth;
}

/* sk_deltanet.c: the steps the forward and the replay share (the same operations, hence the same bits). */
void dn_conv_row(const sk_dn_ctx *d, const sk_kernels *kern, const sk_dn *b, const dn_hist *h, int64_t i, float *out);
void dn_rule_head(const sk_dn_ctx *d, const sk_kernels *kern, int h, const float *src, float *dst, const float *cv,
                  int64_t ld_cv, const float *bg, int64_t ld_bg, int64_t n, float *o, int64_t ld_o);
void dn_conv_advance(const sk_dn_ctx *d, const dn_hist *h, int64_t n, float *dst);
/* Room for n floats of pending conv outputs: 0, or -1 out of memory. */
int dn_reserve_pcv(sk_dn_ctx *d, int64_t n);

#endif
