/* Gated delta-net blocks (Qwen3.5's linear attention) and the recurrent state of their sequences,
 * for sk_model.c's forward pass.
 *
 * A block projects every row to qkv (the conv channels [q | k | v]), z, beta and alpha (sk_model.c runs
 * those matmuls and ssm_out); this file runs what lies between them:
 *   conv:  a depthwise causal conv1d of width K over the qkv channels (its state: the sequence's last
 *          K - 1 qkv rows), SiLU, q and k L2-normalised per head, q scaled by 1/sqrt(head_k_dim);
 *          decay = exp(softplus(alpha + dt_bias) * a) and beta = sigmoid(beta) per v head;
 *   rule:  per (sequence, v head), token by token: S = S * decay; d = (v - S k) beta; S += d k^T;
 *          o = S q; then o is RMS-normed per head and multiplied by silu(z). V head h reads q and k
 *          head h % n_k_heads (the GGUF's V heads are in tiled order).
 * The conv, the L2 norms and the rule are the kernel table's (sk.h's dn_*, vectorised per instruction
 * set). Every value is computed by one fixed sequence of operations per (sequence, head) and row, so
 * the results depend neither on the batch, nor on the chunking, nor on the thread count (see sk.h).
 *
 * The state of one sequence (one slot): per recurrent block, S [n_v_heads][head_v_dim][head_k_dim]
 * and the conv rows [K - 1][conv_dim], float32, in two buffers. A checkpoint costs nothing: it names
 * the live buffer, and the next forward writes its state into the other one. Rows forwarded after a
 * checkpoint are logged (their qkv row, beta and decay, at most SK_DN_LOG_ROWS of them), so a truncate to
 * any length from the checkpoint on is the checkpoint's buffer plus logged rows to replay through conv
 * and rule only: the same operations as the forward, hence bitwise the same state. The replay waits
 * for the next forward, which runs those rows per head just before the new ones, while the head's state
 * is in cache: a rejected draft costs no pass over the state of its own (sk_dn_internal.h). Snapshots
 * are full copies (prompt caching), two per sequence at most.
 */
#ifndef SK_DELTANET_H
#define SK_DELTANET_H

#include "sk.h"
#include "sk_pool.h"

/* Rows a checkpoint covers: a forward that would take the sequence further past it drops it. */
#define SK_DN_LOG_ROWS 64
#define SK_DN_SNAPSHOTS 2

typedef struct {
    int32_t n_k_heads, n_v_heads, head_k_dim, head_v_dim, conv_kernel;
    sk_tensor qkv, z, beta, alpha, out; /* qkv.data NULL: not a delta-net block */
    const float *conv_w;                /* [conv_kernel][conv_dim] (transposed from the file's [conv_dim][K]) */
    const float *dt_bias, *a, *norm;    /* [n_v_heads], [n_v_heads] (-exp(A_log)), [head_v_dim] */
} sk_dn;

typedef struct sk_dn_ctx sk_dn_ctx;

/* The buffers the matmuls around the block read and write for the current batch (rows of ld floats). */
typedef struct {
    float *qkv, *z, *ba, *o; /* qkv [m][conv_dim]; z, o [m][value_dim]; ba [m][2 n_v]: beta then alpha */
    int64_t ld_qkv, ld_z, ld_ba, ld_o;
} sk_dn_io;

/* blocks[l]: block l's description (it must outlive the context), NULL for attention blocks. NULL when
 * no block is a delta-net block (*err 0), when they do not fit together or out of memory (*err -1). */
sk_dn_ctx *sk_dn_ctx_new(const sk_dn *const *blocks, int n_layer, int n_seq_max, float eps, int *err);
void sk_dn_ctx_free(sk_dn_ctx *d);
/* The recurrent state of one slot, zeroed: 0, or -1 out of memory. */
int sk_dn_state_alloc(sk_dn_ctx *d, int slot);
void sk_dn_state_free(sk_dn_ctx *d, int slot);
int sk_dn_has_state(const sk_dn_ctx *d, int slot);

/* Before a forward (one thread): groups the batch's rows into runs of one sequence, checks that each run
 * continues its sequence (it starts at the state's length, positions consecutive, one run per sequence)
 * and reserves scratch. 0, -1 out of memory, -2 a bad batch. */
int sk_dn_plan(sk_dn_ctx *d, int64_t n_rows, const int32_t *pos, const int32_t *seq);
sk_dn_io sk_dn_buffers(const sk_dn_ctx *d);
/* After the forward (one thread): the states written become the live ones. */
void sk_dn_commit(sk_dn_ctx *d);

/* Block `layer` of a forward, between its input matmuls and ssm_out, in three steps that every thread
 * calls, with a barrier after the first: conv and gates of rows [r0, r1) (this thread's share) and of
 * this thread's share of the pending rows (see the contract below), then
 * the rule of this thread's (run, head) items (pending rows first), then the gated norm of the same items. */
void sk_dn_conv(sk_dn_ctx *d, const sk_kernels *kern, int layer, int64_t r0, int64_t r1, int ith, int nth);
void sk_dn_rule(sk_dn_ctx *d, const sk_kernels *kern, int layer, int ith, int nth);
void sk_dn_gate_norm(sk_dn_ctx *d, const sk_kernels *kern, int layer, int ith, int nth);

/* The recurrent-state contract (core/backend.py), per slot (sk_dn_state.c); checkpoint and snapshot: 0, or
 * -1 out of memory. A truncate back into the rows after the checkpoint runs nothing: those rows become
 * pending, and the next forward runs them first (a snapshot or a read of the state runs them at once,
 * on the pool's threads). */
int sk_dn_checkpoint(sk_dn_ctx *d, int slot);
int sk_dn_snapshot(sk_dn_ctx *d, const sk_kernels *kern, sk_pool *pool, int slot);
int64_t sk_dn_restorable(const sk_dn_ctx *d, int slot, int64_t n);
int64_t sk_dn_length(const sk_dn_ctx *d, int slot);
/* Bring the state back to length n: 0, or -2 n is not restorable. */
int sk_dn_truncate(sk_dn_ctx *d, int slot, int64_t n);
/* Copy of one block's (S, conv rows) of a slot's state, for tests: floats written, or -1. */
int64_t sk_dn_read_state(sk_dn_ctx *d, const sk_kernels *kern, sk_pool *pool, int slot, int layer, float *out,
                         int64_t cap);
/* Floats of one slot's whole state (every recurrent block's S and conv rows). */
int64_t sk_dn_state_floats(const sk_dn_ctx *d);
/* The whole state at the slot's current length into out[cap] (pending rows run first): floats, or -1. */
int64_t sk_dn_export(sk_dn_ctx *d, const sk_kernels *kern, sk_pool *pool, int slot, float *out, int64_t cap);
/* Make `in` (sk_dn_export's) the slot's state at length n; its checkpoint and snapshots go: 0, or -2. */
int sk_dn_import(sk_dn_ctx *d, int slot, const float *in, int64_t n_floats, int64_t n);

#endif
