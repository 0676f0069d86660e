/* Mixture-of-experts FFN blocks (qwen3moe, glm4moe, qwen35moe, gpt-oss) for sk_model.c's forward pass.
 *
 * A MoE block's FFN: a router scores every expert per row, the n_expert_used best (after an optional
 * selection bias) run, and the row receives their outputs weighted by the router's probabilities,
 * plus an always-on shared expert when the model has one (gated per row by a sigmoid in Qwen3.5-MoE). Experts are views into the file's 3-D
 * expert tensors (one [out, in] matrix per expert), so weights are never copied per expert. gpt-oss
 * chooses by the raw logits and weighs by a softmax over the chosen, its experts carry biases (each
 * view's bias) and use the clamped swiglu_oai (sk_oai.h).
 */
#ifndef SK_MOE_H
#define SK_MOE_H

#include "sk.h"
#include "sk_pool.h"

/* SOFTMAX_WEIGHT (gpt-oss): the top-k logits are chosen, their weights a softmax over them (sk_oai.h). */
enum { SK_GATING_SOFTMAX = 0, SK_GATING_SIGMOID = 1, SK_GATING_SOFTMAX_WEIGHT = 2 };
/* The experts' activation: silu(gate) * up, gpt-oss's clamped swiglu_oai (sk_oai.h), or gelu_tanh(gate) * up
 * (Gemma 4). */
enum { SK_ACT_SWIGLU = 0, SK_ACT_SWIGLU_OAI = 1, SK_ACT_GEGLU = 2 };

typedef struct {
    int32_t n_expert, n_expert_used;
    int32_t gating;       /* SK_GATING_* */
    int32_t norm_weights; /* divide the chosen weights by their sum (clamped below) */
    float weights_scale;  /* multiplies the chosen weights; 1: none */
    const float *selection_bias; /* [n_expert] added to the probabilities for choosing only, or NULL */
    sk_tensor router;            /* [n_expert, n_embd] */
    sk_tensor *gate, *up, *down; /* [n_expert] each: gate/up [n_ff_exp, n_embd], down [n_embd, n_ff_exp] */
    sk_tensor shared_gate, shared_up, shared_down; /* data NULL: no shared expert */
    sk_tensor shared_inp; /* [1, n_embd]: the shared expert's output is gated by sigmoid(shared_inp . x); data NULL: not gated */
    int32_t activation;   /* SK_ACT_* of the routed experts (the shared one is always SK_ACT_SWIGLU) */
    const float *expert_scale; /* [n_expert]: multiplies each chosen expert's weight (Gemma 4), or NULL */
} sk_moe;

typedef struct sk_moe_scratch sk_moe_scratch;

/* An owned copy of a caller's description (the context packs its tensors in place); NULL when out
 * of memory or when the shapes do not fit together. */
sk_moe *sk_moe_clone(const sk_moe *src, int64_t n_embd);
void sk_moe_free(sk_moe *m);
/* Every weight of the block, for packing: index i in [0, sk_moe_n_tensors(m)). */
int64_t sk_moe_n_tensors(const sk_moe *m);
sk_tensor *sk_moe_tensor(sk_moe *m, int64_t i);

/* Scratch for forwards of up to m_rows rows through any of the blocks (NULL entries: dense blocks);
 * *s is created on first use. -1 when out of memory. */
int sk_moe_reserve(sk_moe_scratch **s, sk_moe *const *blocks, int n_layer, int64_t n_embd, int64_t m_rows);
void sk_moe_scratch_free(sk_moe_scratch *s);

typedef struct {
    const sk_kernels *kern;
    sk_pool *pool;
    sk_moe_scratch *scratch;
} sk_moe_env;

/* Called by every thread of the pool (it meets the others at barriers, the first one on entry, so
 * each thread may arrive having written any rows of h): x[r] += the block's FFN output for h[r]
 * (the normed rows, [m, n_embd]), r in [0, m). On return every row of x is updated. */
/* How many experts (the shared one included) have run since the last call: each runs once per block
 * and forward in which some row chose it. */
SK_API int64_t sk_moe_experts_run(void);

void sk_moe_ffn(const sk_moe_env *env, const sk_moe *moe, const float *h, float *x, int64_t n_embd, int64_t m,
                int ith, int nth);
/* The same with the router reading route_in [m, n_embd] instead of h (Gemma 4); a block whose shared
 * expert is gated is refused (-1, nothing done), else 0. */
int sk_moe_ffn_routed(const sk_moe_env *env, const sk_moe *moe, const float *route_in, const float *h, float *x,
                      int64_t n_embd, int64_t m, int ith, int nth);

#endif
