/* What the portable kernels and the packer both decode of the newer GGUF block types: the value tables
 * of the types whose 4-bit codes index 16 integers, and the packed scales of IQ4_XS, MXFP4 and Q3_K.
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

/* Q3_K: the 6-bit scale s (0..15) of a super-block's 16-value sub-blocks (sc: its 12 scale bytes): low 4
 * bits in bytes 0-7, high 2 in bytes 8-11, minus 32. */
static inline int sk_q3k_scale(const uint8_t *sc, int s) {
    const int low = s < 8 ? sc[s] & 15 : sc[s - 8] >> 4;
    return (low | (((sc[8 + s % 4] >> (2 * (s / 4))) & 3) << 4)) - 32;
}

#endif
