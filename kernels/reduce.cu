// Reductions: Σx² for the global gradient norm (fp64 accumulation across blocks), and column
// sums for bias gradients (`column_sum`: fixed order, no atomics).
#include "common.cuh"

// out[0] += Σ x² (fp64 atomics across blocks; each block reduces in fp32 first, then one atomic).
extern "C" __global__ void sumsq_fwd_f32(double* __restrict__ out, const float* __restrict__ x,
                                         long long n) {
    __shared__ float scratch[WARP];
    float acc = 0.0f;
    FOR_EACH(i, n) acc += x[i] * x[i];
    acc = block_sum(acc, scratch);
    if (threadIdx.x == 0) atomicAdd(out, (double)acc);
}

#define BIAS(name, T)                                                                            \
    /* db[c] += Σ_rows dy[r, c] (fp32), COL_TILE columns × ROW_LANES row lanes per block */    \
    extern "C" __global__ void bias_bwd_##name(float* __restrict__ db,       /* [C] */         \
                                               const T* __restrict__ dy,     /* [N, C] */      \
                                               int n, int c) {                                 \
        column_sum(db, n, c, [&](int r, int col) { return ld(dy[(long long)r * c + col]); });  \
    }                                                                                          \
    /* y += x (residual) */                                                                    \
    extern "C" __global__ void add_fwd_##name(T* __restrict__ y, const T* __restrict__ x,      \
                                              long long n) {                                   \
        FOR_EACH(i, n) st(&y[i], ld(y[i]) + ld(x[i]));                                         \
    }

FOR_DTYPES(BIAS)

#define BIAS_FWD(name, T, W)                                                                     \
    /* y[r, c] += b[c] */                                                                      \
    extern "C" __global__ void bias_fwd_##name(T* __restrict__ y, const W* __restrict__ b,     \
                                               int n, int c) {                                 \
        FOR_EACH(i, (long long)n * c) st(&y[i], ld(y[i]) + ld(b[i % c]));                      \
    }

FOR_WEIGHT_DTYPES(BIAS_FWD)
