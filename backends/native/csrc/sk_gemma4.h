/* Gemma 4's row-wise pieces (backends/gguf/block_layout.py describes the blocks): the values' weightless
 * RMS norm, the per-layer inputs of a token, a block's gate over its per-layer input, the output scale.
 * sk_model.c runs the matmuls around them; each function here is one scalar sequence per row, the same
 * wherever the row sits and whichever thread runs it. */
#ifndef SK_GEMMA4_H
#define SK_GEMMA4_H

#include "sk.h"

/* v *= 1 / sqrt(mean(v^2) + eps) over n values (no weight). */
void sk_value_norm(float *v, int n, float eps);

/* One token's per-layer inputs in place: row holds x0 . per_layer_model_proj ([n_layer P]); it becomes
 * (rms_norm(row_l / sqrt(n_embd), norm) + embd[token]_l * sqrt(P)) / sqrt(2) for every block l.
 * tmp: n_layer P floats. */
void sk_per_layer_inputs(float *row, const sk_tensor *embd, int32_t token, const float *norm, int n_layer, int P,
                         int n_embd, float eps, float *tmp);

/* gate = gelu_tanh(gate) * inp over P values (a block's per-layer input through its gate). */
void sk_per_layer_gate(float *gate, const float *inp, int P);

/* The router's input of one row of the residual x (n values): rms_norm(x) / sqrt(n) * scale. */
void sk_router_input(const float *x, const float *scale, int64_t n, float eps, float *out);

/* x *= s over n values. */
void sk_scale_row(float *x, int64_t n, float s);

#endif
