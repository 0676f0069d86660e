/* gpt-oss's pieces of the forward (sk_model.c and sk_moe.c call them through small hooks):
 *
 * - attention sinks: a learned logit per query head that joins every softmax's denominator and
 *   contributes no value, so a row's weights over its keys sum to less than one;
 * - routing by softmax over the chosen: the n_expert_used largest router logits are chosen (ties: the
 *   lower expert index) and their weights are the softmax of those logits alone;
 * - the clamped SwiGLU of its experts (swiglu_oai): x = min(gate, 7), y = clamp(up, -7, 7),
 *   out = x * sigmoid(1.702 x) * (y + 1), computed as x / (1 + exp(-1.702 x)) * (y + 1).
 *
 * Scalar code in a fixed order: the same bits whatever the kernel table, batch or thread count.
 */
#ifndef SK_OAI_H
#define SK_OAI_H

#include <stdint.h>

/* One (row, query head)'s attention output from its nc key-chunk partials (p0 + k * step holds chunk
 * k's [max score, sum of exp(score - max), sum of exp(score - max) * value (hd)]) and the head's sink
 * logit: out = sum_k e^(m_k - M) o_k / (e^(sink - M) + sum_k e^(m_k - M) s_k), M the largest of the
 * chunk maxima and the sink; chunks merged in key order. A sink of -INFINITY adds exactly 0 to the
 * denominator: the plain merge of a block without sinks (sk_model.c's attention_merge calls it so). */
void sk_oai_sink_merge(const float *p0, int64_t nc, int64_t step, int hd, float sink, float *out);

/* The experts a row's router logits choose (chosen[0..k), in rank order) and their weights. */
void sk_oai_route(const float *logits, int n_expert, int k, int32_t *chosen, float *weight);

/* y[i] = swiglu_oai(g[i], u[i]) for i in [0, n) (y may alias g). */
void sk_oai_swiglu(const float *g, const float *u, int64_t n, float *y);

#endif
