// Storage cast: fp32 → bf16, round to nearest even (the bf16 recipe's stores, its GEMM
// operands and bf16 gradients on the link).
#include "common.cuh"

extern "C" __global__ void cast_fwd_f32_bf16(bf16* __restrict__ out, const float* __restrict__ x,
                                             long long n) {
    FOR_EACH(i, n) out[i] = __float2bfloat16_rn(x[i]);
}

// Storage cast back: bf16 → fp32, exact (a layer input stored in bf16, widened for the
// backward that recomputes from it).
extern "C" __global__ void cast_bwd_bf16_f32(float* __restrict__ out, const bf16* __restrict__ x,
                                             long long n) {
    FOR_EACH(i, n) out[i] = __bfloat162float(x[i]);
}
