// Storage cast: fp32 → bf16, round to nearest even (the bf16 recipe's stores, its GEMM
// operands and bf16 gradients on the link).
#include "common.cuh"

extern "C" __global__ void cast_fwd_f32_bf16(bf16* __restrict__ out, const float* __restrict__ x,
                                             long long n) {
    FOR_EACH(i, n) out[i] = __float2bfloat16_rn(x[i]);
}
