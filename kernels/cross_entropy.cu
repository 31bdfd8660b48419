// Cross-entropy over a chunk of LM-head logits (the head computes the logits of at most a few
// hundred rows at a time with a GEMM, so B·T·V logits never exist). One block per row. A row whose
// target is IGNORE (0xFFFFFFFF, Hugging Face's label −100) trains nothing: loss 0, gradient 0.
// With softcap > 0 (Gemma 2's final_logit_softcapping) of the capped logits z' = cap·tanh(z / cap),
// the gradient taken back through the cap (× 1 − (z'/cap)²); every thread caps the values it reads.
#include "common.cuh"

#define IGNORE 0xFFFFFFFFu

// z[j], soft-capped when softcap > 0; the cap's derivative into *dcap.
template <typename T>
__device__ __forceinline__ float logit(const T* __restrict__ z, int j, float softcap, float* dcap) {
    return softcapped(ld(z[j]), softcap, dcap);
}

template <typename T>
__device__ __forceinline__ float row_lse(const T* __restrict__ z, int vocab, float softcap,
                                         float* scratch) {
    float m = NEG_INF, dcap;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) m = fmaxf(m, logit(z, j, softcap, &dcap));
    m = block_max(m, scratch);
    float s = 0.0f;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) s += __expf(logit(z, j, softcap, &dcap) - m);
    s = block_sum(s, scratch);
    return m + __logf(s);
}

#define CROSS_ENTROPY(name, T)                                                                   \
    /* losses[r] = lse(z_r) − z_r[target_r] */                                                  \
    extern "C" __global__ void cross_entropy_fwd_##name(float* __restrict__ losses, /* [R] */  \
                                                        const T* __restrict__ logits, /* [R, V] */ \
                                                        const unsigned* __restrict__ targets,  \
                                                        int rows, int vocab, float softcap) {  \
        __shared__ float scratch[WARP];                                                        \
        const long long r = blockIdx.x;                                                        \
        if (r >= rows) return;                                                                 \
        const T* z = logits + r * vocab;                                                       \
        if (targets[r] == IGNORE) {                                                            \
            if (threadIdx.x == 0) losses[r] = 0.0f;                                            \
            return;                                                                            \
        }                                                                                      \
        const float lse = row_lse(z, vocab, softcap, scratch);                                 \
        float dcap;                                                                            \
        if (threadIdx.x == 0) losses[r] = lse - logit(z, targets[r], softcap, &dcap);          \
    }                                                                                          \
    /* Fused: the loss, and in place dz = scale · (softmax(z) − onehot(target)). */            \
    extern "C" __global__ void cross_entropy_bwd_##name(T* __restrict__ logits,  /* [R, V] */  \
                                                        float* __restrict__ losses, /* [R] */  \
                                                        const unsigned* __restrict__ targets,  \
                                                        int rows, int vocab, float scale,      \
                                                        float softcap) {                       \
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
        const float lse = row_lse(z, vocab, softcap, scratch);                                 \
        float dcap;                                                                            \
        const float zt = logit(z, tgt, softcap, &dcap);                                        \
        __syncthreads();                                                                       \
        if (threadIdx.x == 0) losses[r] = lse - zt;                                            \
        for (int j = threadIdx.x; j < vocab; j += blockDim.x) {                                \
            const float p = __expf(logit(z, j, softcap, &dcap) - lse);                         \
            st(&z[j], scale * (p - (j == (int)tgt ? 1.0f : 0.0f)) * dcap);                     \
        }                                                                                      \
    }

FOR_DTYPES(CROSS_ENTROPY)
