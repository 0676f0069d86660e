/* Entry points shared between the AVX2 files (both compiled for that target only). */
#ifndef SK_AVX2_H
#define SK_AVX2_H

#include "sk.h"

void sk_avx2_gemm_q(const sk_tensor *w, int64_t n0, int64_t n1, const sk_act *a, int64_t m, float *out, int64_t ldo,
                    int accumulate);

#endif
