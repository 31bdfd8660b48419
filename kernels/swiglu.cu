// SwiGLU: out = silu(gate) · up, elementwise over [N, I].
#include "common.cuh"

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }

#define SWIGLU_FWD(name, O, T)                                                                   \
    extern "C" __global__ void swiglu_fwd_##name(O* __restrict__ out,        /* [N, I] */      \
                                                 const T* __restrict__ gate, /* [N, I] */      \
                                                 const T* __restrict__ up,   /* [N, I] */      \
                                                 long long n) {                                \
        FOR_EACH(i, n) {                                                                       \
            const float g = ld(gate[i]);                                                       \
            st(&out[i], g * sigmoid(g) * ld(up[i]));                                           \
        }                                                                                      \
    }

// Forward for each (output O, input T): `f32o16` writes the bf16 a bf16 device keeps for the
// down projection (rounded to nearest even, as the GEMM's cast would).
SWIGLU_FWD(f32, float, float)
SWIGLU_FWD(bf16, bf16, bf16)
SWIGLU_FWD(f32o16, bf16, float)

#define SWIGLU_BWD(name, O, T)                                                                  \
    /* d gate = dout·up·σ(g)(1 + g(1 − σ(g))),  d up = dout·silu(g) */                         \
    extern "C" __global__ void swiglu_bwd_##name(O* __restrict__ dgate,      /* [N, I] */      \
                                                 O* __restrict__ dup,        /* [N, I] */      \
                                                 const T* __restrict__ dout, /* [N, I] */      \
                                                 const T* __restrict__ gate,                   \
                                                 const T* __restrict__ up, long long n) {      \
        FOR_EACH(i, n) {                                                                       \
            const float g = ld(gate[i]), u = ld(up[i]), d = ld(dout[i]);                       \
            const float s = sigmoid(g);                                                        \
            st(&dgate[i], d * u * s * (1.0f + g * (1.0f - s)));                                \
            st(&dup[i], d * g * s);                                                            \
        }                                                                                      \
    }

// Backward for each (outputs O, inputs T): `f32o16` writes the bf16 a bf16 device keeps for the
// GEMMs that read d gate and d up (rounded to nearest even, as their casts would).
SWIGLU_BWD(f32, float, float)
SWIGLU_BWD(bf16, bf16, bf16)
SWIGLU_BWD(f32o16, bf16, float)
