// Token embedding: forward gather and backward scatter-add (grouped by token, in row order).
#include "common.cuh"

#define EMBEDDING_FWD(name, T, W)                                                                \
    /* out[N, C] = wte[tokens[n], :] · scale */                                                \
    extern "C" __global__ void embedding_fwd_##name(T* __restrict__ out,         /* [N, C] */  \
                                                    const W* __restrict__ wte,   /* [V, C] */  \
                                                    const unsigned* __restrict__ tokens, /* [N] */ \
                                                    int n, int c, float scale) {               \
        FOR_EACH(i, (long long)n * c) {                                                        \
            const long long row = i / c, col = i % c;                                          \
            st(&out[i], ld(wte[(long long)tokens[row] * c + col]) * scale);                    \
        }                                                                                      \
    }

FOR_WEIGHT_DTYPES(EMBEDDING_FWD)

#define EMBEDDING_BWD(name, T)                                                                   \
    /* dwte[t, :] += Σ dout[r, :]·scale over the rows r of token t, added in row order: the rows come \
       grouped by token (`launch::group_tokens`: order ‖ starts ‖ tokens), one thread per        \
       (token, column), no atomics — the CPU's bits on every run (the product rounded before    \
       the sum, `__fmul_rn`, as the CPU does: never fused into an FMA). */                      \
    extern "C" __global__ void embedding_bwd_##name(float* __restrict__ dwte,    /* [V, C] */  \
                                                    const T* __restrict__ dout,  /* [N, C] */  \
                                                    const unsigned* __restrict__ groups,       \
                                                    int n, int u, int c, float scale) {        \
        const unsigned* order = groups;       /* [N] */                                       \
        const unsigned* starts = groups + n;  /* [U + 1] */                                   \
        const unsigned* tokens = starts + u + 1; /* [U] */                                    \
        FOR_EACH(i, (long long)u * c) {                                                        \
            const long long g = i / c, col = i % c;                                            \
            float* dst = &dwte[(long long)tokens[g] * c + col];                                \
            float acc = *dst;                                                                  \
            for (unsigned j = starts[g]; j < starts[g + 1]; ++j)                               \
                acc += __fmul_rn(ld(dout[(long long)order[j] * c + col]), scale);              \
            *dst = acc;                                                                        \
        }                                                                                      \
    }

FOR_DTYPES(EMBEDDING_BWD)
