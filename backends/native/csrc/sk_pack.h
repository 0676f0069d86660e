/* The column-interleaved layout the SIMD kernels read quantized weights in (packed once at load).
 *
 * Each quantized weight is rewritten losslessly (the same integers and scales, moved) so that 16
 * output columns sit side by side: one 64-byte vector holds 4 consecutive values of one 32-value
 * block for each of the 16 columns (4 bytes per column, columns in order). The AVX-512 kernels read a
 * vector as one register, the AVX2 kernels as two (columns 0-7 and 8-15).
 *
 * Layout per group of 16 columns (columns past the tensor's end are zero), `row_bytes` = one group:
 *   Q4_0 block: [16 f16 d] [4 x 64 B nibbles]              Q4_1: [16 d] [16 m] [4 x 64 B]
 *   Q5_0 block: [16 d] [64 B high bits] [4 x 64 B]         Q5_1: [16 d] [16 m] [64 B] [4 x 64 B]
 *   Q8_0 block: [16 d] [8 x 64 B bytes, value + 128]
 *   IQ4_NL block: as Q4_0, the nibbles its 4-bit codes (the kernels map them through the table)
 *   MXFP4 block: [16 E8M0 exponent bytes] [4 x 64 B nibbles, its codes]
 *   Q4_K / Q5_K super-block: [16 d] [16 dmin] [8 x 16 sc] [8 x 16 mn], then 8 blocks as Q4_0 / Q5_0
 *                            without the d
 *   Q6_K super-block: [16 d] [16 x 16 int8 sc], then 8 blocks of [2 x 64 B high bits] [4 x 64 B nibbles]
 *   Q3_K super-block: [16 d] [16 x 16 int8 (scale - 32)] as Q6_K's, then 8 blocks of [2 x 64 B low bits]
 *                     [64 B third bits]: the value + 4 (0..7) in 3 bits
 *   Q2_K super-block: [16 d] [16 dmin] [16 x 16 (sc | mn << 4)] (per 16 values, GGUF's bytes), then 8
 *                     blocks of [2 x 64 B] 2-bit values
 *   IQ4_XS super-block: [16 d] [8 x 16 int8 (scale - 32)], then 8 blocks of nibbles as IQ4_NL's
 * So every type keeps about its file's bits per value (the headers of 16 columns side by side).
 * Nibble vector j: lane c byte i = value 4j+i | value 16+4j+i << 4 (low nibbles: group j, high: j+4,
 * group t = values 4t..4t+3). High bits (Q5): lane c byte i bit t = bit 4 of value 4t+i. High bits
 * (Q6): plane p, lane c byte i, bits 2u..2u+1 = bits 4-5 of value 4(4p+u)+i. Low bits (Q2_K, Q3_K): the
 * same planes with bits 0-1 of each value. Third bits (Q3_K): as Q5's high bits, with bit 2 of each value.
 */
#ifndef SK_PACK_H
#define SK_PACK_H

#include "sk.h"

enum { SK_GROUP = 16, SK_NIB = 256, SK_HB5 = 64, SK_HB6 = 128, SK_BYTES8 = 512, SK_DVEC = 32 };
enum { SK_KHDR = 2 * SK_DVEC + 2 * 8 * SK_GROUP, SK_Q6HDR = SK_DVEC + 16 * SK_GROUP, SK_XSHDR = SK_DVEC + 8 * SK_GROUP };
enum { SK_Q2HDR = 2 * SK_DVEC + 16 * SK_GROUP, SK_E8M0 = SK_GROUP };
/* Bytes of one packed 32-value block of a 16-column group: Q2_K's 2-bit planes, Q3_K's 3 bits. */
enum { SK_Q2BLK = SK_HB6, SK_Q3BLK = SK_HB6 + SK_HB5 };

/* Bytes of one 32-value block of a column group (0: a super-block type or unsupported). */
static inline int64_t sk_block_tile_bytes(int type) {
    switch (type) {
    case SK_Q4_0: return SK_DVEC + SK_NIB;
    case SK_Q4_1: return 2 * SK_DVEC + SK_NIB;
    case SK_Q5_0: return SK_DVEC + SK_HB5 + SK_NIB;
    case SK_Q5_1: return 2 * SK_DVEC + SK_HB5 + SK_NIB;
    case SK_Q8_0: return SK_DVEC + SK_BYTES8;
    case SK_IQ4_NL: return SK_DVEC + SK_NIB;
    case SK_MXFP4: return SK_E8M0 + SK_NIB;
    default: return 0;
    }
}

/* Bytes of one 256-value super-block of a column group (0: not a K type). */
static inline int64_t sk_super_tile_bytes(int type) {
    switch (type) {
    case SK_Q4_K: return SK_KHDR + 8 * SK_NIB;
    case SK_Q5_K: return SK_KHDR + 8 * (SK_HB5 + SK_NIB);
    case SK_Q6_K: return SK_Q6HDR + 8 * (SK_HB6 + SK_NIB);
    case SK_Q3_K: return SK_Q6HDR + 8 * SK_Q3BLK;
    case SK_Q2_K: return SK_Q2HDR + 8 * SK_Q2BLK;
    case SK_IQ4_XS: return SK_XSHDR + 8 * SK_NIB;
    default: return 0;
    }
}

/* Bytes of one packed group of 16 columns (the layout's row_bytes); 0 when the tensor cannot be packed. */
int64_t sk_packed_group_bytes(const sk_tensor *w);
/* Whether w is a packed quantized weight the SIMD kernels read. */
int sk_packed_supported(const sk_tensor *w);
/* Columns [16 g0, 16 g1) (in groups of 16) into dst, one group after another. */
void sk_pack_groups(const sk_tensor *w, int64_t g0, int64_t g1, uint8_t *dst);
/* The same bytes, every type through its values one by one (the reference the copying paths are
 * tested against: sk_test_pack). */
void sk_pack_groups_by_value(const sk_tensor *w, int64_t g0, int64_t g1, uint8_t *dst);

#endif
