/* Position-dependent scales of attention (backends/gguf/rope_scaling.py describes them).
 *
 * YaRN's magnitude multiplies every rotated pair's cos and sin (the rope table, rope_mscale); the
 * attention temperature multiplies a query row at position p by 1 + scale * ln(floor(p / floor_len) + 1)
 * after rope (mistral3, from Llama 4). A config field of 0 means "none" for both, so contexts whose
 * runtime never sets them (the draft heads) keep plain rope. */
#ifndef SK_ROPE_H
#define SK_ROPE_H

#include <math.h>
#include <stdint.h>

/* The factor cos and sin are multiplied by: 1 when the config leaves it at 0. */
static inline double sk_rope_mscale(float mscale) { return mscale != 0.0f ? (double)mscale : 1.0; }

/* The query multiplier at position pos; 1 when there is no temperature (scale 0 or floor_len <= 0). */
static inline float sk_attn_temperature(float scale, int32_t floor_len, int64_t pos) {
    if (scale == 0.0f || floor_len <= 0) return 1.0f;
    return (float)(log(floor((double)pos / (double)floor_len) + 1.0) * scale + 1.0);
}

#endif
