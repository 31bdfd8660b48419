// RoPE, Hugging Face `rotate_half` layout: dim i pairs with i + hd/2 (not interleaved).
// In place on q or k laid out [B·T, H, hd]; row r is at position pos[r] (its position in its
// document; the host checked every position is inside the tables). Backward rotates by −θ (the
// adjoint of a rotation).
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void rope_apply(T* __restrict__ x,          // [N, H, hd]
                                           const float* __restrict__ cos_t,  // [T, hd/2]
                                           const float* __restrict__ sin_t,  // [T, hd/2]
                                           const unsigned* __restrict__ pos,  // [N]
                                           int n, int h, int hd, float sign) {
    const int half = hd / 2;
    FOR_EACH(i, (long long)n * h * half) {
        const long long row = i / ((long long)h * half);
        const int rem = (int)(i % ((long long)h * half));
        const int head = rem / half, d = rem % half;
        const long long p = pos[row];
        const float c = cos_t[p * half + d], s = sign * sin_t[p * half + d];
        T* base = x + (row * h + head) * hd;
        const float a = ld(base[d]), b = ld(base[d + half]);
        st(&base[d], a * c - b * s);
        st(&base[d + half], b * c + a * s);
    }
}

#define ROPE(name, T)                                                                            \
    extern "C" __global__ void rope_fwd_##name(T* x, const float* cos_t, const float* sin_t,   \
                                               const unsigned* pos, int n, int h, int hd) {    \
        rope_apply<T>(x, cos_t, sin_t, pos, n, h, hd, 1.0f);                                   \
    }                                                                                          \
    extern "C" __global__ void rope_bwd_##name(T* dx, const float* cos_t, const float* sin_t,  \
                                               const unsigned* pos, int n, int h, int hd) {    \
        rope_apply<T>(dx, cos_t, sin_t, pos, n, h, hd, -1.0f);                                 \
    }

FOR_DTYPES(ROPE)
