/* The value tables of the GGUF block types whose 4-bit codes index 16 integers, and MXFP4's scale.
 *
 * IQ4_NL and IQ4_XS codes index a non-uniform table; MXFP4 codes index the FP4 (E2M1) values, doubled
 * so they are integers, with the block's power-of-two scale halved to match. The integers go through
 * the int8 activation path as any other block's values do.
 */
#ifndef SK_CODEBOOKS_H
#define SK_CODEBOOKS_H

#include <stdint.h>

static const int8_t sk_iq4nl_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

static const int8_t sk_mxfp4_values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* MXFP4's block scale: an E8M0 exponent e, meaning 2^(e - 127), halved as the doubled values need:
 * 2^(e - 128), a subnormal float for e < 2. */
static inline float sk_e8m0_half(uint8_t e) {
    union { uint32_t u; float f; } v = {e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23};
    return v.f;
}

/* IQ4_XS: the 6-bit scale of 32-value block j (0..7) of a super-block p, minus 32 (the block's step is
 * d * this). */
static inline int sk_iq4xs_scale(const uint8_t *p, int j) {
    const int scales_h = p[2] | (p[3] << 8);
    return (((p[4 + j / 2] >> (4 * (j % 2))) & 15) | (((scales_h >> (2 * j)) & 3) << 4)) - 32;
}

#endif
