// Storage casts: fp32 master weights → bf16 stream copies (round to nearest even), and back.
#include "common.cuh"

extern "C" __global__ void cast_fwd_f32_bf16(bf16* __restrict__ out, const float* __restrict__ x,
                                             long long n) {
    FOR_EACH(i, n) out[i] = __float2bfloat16_rn(x[i]);
}

extern "C" __global__ void cast_fwd_bf16_f32(float* __restrict__ out, const bf16* __restrict__ x,
                                             long long n) {
    FOR_EACH(i, n) out[i] = __bfloat162float(x[i]);
}
