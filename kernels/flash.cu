// Causal grouped-query flash attention on the tensor cores, for the bf16 recipe: Q, K, V and dO
// are stored in bf16 (the program rounded them when it stored them; a pair of them is one 32-bit
// word of an MMA fragment as it is loaded), O, dQ, dK and dV in fp32, every product runs on `mma.sync.m16n8k16` with fp32 accumulation, the softmax
// statistics and D = dO·O are fp32, and there is no T×T matrix. Same arguments and results as
// attention.cu (documents through `pos`, query ranges q0..q1, dK/dV accumulated, lse and delta
// [B, NH, q1−q0]) without its `tile`: the tiles here are compile-time.
//
// The probabilities P and their gradients dS are fp32 numbers, not bf16: each enters a product
// as two bf16 halves, hi = bf16(x) and lo = bf16(x − hi), so hi + lo is x to 2⁻¹⁸ relative and the
// result is the fp32 attention of the rounded inputs (what the CPU device computes), at the cost
// of a second MMA for P·V, dS·K, Pᵀ·dO and dSᵀ·Q: 3 MMAs forward where FlashAttention-2 has 2,
// and 10 backward (S and dP are formed in both backward kernels) where it has 5. (FA2 rounds P
// to bf16 instead: a recipe change, not taken.)
//
// Work split: a block is FLASH_WARPS warps, each owning 16 rows — query rows (forward, dq) or key
// rows (dk/dv) — one head, one sequence. The other side streams through shared memory in tiles
// of bf16 rows, padded by PAD halfwords so the fragment loads of a warp hit 32 distinct banks.
// Fragments follow the PTX ISA's layouts for m16n8k16 (lane = 4·grp + tig): A's registers hold
// rows grp / grp+8 and columns 2·tig(+1) / 2·tig+8(+1); B's hold rows 2·tig(+1) / 2·tig+8(+1) of
// column grp; C's hold rows grp / grp+8, columns 2·tig(+1). A transposed B read (`b_cols`) packs
// two halfwords per register, what ldmatrix.trans does on hardware (the emulator models
// mma.sync, not ldmatrix).
//
// Head dims 32, 64 and 128 (the presets' and the demo's): the symbols are flash{HD}_{fwd|bwd|
// bwd_kv}_f32i16 (bf16 in, fp32 out, as attention.cu's). Geometry and shared-memory sizes are in src/device/launch.rs (`flash`).
#include "common.cuh"

#define FLASH_WARPS 4
#define FLASH_ROWS (FLASH_WARPS * 16)  // rows a block owns
#define FWD_KEYS 64                    // key tile of the forward
#define DQ_KEYS 32                     // key tile of dq
#define KV_QUERIES 16                  // query tile of dk/dv
#define PAD 8                          // halfwords of padding per shared row

__device__ __forceinline__ unsigned bf16_bits(float x) {
    return static_cast<__nv_bfloat16_raw>(__float2bfloat16_rn(x)).x;
}

__device__ __forceinline__ float bf16_value(unsigned bits) { return __uint_as_float(bits << 16); }

// Two values as one register of bf16 pairs: `lo` in the low half (the lower column or row).
__device__ __forceinline__ unsigned pack(float lo, float hi) {
    return bf16_bits(lo) | (bf16_bits(hi) << 16);
}

// Elements p[0] and p[1] (p[0] in the low half) as a bf16 pair: fp32 ones rounded, bf16 ones as
// they are stored.
__device__ __forceinline__ unsigned pair(const float* p) { return pack(p[0], p[1]); }
__device__ __forceinline__ unsigned pair(const bf16* p) {
    return *reinterpret_cast<const unsigned*>(p);  // 4-byte aligned: p is an even element
}

// x0, x1 = hi + lo, each a packed bf16 pair.
__device__ __forceinline__ void split(float x0, float x1, unsigned& hi, unsigned& lo) {
    const unsigned h0 = bf16_bits(x0), h1 = bf16_bits(x1);
    hi = h0 | (h1 << 16);
    lo = pack(x0 - bf16_value(h0), x1 - bf16_value(h1));
}

// An A fragment from two C fragments (columns 0–7 and 8–15 of a 16×16 block), as hi and lo.
__device__ __forceinline__ void split_a(const float c0[4], const float c1[4], unsigned hi[4],
                                        unsigned lo[4]) {
    split(c0[0], c0[1], hi[0], lo[0]);
    split(c0[2], c0[3], hi[1], lo[1]);
    split(c1[0], c1[1], hi[2], lo[2]);
    split(c1[2], c1[3], hi[3], lo[3]);
}

// D += A·B as the two MMAs of A's hi and lo halves.
__device__ __forceinline__ void mma_split(float d[4], const unsigned hi[4], const unsigned lo[4],
                                          const unsigned b[2]) {
    mma_m16n8k16_bf16(d, hi, b, d);
    mma_m16n8k16_bf16(d, lo, b, d);
}

// Copy rows first … first+rows−1 (those < end) of head `head` of a [B, len, heads, HD] tensor
// holding rows base … base+len−1 of each sequence into a shared tile as bf16, zeros past `end`.
template <typename T, int HD>
__device__ __forceinline__ void load_tile(unsigned* s, const T* __restrict__ src, long long b,
                                          int base, int len, int heads, int head, int first,
                                          int rows, int end) {
    constexpr int W = (HD + PAD) / 2;  // words per shared row
    for (int i = threadIdx.x; i < rows * (HD / 2); i += blockDim.x) {
        const int r = i / (HD / 2), d = 2 * (i % (HD / 2));
        const int at = first + r;
        unsigned w = 0;
        if (at < end) {
            const T* p = src + ((b * len + at - base) * heads + head) * (long long)HD + d;
            w = pair(p);
        }
        s[r * W + d / 2] = w;
    }
}

// A fragment: rows r0 … r0+15, columns k0 … k0+15 of a shared tile.
template <int HD>
__device__ __forceinline__ void a_frag(unsigned a[4], const unsigned* s, int r0, int k0) {
    constexpr int W = (HD + PAD) / 2;
    const int lane = threadIdx.x % WARP, grp = lane >> 2, tig = lane & 3;
    const unsigned* p = s + (r0 + grp) * W + k0 / 2 + tig;
    a[0] = p[0];
    a[1] = p[8 * W];
    a[2] = p[4];
    a[3] = p[8 * W + 4];
}

// B fragment with B[k][n] = tile[n0 + n][k0 + k] (the tile's rows are B's columns: Kᵀ, Vᵀ, Qᵀ).
template <int HD>
__device__ __forceinline__ void b_rows(unsigned b[2], const unsigned* s, int n0, int k0) {
    constexpr int W = (HD + PAD) / 2;
    const int lane = threadIdx.x % WARP, grp = lane >> 2, tig = lane & 3;
    const unsigned* p = s + (n0 + grp) * W + k0 / 2 + tig;
    b[0] = p[0];
    b[1] = p[4];
}

// B fragment with B[k][n] = tile[k0 + k][n0 + n] (the tile's rows are B's rows: V, K, dO, Q).
template <int HD>
__device__ __forceinline__ void b_cols(unsigned b[2], const unsigned* s, int k0, int n0) {
    constexpr int S = HD + PAD;  // halfwords per shared row
    const int lane = threadIdx.x % WARP, grp = lane >> 2, tig = lane & 3;
    const unsigned short* p =
        reinterpret_cast<const unsigned short*>(s) + (k0 + 2 * tig) * S + n0 + grp;
    b[0] = (unsigned)p[0] | ((unsigned)p[S] << 16);
    b[1] = (unsigned)p[8 * S] | ((unsigned)p[9 * S] << 16);
}

// acc += C·B for a warp's 16 rows: C is K columns of fp32 C fragments (P or dS, entering as A
// fragments of hi + lo halves) and B is rows 0 … K−1 of a shared tile (V, K, dO or Q).
template <int HD, int K>
__device__ __forceinline__ void add_split_times_tile(float acc[HD / 8][4], const float c[K / 8][4],
                                                     const unsigned* tile) {
#pragma unroll
    for (int kc = 0; kc < K / 16; kc++) {
        unsigned hi[4], lo[4];
        split_a(c[2 * kc], c[2 * kc + 1], hi, lo);
#pragma unroll
        for (int nd = 0; nd < HD / 8; nd++) {
            unsigned b[2];
            b_cols<HD>(b, tile, kc * 16, nd * 8);
            mma_split(acc[nd], hi, lo, b);
        }
    }
}

// A fragments of a warp's 16 rows straight from global memory (row pointers, null past the end).
template <typename T, int HD>
__device__ __forceinline__ void a_rows(unsigned a[HD / 16][4], const T* ra, const T* rb) {
    const int tig = (threadIdx.x % WARP) & 3;
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) {
        const int d = kk * 16 + 2 * tig;
        a[kk][0] = ra ? pair(ra + d) : 0u;
        a[kk][1] = rb ? pair(rb + d) : 0u;
        a[kk][2] = ra ? pair(ra + d + 8) : 0u;
        a[kk][3] = rb ? pair(rb + d + 8) : 0u;
    }
}

// Sum or max over the four lanes of a quad (the lanes holding one C row).
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(FULL_MASK, v, 1);
    return v + __shfl_xor_sync(FULL_MASK, v, 2);
}
__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, 1));
    return fmaxf(v, __shfl_xor_sync(FULL_MASK, v, 2));
}

// The first key query i of sequence b attends to.
__device__ __forceinline__ int first_key(const unsigned* __restrict__ pos, long long b, int t,
                                         int window, int i) {
    const int doc = i - (int)pos[b * t + i];
    return window > 0 ? max(doc, i + 1 - window) : doc;
}

// One query row of a lane: its index, whether it exists, its first key.
struct QueryRow {
    int i, lo;
    bool live;
    __device__ bool sees(int j) const { return live && j >= lo && j <= i; }
};

__device__ __forceinline__ QueryRow query_row(const unsigned* pos, long long b, int t, int window, int q1,
                                              int i) {
    const bool live = i < q1;
    return QueryRow{i, live ? first_key(pos, b, t, window, i) : t, live};
}

// Rows of one head and sequence in a [B, nq, NH, HD] tensor holding queries q0 … q0+nq−1.
template <int HD>
struct HeadRows {
    long long b;
    int nq, q0, nh, h;
    // Query r's row, or null when it does not exist.
    template <typename P>
    __device__ P* row(P* base, const QueryRow& r) const {
        return r.live ? base + ((b * nq + r.i - q0) * nh + h) * (long long)HD : nullptr;
    }
};

// The queries of a forward or dq block (FLASH_ROWS of one head and sequence), of this thread's
// warp (16) and of this lane (two: C-fragment rows grp and grp + 8).
template <int HD>
struct QueryBlock {
    long long b;
    int h, g;
    int first, last;    // the block's first and last query
    int w0, w_last;     // the warp's first and last query
    int w_lo;           // the warp's lowest first key
    bool warp_live;     // whether the warp has a query
    QueryRow rows[2];   // the lane's two queries
    HeadRows<HD> at;    // their rows in [B, nq, NH, HD] tensors
    // Whether any of the warp's queries sees a key of the tile j0 … j0+len−1 (warp-uniform).
    __device__ bool sees_tile(int j0, int len) const {
        return warp_live && j0 <= w_last && j0 + len > w_lo;
    }
};

template <int HD>
__device__ __forceinline__ QueryBlock<HD> query_block(const unsigned* __restrict__ pos, int t, int window,
                                                      int q0, int q1, int nh, int nkv) {
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    QueryBlock<HD> qb;
    qb.b = blockIdx.z;
    qb.h = blockIdx.y;
    qb.g = qb.h / (nh / nkv);
    qb.first = q0 + blockIdx.x * FLASH_ROWS;
    qb.last = min(qb.first + FLASH_ROWS, q1) - 1;
    qb.w0 = qb.first + warp * 16;
    qb.warp_live = qb.w0 < q1;
    qb.w_last = min(qb.w0 + 15, q1 - 1);
    qb.w_lo = qb.warp_live ? first_key(pos, qb.b, t, window, qb.w0) : t;
    qb.rows[0] = query_row(pos, qb.b, t, window, q1, qb.w0 + (lane >> 2));
    qb.rows[1] = query_row(pos, qb.b, t, window, q1, qb.w0 + (lane >> 2) + 8);
    qb.at = HeadRows<HD>{qb.b, q1 - q0, q0, nh, qb.h};
    return qb;
}

// Write a warp's two rows of a [16, HD] C-fragment result (times `mul`) into row pointers; with
// `add` onto what is there.
template <typename T, int HD>
__device__ __forceinline__ void store_rows(T* ra, T* rb, const float c[HD / 8][4], float mul_a,
                                           float mul_b, bool add) {
    const int tig = (threadIdx.x % WARP) & 3;
#pragma unroll
    for (int nd = 0; nd < HD / 8; nd++) {
        const int d = nd * 8 + 2 * tig;
#pragma unroll
        for (int e = 0; e < 2; e++) {
            if (ra) st(&ra[d + e], (add ? ld(ra[d + e]) : 0.0f) + c[nd][e] * mul_a);
            if (rb) st(&rb[d + e], (add ? ld(rb[d + e]) : 0.0f) + c[nd][2 + e] * mul_b);
        }
    }
}

template <typename I, typename O, int HD>
__device__ void flash_fwd(O* __restrict__ out, float* __restrict__ lse, const I* __restrict__ q,
                          const I* __restrict__ k, const I* __restrict__ v,
                          const unsigned* __restrict__ pos, int t, int window, int q0, int q1, int nh, int nkv,
                          float scale) {
    extern __shared__ float smem[];
    constexpr int W = (HD + PAD) / 2;
    unsigned* ks = reinterpret_cast<unsigned*>(smem);  // [FWD_KEYS, HD] bf16
    unsigned* vs = ks + FWD_KEYS * W;                    // [FWD_KEYS, HD] bf16
    const int tig = (threadIdx.x % WARP) & 3;
    const QueryBlock<HD> qb = query_block<HD>(pos, t, window, q0, q1, nh, nkv);
    const long long b = qb.b;
    const int h = qb.h, g = qb.g, nq = q1 - q0, first = qb.first, last = qb.last;
    const bool warp_live = qb.warp_live;
    const QueryRow ra = qb.rows[0], rb = qb.rows[1];
    const QueryRow* rows = qb.rows;
    const HeadRows<HD>& at = qb.at;
    unsigned qa[HD / 16][4];
    a_rows<I, HD>(qa, at.row(q, ra), at.row(q, rb));
    float o[HD / 8][4];
#pragma unroll
    for (int nd = 0; nd < HD / 8; nd++) o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.0f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
    const int j_begin = first_key(pos, b, t, window, first) / FWD_KEYS * FWD_KEYS;
    for (int j0 = j_begin; j0 <= last; j0 += FWD_KEYS) {
        __syncthreads();
        // Keys past q1 are seen by no query of the range: zeros, never read.
        load_tile<I, HD>(ks, k, b, 0, t, nkv, g, j0, FWD_KEYS, q1);
        load_tile<I, HD>(vs, v, b, 0, t, nkv, g, j0, FWD_KEYS, q1);
        __syncthreads();
        if (!qb.sees_tile(j0, FWD_KEYS)) continue;  // warp-uniform
        // S = Q·Kᵀ for the warp's 16 queries × the tile's keys.
        float s[FWD_KEYS / 8][4];
#pragma unroll
        for (int nt = 0; nt < FWD_KEYS / 8; nt++) {
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < HD / 16; kk++) {
                unsigned bk[2];
                b_rows<HD>(bk, ks, nt * 8, kk * 16);
                mma_m16n8k16_bf16(s[nt], qa[kk], bk, s[nt]);
            }
        }
        // Scale and mask; the online softmax over the tile.
        float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int nt = 0; nt < FWD_KEYS / 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int j = j0 + nt * 8 + 2 * tig + (e & 1);
                s[nt][e] = rows[e >> 1].sees(j) ? s[nt][e] * scale : NEG_INF;
                mx[e >> 1] = fmaxf(mx[e >> 1], s[nt][e]);
            }
        float base[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const float mn = fmaxf(m[r], quad_max(mx[r]));
            base[r] = mn == NEG_INF ? 0.0f : mn;  // a row with no key yet: P = 0, not NaN
            const float corr = __expf(m[r] - base[r]);
            m[r] = mn;
            l[r] *= corr;
#pragma unroll
            for (int nd = 0; nd < HD / 8; nd++) {
                o[nd][2 * r] *= corr;
                o[nd][2 * r + 1] *= corr;
            }
        }
#pragma unroll
        for (int nt = 0; nt < FWD_KEYS / 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                s[nt][e] = __expf(s[nt][e] - base[e >> 1]);
                l[e >> 1] += s[nt][e];
            }
        // O += P·V.
        add_split_times_tile<HD, FWD_KEYS>(o, s, vs);
    }
    if (!warp_live) return;
    const float la = quad_sum(l[0]), lb = quad_sum(l[1]);
    store_rows<O, HD>(at.row(out, ra), at.row(out, rb), o, 1.0f / la, 1.0f / lb, false);
    if (tig == 0) {
        if (ra.live) lse[(b * nh + h) * nq + ra.i - q0] = m[0] + __logf(la);
        if (rb.live) lse[(b * nh + h) * nq + rb.i - q0] = m[1] + __logf(lb);
    }
}

// dq_i = scale · Σ_j p_ij (dO_i·v_j − D_i) k_j with D_i = dO_i·O_i (fp32, written to `delta` for
// the dk/dv kernel) and p_ij = exp(scale q_i·k_j − lse_i).
template <typename I, typename O, int HD>
__device__ void flash_bwd_dq(O* __restrict__ dq, float* __restrict__ delta,
                             const I* __restrict__ dout, const O* __restrict__ out,
                             const I* __restrict__ q, const I* __restrict__ k,
                             const I* __restrict__ v, const float* __restrict__ lse,
                             const unsigned* __restrict__ pos, int t, int window, int q0, int q1, int nh,
                             int nkv, float scale) {
    extern __shared__ float smem[];
    constexpr int W = (HD + PAD) / 2;
    unsigned* ks = reinterpret_cast<unsigned*>(smem);  // [DQ_KEYS, HD] bf16
    unsigned* vs = ks + DQ_KEYS * W;                     // [DQ_KEYS, HD] bf16
    const int tig = (threadIdx.x % WARP) & 3;
    const QueryBlock<HD> qb = query_block<HD>(pos, t, window, q0, q1, nh, nkv);
    const long long b = qb.b;
    const int h = qb.h, g = qb.g, nq = q1 - q0, first = qb.first, last = qb.last;
    const bool warp_live = qb.warp_live;
    const QueryRow ra = qb.rows[0], rb = qb.rows[1];
    const QueryRow* rows = qb.rows;
    const HeadRows<HD>& at = qb.at;
    unsigned qa[HD / 16][4], da[HD / 16][4];
    a_rows<I, HD>(qa, at.row(q, ra), at.row(q, rb));
    a_rows<I, HD>(da, at.row(dout, ra), at.row(dout, rb));
    // D and lse of the lane's two rows (the quad splits each row's dims).
    float di[2], li[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const I* dor = at.row(dout, rows[r]);
        const O* orow = at.row(out, rows[r]);
        float part = 0.0f;
        if (dor)
            for (int d = tig; d < HD; d += 4) part += ld(dor[d]) * ld(orow[d]);
        di[r] = quad_sum(part);
        const long long at = (b * nh + h) * nq + rows[r].i - q0;
        li[r] = rows[r].live ? lse[at] : 0.0f;
        if (rows[r].live && tig == 0) delta[at] = di[r];
    }
    float acc[HD / 8][4];
#pragma unroll
    for (int nd = 0; nd < HD / 8; nd++) acc[nd][0] = acc[nd][1] = acc[nd][2] = acc[nd][3] = 0.0f;
    const int j_begin = first_key(pos, b, t, window, first) / DQ_KEYS * DQ_KEYS;
    for (int j0 = j_begin; j0 <= last; j0 += DQ_KEYS) {
        __syncthreads();
        load_tile<I, HD>(ks, k, b, 0, t, nkv, g, j0, DQ_KEYS, q1);
        load_tile<I, HD>(vs, v, b, 0, t, nkv, g, j0, DQ_KEYS, q1);
        __syncthreads();
        if (!qb.sees_tile(j0, DQ_KEYS)) continue;  // warp-uniform
        float s[DQ_KEYS / 8][4], dp[DQ_KEYS / 8][4];
#pragma unroll
        for (int nt = 0; nt < DQ_KEYS / 8; nt++) {
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
            dp[nt][0] = dp[nt][1] = dp[nt][2] = dp[nt][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < HD / 16; kk++) {
                unsigned bk[2], bv[2];
                b_rows<HD>(bk, ks, nt * 8, kk * 16);
                mma_m16n8k16_bf16(s[nt], qa[kk], bk, s[nt]);
                b_rows<HD>(bv, vs, nt * 8, kk * 16);
                mma_m16n8k16_bf16(dp[nt], da[kk], bv, dp[nt]);
            }
        }
        // dS = P ∘ (dP − D), into s.
#pragma unroll
        for (int nt = 0; nt < DQ_KEYS / 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int r = e >> 1, j = j0 + nt * 8 + 2 * tig + (e & 1);
                const float p = rows[r].sees(j) ? __expf(s[nt][e] * scale - li[r]) : 0.0f;
                s[nt][e] = p * (dp[nt][e] - di[r]);
            }
        // dQ += dS·K.
        add_split_times_tile<HD, DQ_KEYS>(acc, s, ks);
    }
    if (!warp_live) return;
    store_rows<O, HD>(at.row(dq, ra), at.row(dq, rb), acc, scale, scale, false);
}

// For kv head g's key rows j < q1: dv_j += Σ_{h in g} Σ_i p_ij dO_i and
// dk_j += scale · Σ_{h in g} Σ_i p_ij (dO_i·v_j − D_i) q_i over the chunk's queries i that see j.
// A warp owns 16 key rows: no atomics.
template <typename I, typename O, int HD>
__device__ void flash_bwd_kv(O* __restrict__ dk, O* __restrict__ dv, const I* __restrict__ dout,
                             const I* __restrict__ q, const I* __restrict__ k,
                             const I* __restrict__ v, const float* __restrict__ lse,
                             const float* __restrict__ delta, const unsigned* __restrict__ pos,
                             int t, int window, int q0, int q1, int nh, int nkv, float scale) {
    extern __shared__ float smem[];
    constexpr int W = (HD + PAD) / 2;
    unsigned* kb = reinterpret_cast<unsigned*>(smem);  // [FLASH_ROWS, HD] the block's keys
    unsigned* vb = kb + FLASH_ROWS * W;                  // [FLASH_ROWS, HD] their values
    unsigned* qs = vb + FLASH_ROWS * W;                  // [KV_QUERIES, HD] a query tile
    unsigned* ds_ = qs + KV_QUERIES * W;                 // [KV_QUERIES, HD] its dO
    float* ls = reinterpret_cast<float*>(ds_ + KV_QUERIES * W);  // [KV_QUERIES] lse
    float* dls = ls + KV_QUERIES;                                // [KV_QUERIES] delta
    int* los = reinterpret_cast<int*>(dls + KV_QUERIES);         // [KV_QUERIES] first keys
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP, grp = lane >> 2;
    const int tig = lane & 3;
    const long long b = blockIdx.z;
    const int g = blockIdx.y, group = nh / nkv, nq = q1 - q0;
    const int first = blockIdx.x * FLASH_ROWS;  // the block's first key
    const int last = min(first + FLASH_ROWS, q1) - 1;
    const int w0 = first + warp * 16;  // the warp's first key
    const bool warp_live = w0 < q1;
    const int w_last = min(w0 + 15, q1 - 1);
    const int keys[2] = {w0 + grp, w0 + grp + 8};
    load_tile<I, HD>(kb, k, b, 0, t, nkv, g, first, FLASH_ROWS, q1);
    load_tile<I, HD>(vb, v, b, 0, t, nkv, g, first, FLASH_ROWS, q1);
    float dka[HD / 8][4], dva[HD / 8][4];
#pragma unroll
    for (int nd = 0; nd < HD / 8; nd++)
#pragma unroll
        for (int e = 0; e < 4; e++) dka[nd][e] = dva[nd][e] = 0.0f;
    for (int h = g * group; h < (g + 1) * group; h++) {
        // Queries before the block's first key see none of it, nor do those past its last key's
        // document.
        for (int i0 = max(first, q0); i0 < q1 && first_key(pos, b, t, window, i0) <= last;
             i0 += KV_QUERIES) {
            __syncthreads();
            load_tile<I, HD>(qs, q, b, q0, nq, nh, h, i0, KV_QUERIES, q1);
            load_tile<I, HD>(ds_, dout, b, q0, nq, nh, h, i0, KV_QUERIES, q1);
            for (int r = threadIdx.x; r < KV_QUERIES; r += blockDim.x) {
                const int row = i0 + r;
                const bool live = row < q1;
                ls[r] = live ? lse[(b * nh + h) * nq + row - q0] : 0.0f;
                dls[r] = live ? delta[(b * nh + h) * nq + row - q0] : 0.0f;
                los[r] = live ? first_key(pos, b, t, window, row) : t;
            }
            __syncthreads();
            // Warp-uniform: every query of the tile is before the warp's keys, or starts its
            // document after them.
            if (!warp_live || i0 + KV_QUERIES <= w0 || los[0] > w_last) continue;
            // Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ: the warp's 16 keys × the tile's queries.
            float s[KV_QUERIES / 8][4], dp[KV_QUERIES / 8][4];
#pragma unroll
            for (int nt = 0; nt < KV_QUERIES / 8; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) s[nt][e] = dp[nt][e] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < HD / 16; kk++) {
                unsigned ka[4], va[4];
                a_frag<HD>(ka, kb, warp * 16, kk * 16);
                a_frag<HD>(va, vb, warp * 16, kk * 16);
#pragma unroll
                for (int nt = 0; nt < KV_QUERIES / 8; nt++) {
                    unsigned bq[2], bd[2];
                    b_rows<HD>(bq, qs, nt * 8, kk * 16);
                    mma_m16n8k16_bf16(s[nt], ka, bq, s[nt]);
                    b_rows<HD>(bd, ds_, nt * 8, kk * 16);
                    mma_m16n8k16_bf16(dp[nt], va, bd, dp[nt]);
                }
            }
            // Pᵀ into s, dSᵀ into dp.
#pragma unroll
            for (int nt = 0; nt < KV_QUERIES / 8; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int j = keys[e >> 1], ii = nt * 8 + 2 * tig + (e & 1), i = i0 + ii;
                    const bool sees = j < q1 && i < q1 && los[ii] <= j && j <= i;
                    const float p = sees ? __expf(s[nt][e] * scale - ls[ii]) : 0.0f;
                    s[nt][e] = p;
                    dp[nt][e] = p * (dp[nt][e] - dls[ii]);
                }
            // dV += Pᵀ·dO and dK += dSᵀ·Q.
            add_split_times_tile<HD, KV_QUERIES>(dva, s, ds_);
            add_split_times_tile<HD, KV_QUERIES>(dka, dp, qs);
        }
    }
    if (!warp_live) return;
    // The lane's two key rows in [B, T, NKV, HD] (null past q1).
    long long kr[2];
#pragma unroll
    for (int r = 0; r < 2; r++) kr[r] = keys[r] < q1 ? ((b * t + keys[r]) * nkv + g) * HD : -1;
    store_rows<O, HD>(kr[0] < 0 ? nullptr : dk + kr[0], kr[1] < 0 ? nullptr : dk + kr[1], dka,
                      scale, scale, true);
    store_rows<O, HD>(kr[0] < 0 ? nullptr : dv + kr[0], kr[1] < 0 ? nullptr : dv + kr[1], dva,
                      1.0f, 1.0f, true);
}

static_assert(FWD_KEYS % 16 == 0 && DQ_KEYS % 16 == 0 && KV_QUERIES % 16 == 0,
              "tiles are whole 16-row MMA steps");

#define FLASH(HD, name, I, O)                                                                    \
    extern "C" __global__ void flash##HD##_fwd_##name(O* out, float* lse, const I* q,            \
                                                      const I* k, const I* v,                   \
                                                      const unsigned* pos, int t, int window, int q0,       \
                                                      int q1, int nh, int nkv, float scale) {   \
        flash_fwd<I, O, HD>(out, lse, q, k, v, pos, t, window, q0, q1, nh, nkv, scale);                  \
    }                                                                                            \
    extern "C" __global__ void flash##HD##_bwd_##name(                                           \
        O* dq, float* delta, const I* dout, const O* out, const I* q, const I* k, const I* v,   \
        const float* lse, const unsigned* pos, int t, int window, int q0, int q1, int nh, int nkv,          \
        float scale) {                                                                           \
        flash_bwd_dq<I, O, HD>(dq, delta, dout, out, q, k, v, lse, pos, t, window, q0, q1, nh, nkv,      \
                               scale);                                                           \
    }                                                                                            \
    extern "C" __global__ void flash##HD##_bwd_kv_##name(                                        \
        O* dk, O* dv, const I* dout, const I* q, const I* k, const I* v, const float* lse,      \
        const float* delta, const unsigned* pos, int t, int window, int q0, int q1, int nh, int nkv,        \
        float scale) {                                                                           \
        flash_bwd_kv<I, O, HD>(dk, dv, dout, q, k, v, lse, delta, pos, t, window, q0, q1, nh, nkv,       \
                               scale);                                                           \
    }

FLASH(32, f32i16, bf16, float)
FLASH(64, f32i16, bf16, float)
FLASH(128, f32i16, bf16, float)
