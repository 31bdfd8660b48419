// Cross-entropy over a chunk of LM-head logits (the head computes the logits of at most a few
// hundred rows at a time with a GEMM, so B·T·V logits never exist). One block per row. A row whose
// target is IGNORE (0xFFFFFFFF, Hugging Face's label −100) trains nothing: loss 0, gradient 0.
#include "common.cuh"

#define IGNORE 0xFFFFFFFFu

template <typename T>
__device__ __forceinline__ float row_lse(const T* __restrict__ z, int vocab, float* scratch) {
    float m = NEG_INF;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) m = fmaxf(m, ld(z[j]));
    m = block_max(m, scratch);
    float s = 0.0f;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) s += __expf(ld(z[j]) - m);
    s = block_sum(s, scratch);
    return m + __logf(s);
}

#define CROSS_ENTROPY(name, T)                                                                   \
    /* losses[r] = lse(z_r) − z_r[target_r] */                                                  \
    extern "C" __global__ void cross_entropy_fwd_##name(float* __restrict__ losses, /* [R] */  \
                                                        const T* __restrict__ logits, /* [R, V] */ \
                                                        const unsigned* __restrict__ targets,  \
                                                        int rows, int vocab) {                 \
        __shared__ float scratch[WARP];                                                        \
        const long long r = blockIdx.x;                                                        \
        if (r >= rows) return;                                                                 \
        const T* z = logits + r * vocab;                                                       \
        if (targets[r] == IGNORE) {                                                            \
            if (threadIdx.x == 0) losses[r] = 0.0f;                                            \
            return;                                                                            \
        }                                                                                      \
        const float lse = row_lse(z, vocab, scratch);                                          \
        if (threadIdx.x == 0) losses[r] = lse - ld(z[targets[r]]);                             \
    }                                                                                          \
    /* Fused: the loss, and in place dz = scale · (softmax(z) − onehot(target)). */            \
    extern "C" __global__ void cross_entropy_bwd_##name(T* __restrict__ logits,  /* [R, V] */  \
                                                        float* __restrict__ losses, /* [R] */  \
                                                        const unsigned* __restrict__ targets,  \
                                                        int rows, int vocab, float scale) {    \
        __shared__ float scratch[WARP];                                                        \
        const long long r = blockIdx.x;                                                        \
        if (r >= rows) return;                                                                 \
        T* z = logits + r * vocab;                                                             \
        const unsigned tgt = targets[r];                                                       \
        if (tgt == IGNORE) {                                                                   \
            if (threadIdx.x == 0) losses[r] = 0.0f;                                            \
            for (int j = threadIdx.x; j < vocab; j += blockDim.x) st(&z[j], 0.0f);             \
            return;                                                                            \
        }                                                                                      \
        const float lse = row_lse(z, vocab, scratch);                                          \
        const float zt = ld(z[tgt]);                                                           \
        __syncthreads();                                                                       \
        if (threadIdx.x == 0) losses[r] = lse - zt;                                            \
        for (int j = threadIdx.x; j < vocab; j += blockDim.x) {                                \
            const float p = __expf(ld(z[j]) - lse);                                            \
            st(&z[j], scale * (p - (j == (int)tgt ? 1.0f : 0.0f)));                            \
        }                                                                                      \
    }

FOR_DTYPES(CROSS_ENTROPY)
