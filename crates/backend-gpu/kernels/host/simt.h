// A host emulator of the CUDA execution model, so tests can run the backend's
// kernels (kernels/*.cu, compiled by the system's C++ compiler) on a machine
// without a GPU.
//
// Every thread of a block is a fiber of one OS thread (switched by a few
// instructions on x86-64, by ucontext elsewhere); the blocks
// of a grid run one after another, so `__shared__` arrays are function
// statics. A fiber runs until it reaches a barrier (`__syncthreads`, a warp's
// shuffle, `__syncwarp`, a warp's `mma`), then the next fiber runs: the
// interleaving is deterministic for a seed, and the seed permutes the order
// the threads take turns in, so a kernel that reads shared memory before the
// barrier that orders the write gets different data under different seeds.
// A thread that returns while others of its block (or warp) wait at a
// barrier, or a barrier no thread can complete, aborts with a message.
//
// `mma.sync.m16n8k16` with bf16 inputs and f32 accumulation is computed here
// from the PTX ISA's fragment layout (lane = 4 g + t: A[g][2t..2t+1] in a0,
// A[g+8][2t..] in a1, A[g][2t+8..] in a2, A[g+8][2t+8..] in a3, B[2t..2t+1][g]
// in b0, B[2t+8..][g] in b1, C[g][2t], C[g][2t+1], C[g+8][2t], C[g+8][2t+1]),
// each product exact and the 16 products summed in f64 then added to C in
// f32; likewise `mma.sync.m16n8k32` with E4M3 inputs (`simt_mma_e4m3`). The
// kernels' sources call them through `ARBOR_HOST_SIMT`.
#pragma once
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>

#include <algorithm>
#include <functional>
#include <vector>

using std::max;
using std::min;

#define ARBOR_HOST_SIMT 1
#define __device__
#define __global__
#define __forceinline__ inline
#define __shared__ static
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define DYNAMIC_SMEM(T, name) T* name = reinterpret_cast<T*>(simt::blk->dynamic_smem.data())

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
inline dim3 threadIdx, blockIdx, blockDim, gridDim;

static inline unsigned __float_as_uint(float f) {
    unsigned u;
    memcpy(&u, &f, 4);
    return u;
}
static inline float __uint_as_float(unsigned u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline float __int_as_float(int i) {
    float f;
    memcpy(&f, &i, 4);
    return f;
}

static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
[[noreturn]] static inline void __trap() { abort(); }

// Atomics: the fibers of a block take turns on one OS thread, so a plain
// read-modify-write is atomic.
template <typename T> inline T atomicMax(T* p, T v) {
    const T old = *p;
    if (v > old) *p = v;
    return old;
}
template <typename T> inline T atomicMin(T* p, T v) {
    const T old = *p;
    if (v < old) *p = v;
    return old;
}
template <typename T> inline T atomicAdd(T* p, T v) {
    const T old = *p;
    *p = old + v;
    return old;
}

namespace simt {

[[noreturn]] inline void fail(const char* what) {
    fprintf(stderr, "simt: %s (block %u,%u,%u thread %u,%u,%u)\n", what, blockIdx.x, blockIdx.y,
            blockIdx.z, threadIdx.x, threadIdx.y, threadIdx.z);
    exit(3);
}

struct Barrier {
    int size = 0;
    int arrived = 0;
    unsigned gen = 0;
};

// One warp's exchange area: a shuffle's values, an mma's fragments.
struct WarpArea {
    Barrier bar;
    int live = 32;
    uint64_t slot[32];
    uint32_t a[32][4], b[32][2];
    float c[32][4];
};

// Fiber contexts: on x86-64 a saved stack pointer (simt_switch pushes the
// callee-saved registers, swaps stacks and pops them: no system calls);
// elsewhere a ucontext.
#if defined(__x86_64__)
extern "C" void simt_switch(void** save_sp, void* load_sp);
asm(R"(
    .text
    .globl simt_switch
    .hidden simt_switch
    .type simt_switch, @function
simt_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size simt_switch, .-simt_switch
)");
struct Context {
    void* sp = nullptr;
};
inline void context_switch(Context* save, Context* load) { simt_switch(&save->sp, load->sp); }
// A context that starts `entry` on the stack [base, base + bytes).
inline void context_make(Context* c, char* base, size_t bytes, void (*entry)()) {
    uintptr_t top = ((uintptr_t)(base + bytes)) & ~(uintptr_t)15;
    void** sp = (void**)top;
    *--sp = nullptr;                   // entry's return address (never used)
    *--sp = (void*)entry;              // where simt_switch's ret goes
    for (int i = 0; i < 6; ++i) *--sp = nullptr;  // rbp, rbx, r12..r15
    c->sp = sp;
}
#else
struct Context {
    ucontext_t uc;
};
inline void context_switch(Context* save, Context* load) { swapcontext(&save->uc, &load->uc); }
inline void context_make(Context* c, char* base, size_t bytes, void (*entry)()) {
    getcontext(&c->uc);
    c->uc.uc_stack.ss_sp = base;
    c->uc.uc_stack.ss_size = bytes;
    c->uc.uc_link = nullptr;
    makecontext(&c->uc, entry, 0);
}
#endif

struct Fiber {
    Context ctx;
    dim3 tid;
    bool done = false;
};

// Bytes of a fiber's stack.
constexpr size_t STACK_BYTES = 64 * 1024;

// Stacks for `n` fibers, kept for the OS thread's later launches.
inline char* stacks(size_t n) {
    static thread_local std::vector<char> pool;
    if (pool.size() < n * STACK_BYTES) pool.resize(n * STACK_BYTES);
    return pool.data();
}

struct Block {
    std::vector<Fiber> fibers;
    int cur = 0;
    int live = 0;
    Context main;
    Barrier bar;
    std::vector<WarpArea> warps;
    std::function<void()> body;
    // Dynamic shared memory, filled with NaN bytes (0xff) before each block:
    // a read of what no thread wrote shows.
    std::vector<unsigned char> dynamic_smem;
};

inline Block* blk = nullptr;

inline int linear_tid() {
    return (int)(threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z));
}

// The next fiber after `from` that has not returned, or -1.
inline int next_live(int from) {
    const int n = (int)blk->fibers.size();
    for (int i = 1; i <= n; ++i) {
        const int j = (from + i) % n;
        if (!blk->fibers[j].done) return j;
    }
    return -1;
}

inline WarpArea& warp();
inline int live_of(const Barrier& bar);

inline void yield() {
    Block& b = *blk;
    const int prev = b.cur, next = next_live(prev);
    if (next < 0 || next == prev) fail("deadlock: no other thread can reach the barrier");
    b.cur = next;
    threadIdx = b.fibers[next].tid;
    context_switch(&b.fibers[prev].ctx, &b.fibers[next].ctx);
}

// Waits at `bar` until its `size` threads arrived; `live` threads of its
// scope have not returned (fewer than `size` can never complete it).
inline void wait(Barrier& bar, int live) {
    if (live < bar.size) fail("a barrier waits for a thread that returned");
    const unsigned gen = bar.gen;
    if (++bar.arrived == bar.size) {
        bar.arrived = 0;
        bar.gen++;
        return;
    }
    while (bar.gen == gen) {
        yield();
        if (bar.gen == gen && live_of(bar) < bar.size) fail("a barrier waits for a thread that returned");
    }
}

inline WarpArea& warp() { return blk->warps[linear_tid() >> 5]; }

// Threads not yet returned in the scope of `bar` (the block, or a warp).
inline int live_of(const Barrier& bar) {
    if (&bar == &blk->bar) return blk->live;
    for (const WarpArea& w : blk->warps) {
        if (&w.bar == &bar) return w.live;
    }
    fail("unknown barrier");
}

inline void fiber_entry() {
    Block& b = *blk;
    b.body();
    b.fibers[b.cur].done = true;
    b.live--;
    warp().live--;
    if (b.bar.arrived > 0) fail("a thread returned while others wait at __syncthreads");
    if (warp().bar.arrived > 0) fail("a thread returned while its warp waits at a barrier");
    const int next = next_live(b.cur);
    if (next < 0) {
        Context done;
        context_switch(&done, &b.main);
    }
    b.cur = next;
    threadIdx = b.fibers[next].tid;
    Context done;
    context_switch(&done, &b.fibers[next].ctx);
}

// Runs `body` as every thread of a `grid` of `block`s with `smem_bytes` of
// dynamic shared memory; `seed` permutes the order the threads of a block
// take turns in.
inline void launch(dim3 grid, dim3 block, uint64_t seed, std::function<void()> body,
                   size_t smem_bytes = 0) {
    const int n = (int)(block.x * block.y * block.z);
    if (n % 32 != 0) fail("blocks must be whole warps");
    std::vector<int> order(n);
    for (int i = 0; i < n; ++i) order[i] = i;
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
    for (int i = n - 1; i > 0 && seed != 0; --i) {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        std::swap(order[i], order[(int)(s % (uint64_t)(i + 1))]);
    }
    gridDim = grid;
    blockDim = block;
    char* const stack = stacks((size_t)n);
    for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                Block b;
                blk = &b;
                blockIdx = dim3{bx, by, bz};
                b.body = body;
                b.fibers.resize(n);
                b.live = n;
                b.bar.size = n;
                b.warps.resize(n / 32);
                b.dynamic_smem.assign(smem_bytes, 0xff);
                for (WarpArea& w : b.warps) w.bar.size = 32;
                for (int i = 0; i < n; ++i) {
                    Fiber& f = b.fibers[i];
                    const unsigned t = (unsigned)order[i];
                    f.tid = dim3{t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
                    context_make(&f.ctx, stack + (size_t)i * STACK_BYTES, STACK_BYTES,
                                 fiber_entry);
                }
                b.cur = 0;
                threadIdx = b.fibers[0].tid;
                context_switch(&b.main, &b.fibers[0].ctx);
                if (b.live != 0) fail("a block ended with live threads");
                blk = nullptr;
            }
}

inline float bf16_value(uint32_t bits16) { return __uint_as_float((bits16 & 0xffffu) << 16); }

}  // namespace simt

inline void __syncthreads() { simt::wait(simt::blk->bar, simt::blk->live); }
inline void __syncwarp(unsigned = 0xffffffffu) { simt::wait(simt::warp().bar, simt::warp().live); }

template <typename T>
inline T simt_shfl_from(T v, int src) {
    simt::WarpArea& w = simt::warp();
    const int lane = simt::linear_tid() & 31;
    static_assert(sizeof(T) <= 8, "shuffled values fit 8 bytes");
    memcpy(&w.slot[lane], &v, sizeof(T));
    simt::wait(w.bar, w.live);
    T r;
    memcpy(&r, &w.slot[src], sizeof(T));
    simt::wait(w.bar, w.live);
    return r;
}

template <typename T>
inline T __shfl(T v, int src, int width = 32) {
    const int lane = simt::linear_tid() & 31, base = lane & ~(width - 1);
    return simt_shfl_from(v, base + (src & (width - 1)));
}
template <typename T>
inline T __shfl_xor(T v, int mask, int width = 32) {
    const int lane = simt::linear_tid() & 31, base = lane & ~(width - 1);
    const int src = lane ^ mask;
    return simt_shfl_from(v, src >= base + width ? lane : src);
}
template <typename T>
inline T __shfl_up(T v, int delta, int width = 32) {
    const int lane = simt::linear_tid() & 31, base = lane & ~(width - 1);
    return simt_shfl_from(v, lane - delta < base ? lane : lane - delta);
}

// One warp-wide m16n8kK product: every lane's fragments are staged, then
// `unpack(l, a, b0, b1, A, B)` places lane l's inputs in A[16][K] and B[K][8],
// and each lane adds its four outputs (C layout of m16n8kK: lane (g, t) holds
// C[g][2t], C[g][2t+1], C[g+8][2t], C[g+8][2t+1]), the products exact and
// summed in f64, then rounded once to f32.
template <int K, typename Unpack>
inline void simt_mma(float* c, const uint32_t* a, uint32_t b0, uint32_t b1, Unpack unpack) {
    simt::WarpArea& w = simt::warp();
    const int lane = simt::linear_tid() & 31;
    memcpy(w.a[lane], a, 16);
    w.b[lane][0] = b0;
    w.b[lane][1] = b1;
    memcpy(w.c[lane], c, 16);
    simt::wait(w.bar, w.live);
    float A[16][K], B[K][8];
    for (int l = 0; l < 32; ++l) unpack(l, w.a[l], w.b[l][0], w.b[l][1], A, B);
    const int g = lane >> 2, t = lane & 3;
    for (int r = 0; r < 4; ++r) {
        const int row = g + 8 * (r >> 1), col = 2 * t + (r & 1);
        double s = 0.0;
        for (int k = 0; k < K; ++k) s += (double)A[row][k] * (double)B[k][col];
        c[r] = (float)((double)w.c[lane][r] + s);
    }
    simt::wait(w.bar, w.live);
}

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 for the calling warp.
inline void simt_mma_bf16(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
    simt_mma<16>(c, a, b0, b1, [](int l, const uint32_t* a, uint32_t b0, uint32_t b1,
                                  float (*A)[16], float (*B)[8]) {
        const int g = l >> 2, t = l & 3;
        for (int h = 0; h < 2; ++h) {
            A[g][2 * t + h] = simt::bf16_value(a[0] >> (16 * h));
            A[g + 8][2 * t + h] = simt::bf16_value(a[1] >> (16 * h));
            A[g][2 * t + 8 + h] = simt::bf16_value(a[2] >> (16 * h));
            A[g + 8][2 * t + 8 + h] = simt::bf16_value(a[3] >> (16 * h));
            B[2 * t + h][g] = simt::bf16_value(b0 >> (16 * h));
            B[2 * t + 8 + h][g] = simt::bf16_value(b1 >> (16 * h));
        }
    });
}

// An E4M3 code's value (OCP "fn": no infinities, S.1111.111 NaN).
inline float simt_e4m3_value(uint32_t c) {
    const uint32_t e = (c >> 3) & 15u, m = c & 7u;
    if (e == 15u && m == 7u) return NAN;
    const float v = e == 0u ? ldexpf((float)m, -9) : ldexpf(1.0f + (float)m / 8.0f, (int)e - 7);
    return (c & 0x80u) ? -v : v;
}

// mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 for the calling warp:
// lane (g, t) holds A[g][4t..4t+3] (a0, one byte each, lowest first),
// A[g+8][4t..] (a1), A[g][16+4t..] (a2), A[g+8][16+4t..] (a3),
// B[4t..4t+3][g] (b0), B[16+4t..][g] (b1).
inline void simt_mma_e4m3(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
    simt_mma<32>(c, a, b0, b1, [](int l, const uint32_t* a, uint32_t b0, uint32_t b1,
                                  float (*A)[32], float (*B)[8]) {
        const int g = l >> 2, t = l & 3;
        for (int i = 0; i < 4; ++i) {
            const int sh = 8 * i;
            A[g][4 * t + i] = simt_e4m3_value((a[0] >> sh) & 0xffu);
            A[g + 8][4 * t + i] = simt_e4m3_value((a[1] >> sh) & 0xffu);
            A[g][16 + 4 * t + i] = simt_e4m3_value((a[2] >> sh) & 0xffu);
            A[g + 8][16 + 4 * t + i] = simt_e4m3_value((a[3] >> sh) & 0xffu);
            B[4 * t + i][g] = simt_e4m3_value((b0 >> sh) & 0xffu);
            B[16 + 4 * t + i][g] = simt_e4m3_value((b1 >> sh) & 0xffu);
        }
    });
}
