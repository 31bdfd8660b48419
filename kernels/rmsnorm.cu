// RMSNorm y = (w_offset + w) · x · rsqrt(mean(x²) + eps) (`w_offset` 0, or 1 for Gemma's `1 + w`),
// one block per row; backward recomputes from rstd: dx one block per row, dw by columns in a
// fixed order (`column_sum`, no atomics).
#include "common.cuh"

#define RMSNORM_FWD(name, O, T, W)                                                                  \
    extern "C" __global__ void rmsnorm_fwd_##name(O* __restrict__ out,        /* [N, C] */     \
                                                  float* __restrict__ rstd,   /* [N] */        \
                                                  const T* __restrict__ x,    /* [N, C] */     \
                                                  const W* __restrict__ w,    /* [C] */        \
                                                  int n, int c, float eps, float w_offset) {   \
        __shared__ float scratch[WARP];                                                        \
        const long long row = blockIdx.x;                                                      \
        if (row >= n) return;                                                                  \
        const T* xr = x + row * c;                                                             \
        float ss = 0.0f;                                                                       \
        for (int j = threadIdx.x; j < c; j += blockDim.x) {                                    \
            const float v = ld(xr[j]);                                                         \
            ss += v * v;                                                                       \
        }                                                                                      \
        ss = block_sum(ss, scratch);                                                           \
        const float r = rsqrtf(ss / (float)c + eps);                                           \
        if (threadIdx.x == 0) rstd[row] = r;                                                   \
        for (int j = threadIdx.x; j < c; j += blockDim.x)                                      \
            st(&out[row * c + j], (w_offset + ld(w[j])) * (ld(xr[j]) * r));                    \
    }

// Forward for each (output O, input T, weights W): `f32w16o16` writes the bf16 a bf16 device keeps
// for the GEMMs that read the norm's output (rounded to nearest even, as the GEMM's cast would).
#define FOR_RMSNORM_FWD(M) \
    M(f32, float, float, float) M(bf16, bf16, bf16, bf16) M(f32w16, float, float, bf16) \
    M(f32w16o16, bf16, float, bf16)

FOR_RMSNORM_FWD(RMSNORM_FWD)

#define RMSNORM(name, T, W)                                                                      \
    /* dx (+)= r·(w'∘dy) − x·r³/C · Σ(w'∘dy∘x), w' = w_offset + w (+= when accumulate: the    \
       residual fused) */                                                                       \
    extern "C" __global__ void rmsnorm_bwd_##name(T* __restrict__ dx,          /* [N, C] */    \
                                                  const T* __restrict__ dout,  /* [N, C] */    \
                                                  const T* __restrict__ x,     /* [N, C] */    \
                                                  const W* __restrict__ w,     /* [C] */       \
                                                  const float* __restrict__ rstd, /* [N] */    \
                                                  int n, int c, int accumulate,                \
                                                  float w_offset) {                            \
        __shared__ float scratch[WARP];                                                        \
        const long long row = blockIdx.x;                                                      \
        if (row >= n) return;                                                                  \
        const T* xr = x + row * c;                                                             \
        const T* dyr = dout + row * c;                                                         \
        const float r = rstd[row];                                                             \
        float dot = 0.0f;                                                                      \
        for (int j = threadIdx.x; j < c; j += blockDim.x)                                      \
            dot += (w_offset + ld(w[j])) * ld(dyr[j]) * ld(xr[j]);                             \
        dot = block_sum(dot, scratch);                                                         \
        const float k = dot * r * r * r / (float)c;                                            \
        for (int j = threadIdx.x; j < c; j += blockDim.x) {                                    \
            const float xv = ld(xr[j]), dy = ld(dyr[j]);                                       \
            const float v = r * (w_offset + ld(w[j])) * dy - xv * k;                           \
            st(&dx[row * c + j], accumulate ? ld(dx[row * c + j]) + v : v);                    \
        }                                                                                      \
    }

FOR_WEIGHT_DTYPES(RMSNORM)

#define RMSNORM_DW(name, T)                                                                      \
    /* dw += Σ_rows dy∘x·r (fp32), COL_TILE columns × ROW_LANES row lanes per block */         \
    extern "C" __global__ void rmsnorm_bwd_dw_##name(float* __restrict__ dw,       /* [C] */       \
                                                 const T* __restrict__ dout,   /* [N, C] */    \
                                                 const T* __restrict__ x,      /* [N, C] */    \
                                                 const float* __restrict__ rstd, /* [N] */     \
                                                 int n, int c) {                               \
        column_sum(dw, n, c, [&](int r, int col) {                                             \
            const long long i = (long long)r * c + col;                                        \
            return ld(dout[i]) * ld(x[i]) * rstd[r];                                           \
        });                                                                                    \
    }

FOR_DTYPES(RMSNORM_DW)
