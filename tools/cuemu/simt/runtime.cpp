// The SIMT runtime of cuemu: runs one CUDA thread block on the calling OS thread, one
// cooperative fiber per CUDA thread. A fiber runs until it reaches a synchronisation point
// (__syncthreads, a warp shuffle/vote, __syncwarp) or exits; the scheduler then runs the next
// one in the launch's schedule order (forward, reverse or seeded random). Barriers and warp
// operations are real rendezvous: a warp shuffle completes only when every lane its mask names
// has arrived at the same operation, a barrier only when every thread that has not exited waits
// at the same __syncthreads — so a missing barrier, a mask naming absent lanes, a divergent
// barrier or a deadlock is seen, named, and ends the block with an error instead of a wrong
// number.
//
// Shared memory is one arena per OS thread: static __shared__ arrays from its start, the
// launch's dynamic shared memory flush against a PROT_NONE guard page at its end, every byte
// set to the schedule's poison when a block starts. Faults (SIGSEGV/SIGBUS) in kernel code are
// caught and reported with the address; any other fault goes to the handler that was there
// before.
//
// Built by the emulator with the host C++ compiler into libcuemu_simt.so; kernel programs link
// against it. Only x86-64 has the hand-written context switch; other targets use ucontext.

#include "cuemu_abi.h"

#include <algorithm>
#include <csetjmp>
#include <csignal>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>
#include <vector>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#define EXPORT extern "C" __attribute__((visibility("default")))

namespace {

// ---------------------------------------------------------------------------------------------
// Context switch.
#if defined(__x86_64__)
extern "C" void cuemu_ctx_switch(void** save_sp, void* load_sp);
extern "C" void cuemu_fiber_start();
asm(R"(
    .text
    .globl cuemu_ctx_switch
    .hidden cuemu_ctx_switch
    .type cuemu_ctx_switch,@function
cuemu_ctx_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size cuemu_ctx_switch,.-cuemu_ctx_switch

    .globl cuemu_fiber_start
    .hidden cuemu_fiber_start
    .type cuemu_fiber_start,@function
cuemu_fiber_start:
    movq %r12, %rdi
    call cuemu_fiber_main
    ud2
    .size cuemu_fiber_start,.-cuemu_fiber_start
)");
#endif

const size_t STACK_BYTES = 256 << 10;
const size_t SHARED_ARENA = 256 << 10;  // above every GPU's per-block limit (227 KiB)

enum State { RUNNABLE, AT_BARRIER, AT_WARP, DONE };

// Warp operation kinds (cuemu_simt.h uses the same numbers).
enum {
    OP_SHFL_IDX = 0,
    OP_SHFL_UP = 1,
    OP_SHFL_DOWN = 2,
    OP_SHFL_XOR = 3,
    OP_BALLOT = 4,
    OP_ANY = 5,
    OP_ALL = 6,
    OP_SYNCWARP = 7,
    OP_MMA = 8,
};

const char* op_name(int op) {
    static const char* names[] = {"__shfl_sync",   "__shfl_up_sync", "__shfl_down_sync",
                                  "__shfl_xor_sync", "__ballot_sync",  "__any_sync",
                                  "__all_sync",    "__syncwarp",     "mma.sync.m16n8k16"};
    return op >= 0 && op < 9 ? names[op] : "warp operation";
}

struct Fiber {
    void* sp = nullptr;
    char* stack = nullptr;  // mapping (guard page first)
#if !defined(__x86_64__)
    ucontext_t uc;
#endif
    cuemu_thread_view view;
    unsigned linear = 0, lane = 0, warp = 0;
    State state = DONE;
    const void* site = nullptr;  // return address of the pending sync call
    int line = 0;
    // Pending warp operation.
    int op = 0;
    unsigned mask = 0;
    uint64_t value = 0;
    int arg = 0, width = 32;
    uint64_t result = 0;
    // Pending mma: this lane's fragments.
    const unsigned* mma_a = nullptr;
    const unsigned* mma_b = nullptr;
    const float* mma_c = nullptr;
    float* mma_d = nullptr;
    // Pending __syncthreads_{count,and,or}.
    int bar_op = 0, bar_pred = 0, bar_result = 0;
};

struct Block {
    const cuemu_block_args* args;
    cuemu_block_result* result;
    std::vector<Fiber*> fibers;
    unsigned n = 0;
    void* sched_sp = nullptr;
#if !defined(__x86_64__)
    ucontext_t sched_uc;
#endif
    bool failed = false;
    // Scheduling: the threads of this pass (run from `pos` on), those of the next, counts.
    std::vector<unsigned> pass, next;
    size_t pos = 0;
    unsigned done = 0, at_barrier = 0;
    // Per warp: lanes that exist, lanes that exited, lanes waiting at a warp operation.
    std::vector<unsigned> exists, exited, waiting;
    // Shared memory.
    unsigned char* arena = nullptr;
    size_t static_end = 0;
    unsigned char* dynamic_base = nullptr;
    std::vector<std::pair<const void*, size_t>> statics;
};

struct ThreadState {
    std::vector<Fiber*> pool;
    unsigned char* arena = nullptr;  // SHARED_ARENA bytes followed by a guard page
    size_t page = 4096;
    stack_t alt{};
    bool alt_installed = false;
};

// Initial-exec TLS: a few words, read on every threadIdx access (no __tls_get_addr call).
#define TLS thread_local __attribute__((tls_model("initial-exec")))
TLS ThreadState* tl_state = nullptr;
TLS Block* tl_block = nullptr;
TLS Fiber* tl_fiber = nullptr;
TLS sigjmp_buf* tl_jmp = nullptr;
TLS volatile uint64_t tl_fault = 0;

ThreadState& state() {
    if (!tl_state) {
        tl_state = new ThreadState();
        tl_state->page = (size_t)sysconf(_SC_PAGESIZE);
    }
    return *tl_state;
}

// ---------------------------------------------------------------------------------------------
// Errors.

void fail(int code, const Fiber* f, const char* fmt, ...) __attribute__((format(printf, 3, 4)));
void fail(int code, const Fiber* f, const char* fmt, ...) {
    Block* b = tl_block;
    if (b->failed) return;
    b->failed = true;
    b->result->code = code;
    if (f) b->result->thread = f->view.thread_idx;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(b->result->message, sizeof b->result->message, fmt, ap);
    va_end(ap);
}

// ---------------------------------------------------------------------------------------------
// Switching.

// Leave fiber `f` (blocked, exited, or runnable for the next pass): switch straight to the
// next runnable thread of this pass, or back to the scheduler when the pass is over.
void to_scheduler(Fiber* f) {
    Block* b = tl_block;
    b->result->switches++;
    Fiber* g = nullptr;
    while (!b->failed && b->pos < b->pass.size()) {
        Fiber* c = b->fibers[b->pass[b->pos++]];
        if (c->state == RUNNABLE && c != f) {
            g = c;
            break;
        }
    }
#if defined(__x86_64__)
    if (g) {
        tl_fiber = g;
        cuemu_ctx_switch(&f->sp, g->sp);
    } else {
        cuemu_ctx_switch(&f->sp, b->sched_sp);
    }
#else
    if (g) {
        tl_fiber = g;
        swapcontext(&f->uc, &g->uc);
    } else {
        swapcontext(&f->uc, &b->sched_uc);
    }
#endif
    tl_fiber = f;
}

void run_fiber(Block* b, Fiber* f) {
    tl_fiber = f;
    b->result->switches++;
#if defined(__x86_64__)
    cuemu_ctx_switch(&b->sched_sp, f->sp);
#else
    swapcontext(&b->sched_uc, &f->uc);
#endif
    tl_fiber = nullptr;
}

}  // namespace

extern "C" __attribute__((visibility("hidden"), noreturn)) void cuemu_fiber_main(Fiber* f) {
    Block* b = tl_block;
    b->args->kernel(b->args->params);
    f->state = DONE;
    b->done++;
    b->exited[f->warp] |= 1u << f->lane;
    for (;;) to_scheduler(f);
}

#if !defined(__x86_64__)
namespace {
void fiber_entry_uc(unsigned lo, unsigned hi) {
    cuemu_fiber_main((Fiber*)(((uintptr_t)hi << 32) | lo));
}
}  // namespace
#endif

namespace {

// A fiber (with a stack and a guard page below it) from the calling thread's pool.
Fiber* fiber(unsigned i) {
    ThreadState& ts = state();
    while (ts.pool.size() <= i) {
        Fiber* f = new Fiber();
        void* m = mmap(nullptr, STACK_BYTES + ts.page, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED) {
            delete f;
            return nullptr;
        }
        mprotect(m, ts.page, PROT_NONE);
        f->stack = (char*)m;
        ts.pool.push_back(f);
    }
    return ts.pool[i];
}

void init_fiber(Fiber* f) {
    ThreadState& ts = state();
    char* top = f->stack + ts.page + STACK_BYTES;  // 16-byte aligned (page aligned)
#if defined(__x86_64__)
    uint64_t* sp = (uint64_t*)top;
    *--sp = (uint64_t)&cuemu_fiber_start;  // return address of the first switch
    *--sp = 0;                            // rbp
    *--sp = 0;                            // rbx
    *--sp = (uint64_t)f;                  // r12: the fiber, moved to rdi by cuemu_fiber_start
    *--sp = 0;                            // r13
    *--sp = 0;                            // r14
    *--sp = 0;                            // r15
    uint32_t mxcsr = __builtin_ia32_stmxcsr();
    uint16_t cw;
    __asm__ volatile("fnstcw %0" : "=m"(cw));
    --sp;
    std::memcpy((char*)sp, &mxcsr, 4);
    std::memcpy((char*)sp + 4, &cw, 2);
    f->sp = sp;
#else
    getcontext(&f->uc);
    f->uc.uc_stack.ss_sp = f->stack + ts.page;
    f->uc.uc_stack.ss_size = STACK_BYTES;
    f->uc.uc_link = nullptr;
    uintptr_t p = (uintptr_t)f;
    makecontext(&f->uc, (void (*)())fiber_entry_uc, 2, (unsigned)(p & 0xffffffffu),
                (unsigned)(p >> 32));
#endif
}

// ---------------------------------------------------------------------------------------------
// Faults.

struct sigaction prev_segv, prev_bus;
pthread_once_t handler_once = PTHREAD_ONCE_INIT;

void chain(int sig, siginfo_t* si, void* uc) {
    struct sigaction* p = sig == SIGSEGV ? &prev_segv : &prev_bus;
    if ((p->sa_flags & SA_SIGINFO) && p->sa_sigaction) {
        p->sa_sigaction(sig, si, uc);
    } else if (p->sa_handler == SIG_IGN) {
    } else if (p->sa_handler == SIG_DFL || p->sa_handler == nullptr) {
        // Restore the default action and return: the faulting instruction runs again and the
        // process dies as it would have without us.
        signal(sig, SIG_DFL);
    } else {
        p->sa_handler(sig);
    }
}

void on_fault(int sig, siginfo_t* si, void* uc) {
    if (tl_jmp && tl_block) {
        tl_fault = (uint64_t)si->si_addr;
        siglongjmp(*tl_jmp, 1);
    }
    chain(sig, si, uc);
}

void install_handler() {
    struct sigaction sa;
    std::memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &prev_segv);
    sigaction(SIGBUS, &sa, &prev_bus);
}

// A stack for the fault handler: a fault on a fiber's guard page (stack overflow) must still
// be handled.
void ensure_altstack() {
    ThreadState& ts = state();
    if (ts.alt_installed) return;
    size_t bytes = 64 << 10;
    void* m = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return;
    ts.alt.ss_sp = m;
    ts.alt.ss_size = bytes;
    ts.alt.ss_flags = 0;
    stack_t old;
    if (sigaltstack(nullptr, &old) == 0 && !(old.ss_flags & SS_DISABLE)) {
        munmap(m, bytes);  // the thread has one already (Rust's threads do)
        ts.alt_installed = true;
        return;
    }
    sigaltstack(&ts.alt, nullptr);
    ts.alt_installed = true;
}

// ---------------------------------------------------------------------------------------------
// The block.

unsigned char* arena() {
    ThreadState& ts = state();
    if (!ts.arena) {
        void* m = mmap(nullptr, SHARED_ARENA + ts.page, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED) return nullptr;
        mprotect((char*)m + SHARED_ARENA, ts.page, PROT_NONE);
        ts.arena = (unsigned char*)m;
    }
    return ts.arena;
}

uint64_t xorshift(uint64_t& s) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return s;
}

// Order the threads of a pass by the launch's schedule: forward runs them in the order they
// became runnable (thread order at the start, lane order as warp operations complete), reverse
// in the opposite order, random in a seeded shuffle.
void order(const Block* b, std::vector<unsigned>& ord, uint64_t& rng) {
    switch (b->args->schedule) {
        case CUEMU_REVERSE:
            std::reverse(ord.begin(), ord.end());
            break;
        case CUEMU_RANDOM:
            for (size_t i = ord.size(); i > 1; i--) std::swap(ord[i - 1], ord[xorshift(rng) % i]);
            break;
        default:
            break;
    }
}

const char* state_name(State s) {
    switch (s) {
        case RUNNABLE: return "running";
        case AT_BARRIER: return "at __syncthreads";
        case AT_WARP: return "at a warp operation";
        default: return "exited";
    }
}

// Every thread that has not exited waits at a barrier: release them (all at one site), or
// report the divergence.
bool try_barrier(Block* b) {
    if (b->at_barrier == 0 || b->at_barrier + b->done != b->n) return false;
    Fiber* first = nullptr;
    for (Fiber* f : b->fibers)
        if (f->state == AT_BARRIER) {
            first = f;
            break;
        }
    int count = 0, all = 1, any = 0;
    for (Fiber* f : b->fibers) {
        if (f->state != AT_BARRIER) continue;
        if (f->site != first->site) {
            fail(CUEMU_DIVERGENT_BARRIER, f,
                 "divergent barrier: thread (%u,%u,%u) waits at __syncthreads (line %d) while "
                 "thread (%u,%u,%u) waits at another __syncthreads (line %d)",
                 f->view.thread_idx.x, f->view.thread_idx.y, f->view.thread_idx.z, f->line,
                 first->view.thread_idx.x, first->view.thread_idx.y, first->view.thread_idx.z,
                 first->line);
            return false;
        }
        count += f->bar_pred != 0;
        all &= f->bar_pred != 0;
        any |= f->bar_pred != 0;
    }
    for (Fiber* f : b->fibers) {
        if (f->state != AT_BARRIER) continue;
        f->bar_result = f->bar_op == 1 ? count : f->bar_op == 2 ? all : f->bar_op == 3 ? any : 0;
        f->state = RUNNABLE;
        b->next.push_back(f->linear);
    }
    b->at_barrier = 0;
    return true;
}

void report_deadlock(Block* b) {
    char detail[700];
    size_t used = 0;
    detail[0] = 0;
    unsigned shown = 0;
    for (Fiber* f : b->fibers) {
        if (f->state == DONE || shown >= 6) continue;
        shown++;
        used += snprintf(detail + used, sizeof detail - used, "%sthread (%u,%u,%u) %s%s line %d",
                         shown > 1 ? "; " : "", f->view.thread_idx.x, f->view.thread_idx.y,
                         f->view.thread_idx.z, state_name(f->state),
                         f->state == AT_WARP ? " " : "",
                         f->line);
        if (f->state == AT_WARP && used < sizeof detail)
            used += snprintf(detail + used, sizeof detail - used, " (%s, mask 0x%08x)",
                             op_name(f->op), f->mask);
        if (used >= sizeof detail) break;
    }
    fail(CUEMU_DEADLOCK, nullptr,
         "deadlock: no thread of the block can run and no barrier or warp operation can complete "
         "(%s)",
         detail);
}

// ---------------------------------------------------------------------------------------------
// Warp operations.

Fiber* lane_fiber(Block* b, unsigned warp, unsigned lane) {
    unsigned i = warp * 32 + lane;
    return i < b->n ? b->fibers[i] : nullptr;
}

float bf16_value(unsigned bits) {
    unsigned u = bits << 16;
    float x;
    std::memcpy(&x, &u, 4);
    return x;
}

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 for warp `w`, from every lane's fragments
// in the PTX ISA's layouts (groupID = lane >> 2, threadID_in_group = lane % 4; two bf16 per 32-bit
// register, the lower-indexed one in the low half):
//   A 16×16: a_i at row groupID (+8 for i in 2,3,6,7), col 2·tig + (i & 1) (+8 for i ≥ 4)
//   B 16×8:  b_i at row 2·tig + (i & 1) (+8 for i ≥ 2), col groupID
//   C/D 16×8: c_i at row groupID (+8 for i ≥ 2), col 2·tig + (i & 1)
// Products of bf16 values are exact in fp32; they are summed in k order onto C.
void mma_m16n8k16_bf16(Block* b, unsigned w) {
    float A[16][16], B[16][8], C[16][8];
    for (unsigned l = 0; l < 32; l++) {
        const Fiber* g = lane_fiber(b, w, l);
        unsigned grp = l >> 2, tig = l & 3;
        for (unsigned i = 0; i < 8; i++) {
            unsigned bits = (g->mma_a[i / 2] >> (16 * (i & 1))) & 0xffffu;
            unsigned row = grp + ((i == 2 || i == 3 || i == 6 || i == 7) ? 8 : 0);
            unsigned col = 2 * tig + (i & 1) + (i >= 4 ? 8 : 0);
            A[row][col] = bf16_value(bits);
        }
        for (unsigned i = 0; i < 4; i++) {
            unsigned bits = (g->mma_b[i / 2] >> (16 * (i & 1))) & 0xffffu;
            B[2 * tig + (i & 1) + (i >= 2 ? 8 : 0)][grp] = bf16_value(bits);
            C[grp + (i >= 2 ? 8 : 0)][2 * tig + (i & 1)] = g->mma_c[i];
        }
    }
    for (unsigned l = 0; l < 32; l++) {
        Fiber* g = lane_fiber(b, w, l);
        unsigned grp = l >> 2, tig = l & 3;
        for (unsigned i = 0; i < 4; i++) {
            unsigned row = grp + (i >= 2 ? 8 : 0), col = 2 * tig + (i & 1);
            float acc = C[row][col];
            for (unsigned k = 0; k < 16; k++) acc += A[row][k] * B[k][col];
            g->mma_d[i] = acc;
        }
    }
}

// If every lane `f`'s mask names waits at the same warp operation, complete it for all.
void try_warp(Block* b, Fiber* f) {
    unsigned mask = f->mask, w = f->warp;
    if (unsigned absent = mask & ~b->exists[w]) {
        unsigned l = (unsigned)__builtin_ctz(absent);
        fail(CUEMU_WARP_MASK, f,
             "%s (line %d): mask 0x%08x names lane %u of warp %u, which does not exist (the "
             "block has %u threads)",
             op_name(f->op), f->line, mask, l, w, b->n);
        return;
    }
    if (unsigned gone = mask & b->exited[w]) {
        unsigned l = (unsigned)__builtin_ctz(gone);
        fail(CUEMU_WARP_MASK, f,
             "%s (line %d): mask 0x%08x names lane %u of warp %u, which has exited",
             op_name(f->op), f->line, mask, l, w);
        return;
    }
    if ((b->waiting[w] & mask) != mask) return;  // not all arrived yet
    for (unsigned l = 0; l < 32; l++) {
        if (!(mask >> l & 1)) continue;
        Fiber* g = lane_fiber(b, w, l);
        if (g->site != f->site || g->op != f->op || g->mask != f->mask) {
            fail(CUEMU_WARP_MASK, f,
                 "%s (line %d, mask 0x%08x) of lane %u meets %s (line %d, mask 0x%08x) of lane "
                 "%u: the lanes of a warp operation must execute the same one with the same mask",
                 op_name(f->op), f->line, f->mask, f->lane, op_name(g->op), g->line, g->mask,
                 g->lane);
            return;
        }
    }
    if (f->op == OP_MMA) {
        mma_m16n8k16_bf16(b, w);
        b->waiting[w] &= ~mask;
        for (unsigned l = 0; l < 32; l++) {
            Fiber* g = lane_fiber(b, w, l);
            g->state = RUNNABLE;
            b->next.push_back(g->linear);
        }
        return;
    }
    // All arrived: compute each lane's result.
    for (unsigned l = 0; l < 32; l++) {
        if (!(mask >> l & 1)) continue;
        Fiber* g = lane_fiber(b, f->warp, l);
        int width = g->width;
        if (g->op <= OP_SHFL_XOR && (width <= 0 || width > 32 || (width & (width - 1)))) {
            fail(CUEMU_WARP_MASK, g, "%s (line %d): width %d is not a power of two up to 32",
                 op_name(g->op), g->line, width);
            return;
        }
        unsigned base = g->op <= OP_SHFL_XOR ? l & ~(unsigned)(width - 1) : 0;
        int src = (int)l;
        switch (g->op) {
            case OP_SHFL_IDX: src = (int)base + (int)((unsigned)g->arg % (unsigned)width); break;
            case OP_SHFL_UP: src = (int)l - g->arg < (int)base ? (int)l : (int)l - g->arg; break;
            case OP_SHFL_DOWN:
                src = (int)l + g->arg >= (int)(base + width) ? (int)l : (int)l + g->arg;
                break;
            case OP_SHFL_XOR: {
                int x = (int)(l ^ (unsigned)g->arg);
                src = x >= (int)(base + width) ? (int)l : x;
                break;
            }
            default: break;
        }
        if (g->op <= OP_SHFL_XOR) {
            if (src < 0 || src > 31 || !(mask >> src & 1)) {
                fail(CUEMU_WARP_MASK, g,
                     "%s (line %d): lane %u reads lane %d, which the mask 0x%08x leaves out",
                     op_name(g->op), g->line, l, src, mask);
                return;
            }
            g->result = lane_fiber(b, f->warp, (unsigned)src)->value;
        } else if (g->op == OP_BALLOT || g->op == OP_ANY || g->op == OP_ALL) {
            unsigned ballot = 0;
            for (unsigned k = 0; k < 32; k++)
                if ((mask >> k & 1) && lane_fiber(b, f->warp, k)->value) ballot |= 1u << k;
            g->result = g->op == OP_BALLOT ? ballot
                        : g->op == OP_ANY  ? (ballot != 0)
                                           : (ballot == mask);
        } else {
            g->result = 0;
        }
    }
    b->waiting[w] &= ~mask;
    for (unsigned l = 0; l < 32; l++)
        if (mask >> l & 1) {
            Fiber* g = lane_fiber(b, w, l);
            g->state = RUNNABLE;
            b->next.push_back(g->linear);
        }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// What kernel code calls (declared in cuemu_simt.h).

EXPORT const cuemu_thread_view* cuemu_self(void) { return &tl_fiber->view; }

EXPORT __attribute__((noinline)) int cuemu_syncthreads_op(int op, int pred, int line) {
    Fiber* f = tl_fiber;
    f->site = __builtin_return_address(0);
    f->line = line;
    f->bar_op = op;
    f->bar_pred = pred;
    f->state = AT_BARRIER;
    tl_block->at_barrier++;
    to_scheduler(f);
    return f->bar_result;
}

EXPORT __attribute__((noinline)) void cuemu_syncthreads(int line) {
    Fiber* f = tl_fiber;
    f->site = __builtin_return_address(0);
    f->line = line;
    f->bar_op = 0;
    f->bar_pred = 0;
    f->state = AT_BARRIER;
    tl_block->at_barrier++;
    to_scheduler(f);
}

EXPORT __attribute__((noinline)) uint64_t cuemu_warp_op(int op, unsigned mask, uint64_t value,
                                                        int arg, int width, int line) {
    Fiber* f = tl_fiber;
    Block* b = tl_block;
    f->site = __builtin_return_address(0);
    f->line = line;
    f->op = op;
    f->mask = mask;
    f->value = value;
    f->arg = arg;
    f->width = width;
    if (!(mask >> f->lane & 1)) {
        fail(CUEMU_WARP_MASK, f,
             "%s (line %d): lane %u calls it with mask 0x%08x, which leaves it out", op_name(op),
             line, f->lane, mask);
        for (;;) to_scheduler(f);
    }
    f->state = AT_WARP;
    b->waiting[f->warp] |= 1u << f->lane;
    try_warp(b, f);
    // Wait for the other lanes, or (when this lane completed the group, and was queued with
    // them) let the schedule decide which lane goes on first.
    to_scheduler(f);
    return f->result;
}

// One warp's mma.sync.m16n8k16 with bf16 inputs and fp32 accumulators (all 32 lanes take part).
EXPORT __attribute__((noinline)) void cuemu_mma_m16n8k16_bf16(float* d, const unsigned* a,
                                                              const unsigned* bfrag, const float* c,
                                                              int line) {
    Fiber* f = tl_fiber;
    Block* b = tl_block;
    f->site = __builtin_return_address(0);
    f->line = line;
    f->op = OP_MMA;
    f->mask = 0xffffffffu;
    f->value = 0;
    f->arg = 0;
    f->width = 32;
    f->mma_a = a;
    f->mma_b = bfrag;
    f->mma_c = c;
    f->mma_d = d;
    f->state = AT_WARP;
    b->waiting[f->warp] |= 1u << f->lane;
    try_warp(b, f);
    to_scheduler(f);
}

EXPORT unsigned cuemu_activemask(void) {
    Fiber* f = tl_fiber;
    Block* b = tl_block;
    unsigned m = 0;
    for (unsigned l = 0; l < 32; l++) {
        Fiber* g = lane_fiber(b, f->warp, l);
        if (g && g->state != DONE) m |= 1u << l;
    }
    return m;
}

EXPORT void* cuemu_shared_static(const void* tag, size_t bytes, size_t align, int line) {
    Block* b = tl_block;
    for (auto& s : b->statics)
        if (s.first == tag) return b->arena + s.second;
    if (align < 16) align = 16;
    size_t at = (b->static_end + align - 1) / align * align;
    size_t end = at + bytes;
    size_t dynamic = (size_t)(b->arena + SHARED_ARENA - b->dynamic_base);
    if (end + b->args->dynamic_shared > b->args->shared_capacity ||
        b->arena + end > b->dynamic_base) {
        fail(CUEMU_SHARED_OVERFLOW, tl_fiber,
             "shared memory over the limit: __shared__ array of %zu bytes (line %d) brings the "
             "static total to %zu bytes, with %zu bytes of dynamic shared memory (%zu reserved), "
             "over the %zu bytes this launch may use",
             bytes, line, end, b->args->dynamic_shared, dynamic, b->args->shared_capacity);
        for (;;) to_scheduler(tl_fiber);
    }
    b->statics.push_back({tag, at});
    b->static_end = end;
    // Uninitialised, as on a GPU: the schedule's poison.
    std::memset(b->arena + at, b->args->poison, bytes);
    return b->arena + at;
}

EXPORT void* cuemu_shared_dynamic(void) { return tl_block->dynamic_base; }

EXPORT __attribute__((noreturn)) void cuemu_trap(const char* what, int line) {
    fail(CUEMU_TRAP, tl_fiber, "%s (line %d)", what, line);
    for (;;) to_scheduler(tl_fiber);
}

EXPORT void cuemu_unsupported(const char* what, int line) {
    fail(CUEMU_UNSUPPORTED, tl_fiber, "not emulated: %s (line %d)", what, line);
    for (;;) to_scheduler(tl_fiber);
}

EXPORT unsigned cuemu_simt_abi(void) { return CUEMU_SIMT_ABI; }

EXPORT void cuemu_release_thread(void) {
    ThreadState* ts = tl_state;
    if (!ts) return;
    for (Fiber* f : ts->pool) {
        munmap(f->stack, STACK_BYTES + ts->page);
        delete f;
    }
    if (ts->arena) munmap(ts->arena, SHARED_ARENA + ts->page);
    delete ts;
    tl_state = nullptr;
}

EXPORT int cuemu_run_block(const cuemu_block_args* args, cuemu_block_result* result) {
    std::memset(result, 0, sizeof *result);
    pthread_once(&handler_once, install_handler);
    ensure_altstack();
    Block b;
    b.args = args;
    b.result = result;
    b.n = args->block.x * args->block.y * args->block.z;
    b.arena = arena();
    if (!b.arena) {
        result->code = CUEMU_UNSUPPORTED;
        snprintf(result->message, sizeof result->message, "cannot map shared memory");
        return result->code;
    }
    result->shared_base = (uint64_t)b.arena;
    result->shared_end = (uint64_t)(b.arena + SHARED_ARENA);
    if (args->dynamic_shared > args->shared_capacity || args->dynamic_shared > SHARED_ARENA) {
        result->code = CUEMU_SHARED_OVERFLOW;
        snprintf(result->message, sizeof result->message,
                 "shared memory over the limit: %zu bytes of dynamic shared memory asked, %zu "
                 "allowed",
                 args->dynamic_shared, args->shared_capacity);
        return result->code;
    }
    // Dynamic shared memory ends at the guard page (rounded to 16 bytes, CUDA's alignment),
    // poisoned; static arrays are poisoned as they are first declared.
    b.dynamic_base = b.arena + SHARED_ARENA - (args->dynamic_shared + 15) / 16 * 16;
    std::memset(b.dynamic_base, args->poison, (size_t)(b.arena + SHARED_ARENA - b.dynamic_base));
    unsigned warps = (b.n + 31) / 32;
    b.exists.assign(warps, 0);
    b.exited.assign(warps, 0);
    b.waiting.assign(warps, 0);
    for (unsigned i = 0; i < b.n; i++) b.exists[i / 32] |= 1u << (i % 32);
    b.next.reserve(b.n);
    b.pass.reserve(b.n);
    b.fibers.resize(b.n);
    for (unsigned i = 0; i < b.n; i++) {
        Fiber* f = fiber(i);
        if (!f) {
            result->code = CUEMU_UNSUPPORTED;
            snprintf(result->message, sizeof result->message, "cannot map fiber stacks");
            return result->code;
        }
        init_fiber(f);
        unsigned bx = args->block.x, by = args->block.y;
        f->view.thread_idx = {i % bx, (i / bx) % by, i / (bx * by)};
        f->view.block_idx = args->block_idx;
        f->view.block_dim = args->block;
        f->view.grid_dim = args->grid;
        f->linear = i;
        f->lane = i % 32;
        f->warp = i / 32;
        f->state = RUNNABLE;
        f->site = nullptr;
        f->line = 0;
        f->result = 0;
        b.fibers[i] = f;
        b.next.push_back(i);
    }
    sigjmp_buf jmp;
    tl_block = &b;
    tl_fault = 0;
    if (sigsetjmp(jmp, 1) != 0) {
        // A fault in kernel code: the block's fibers are abandoned (their stacks are reused).
        tl_jmp = nullptr;
        tl_block = nullptr;
        tl_fiber = nullptr;
        result->code = CUEMU_FAULT;
        result->fault_address = tl_fault;
        snprintf(result->message, sizeof result->message, "memory fault at 0x%llx",
                 (unsigned long long)tl_fault);
        return result->code;
    }
    tl_jmp = &jmp;
    uint64_t rng = args->seed * 0x9E3779B97F4A7C15ull + 1 +
                   ((uint64_t)args->block_idx.x << 1) + ((uint64_t)args->block_idx.y << 22) +
                   ((uint64_t)args->block_idx.z << 43);
    if (rng == 0) rng = 1;
    for (;;) {
        b.pass.swap(b.next);
        b.next.clear();
        order(&b, b.pass, rng);
        // Run the pass: each fiber hands over to the next runnable one itself (to_scheduler);
        // control comes back here when the pass is over.
        b.pos = 0;
        while (b.pos < b.pass.size()) {
            Fiber* f = b.fibers[b.pass[b.pos++]];
            if (f->state == RUNNABLE) {
                run_fiber(&b, f);
                break;
            }
        }
        if (b.failed || b.done == b.n) break;
        if (!b.next.empty()) continue;
        if (try_barrier(&b)) continue;
        if (b.failed) break;
        // Nothing can run: a warp operation waiting for a lane that exited is an error of its
        // own; anything else is a deadlock.
        for (Fiber* f : b.fibers) {
            if (f->state == AT_WARP) try_warp(&b, f);
            if (b.failed) break;
        }
        if (b.failed) break;
        if (!b.next.empty()) continue;
        report_deadlock(&b);
        break;
    }
    tl_jmp = nullptr;
    tl_block = nullptr;
    tl_fiber = nullptr;
    return result->code;
}
