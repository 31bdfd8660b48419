// The mixture-of-experts MLP's routing, permutation and combination (fp32), around the experts'
// GEMMs (cuBLAS): the router's softmax and top-k per token, the gather of each expert's rows, the
// weighted sum of the experts' outputs per token in ascending expert order (transformers'
// `index_add_` loop, as src/model/ops/moe.rs), and their backward. Products and sums that the
// CPU reference forms one by one are formed here with __fmul_rn / __fadd_rn in its order, so no
// contraction into an FMA changes the bits.
#include "common.cuh"

// The indices of the k largest of `z` [e] into `ex`, descending (ties: the lower index).
__device__ __forceinline__ void top_k(unsigned* ex, const float* z, int e, int k) {
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int i = 0; i < e; i++) {
            bool taken = false;
            for (int q = 0; q < j; q++) taken |= ex[q] == (unsigned)i;
            if (!taken && (best < 0 || z[i] > z[best])) best = i;
        }
        ex[j] = (unsigned)best;
    }
}

// Per token (one thread). `router` 0 (Mixtral, Qwen3-MoE): softmax of the router logits [E]
// (max-shifted), the k largest probabilities (ties: the lower index) and their weights,
// renormalised to sum 1 when `norm`. `router` 1 (GPT-OSS): the k largest logits and the softmax
// over them. `probs` gets the softmax over every expert either way (the load-balancing loss's).
extern "C" __global__ void moe_route_fwd_f32(float* __restrict__ probs,        /* [N, E] */
                                             unsigned* __restrict__ expert,    /* [N, k] */
                                             float* __restrict__ weight,       /* [N, k] */
                                             const float* __restrict__ logits, /* [N, E] */
                                             int n, int e, int k, int norm, int router) {
    FOR_EACH(t, n) {
        const float* z = logits + t * (long long)e;
        float* p = probs + t * (long long)e;
        unsigned* ex = expert + t * (long long)k;
        float* w = weight + t * (long long)k;
        float m = NEG_INF;
        for (int i = 0; i < e; i++) m = fmaxf(m, z[i]);
        float sum = 0.0f;
        for (int i = 0; i < e; i++) {
            p[i] = expf(z[i] - m);
            sum = __fadd_rn(sum, p[i]);
        }
        for (int i = 0; i < e; i++) p[i] = __fdiv_rn(p[i], sum);
        if (router == 1) {
            top_k(ex, z, e, k);
            float mk = NEG_INF;
            for (int j = 0; j < k; j++) mk = fmaxf(mk, z[ex[j]]);
            float sk = 0.0f;
            for (int j = 0; j < k; j++) {
                w[j] = expf(z[ex[j]] - mk);
                sk = __fadd_rn(sk, w[j]);
            }
            for (int j = 0; j < k; j++) w[j] = __fdiv_rn(w[j], sk);
            continue;
        }
        top_k(ex, p, e, k);
        float total = 0.0f;
        for (int j = 0; j < k; j++) {
            w[j] = p[ex[j]];
            total = __fadd_rn(total, w[j]);
        }
        if (norm)
            for (int j = 0; j < k; j++) w[j] = __fdiv_rn(w[j], total);
    }
}

// x[r, :] = h[slots[r] / k, :]: each expert's rows, grouped.
#define GATHER(name, T)                                                                          \
    /* x[r] = h[slots[r] / k]: each grouped row's token (bf16 under the bf16 recipe, where h is  \
       the norm's bf16 output and x a GEMM operand) */                                          \
    extern "C" __global__ void moe_gather_fwd_##name(T* __restrict__ x,              /* [R, C] */ \
                                                     const T* __restrict__ h,        /* [N, C] */ \
                                                     const unsigned* __restrict__ slots, /* [R] */ \
                                                     int rows, int c, int k) {                  \
        FOR_EACH(i, (long long)rows * c) {                                                      \
            const long long r = i / c, col = i % c;                                             \
            x[i] = h[(long long)(slots[r] / k) * c + col];                                      \
        }                                                                                       \
    }

FOR_DTYPES(GATHER)

// The experts' biases over all grouped rows at once: y[r, :] += b[e, :], e = the expert of row r
// (the expert chosen in its slot); `W`: the biases as the device holds them.
#define EXPERT_BIAS(name, T, W)                                                                  \
    extern "C" __global__ void moe_bias_fwd_##name(T* __restrict__ y,              /* [R, w] */ \
                                                   const W* __restrict__ b,        /* [E, w] */ \
                                                   const unsigned* __restrict__ slots, /* [R] */ \
                                                   const unsigned* __restrict__ expert,        \
                                                   int rows, int w) {                          \
        FOR_EACH(i, (long long)rows * w) {                                                      \
            const long long r = i / w, col = i % w;                                             \
            st(&y[i], ld(y[i]) + ld(b[(long long)expert[slots[r]] * w + col]));                 \
        }                                                                                       \
    }

EXPERT_BIAS(f32, float, float)
EXPERT_BIAS(f32w16, float, bf16)

// The experts' bias gradients: db[e, col] += Σ over expert e's rows (offsets[e] ≤ r <
// offsets[e + 1]) of dy[r, col], in row order (the CPU's); one thread per (expert, column).
extern "C" __global__ void moe_bias_bwd_f32(float* __restrict__ db,               /* [E, w] */
                                            const float* __restrict__ dy,         /* [R, w] */
                                            const unsigned* __restrict__ offsets, /* [E + 1] */
                                            int e, int w) {
    FOR_EACH(i, (long long)e * w) {
        const long long x = i / w, col = i % w;
        float acc = 0.0f;
        for (long long r = offsets[x]; r < offsets[x + 1]; r++)
            acc = __fadd_rn(acc, dy[r * w + col]);
        db[i] = __fadd_rn(db[i], acc);
    }
}

// The j-th of token t's k slots in ascending expert order (the experts of a token differ).
__device__ __forceinline__ int nth_slot(const unsigned* ex, int k, int j) {
    int prev = -1, slot = 0;
    for (int q = 0; q <= j; q++) {
        int best = -1;
        for (int s = 0; s < k; s++)
            if ((int)ex[s] > prev && (best < 0 || ex[s] < ex[best])) best = s;
        prev = (int)ex[best];
        slot = best;
    }
    return slot;
}

// out[t, :] = Σ over t's slots in ascending expert order of weight · y[row of the slot, :]
// (weight 1 when `weight` is null: the backward's sum of the rows' input gradients). A block per
// token at a time: the token's slot order is found once (into shared memory, up to
// MOE_ORDER_MAX slots; beyond, per column) and its threads run over the columns.
#define MOE_ORDER_MAX 64
extern "C" __global__ void moe_combine_fwd_f32(float* __restrict__ out,             /* [N, C] */
                                               const float* __restrict__ y,         /* [R, C] */
                                               const unsigned* __restrict__ row_of, /* [N, k] */
                                               const unsigned* __restrict__ expert, /* [N, k] */
                                               const float* __restrict__ weight,    /* [N, k] */
                                               int n, int c, int k) {
    __shared__ int order[MOE_ORDER_MAX];
    for (long long t = blockIdx.x; t < n; t += gridDim.x) {
        const unsigned* ex = expert + t * k;
        __syncthreads();  // the previous token's columns are done with `order`
        if (k <= MOE_ORDER_MAX)
            for (int j = threadIdx.x; j < k; j += blockDim.x) order[j] = nth_slot(ex, k, j);
        __syncthreads();
        for (int col = threadIdx.x; col < c; col += blockDim.x) {
            float acc = 0.0f;
            for (int j = 0; j < k; j++) {
                const int s = k <= MOE_ORDER_MAX ? order[j] : nth_slot(ex, k, j);
                const float v = y[(long long)row_of[t * k + s] * c + col];
                acc = __fadd_rn(acc, weight ? __fmul_rn(v, weight[t * k + s]) : v);
            }
            out[t * (long long)c + col] = acc;
        }
    }
}

// The weighted sum's backward: dy[r, :] = weight of r's slot · dout[token of r, :], and per slot
// d weight = Σ_c dout[t, c] · y[row, c] (in column order).
extern "C" __global__ void moe_combine_bwd_f32(float* __restrict__ dy,              /* [R, C] */
                                               float* __restrict__ dweight,         /* [N, k] */
                                               const float* __restrict__ dout,      /* [N, C] */
                                               const float* __restrict__ y,         /* [R, C] */
                                               const unsigned* __restrict__ slots,  /* [R] */
                                               const unsigned* __restrict__ row_of, /* [N, k] */
                                               const float* __restrict__ weight,    /* [N, k] */
                                               int rows, int c, int k) {
    FOR_EACH(i, (long long)rows * c) {
        const long long r = i / c, col = i % c;
        const unsigned slot = slots[r];
        dy[i] = __fmul_rn(dout[(long long)(slot / k) * c + col], weight[slot]);
    }
    FOR_EACH(slot, rows) {
        const float* d = dout + (slot / k) * (long long)c;
        const float* yr = y + (long long)row_of[slot] * c;
        float acc = 0.0f;
        for (int col = 0; col < c; col++) acc = __fadd_rn(acc, __fmul_rn(d[col], yr[col]));
        dweight[slot] = acc;
    }
}

// The router's backward per token (one thread). `router` 0: d probability of each chosen expert
// (through the renormalisation when `norm`), then the softmax's: dz = p ⊙ (dp − Σ p·dp).
// `router` 1: the softmax over the chosen logits: dz_j = w_j (dw_j − Σ w·dw), 0 elsewhere.
// The load-balancing loss's dL/dp `aux` [E] (null: none) through the softmax `p`, added to dz:
// dz += p ⊙ (aux − ⟨p, aux⟩) — on the tokens that are not padding (`pad` [N] non-zero; null:
// none is).
__device__ __forceinline__ void add_aux(float* dz, const float* p, const float* aux, int e) {
    if (!aux) return;
    float dot = 0.0f;
    for (int i = 0; i < e; i++) dot = __fadd_rn(dot, __fmul_rn(p[i], aux[i]));
    for (int i = 0; i < e; i++) dz[i] = __fadd_rn(dz[i], __fmul_rn(p[i], __fsub_rn(aux[i], dot)));
}

extern "C" __global__ void moe_route_bwd_f32(float* __restrict__ dlogits,         /* [N, E] */
                                             const float* __restrict__ probs,     /* [N, E] */
                                             const unsigned* __restrict__ expert, /* [N, k] */
                                             const float* __restrict__ weight,    /* [N, k] */
                                             const float* __restrict__ dweight,   /* [N, k] */
                                             const float* __restrict__ aux,       /* [E] or null */
                                             const unsigned char* __restrict__ pad, /* [N] or null */
                                             int n, int e, int k, int norm, int router) {
    FOR_EACH(t, n) {
        const float* p = probs + t * (long long)e;
        const float* aux_t = (pad && pad[t]) ? (const float*)0 : aux;
        const unsigned* ex = expert + t * (long long)k;
        const float* dw = dweight + t * (long long)k;
        float* dz = dlogits + t * (long long)e;
        for (int i = 0; i < e; i++) dz[i] = 0.0f;
        if (router == 1) {
            const float* w = weight + t * (long long)k;
            float dot = 0.0f;
            for (int j = 0; j < k; j++) dot = __fadd_rn(dot, __fmul_rn(w[j], dw[j]));
            for (int j = 0; j < k; j++) dz[ex[j]] = __fmul_rn(w[j], __fsub_rn(dw[j], dot));
            add_aux(dz, p, aux_t, e);
            continue;
        }
        float total = 0.0f, cross = 0.0f;
        if (norm)
            for (int j = 0; j < k; j++) {
                total = __fadd_rn(total, p[ex[j]]);
                cross = __fadd_rn(cross, __fmul_rn(dw[j], p[ex[j]]));
            }
        // dz first holds dp (0 for the experts not chosen), then the softmax's backward.
        for (int j = 0; j < k; j++)
            dz[ex[j]] = norm ? __fsub_rn(__fdiv_rn(dw[j], total),
                                         __fdiv_rn(cross, __fmul_rn(total, total)))
                             : dw[j];
        float dot = 0.0f;
        for (int i = 0; i < e; i++) dot = __fadd_rn(dot, __fmul_rn(p[i], dz[i]));
        for (int i = 0; i < e; i++) dz[i] = __fmul_rn(p[i], __fsub_rn(dz[i], dot));
        add_aux(dz, p, aux_t, e);
    }
}

// sums[i] = Σ_t probs[t, i] (t ascending, summed and written in double): each expert's router probability summed
// over the call's tokens but padding (`pad` [N] non-zero; null: none is), in the CPU's order (`ExpertLoad::of`).
extern "C" __global__ void moe_prob_sums_fwd_f32(double* __restrict__ sums,                 /* [E] */
                                                 const float* __restrict__ probs,          /* [N, E] */
                                                 const unsigned char* __restrict__ pad,    /* [N] or null */
                                                 int n, int e) {
    FOR_EACH(i, e) {
        double s = 0.0;
        for (int t = 0; t < n; t++)
            if (!pad || !pad[t]) s += (double)probs[t * (long long)e + i];
        sums[i] = s;
    }
}

__device__ __forceinline__ float moe_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// GPT-OSS's clamped SwiGLU over interleaved gate/up `gu` [R, 2I] (gate even, up odd):
// g = min(gate, limit), u = clamp(up, −limit, limit), out = (u + 1)·g·σ(α·g), in
// transformers' order.
extern "C" __global__ void moe_clamped_swiglu_fwd_f32(float* __restrict__ out,      /* [R, I] */
                                                      const float* __restrict__ gu, /* [R, 2I] */
                                                      long long n, float alpha, float limit) {
    FOR_EACH(j, n) {
        const float g = fminf(gu[2 * j], limit);
        const float u = fminf(fmaxf(gu[2 * j + 1], -limit), limit);
        const float glu = __fmul_rn(g, moe_sigmoid(__fmul_rn(g, alpha)));
        out[j] = __fmul_rn(__fadd_rn(u, 1.0f), glu);
    }
}

// Its backward: d gu [R, 2I] from d out [R, I]; no gradient where a clamp holds (the bounds
// themselves pass, as torch's clamp).
extern "C" __global__ void moe_clamped_swiglu_bwd_f32(float* __restrict__ dgu,       /* [R, 2I] */
                                                      const float* __restrict__ dout, /* [R, I] */
                                                      const float* __restrict__ gu,   /* [R, 2I] */
                                                      long long n, float alpha, float limit) {
    FOR_EACH(j, n) {
        const float gate = gu[2 * j], up = gu[2 * j + 1];
        const float g = fminf(gate, limit);
        const float u = fminf(fmaxf(up, -limit), limit);
        const float sg = moe_sigmoid(__fmul_rn(g, alpha));
        const float glu = __fmul_rn(g, sg);
        const float dglu = __fmul_rn(dout[j], __fadd_rn(u, 1.0f));
        const float slope =
            __fadd_rn(sg, __fmul_rn(__fmul_rn(__fmul_rn(g, alpha), sg), __fsub_rn(1.0f, sg)));
        dgu[2 * j] = gate <= limit ? __fmul_rn(dglu, slope) : 0.0f;
        dgu[2 * j + 1] = (up >= -limit && up <= limit) ? __fmul_rn(dout[j], glu) : 0.0f;
    }
}
