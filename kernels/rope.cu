// RoPE, Hugging Face `rotate_half` layout: dim i pairs with i + hd/2 (not interleaved).
// y = RoPE(x) on q or k (or their gradients) laid out [B·T, H, hd]; y may be x (in place: each
// thread reads its pair before writing it). Row r is at position pos[r] (its position in its
// document; the host checked every position is inside the tables). Backward rotates by −θ (the
// adjoint of a rotation). Symbols `_f32`, `_bf16`, and `_f32o16` (fp32 in, bf16 out: the bf16
// recipe storing Q and K, and rounding dQ and dK for their GEMMs, in the same pass).
#include "common.cuh"

template <typename I, typename O>
__device__ __forceinline__ void rope_apply(O* y,                              // [N, H, hd]
                                           const I* x,                        // [N, H, hd]
                                           const float* __restrict__ cos_t,   // [T, hd/2]
                                           const float* __restrict__ sin_t,   // [T, hd/2]
                                           const unsigned* __restrict__ pos,  // [N]
                                           int n, int h, int hd, float sign) {
    const int half = hd / 2;
    FOR_EACH(i, (long long)n * h * half) {
        const long long row = i / ((long long)h * half);
        const int rem = (int)(i % ((long long)h * half));
        const int head = rem / half, d = rem % half;
        const long long p = pos[row];
        const float c = cos_t[p * half + d], s = sign * sin_t[p * half + d];
        const long long at = (row * h + head) * hd;
        const float a = ld(x[at + d]), b = ld(x[at + d + half]);
        st(&y[at + d], a * c - b * s);
        st(&y[at + d + half], b * c + a * s);
    }
}

#define ROPE(name, I, O)                                                                         \
    extern "C" __global__ void rope_fwd_##name(O* y, const I* x, const float* cos_t,            \
                                               const float* sin_t, const unsigned* pos, int n,  \
                                               int h, int hd) {                                 \
        rope_apply<I, O>(y, x, cos_t, sin_t, pos, n, h, hd, 1.0f);                              \
    }                                                                                           \
    extern "C" __global__ void rope_bwd_##name(O* y, const I* x, const float* cos_t,            \
                                               const float* sin_t, const unsigned* pos, int n,  \
                                               int h, int hd) {                                 \
        rope_apply<I, O>(y, x, cos_t, sin_t, pos, n, h, hd, -1.0f);                             \
    }

ROPE(f32, float, float)
ROPE(bf16, bf16, bf16)
ROPE(f32o16, float, bf16)
