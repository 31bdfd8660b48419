// cuemu: CUDA device code on the host. Force-included (`-include`) before a kernel program the
// emulated NVRTC compiles with the host C++ compiler. It gives device code what NVRTC gives it:
// the built-in variables (threadIdx, blockIdx, blockDim, gridDim, warpSize), barriers, warp
// shuffles and votes, atomics, the math functions, and NVIDIA's own cuda_bf16.h types (their
// host implementation). Synchronisation goes to the SIMT runtime (runtime.cpp), which runs
// every CUDA thread of a block as a cooperative fiber.
//
// `__shared__` declarations are rewritten by the emulator before compilation (a static array
// becomes a reference into the block's shared memory, `extern __shared__` the dynamic part),
// so `__shared__` itself is left undefined here: a declaration the rewrite missed is a compile
// error, not silently thread-private memory.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <type_traits>
#include <utility>

#include <cuda_bf16.h>

#include "cuemu_abi.h"

#define __CUEMU__ 1

// cuda_bf16.h defined these as attributes for a host compiler; device code needs them empty.
#undef __global__
#define __global__
#undef __device__
#define __device__
#undef __host__
#define __host__
#undef __forceinline__
#define __forceinline__ inline __attribute__((always_inline))
#undef __noinline__
#define __noinline__ __attribute__((noinline))
#undef __launch_bounds__
#define __launch_bounds__(...)
#undef __shared__
#define __shared__ __cuemu_shared_declaration_not_rewritten__
#undef __constant__
#define __constant__ __cuemu_constant_memory_not_emulated__

extern "C" {
const cuemu_thread_view* cuemu_self(void);
void cuemu_syncthreads(int line);
int cuemu_syncthreads_op(int op, int pred, int line);
uint64_t cuemu_warp_op(int op, unsigned mask, uint64_t value, int arg, int width, int line);
unsigned cuemu_activemask(void);
void* cuemu_shared_static(const void* tag, size_t bytes, size_t align, int line);
void* cuemu_shared_dynamic(void);
__attribute__((noreturn)) void cuemu_trap(const char* what, int line);
void cuemu_unsupported(const char* what, int line);
void cuemu_mma_m16n8k16_bf16(float* d, const unsigned* a, const unsigned* b, const float* c,
                             int line);
}

#define threadIdx (::cuemu_self()->thread_idx)
#define blockIdx (::cuemu_self()->block_idx)
#define blockDim (::cuemu_self()->block_dim)
#define gridDim (::cuemu_self()->grid_dim)
#define warpSize 32

// ---- barriers --------------------------------------------------------------------------------
#define __syncthreads() ::cuemu_syncthreads(__LINE__)
#define __syncthreads_count(p) ::cuemu_syncthreads_op(1, (p) != 0, __LINE__)
#define __syncthreads_and(p) ::cuemu_syncthreads_op(2, (p) != 0, __LINE__)
#define __syncthreads_or(p) ::cuemu_syncthreads_op(3, (p) != 0, __LINE__)
#define __syncwarp(...) ::cuemu_detail::syncwarp(__LINE__, ##__VA_ARGS__)
#define __trap() ::cuemu_trap("__trap()", __LINE__)
#undef assert
#define assert(e) ((e) ? (void)0 : ::cuemu_trap("device assertion failed: " #e, __LINE__))

// ---- warp operations -------------------------------------------------------------------------
namespace cuemu_detail {
enum { SHFL_IDX = 0, SHFL_UP = 1, SHFL_DOWN = 2, SHFL_XOR = 3, BALLOT = 4, ANY = 5, ALL = 6,
       SYNCWARP = 7 };

template <class T>
inline T shfl(int op, unsigned mask, T v, int arg, int width, int line) {
    static_assert(sizeof(T) <= 8, "cuemu: shuffles of types wider than 8 bytes are not emulated");
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    bits = ::cuemu_warp_op(op, mask, bits, arg, width, line);
    T out;
    std::memcpy(&out, &bits, sizeof(T));
    return out;
}

inline void syncwarp(int line, unsigned mask = 0xffffffffu) {
    ::cuemu_warp_op(SYNCWARP, mask, 0, 0, 32, line);
}
}  // namespace cuemu_detail

#define __shfl_sync(m, v, l, ...) ::cuemu_detail::shfl(0, (m), (v), (l), ::cuemu_detail_width(__VA_ARGS__), __LINE__)
#define __shfl_up_sync(m, v, d, ...) ::cuemu_detail::shfl(1, (m), (v), (d), ::cuemu_detail_width(__VA_ARGS__), __LINE__)
#define __shfl_down_sync(m, v, d, ...) ::cuemu_detail::shfl(2, (m), (v), (d), ::cuemu_detail_width(__VA_ARGS__), __LINE__)
#define __shfl_xor_sync(m, v, x, ...) ::cuemu_detail::shfl(3, (m), (v), (x), ::cuemu_detail_width(__VA_ARGS__), __LINE__)
#define __ballot_sync(m, p) ((unsigned)::cuemu_warp_op(4, (m), (p) != 0, 0, 32, __LINE__))
#define __any_sync(m, p) ((int)::cuemu_warp_op(5, (m), (p) != 0, 0, 32, __LINE__))
#define __all_sync(m, p) ((int)::cuemu_warp_op(6, (m), (p) != 0, 0, 32, __LINE__))
#define __activemask() ::cuemu_activemask()
inline int cuemu_detail_width() { return 32; }
inline int cuemu_detail_width(int w) { return w; }

// ---- math ------------------------------------------------------------------------------------
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
// The fast intrinsics as the hardware computes them: ex2.approx(x·log2 e) and lg2.approx(x)·ln 2.
// Rounding x·log2 e to fp32 gives the |x|-dependent error NVIDIA documents for __expf; the exp2
// and log2 themselves are the host's (within an ulp, where ex2/lg2.approx are within 2).
inline float __expf(float x) { return exp2f(x * 1.44269504088896341f); }
inline float __logf(float x) { return log2f(x) * 0.693147180559945309f; }
inline float __log2f(float x) { return log2f(x); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __tanf(float x) { return tanf(x); }
inline float __powf(float a, float b) { return powf(a, b); }
inline float exp10f_(float x) { return powf(10.0f, x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : x > 1.0f ? 1.0f : x; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
// CUDA never contracts __fadd_rn/__fmul_rn into a fused multiply-add; the host build contracts
// with -ffp-contract=fast (following --fmad), so the rounded value is pinned by an empty asm the
// compiler cannot see through.
inline float cuemu_pin(float r) {
#if defined(__x86_64__)
    asm("" : "+x"(r));
#elif defined(__aarch64__)
    asm("" : "+w"(r));
#else
    volatile float v = r;
    r = v;
#endif
    return r;
}
inline float __fadd_rn(float a, float b) { return cuemu_pin(a + b); }
inline float __fmul_rn(float a, float b) { return cuemu_pin(a * b); }
inline float __fsub_rn(float a, float b) { return cuemu_pin(a - b); }
inline float __fdiv_rn(float a, float b) { return cuemu_pin(a / b); }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __int_as_float(int x) { float f; std::memcpy(&f, &x, 4); return f; }
inline int __float_as_int(float f) { int x; std::memcpy(&x, &f, 4); return x; }
inline float __uint_as_float(unsigned x) { float f; std::memcpy(&f, &x, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned x; std::memcpy(&x, &f, 4); return x; }
inline double __longlong_as_double(long long x) { double d; std::memcpy(&d, &x, 8); return d; }
inline long long __double_as_longlong(double d) { long long x; std::memcpy(&x, &d, 8); return x; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
inline int __clzll(long long x) { return x ? __builtin_clzll((unsigned long long)x) : 64; }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) {
    unsigned r = 0;
    for (int i = 0; i < 32; i++) r |= ((x >> i) & 1u) << (31 - i);
    return r;
}
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }
template <class T>
inline T __ldg(const T* p) { return *p; }
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_system() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline long long clock64() { return (long long)__builtin_ia32_rdtsc(); }

// ---- atomics (device memory is shared by the blocks the emulator runs on several threads) ----
namespace cuemu_detail {
template <class T, class F>
inline T atomic_update(T* p, F f) {
    T old;
    __atomic_load(p, &old, __ATOMIC_RELAXED);
    T next;
    do {
        next = f(old);
    } while (!__atomic_compare_exchange(p, &old, &next, false, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED));
    return old;
}
}  // namespace cuemu_detail

template <class T>
inline typename std::enable_if<std::is_integral<T>::value, T>::type atomicAdd(T* p, T v) {
    return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
inline float atomicAdd(float* p, float v) {
    return cuemu_detail::atomic_update(p, [v](float o) { return o + v; });
}
inline double atomicAdd(double* p, double v) {
    return cuemu_detail::atomic_update(p, [v](double o) { return o + v; });
}
template <class T>
inline T atomicSub(T* p, T v) { return __atomic_fetch_sub(p, v, __ATOMIC_SEQ_CST); }
template <class T>
inline T atomicExch(T* p, T v) {
    T old;
    __atomic_exchange(p, &v, &old, __ATOMIC_SEQ_CST);
    return old;
}
template <class T>
inline T atomicCAS(T* p, T expected, T desired) {
    __atomic_compare_exchange(p, &expected, &desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return expected;
}
template <class T>
inline T atomicMax(T* p, T v) {
    return cuemu_detail::atomic_update(p, [v](T o) { return o > v ? o : v; });
}
template <class T>
inline T atomicMin(T* p, T v) {
    return cuemu_detail::atomic_update(p, [v](T o) { return o < v ? o : v; });
}
template <class T>
inline T atomicAnd(T* p, T v) { return __atomic_fetch_and(p, v, __ATOMIC_SEQ_CST); }
template <class T>
inline T atomicOr(T* p, T v) { return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST); }
template <class T>
inline T atomicXor(T* p, T v) { return __atomic_fetch_xor(p, v, __ATOMIC_SEQ_CST); }

// ---- what the emulator appends: one trampoline per kernel and its parameter description -----
namespace cuemu_detail {
template <class T> struct elem { static constexpr const char* name = "b"; };
template <> struct elem<float> { static constexpr const char* name = "f32"; };
template <> struct elem<double> { static constexpr const char* name = "f64"; };
template <> struct elem<__nv_bfloat16> { static constexpr const char* name = "bf16"; };
template <> struct elem<__half> { static constexpr const char* name = "f16"; };
template <> struct elem<signed char> { static constexpr const char* name = "i8"; };
template <> struct elem<char> { static constexpr const char* name = "i8"; };
template <> struct elem<unsigned char> { static constexpr const char* name = "u8"; };
template <> struct elem<short> { static constexpr const char* name = "i16"; };
template <> struct elem<unsigned short> { static constexpr const char* name = "u16"; };
template <> struct elem<int> { static constexpr const char* name = "i32"; };
template <> struct elem<unsigned> { static constexpr const char* name = "u32"; };
template <> struct elem<long> { static constexpr const char* name = "i64"; };
template <> struct elem<unsigned long> { static constexpr const char* name = "u64"; };
template <> struct elem<long long> { static constexpr const char* name = "i64"; };
template <> struct elem<unsigned long long> { static constexpr const char* name = "u64"; };
template <> struct elem<void> { static constexpr const char* name = "b"; };

inline void put(char*& o, const char* end, const char* s) {
    while (*s && o + 1 < end) *o++ = *s++;
}

// One parameter: `w:T` a pointer to writable T, `r:T` a pointer to const T, `s:N` a scalar of
// N bytes; separated by commas.
template <class A>
inline void describe(char*& o, const char* end) {
    using T = typename std::remove_cv<typename std::remove_reference<A>::type>::type;
    if (std::is_pointer<T>::value) {
        using P = typename std::remove_pointer<T>::type;
        put(o, end, std::is_const<P>::value ? "r:" : "w:");
        put(o, end, elem<typename std::remove_cv<P>::type>::name);
    } else {
        char n[24];
        snprintf(n, sizeof n, "s:%zu", sizeof(T));
        put(o, end, n);
    }
    put(o, end, ",");
}

template <class... A>
inline const char* signature(void (*)(A...)) {
    static char buf[1024];
    char* o = buf;
    const char* end = buf + sizeof buf;
    (void)std::initializer_list<int>{(describe<A>(o, end), 0)...};
    *o = 0;
    return buf;
}

template <class... A, std::size_t... I>
inline void call(void (*f)(A...), void** p, std::index_sequence<I...>) {
    f(*static_cast<typename std::remove_cv<typename std::remove_reference<A>::type>::type*>(p[I])...);
}

template <class... A>
inline void invoke(void (*f)(A...), void** p) {
    call(f, p, std::index_sequence_for<A...>{});
}
}  // namespace cuemu_detail

extern "C" {
typedef struct cuemu_kernel_entry {
    const char* name;
    cuemu_kernel_fn run;
    const char* (*signature)(void);
} cuemu_kernel_entry;
}
