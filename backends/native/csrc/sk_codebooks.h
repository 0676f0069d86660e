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

#endif
