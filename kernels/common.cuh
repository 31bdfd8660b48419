// megatrain CUDA kernels: shared definitions.
//
// Every kernel file includes this header and instantiates its kernels for each storage dtype with
// a macro, so the exported symbols are `{op}_{fwd|bwd}_{dtype}` (`f32`, `bf16`), `extern "C"` so
// the host looks them up by name. Arithmetic is fp32 whatever the storage dtype; weight gradients
// are always fp32. Shapes are written beside pointers: `// [N, C]`.
//
// Compiled at start-up by NVRTC (`--std=c++17`, `-arch=sm_80|sm_90`), with the CUDA headers of
// the toolkit or of the `nvidia-cuda-runtime-cu12` wheel on the include path.
#pragma once

#include <cuda_bf16.h>

typedef __nv_bfloat16 bf16;

// Load any storage dtype as fp32; store fp32 into any storage dtype (round to nearest even).
__device__ __forceinline__ float ld(float x) { return x; }
__device__ __forceinline__ float ld(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void st(float* p, float v) { *p = v; }
__device__ __forceinline__ void st(bf16* p, float v) { *p = __float2bfloat16_rn(v); }

#define NEG_INF (__int_as_float(0xff800000))

#define WARP 32
#define FULL_MASK 0xffffffffu

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = WARP / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, ≤ 1024); every thread gets the result.
// `scratch` holds ≥ 32 floats of shared memory.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int warps = blockDim.x / WARP;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < warps ? scratch[lane] : 0.0f;
    return warp_sum(t);
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int warps = blockDim.x / WARP;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < warps ? scratch[lane] : NEG_INF;
    return warp_max(t);
}

// D = A·B + C on the tensor cores for one warp (all 32 lanes), shape m16n8k16: A 16×16 bf16
// (row-major, four 32-bit registers per lane), B 16×8 bf16 (column-major, two), C and D 16×8
// fp32 (four floats), in the PTX ISA's fragment layouts for mma.m16n8k16. The CUDA emulator
// (tools/cuemu) substitutes its own implementation of the same layouts (__CUEMU__), so kernels
// reach the tensor cores only through wrappers like this one.
__device__ __forceinline__ void mma_m16n8k16_bf16(float d[4], const unsigned a[4],
                                                  const unsigned b[2], const float c[4]) {
#ifdef __CUEMU__
    cuemu_mma_m16n8k16_bf16(d, a, b, c, __LINE__);
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]),
          "f"(c[1]), "f"(c[2]), "f"(c[3]));
#endif
}

// Grid-stride loop over n elements.
#define FOR_EACH(i, n) \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (long long)(n); \
         i += (long long)gridDim.x * blockDim.x)

// Instantiate a kernel body macro for both storage dtypes.
#define FOR_DTYPES(M) M(f32, float) M(bf16, bf16)
// A kernel that reads weights, for each (activations T, weights W): both fp32, both bf16, and
// `f32w16` (fp32 activations, the bf16 weights a bf16 device holds).
#define FOR_WEIGHT_DTYPES(M) M(f32, float, float) M(bf16, bf16, bf16) M(f32w16, float, bf16)

// Column sums in a fixed order (no atomics, the same bits on every run): a block of COL_TILE ×
// ROW_LANES threads owns COL_TILE consecutive columns (a half-warp reads them coalesced); lane
// `ty` sums rows ty, ty + ROW_LANES, …, then lane 0 adds the ROW_LANES partial sums in order.
// 16 × 64: a 2048-wide sum is 128 blocks of 1024 threads, about one per SM of an H100 (32 × 8
// left half its SMs idle and each thread a 4096-row loop at 32k rows: 6 ms where 0.2 would do).
#define COL_TILE 16
#define ROW_LANES 64
template <typename Term>
__device__ __forceinline__ void column_sum(float* __restrict__ dst, int n, int c, Term term) {
    __shared__ float part[ROW_LANES][COL_TILE];
    if (c <= 0) return;  // the same for every thread of the block
    const int tx = threadIdx.x % COL_TILE, ty = threadIdx.x / COL_TILE;
    const int col = blockIdx.x * COL_TILE + tx;
    // Columns past the end read the last one and write nothing: no branch around the barrier.
    const int read = min(col, c - 1);
    float acc = 0.0f;
    for (int r = ty; r < n; r += ROW_LANES) acc += term(r, read);
    part[ty][tx] = acc;
    __syncthreads();
    if (ty == 0 && col < c) {
        float s = 0.0f;
#pragma unroll
        for (int k = 0; k < ROW_LANES; k++) s += part[k][tx];
        dst[col] += s;
    }
}

// Attention logit soft-capping (Gemma 2's attn_logit_softcapping; softcap > 0, 0: none): a scaled
// score s becomes softcap·tanh(s / softcap) (transformers' order: divide, tanh, multiply); its
// derivative 1 − tanh² goes to *dcap (1 without a cap).
__device__ __forceinline__ float softcapped(float s, float softcap, float* dcap) {
    if (softcap > 0.0f) {
        const float th = tanhf(s / softcap);
        *dcap = 1.0f - th * th;
        return th * softcap;
    }
    *dcap = 1.0f;
    return s;
}
