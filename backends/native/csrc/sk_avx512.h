/* Entry points shared between the AVX-512 files (both compiled for that target only). */
#ifndef SK_AVX512_H
#define SK_AVX512_H

#include "sk.h"

void sk_avx512_gemm_q(const sk_tensor *w, int64_t n0, int64_t n1, const sk_act *a, int64_t m, float *out, int64_t ldo,
                      int accumulate);

#endif
