// The C ABI between the emulator (Rust, libcuemu.so) and the SIMT runtime (libcuemu_simt.so)
// that runs the host build of CUDA kernels. `src/simt.rs` mirrors these structs field for field.
#pragma once
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct cuemu_dim3 {
    unsigned x, y, z;
} cuemu_dim3;

// What a kernel thread sees as threadIdx/blockIdx/blockDim/gridDim.
typedef struct cuemu_thread_view {
    cuemu_dim3 thread_idx, block_idx, block_dim, grid_dim;
} cuemu_thread_view;

// The trampoline the emulator generates per kernel: unpacks `params` (CUDA's kernelParams
// layout: one pointer per argument) and calls the kernel.
typedef void (*cuemu_kernel_fn)(void** params);

// Thread schedules: the order a block's threads run between synchronisation points.
enum { CUEMU_FORWARD = 0, CUEMU_REVERSE = 1, CUEMU_RANDOM = 2 };

typedef struct cuemu_block_args {
    cuemu_kernel_fn kernel;
    void** params;
    cuemu_dim3 grid, block, block_idx;
    size_t shared_capacity;        // bytes of shared memory the block may use (static + dynamic)
    size_t dynamic_shared;         // bytes of dynamic shared memory asked for at launch
    unsigned schedule;             // CUEMU_FORWARD | CUEMU_REVERSE | CUEMU_RANDOM
    uint64_t seed;                 // for CUEMU_RANDOM
    unsigned char poison;          // byte every shared memory byte holds when the block starts
} cuemu_block_args;

// Errors a block can end with (0 = none).
enum {
    CUEMU_OK = 0,
    CUEMU_DIVERGENT_BARRIER = 1,   // threads of a block wait at different __syncthreads
    CUEMU_DEADLOCK = 2,            // no thread can run and no barrier can complete
    CUEMU_WARP_MASK = 3,           // a warp operation's mask names absent/exited lanes, or lanes disagree
    CUEMU_SHARED_OVERFLOW = 4,     // static + dynamic shared memory over the launch's limit
    CUEMU_TRAP = 5,                // __trap() or a failed device assert
    CUEMU_FAULT = 6,               // SIGSEGV/SIGBUS in kernel code (address in `fault_address`)
    CUEMU_UNSUPPORTED = 7,         // a construct the emulator does not implement
};

typedef struct cuemu_block_result {
    int code;
    cuemu_dim3 thread;             // the thread the error is about (when one is)
    uint64_t fault_address;        // CUEMU_FAULT: the faulting address
    uint64_t shared_base;          // the block's shared memory arena (to name faults in it)
    uint64_t shared_end;
    uint64_t switches;             // fiber switches in this block (a cost figure)
    char message[1024];
} cuemu_block_result;

// Run one block of a launch to completion on the calling thread. Returns `result->code`.
int cuemu_run_block(const cuemu_block_args* args, cuemu_block_result* result);

// Release the calling thread's fiber stacks and shared memory (block runners call it on exit).
void cuemu_release_thread(void);

// The runtime's ABI version (the emulator refuses a mismatched library).
unsigned cuemu_simt_abi(void);
#define CUEMU_SIMT_ABI 1

#ifdef __cplusplus
}
#endif
