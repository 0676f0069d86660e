/* gpt-oss's attention sinks, routing and clamped SwiGLU: see sk_oai.h. */
#include "sk_oai.h"

#include <math.h>

#define SWIGLU_OAI_ALPHA 1.702f
#define SWIGLU_OAI_LIMIT 7.0f

void sk_oai_sink_merge(const float *p0, int64_t nc, int64_t step, int hd, float sink, float *out) {
    float m = sink;
    for (int64_t k = 0; k < nc; k++) m = p0[k * step] > m ? p0[k * step] : m;
    float s = expf(sink - m);
    for (int d = 0; d < hd; d++) out[d] = 0.0f;
    for (int64_t k = 0; k < nc; k++) {
        const float *p = p0 + k * step, w = expf(p[0] - m);
        s += w * p[1];
        for (int d = 0; d < hd; d++) out[d] += w * p[2 + d];
    }
    const float inv = 1.0f / s;
    for (int d = 0; d < hd; d++) out[d] *= inv;
}

void sk_oai_route(const float *logits, int n_expert, int k, int32_t *chosen, float *weight) {
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < n_expert; e++) {
            int taken = 0;
            for (int i = 0; i < j; i++) taken |= chosen[i] == e;
            if (!taken && (best < 0 || logits[e] > logits[best])) best = e; /* a NaN never replaces */
        }
        chosen[j] = best;
    }
    const float mx = logits[chosen[0]]; /* the largest chosen logit */
    float sum = 0.0f;
    for (int j = 0; j < k; j++) {
        weight[j] = expf(logits[chosen[j]] - mx);
        sum += weight[j];
    }
    for (int j = 0; j < k; j++) weight[j] /= sum;
}

void sk_oai_swiglu(const float *g, const float *u, int64_t n, float *y) {
    for (int64_t i = 0; i < n; i++) {
        const float x = g[i] > SWIGLU_OAI_LIMIT ? SWIGLU_OAI_LIMIT : g[i];
        const float v = u[i] < -SWIGLU_OAI_LIMIT ? -SWIGLU_OAI_LIMIT : (u[i] > SWIGLU_OAI_LIMIT ? SWIGLU_OAI_LIMIT : u[i]);
        y[i] = x / (1.0f + expf(SWIGLU_OAI_ALPHA * -x)) * (v + 1.0f);
    }
}
