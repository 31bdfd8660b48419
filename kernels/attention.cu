// Causal grouped-query attention over documents, flash style: tiles of K/V (or Q/dO) in shared
// memory, an online softmax, no T×T matrix. The backward recomputes probabilities from the
// forward's log-sum-exp.
//
// Documents: pos [B, T] (u32) is each token's position in its document, so query i attends to keys
// first_key(i) = i − pos[i] … i: documents packed into one row never see each other (varlen
// attention, as FlashAttention's cu_seqlens). First keys never decrease along a row, which bounds
// the tiles a block visits. Scores may be soft-capped (`softcap` > 0: Gemma 2).
//
// Queries: rows q0 … q1−1 of every sequence (a token chunk; 0 … T−1 for the whole sequence).
// Layouts: q, out, dout, dq [B, q1−q0, NH, hd] (the chunk's rows only); k, v, dk, dv
// [B, T, NKV, hd]; lse, delta [B, NH, q1−q0] fp32. dk and dv are accumulated (+=): a sequence's
// key gradients are summed over its query chunks in stream order. Query head h reads kv head
// h / (NH / NKV) (repeat_interleave). hd ≤ 256 (MAX_PER_LANE × 32). Storage: `I` for the inputs
// q, k, v, dout and `O` for out, dq, dk, dv (symbols `_f32`, `_bf16`, `_f32i16`: bf16 in, fp32
// out); statistics and arithmetic fp32. One warp per query row (forward, dq) or per key row
// (dk/dv); a block holds ROWS warps and a tile of `tile` rows of the other side, `tile` chosen by
// the host so the tiles fit in shared memory (launch geometry in src/device/launch.rs).
#include "common.cuh"

#define MAX_PER_LANE 8
#define ROWS 8

// Lanes own dims lane, lane + 32, … of a row.
template <typename T>
__device__ __forceinline__ void load_row(float* r, const T* __restrict__ p, int hd) {
    const int lane = threadIdx.x % WARP;
#pragma unroll
    for (int k = 0; k < MAX_PER_LANE; k++) {
        const int d = lane + k * WARP;
        r[k] = d < hd ? ld(p[d]) : 0.0f;
    }
}

// Dot of a lane-distributed row with a shared-memory row, summed over the warp.
__device__ __forceinline__ float dot_shared(const float* r, const float* s, int hd) {
    const int lane = threadIdx.x % WARP;
    float acc = 0.0f;
#pragma unroll
    for (int k = 0; k < MAX_PER_LANE; k++) {
        const int d = lane + k * WARP;
        if (d < hd) acc += r[k] * s[d];
    }
    return warp_sum(acc);
}

// Copy `rows` rows (from row `first`) of a [B, len, H, hd] tensor holding rows base … base+len−1
// of each sequence, head `head`, into shared memory (zeros past the end).
template <typename T>
__device__ __forceinline__ void load_tile(float* dst, const T* __restrict__ src, long long b,
                                          int base, int len, int heads, int head, int hd,
                                          int first, int rows) {
    for (int i = threadIdx.x; i < rows * hd; i += blockDim.x) {
        const int r = i / hd, d = i % hd;
        const int at = first + r - base;
        dst[i] = at < len ? ld(src[((b * len + at) * heads + head) * (long long)hd + d]) : 0.0f;
    }
}

// The first key query i of sequence b attends to.
__device__ __forceinline__ int first_key(const unsigned* __restrict__ pos, long long b, int t,
                                         int window, int i) {
    const int doc = i - (int)pos[b * t + i];
    return window > 0 ? max(doc, i + 1 - window) : doc;
}

template <typename I, typename O>
__device__ void attention_fwd(O* __restrict__ out, float* __restrict__ lse,
                              const I* __restrict__ q, const I* __restrict__ k,
                              const I* __restrict__ v, const unsigned* __restrict__ pos, int t, int window,
                              int q0, int q1, int nh, int nkv, int hd, int tile, float scale,
                              float softcap) {
    extern __shared__ float smem[];
    float* ks = smem;              // [tile, hd]
    float* vs = smem + tile * hd;  // [tile, hd]
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const long long b = blockIdx.z;
    const int h = blockIdx.y, g = h / (nh / nkv);
    const int nq = q1 - q0;
    const int first = q0 + blockIdx.x * ROWS;
    const int i = first + warp;  // this warp's query row
    const bool live = i < q1;
    const long long qrow = ((b * nq + i - q0) * nh + h) * (long long)hd;
    float qr[MAX_PER_LANE], o[MAX_PER_LANE];
    if (live) load_row(qr, q + qrow, hd);
#pragma unroll
    for (int x = 0; x < MAX_PER_LANE; x++) {
        qr[x] *= scale;
        o[x] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;
    const int last = min(first + ROWS, q1) - 1;  // the block's last query row
    const int lo = live ? first_key(pos, b, t, window, i) : 0;
    const int j_begin = first_key(pos, b, t, window, first) / tile * tile;  // the block's lowest
    for (int j0 = j_begin; j0 <= last; j0 += tile) {
        __syncthreads();
        load_tile(ks, k, b, 0, t, nkv, g, hd, j0, tile);
        load_tile(vs, v, b, 0, t, nkv, g, hd, j0, tile);
        __syncthreads();
        if (!live) continue;
        const int jn = min(tile, i - j0 + 1);
        for (int jj = max(0, lo - j0); jj < jn; jj++) {
            float dcap;
            const float s = softcapped(dot_shared(qr, ks + jj * hd, hd), softcap, &dcap);
            const float mn = fmaxf(m, s);
            const float corr = __expf(m - mn), p = __expf(s - mn);
            l = l * corr + p;
#pragma unroll
            for (int x = 0; x < MAX_PER_LANE; x++) {
                const int d = lane + x * WARP;
                o[x] = o[x] * corr + (d < hd ? p * vs[jj * hd + d] : 0.0f);
            }
            m = mn;
        }
    }
    if (!live) return;
    const float inv = 1.0f / l;
    O* orow = out + qrow;
#pragma unroll
    for (int x = 0; x < MAX_PER_LANE; x++) {
        const int d = lane + x * WARP;
        if (d < hd) st(&orow[d], o[x] * inv);
    }
    if (lane == 0) lse[(b * nh + h) * nq + i - q0] = m + __logf(l);
}

// dq_i = scale · Σ_j p_ij (dout_i·v_j − D_i) k_j, with D_i = dout_i·out_i (written for the dk/dv
// kernel) and p_ij = exp(scale q_i·k_j − lse_i).
template <typename I, typename O>
__device__ void attention_bwd_dq(O* __restrict__ dq, float* __restrict__ delta,
                                 const I* __restrict__ dout, const O* __restrict__ out,
                                 const I* __restrict__ q, const I* __restrict__ k,
                                 const I* __restrict__ v, const float* __restrict__ lse,
                                 const unsigned* __restrict__ pos, int t, int window, int q0, int q1, int nh,
                                 int nkv, int hd, int tile, float scale, float softcap) {
    extern __shared__ float smem[];
    float* ks = smem;
    float* vs = smem + tile * hd;
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const long long b = blockIdx.z;
    const int h = blockIdx.y, g = h / (nh / nkv);
    const int nq = q1 - q0;
    const int first = q0 + blockIdx.x * ROWS;
    const int i = first + warp;
    const bool live = i < q1;
    const long long row = ((b * nq + i - q0) * nh + h) * (long long)hd;
    float qr[MAX_PER_LANE], dor[MAX_PER_LANE], acc[MAX_PER_LANE];
    float di = 0.0f, li = 0.0f;
    if (live) {
        load_row(qr, q + row, hd);
        load_row(dor, dout + row, hd);
        float orow[MAX_PER_LANE];
        load_row(orow, out + row, hd);
        float part = 0.0f;
#pragma unroll
        for (int x = 0; x < MAX_PER_LANE; x++) part += dor[x] * orow[x];
        di = warp_sum(part);
        li = lse[(b * nh + h) * nq + i - q0];
        if (lane == 0) delta[(b * nh + h) * nq + i - q0] = di;
    }
#pragma unroll
    for (int x = 0; x < MAX_PER_LANE; x++) {
        qr[x] *= scale;
        acc[x] = 0.0f;
    }
    const int last = min(first + ROWS, q1) - 1;
    const int lo = live ? first_key(pos, b, t, window, i) : 0;
    const int j_begin = first_key(pos, b, t, window, first) / tile * tile;
    for (int j0 = j_begin; j0 <= last; j0 += tile) {
        __syncthreads();
        load_tile(ks, k, b, 0, t, nkv, g, hd, j0, tile);
        load_tile(vs, v, b, 0, t, nkv, g, hd, j0, tile);
        __syncthreads();
        if (!live) continue;
        const int jn = min(tile, i - j0 + 1);
        for (int jj = max(0, lo - j0); jj < jn; jj++) {
            float dcap;
            const float sc = softcapped(dot_shared(qr, ks + jj * hd, hd), softcap, &dcap);
            const float p = __expf(sc - li);
            const float ds = p * (dot_shared(dor, vs + jj * hd, hd) - di) * dcap;
#pragma unroll
            for (int x = 0; x < MAX_PER_LANE; x++) {
                const int d = lane + x * WARP;
                if (d < hd) acc[x] += ds * ks[jj * hd + d];
            }
        }
    }
    if (!live) return;
    O* drow = dq + row;
#pragma unroll
    for (int x = 0; x < MAX_PER_LANE; x++) {
        const int d = lane + x * WARP;
        if (d < hd) st(&drow[d], acc[x] * scale);
    }
}

// For kv head g's key row j < q1: dv_j += Σ_{h in g} Σ_i p_ij dout_i,
// dk_j += scale · Σ_{h in g} Σ_i p_ij (dout_i·v_j − D_i) q_i over the chunk's queries i ≥ j of j's
// document (first_key(i) ≤ j). No atomics: one warp owns a row.
template <typename I, typename O>
__device__ void attention_bwd_kv(O* __restrict__ dk, O* __restrict__ dv,
                                 const I* __restrict__ dout, const I* __restrict__ q,
                                 const I* __restrict__ k, const I* __restrict__ v,
                                 const float* __restrict__ lse, const float* __restrict__ delta,
                                 const unsigned* __restrict__ pos, int t, int window, int q0, int q1, int nh,
                                 int nkv, int hd, int tile, float scale, float softcap) {
    extern __shared__ float smem[];
    float* qs = smem;                       // [tile, hd]
    float* ds_ = smem + tile * hd;          // [tile, hd] (dout rows)
    float* ls = smem + 2 * tile * hd;       // [tile] lse
    float* dls = smem + 2 * tile * hd + tile;  // [tile] delta
    int* los = (int*)(smem + 2 * tile * hd + 2 * tile);  // [tile] each query's first key
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const long long b = blockIdx.z;
    const int g = blockIdx.y, group = nh / nkv;
    const int nq = q1 - q0;
    const int first = blockIdx.x * ROWS;
    const int j = first + warp;
    const bool live = j < q1;
    float kr[MAX_PER_LANE], vr[MAX_PER_LANE], dkr[MAX_PER_LANE], dvr[MAX_PER_LANE];
    if (live) {
        const long long row = ((b * t + j) * nkv + g) * (long long)hd;
        load_row(kr, k + row, hd);
        load_row(vr, v + row, hd);
    }
#pragma unroll
    for (int x = 0; x < MAX_PER_LANE; x++) {
        kr[x] *= scale;
        dkr[x] = 0.0f;
        dvr[x] = 0.0f;
    }
    const int last = min(first + ROWS, q1) - 1;  // the block's last key row
    for (int h = g * group; h < (g + 1) * group; h++) {
        // Queries past the block's last key's document see none of its keys: stop there.
        for (int i0 = max(first, q0); i0 < q1 && first_key(pos, b, t, window, i0) <= last; i0 += tile) {
            __syncthreads();
            load_tile(qs, q, b, q0, nq, nh, h, hd, i0, tile);
            load_tile(ds_, dout, b, q0, nq, nh, h, hd, i0, tile);
            for (int r = threadIdx.x; r < tile; r += blockDim.x) {
                const int row = i0 + r;
                ls[r] = row < q1 ? lse[(b * nh + h) * nq + row - q0] : 0.0f;
                dls[r] = row < q1 ? delta[(b * nh + h) * nq + row - q0] : 0.0f;
                los[r] = row < q1 ? first_key(pos, b, t, window, row) : t;
            }
            __syncthreads();
            if (!live) continue;
            for (int ii = max(0, j - i0); ii < tile && i0 + ii < q1 && los[ii] <= j; ii++) {
                float dcap;
                const float sc = softcapped(dot_shared(kr, qs + ii * hd, hd), softcap, &dcap);
                const float p = __expf(sc - ls[ii]);
                const float dp = dot_shared(vr, ds_ + ii * hd, hd);
                const float dsc = p * (dp - dls[ii]) * dcap;
#pragma unroll
                for (int x = 0; x < MAX_PER_LANE; x++) {
                    const int d = lane + x * WARP;
                    if (d < hd) {
                        dvr[x] += p * ds_[ii * hd + d];
                        dkr[x] += dsc * qs[ii * hd + d];
                    }
                }
            }
        }
    }
    if (!live) return;
    const long long row = ((b * t + j) * nkv + g) * (long long)hd;
#pragma unroll
    for (int x = 0; x < MAX_PER_LANE; x++) {
        const int d = lane + x * WARP;
        if (d < hd) {
            st(&dk[row + d], ld(dk[row + d]) + dkr[x] * scale);
            st(&dv[row + d], ld(dv[row + d]) + dvr[x]);
        }
    }
}

#define ATTENTION(name, I, O)                                                                     \
    extern "C" __global__ void attention_fwd_##name(O* out, float* lse, const I* q, const I* k,  \
                                                    const I* v, const unsigned* pos, int t, int window,     \
                                                    int q0, int q1, int nh, int nkv, int hd,    \
                                                    int tile, float scale, float softcap) {     \
        attention_fwd<I, O>(out, lse, q, k, v, pos, t, window, q0, q1, nh, nkv, hd, tile, scale,        \
                            softcap);                                                           \
    }                                                                                           \
    extern "C" __global__ void attention_bwd_##name(O* dq, float* delta, const I* dout,          \
                                                    const O* out, const I* q, const I* k,       \
                                                    const I* v, const float* lse,               \
                                                    const unsigned* pos, int t, int window, int q0, int q1, \
                                                    int nh, int nkv, int hd, int tile,          \
                                                    float scale, float softcap) {               \
        attention_bwd_dq<I, O>(dq, delta, dout, out, q, k, v, lse, pos, t, window, q0, q1, nh, nkv, hd, \
                               tile, scale, softcap);                                           \
    }                                                                                           \
    extern "C" __global__ void attention_bwd_kv_##name(O* dk, O* dv, const I* dout, const I* q,  \
                                                       const I* k, const I* v, const float* lse, \
                                                       const float* delta, const unsigned* pos,  \
                                                       int t, int window, int q0, int q1, int nh, int nkv,   \
                                                       int hd, int tile, float scale,            \
                                                       float softcap) {                          \
        attention_bwd_kv<I, O>(dk, dv, dout, q, k, v, lse, delta, pos, t, window, q0, q1, nh, nkv, hd,  \
                               tile, scale, softcap);                                           \
    }

// fp32 throughout; bf16 throughout; bf16 inputs (Q, K, V, dO: the bf16 recipe stores them in
// bf16) with fp32 outputs (O, dQ, dK, dV).
ATTENTION(f32, float, float)
ATTENTION(bf16, bf16, bf16)
ATTENTION(f32i16, bf16, float)
