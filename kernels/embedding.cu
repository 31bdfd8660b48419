// Token embedding: forward gather and backward scatter-add.
#include "common.cuh"

#define EMBEDDING_FWD(name, T, W)                                                                \
    /* out[N, C] = wte[tokens[n], :] */                                                        \
    extern "C" __global__ void embedding_fwd_##name(T* __restrict__ out,         /* [N, C] */  \
                                                    const W* __restrict__ wte,   /* [V, C] */  \
                                                    const unsigned* __restrict__ tokens, /* [N] */ \
                                                    int n, int c) {                            \
        FOR_EACH(i, (long long)n * c) {                                                        \
            const long long row = i / c, col = i % c;                                          \
            st(&out[i], ld(wte[(long long)tokens[row] * c + col]));                            \
        }                                                                                      \
    }

FOR_WEIGHT_DTYPES(EMBEDDING_FWD)

#define EMBEDDING_BWD(name, T)                                                                     \
    /* dwte[tokens[n], :] += dout[n, :] (fp32 gradient; atomics: rows may repeat) */           \
    extern "C" __global__ void embedding_bwd_##name(float* __restrict__ dwte,    /* [V, C] */  \
                                                    const T* __restrict__ dout,  /* [N, C] */  \
                                                    const unsigned* __restrict__ tokens, /* [N] */ \
                                                    int n, int c) {                            \
        FOR_EACH(i, (long long)n * c) {                                                        \
            const long long row = i / c, col = i % c;                                          \
            atomicAdd(&dwte[(long long)tokens[row] * c + col], ld(dout[i]));                   \
        }                                                                                      \
    }

FOR_DTYPES(EMBEDDING_BWD)
