// The gated MLP's activation, elementwise over [N, I]: SwiGLU out = silu(gate) · up, and GeGLU
// out = gelu_tanh(gate) · up (Gemma; PyTorch's tanh approximation, in its order).
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

// GELU's tanh approximation and its derivative, as PyTorch computes them (`kBeta` = √(2/π)).
#define GELU_BETA 0.7978845608028654f
#define GELU_KAPPA 0.044715f
__device__ __forceinline__ float gelu_tanh(float x) {
    const float inner = GELU_BETA * (x + GELU_KAPPA * (x * x * x));
    return 0.5f * x * (1.0f + tanhf(inner));
}
__device__ __forceinline__ float gelu_tanh_grad(float x) {
    const float x_sq = x * x;
    const float t = tanhf(GELU_BETA * (x + GELU_KAPPA * (x_sq * x)));
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * (GELU_BETA * (1.0f + 3.0f * GELU_KAPPA * x_sq));
}

#define GEGLU_FWD(name, O, T)                                                                    \
    extern "C" __global__ void geglu_fwd_##name(O* __restrict__ out,        /* [N, I] */       \
                                                const T* __restrict__ gate, /* [N, I] */       \
                                                const T* __restrict__ up,   /* [N, I] */       \
                                                long long n) {                                 \
        FOR_EACH(i, n) st(&out[i], gelu_tanh(ld(gate[i])) * ld(up[i]));                        \
    }

GEGLU_FWD(f32, float, float)
GEGLU_FWD(bf16, bf16, bf16)
GEGLU_FWD(f32o16, bf16, float)

#define GEGLU_BWD(name, O, T)                                                                    \
    /* d up = dout·gelu(g),  d gate = (dout·up)·gelu'(g) */                                    \
    extern "C" __global__ void geglu_bwd_##name(O* __restrict__ dgate,      /* [N, I] */       \
                                                O* __restrict__ dup,        /* [N, I] */       \
                                                const T* __restrict__ dout, /* [N, I] */       \
                                                const T* __restrict__ gate,                    \
                                                const T* __restrict__ up, long long n) {       \
        FOR_EACH(i, n) {                                                                       \
            const float g = ld(gate[i]), u = ld(up[i]), d = ld(dout[i]);                       \
            st(&dgate[i], (d * u) * gelu_tanh_grad(g));                                        \
            st(&dup[i], d * gelu_tanh(g));                                                     \
        }                                                                                      \
    }

GEGLU_BWD(f32, float, float)
GEGLU_BWD(bf16, bf16, bf16)
GEGLU_BWD(f32o16, bf16, float)
