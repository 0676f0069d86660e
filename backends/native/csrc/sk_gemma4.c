/* Gemma 4's row-wise pieces (sk_gemma4.h). */
#include <math.h>

#include "sk_gemma4.h"
#include "sk_swa.h"

static float inv_rms(const float *x, int64_t n, float eps) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    return 1.0f / sqrtf(ss / (float)n + eps);
}

void sk_value_norm(float *v, int n, float eps) {
    const float s = inv_rms(v, n, eps);
    for (int i = 0; i < n; i++) v[i] *= s;
}

void sk_per_layer_inputs(float *row, const sk_tensor *embd, int32_t token, const float *norm, int n_layer, int P,
                         int n_embd, float eps, float *tmp) {
    const float proj_scale = 1.0f / sqrtf((float)n_embd), embd_scale = sqrtf((float)P), half = 1.0f / sqrtf(2.0f);
    sk_dequant_row(embd, token, tmp);
    for (int l = 0; l < n_layer; l++) {
        float *p = row + (int64_t)l * P;
        const float *e = tmp + (int64_t)l * P;
        for (int i = 0; i < P; i++) p[i] *= proj_scale;
        const float s = inv_rms(p, P, eps);
        for (int i = 0; i < P; i++) p[i] = ((p[i] * s) * norm[i] + e[i] * embd_scale) * half;
    }
}

void sk_per_layer_gate(float *gate, const float *inp, int P) { sk_geglu(gate, inp, P, gate); }

void sk_router_input(const float *x, const float *scale, int64_t n, float eps, float *out) {
    const float s = inv_rms(x, n, eps), root = 1.0f / sqrtf((float)n);
    for (int64_t i = 0; i < n; i++) out[i] = ((x[i] * s) * root) * scale[i];
}

void sk_scale_row(float *x, int64_t n, float s) {
    for (int64_t i = 0; i < n; i++) x[i] *= s;
}
