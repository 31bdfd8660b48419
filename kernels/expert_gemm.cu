// The experts' GEMMs of a mixture-of-experts layer, every expert in one launch (bf16 operands,
// fp32 sums and results: the bf16 recipe's GEMMs). The grouped rows of a layer are partitioned
// by expert: expert g owns rows offsets[g] .. offsets[g+1] (offsets [G + 1], on the device).
//
// - `expert_gemm_fwd_f32i16`: for each expert g, C[rows of g] (+)= A[rows of g] · B_gᵀ, with
//   A [R, K] and C [R, N] row-major and B_g = b + g·b_stride either [N, K] (`b_kmajor`: a
//   weight as nn.Linear holds it) or [K, N]. The forward's projections and the backward's
//   d inputs. A block owns a 128 × 128 tile of one expert's rows × N; blockIdx.x counts
//   (row tile, column tile) pairs, column tiles fastest, the experts' row tiles in order (a
//   bound the host computes without the counts: ⌈R/128⌉ + G; blocks past the last tile return
//   at once).
// - `expert_gemm_bwd_f32i16`: for each expert g, C_g (+)= A[rows of g]ᵀ · B[rows of g], with
//   A [R, M] and B [R, N] row-major and C_g = c + g·c_stride [M, N]: the weight gradients (the
//   sum over the expert's rows, in row order). An expert without rows adds nothing (writes
//   zeros without `accumulate`). blockIdx.x: M × N tiles, blockIdx.z: the expert.
//
// Shared tiles follow the operand's layout in memory (16-byte loads and stores, coalesced): a
// k-contiguous operand as [128][32 + 8] (rows, k), one contiguous along its rows as
// [32][128 + 8] (k, rows); fragments come by ldmatrix.x4 from the first and ldmatrix.x4.trans
// from the second (four 8 × 8 matrices an instruction). Both pitches put a matrix's eight
// 16-byte rows in distinct banks. Every product runs
// on mma.sync.m16n8k16 (bf16 × bf16, fp32 sums); the k loop is in order, so every run gives the
// same bits. 8 warps as 2 × 4, each 64 × 32 of the tile; k tiles arrive by cp.async through
// EG_STAGES shared stages (dynamic shared memory: 60 KiB), two k tiles ahead of the one being
// multiplied; two blocks fit an SM (≤ 128 registers a thread), so one block's waits are the
// other's issue slots (one block per SM, 163 registers, ran at ~105 TFLOP/s on an H100).
//
// `vec`: every row start of every operand is 16-byte aligned (the host checks the pointers and
// widths), so eight elements go as one 16-byte copy; else element by element.
#include "common.cuh"

#define EG_BM 128
#define EG_BN 128
#define EG_BK 32
#define EG_THREADS 256
#define EG_STAGES 3             // shared stages: EG_STAGES × 20 KiB of dynamic shared memory
#define EG_KPITCH (EG_BK + 8)   // halfwords per row of a k-contiguous tile
#define EG_RPITCH (EG_BM + 8)   // halfwords per k of a row-contiguous tile
#define EG_TILE (EG_BM * EG_KPITCH > EG_BK * EG_RPITCH ? EG_BM * EG_KPITCH : EG_BK * EG_RPITCH)

typedef unsigned short u16;

__device__ __forceinline__ u16 bits_of(bf16 x) { return static_cast<__nv_bfloat16_raw>(x).x; }

// 16 bytes from global to shared memory without passing through registers (cp.async: the copy
// lands by the next cp_async_wait that covers its group). The emulator copies at once.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
#ifdef __CUEMU__
    *reinterpret_cast<uint4*>(smem) = *reinterpret_cast<const uint4*>(gmem);
#else
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
#endif
}

// Close this thread's group of cp.async copies (one per k tile, even when empty).
__device__ __forceinline__ void cp_async_commit() {
#ifndef __CUEMU__
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// Wait until at most N of this thread's groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#ifndef __CUEMU__
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// One 128 × 32 tile of an operand into a shared tile of the same layout (two chunks of eight
// elements per thread). The operand's element (row r, k) is at src[r·ld + k] when `KC`
// (k-contiguous), else at src[k·ld + r]; rows r ≥ rows and k ≥ ks are zero (both relative to the
// tile's first row and k, whose element `src` addresses). Whole aligned chunks go by cp.async,
// the rest element by element.
template <bool KC>
__device__ __forceinline__ void load_tile(u16* s, const bf16* __restrict__ src, long long ld,
                                          int rows, int ks, bool vec) {
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int c = threadIdx.x + h * EG_THREADS;
        // KC: row c / 4, k (c % 4)·8 .. +8; else k c / 16, rows (c % 16)·8 .. +8.
        const int a = KC ? c / 4 : c / 16;               // the row (KC) or the k
        const int b = KC ? (c % 4) * 8 : (c % 16) * 8;   // the first k (KC) or row of the eight
        const int a_lim = KC ? rows : ks, b_lim = KC ? ks : rows;
        const bf16* p = src + (long long)a * ld + b;
        u16* d = s + (KC ? a * EG_KPITCH + b : a * EG_RPITCH + b);
        if (vec && a < a_lim && b + 8 <= b_lim) {
            cp_async16(d, p);
        } else {
#pragma unroll
            for (int j = 0; j < 8; j++) d[j] = (a < a_lim && b + j < b_lim) ? bits_of(p[j]) : 0;
        }
    }
}

// Four 8 × 8 bf16 matrices of a shared tile into one register each (ldmatrix.x4): lane l gives
// the address `base + off` of row l % 8 of matrix l / 8 (16-byte aligned); lane t gets, of matrix
// j, row t / 4, elements 2·(t % 4) and +1 — an mma.sync fragment's word. The emulator, which
// models mma.sync but not ldmatrix, gathers the same words through warp shuffles.
__device__ __forceinline__ void ldsm_x4(unsigned r[4], const u16* base, int off) {
#ifdef __CUEMU__
    const int lane = threadIdx.x % WARP;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int o = __shfl_sync(FULL_MASK, off, 8 * j + lane / 4);
        r[j] = (unsigned)base[o + 2 * (lane % 4)] | ((unsigned)base[o + 2 * (lane % 4) + 1] << 16);
    }
#else
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(base + off));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s)
                 : "memory");
#endif
}

// The same, transposed (ldmatrix.x4.trans): lane t gets, of matrix j, column t / 4 of rows
// 2·(t % 4) and +1 (the lower row in the low half).
__device__ __forceinline__ void ldsm_x4_trans(unsigned r[4], const u16* base, int off) {
#ifdef __CUEMU__
    const int lane = threadIdx.x % WARP;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int o0 = __shfl_sync(FULL_MASK, off, 8 * j + 2 * (lane % 4));
        const int o1 = __shfl_sync(FULL_MASK, off, 8 * j + 2 * (lane % 4) + 1);
        r[j] = (unsigned)base[o0 + lane / 4] | ((unsigned)base[o1 + lane / 4] << 16);
    }
#else
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(base + off));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s)
                 : "memory");
#endif
}

// The A fragment of rows m0 .. m0 + 15, k k0 .. k0 + 15 (matrix q: rows + 8·(q % 2), k + 8·(q / 2)).
template <bool KC>
__device__ __forceinline__ void frag_a(unsigned a[4], const u16* s, int m0, int k0) {
    const int lane = threadIdx.x % WARP, q = lane / 8, r = lane % 8;
    const int m = m0 + 8 * (q & 1), k = k0 + 8 * (q >> 1);
    if (KC)
        ldsm_x4(a, s, (m + r) * EG_KPITCH + k);
    else
        ldsm_x4_trans(a, s, (k + r) * EG_RPITCH + m);
}

// The B fragments of columns n0 .. n0 + 15 (two n8 tiles), k k0 .. k0 + 15: b0 = {tile 0 k 0–7,
// k 8–15}, b1 = the same of tile 1 (matrix q: columns + 8·(q / 2), k + 8·(q % 2)).
template <bool KC>
__device__ __forceinline__ void frag_b(unsigned b0[2], unsigned b1[2], const u16* s, int n0, int k0) {
    const int lane = threadIdx.x % WARP, q = lane / 8, r = lane % 8;
    const int n = n0 + 8 * (q >> 1), k = k0 + 8 * (q & 1);
    unsigned w[4];
    if (KC)
        ldsm_x4(w, s, (n + r) * EG_KPITCH + k);
    else
        ldsm_x4_trans(w, s, (k + r) * EG_RPITCH + n);
    b0[0] = w[0], b0[1] = w[1], b1[0] = w[2], b1[1] = w[3];
}

// acc += the block's A tile · B tile over one k tile: A rows × k from `sa`, B columns × k from
// `sb` (a B column is an output column), each in its layout.
template <bool AKC, bool BKC>
__device__ __forceinline__ void mma_tile(float acc[4][4][4], const u16* sa, const u16* sb) {
    const int warp = threadIdx.x / WARP;
    const int wm = (warp / 4) * 64, wn = (warp % 4) * 32;
#pragma unroll
    for (int kk = 0; kk < EG_BK; kk += 16) {
        unsigned a[4][4];
#pragma unroll
        for (int i = 0; i < 4; i++) frag_a<AKC>(a[i], sa, wm + i * 16, kk);
        // B two n8 tiles at a time: fewer live registers (no spill under 128).
#pragma unroll
        for (int j = 0; j < 4; j += 2) {
            unsigned b0[2], b1[2];
            frag_b<BKC>(b0, b1, sb, wn + j * 8, kk);
#pragma unroll
            for (int i = 0; i < 4; i++) {
                mma_m16n8k16_bf16(acc[i][j], a[i], b0, acc[i][j]);
                mma_m16n8k16_bf16(acc[i][j + 1], a[i], b1, acc[i][j + 1]);
            }
        }
    }
}

// The block's 128 × 128 product over `ks` k (A's tile at `a`, B's at `b`, their element (0, 0);
// `lda`/`ldb` their row pitches; `m_rows`/`n_rows` the valid rows of A and of B's columns),
// into acc, through EG_STAGES shared stages (`smem`: the kernel's dynamic shared memory, each
// stage an A and a B tile): k tile t + 2 is on its way while t is multiplied.
template <bool AKC, bool BKC>
__device__ __forceinline__ void block_product(float acc[4][4][4], u16* smem,
                                              const bf16* __restrict__ a, long long lda,
                                              int m_rows, const bf16* __restrict__ b,
                                              long long ldb, int n_rows, int ks, bool vec) {
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int q = 0; q < 4; q++) acc[i][j][q] = 0.0f;
    // The step from one k tile to the next in each operand.
    const long long a_step = AKC ? EG_BK : EG_BK * lda, b_step = BKC ? EG_BK : EG_BK * ldb;
    const int tiles = (ks + EG_BK - 1) / EG_BK;
    auto load = [&](int t) {
        u16* st = smem + (t % EG_STAGES) * 2 * EG_TILE;
        const int left = ks - t * EG_BK;
        load_tile<AKC>(st, a + t * a_step, lda, m_rows, left, vec);
        load_tile<BKC>(st + EG_TILE, b + t * b_step, ldb, n_rows, left, vec);
    };
#pragma unroll
    for (int t = 0; t < EG_STAGES - 1; t++) {
        if (t < tiles) load(t);
        cp_async_commit();
    }
    for (int t = 0; t < tiles; t++) {
        cp_async_wait<EG_STAGES - 2>();  // this thread's copies of tile t have landed
        // Everyone's have, and everyone is done with tile t − 1, whose stage is refilled now.
        __syncthreads();
        if (t + EG_STAGES - 1 < tiles) load(t + EG_STAGES - 1);
        cp_async_commit();
        const u16* st = smem + (t % EG_STAGES) * 2 * EG_TILE;
        mma_tile<AKC, BKC>(acc, st, st + EG_TILE);
    }
    cp_async_wait<0>();
}

// acc into C (row pitch ldc; `rows`/`cols` valid from the tile's element (0, 0) at `c`), added to
// what is there when `accumulate`.
__device__ __forceinline__ void store_acc(float* __restrict__ c, long long ldc, int rows, int cols,
                                          const float acc[4][4][4], int accumulate) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int grp = lane / 4, tig = lane % 4;
    const int wm = (warp / 4) * 64, wn = (warp % 4) * 32;
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int r = wm + i * 16 + grp + 8 * h;
                if (r >= rows) continue;
#pragma unroll
                for (int q = 0; q < 2; q++) {
                    const int col = wn + j * 8 + 2 * tig + q;
                    if (col >= cols) continue;
                    float* p = c + (long long)r * ldc + col;
                    const float v = acc[i][j][2 * h + q];
                    *p = accumulate ? *p + v : v;
                }
            }
}

extern "C" __global__ void __launch_bounds__(EG_THREADS, 2)
    expert_gemm_fwd_f32i16(float* __restrict__ c,              /* [R, N] */
                           const bf16* __restrict__ a,         /* [R, K] */
                           const bf16* __restrict__ b,         /* G × ([N, K] or [K, N]) */
                           const unsigned* __restrict__ offsets, /* [G + 1] */
                           int groups, int n, int k, long long b_stride, int b_kmajor,
                           int accumulate, int vec) {
    // This block's expert and row tile: the experts' tiles counted in order.
    int grp = -1;
    // Column tiles vary fastest: a row tile's blocks run together, its rows read from DRAM once
    // and from L2 by the rest (the expert's weight stays in L2 across its row tiles). Row tiles
    // fastest read every row from DRAM once per column tile: ~2 of the 4.6 ms a 128-expert
    // projection of 262,144 rows took on an H100.
    const unsigned col_tiles = (n + EG_BN - 1) / EG_BN;
    unsigned tile = blockIdx.x / col_tiles, lo = 0, rows = 0;
    for (int g = 0; g < groups; g++) {
        const unsigned first = offsets[g], count = offsets[g + 1] - first;
        const unsigned tiles = (count + EG_BM - 1) / EG_BM;
        if (tile < tiles) {
            grp = g;
            lo = first + tile * EG_BM;
            rows = min(count - tile * EG_BM, (unsigned)EG_BM);
            break;
        }
        tile -= tiles;
    }
    if (grp < 0) return;  // past the last tile: the same for the whole block
    const int n0 = (blockIdx.x % col_tiles) * EG_BN;
    const bf16* a0 = a + (long long)lo * k;
    const bf16* bg = b + (long long)grp * b_stride;
    extern __shared__ __align__(16) u16 smem[];
    float acc[4][4][4];
    if (b_kmajor)
        block_product<true, true>(acc, smem, a0, k, rows, bg + (long long)n0 * k, k, n - n0, k,
                                  vec != 0);
    else
        block_product<true, false>(acc, smem, a0, k, rows, bg + n0, n, n - n0, k, vec != 0);
    store_acc(c + (long long)lo * n + n0, n, rows, n - n0, acc, accumulate);
}

extern "C" __global__ void __launch_bounds__(EG_THREADS, 2)
    expert_gemm_bwd_f32i16(float* __restrict__ c,              /* G × [M, N] */
                           const bf16* __restrict__ a,         /* [R, M] */
                           const bf16* __restrict__ b,         /* [R, N] */
                           const unsigned* __restrict__ offsets, /* [G + 1] */
                           int m, int n, long long c_stride, int accumulate, int vec) {
    const int grp = blockIdx.z;
    const int m_tiles = (m + EG_BM - 1) / EG_BM;
    const int m0 = (blockIdx.x % m_tiles) * EG_BM, n0 = (blockIdx.x / m_tiles) * EG_BN;
    const unsigned lo = offsets[grp], rows = offsets[grp + 1] - lo;
    extern __shared__ __align__(16) u16 smem[];
    float acc[4][4][4];
    // k runs over the expert's rows: A and B are contiguous along m and n.
    block_product<false, false>(acc, smem, a + (long long)lo * m + m0, m, m - m0,
                                b + (long long)lo * n + n0, n, n - n0, (int)rows, vec != 0);
    store_acc(c + (long long)grp * c_stride + (long long)m0 * n + n0, n, m - m0, n - n0, acc,
              accumulate);
}
