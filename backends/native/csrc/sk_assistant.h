/* Gemma 4's assistant drafter (llama.cpp's gemma4-assistant) over a native Gemma 4 target's keys and values.
 *
 * The assistant keeps no cache: one step decodes a token x with a hidden state h at the position P of x,
 * every block a query-only attention over the target's cached keys [0, P) of the block kind it reads
 * (a sliding block: the target's last sliding block, within the window; a global one: its last global
 * block), roped with the target's own tables so its queries meet the cached keys alike:
 *
 *     u = pre_proj . [E_target[x] * embd_scale; h]
 *     per block: u += post_attn_norm(wo . attend(rope(q_norm(wq . attn_norm(u))))), scale 1
 *                u += ffn_post_norm(down(gelu_tanh(gate(ffn_norm(u))) * up(ffn_norm(u))));  u *= out_scale
 *     y = output_norm(u);  logits = embd . y (tied);  h_next = post_proj . y
 *
 * The matmuls run on the target's thread pool, split by output columns as the forward splits them, with
 * int8 activations before quantized weights; the scalar steps run on one thread. A row's result depends on
 * that row alone (rows run one after another), not on the others of the call. sk_seq_state.c lends the target's
 * pieces through sk_assistant_target and sk_assistant_kv (its only hooks for this file).
 */
#ifndef SK_ASSISTANT_H
#define SK_ASSISTANT_H

#include "sk.h"
#include "sk_pool.h"

typedef struct {
    int32_t sliding;  /* reads the target's sliding block kv_layer within the window (else a global one) */
    int32_t kv_layer; /* the target block whose keys and values it attends */
    const float *attn_norm, *q_norm, *attn_post_norm, *ffn_norm, *ffn_post_norm;
    sk_tensor wq, wo, w_gate, w_up, w_down;
    float out_scale;
} sk_asst_block;

typedef struct {
    int32_t n_embd, n_head, n_layer;
    float rms_eps, embd_scale; /* embd_scale: the target's embedding multiplier, sqrt(its n_embd) */
    sk_tensor pre_proj;        /* [n_embd, 2 n_embd_target] */
    sk_tensor post_proj;       /* [n_embd_target, n_embd] */
    sk_tensor embd;            /* [n_vocab, n_embd]: the tied head */
    const float *output_norm;
    const sk_asst_block *blocks;
} sk_assistant;

/* The target context's pieces a step reads (filled by sk_seq_state.c). */
typedef struct {
    const sk_kernels *kern;
    sk_pool *pool;
    const sk_tensor *token_embd;
    int32_t n_embd, n_vocab, n_seq_max, swa_window, rope_neox, n_rot, n_rot_swa;
    const double *rope_inv_freq, *rope_inv_freq_swa;
    float rope_mscale;
} sk_target_view;

/* One target block's cache of one slot: kv head h's keys at k + h * head_stride ([ring / 16][hd][16] f16),
 * its values at v + h * head_stride ([ring][hd] f16); position t in row t % ring. */
typedef struct {
    const uint16_t *k, *v;
    int64_t head_stride, ring;
    int32_t head_dim, n_head_kv;
} sk_kv_view;

typedef struct sk_ctx sk_ctx;
/* sk_seq_state.c's hooks: the target's view (-1: not a context an assistant can read), and block `layer`'s cache
 * of `slot` holding positions [lo, hi) (-1: no such block or slot, -2: the cache no longer holds them). */
int sk_assistant_target(const sk_ctx *c, sk_target_view *out);
int sk_assistant_kv(const sk_ctx *c, int slot, int layer, int64_t lo, int64_t hi, sk_kv_view *out);

typedef struct sk_asst sk_asst;
/* The assistant's runtime over `target` (its quantized weights copied into the target's kernel layout;
 * `a` and what it points to must outlive it); NULL when the shapes do not fit or out of memory. */
SK_API sk_asst *sk_asst_new(const sk_assistant *a, sk_ctx *target);
SK_API void sk_asst_free(sk_asst *s);
/* Row r: token tokens[r] with hidden[r] (n_embd_target) at position pos[r] of target slot slots[r], over
 * its keys [0, pos[r]); logits [n_rows, n_vocab], hidden_out [n_rows, n_embd_target]. 0, -1 out of memory,
 * -2 a row whose keys the target's cache does not hold. */
SK_API int sk_asst_step(sk_asst *s, int64_t n_rows, const int32_t *tokens, const int32_t *pos, const int32_t *slots,
                        const float *hidden, float *logits, float *hidden_out);

#endif
