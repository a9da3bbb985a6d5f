// emu.cpp: the scheduler of the CUDA CPU emulation (see cuda_emu.h), the kernel
// registry and the C entry points the Rust side calls (kernels/src/emu.rs).
#include "cuda_emu.h"
#include "registry.h"

#include <cfenv>
#include <csetjmp>
#include <csignal>
#include <cstdarg>
#include <cstdio>
#include <string>
#include <sys/mman.h>
#include <unistd.h>
#include <vector>

// A fiber switch that saves only the callee-saved registers (no signal-mask system call,
// unlike swapcontext): mkv_emu_switch(&save_sp, new_sp).
#ifndef __x86_64__
#error "the emulation's fiber switch (mkv_emu_switch) is x86-64 assembly"
#endif
extern "C" void mkv_emu_switch(void** save_sp, void* new_sp);
asm(R"(
    .text
    .globl mkv_emu_switch
    .type mkv_emu_switch, @function
mkv_emu_switch:
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
    .size mkv_emu_switch, .-mkv_emu_switch
)");

namespace mkv_emu {

thread_local Thread* cur_thread = nullptr;
thread_local Block* cur_block = nullptr;

namespace {

constexpr size_t kStack = 128 * 1024;  // per fiber (kernels keep small frames; sanitizers need more)

size_t page() { return (size_t)sysconf(_SC_PAGESIZE); }

// A mapping whose lowest page (stacks) or highest page (shared memory) is PROT_NONE.
struct Guarded {
    unsigned char* base = nullptr;
    size_t len = 0;
    unsigned char* guard = nullptr;  // the PROT_NONE page
    bool map(size_t usable, bool guard_high) {
        const size_t pg = page();
        const size_t u = (usable + pg - 1) / pg * pg;
        len = u + pg;
        void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) { base = nullptr; return false; }
        base = (unsigned char*)p;
        guard = guard_high ? base + u : base;
        mprotect(guard, pg, PROT_NONE);
        return true;
    }
    void unmap() {
        if (base) munmap(base, len);
        base = nullptr;
    }
};

struct Launch {
    const KernelEntry* k = nullptr;
    Block block{};
    std::vector<Thread> threads;
    std::vector<Guarded>* stacks = nullptr;  // this OS thread's pool, at least one per thread
    Guarded smem;
    void* sched_sp = nullptr;  // the scheduler's saved stack pointer
    void** args = nullptr;
    std::string error;
    bool failed = false;
    sigjmp_buf segv_jump;
    bool segv_armed = false;
};

thread_local Launch* cur_launch = nullptr;
struct sigaction prev_segv, prev_ill;

void on_segv(int sig, siginfo_t* si, void* uc) {
    Launch* l = cur_launch;
    if (l && l->segv_armed && cur_thread && sig == SIGILL) {
        // -fsanitize=bounds with traps: an index past a fixed-size array (static __shared__
        // arrays, local arrays such as a bitmap's words) in the kernel code.
        char buf[200];
        snprintf(buf, sizeof buf,
                 "index out of bounds of a fixed-size array (static shared memory or a local array; "
                 "-fsanitize=bounds trap), block (%u,%u,%u) thread %d",
                 l->block.bid.x, l->block.bid.y, l->block.bid.z, cur_thread->linear);
        l->error = buf;
        l->failed = true;
        siglongjmp(l->segv_jump, 1);
    }
    if (l && l->segv_armed && cur_thread) {
        const unsigned char* a = (const unsigned char*)si->si_addr;
        const size_t pg = page();
        if (l->smem.base && a >= l->smem.guard && a < l->smem.guard + pg) {
            const long off = (long)(a - l->block.dyn_smem);
            char buf[256];
            snprintf(buf, sizeof buf,
                     "shared-memory index out of bounds: byte %ld of a %zu-byte dynamic shared buffer, "
                     "block (%u,%u,%u) thread %d",
                     off, l->block.dyn_bytes, l->block.bid.x, l->block.bid.y, l->block.bid.z, cur_thread->linear);
            l->error = buf;
            l->failed = true;
            siglongjmp(l->segv_jump, 1);
        }
        for (auto& s : *l->stacks) {
            if (a >= s.guard && a < s.guard + pg) {
                l->error = "fiber stack overflow in thread " + std::to_string(cur_thread->linear);
                l->failed = true;
                siglongjmp(l->segv_jump, 1);
            }
        }
    }
    // Not ours: hand it to whoever was there before (Rust's stack-overflow handler, or the default).
    struct sigaction& prev = sig == SIGILL ? prev_ill : prev_segv;
    if (prev.sa_flags & SA_SIGINFO) {
        prev.sa_sigaction(sig, si, uc);
    } else if (prev.sa_handler == SIG_DFL || prev.sa_handler == SIG_IGN) {
        signal(sig, SIG_DFL);
    } else {
        prev.sa_handler(sig);
    }
}

void install_segv() {
    static bool once = [] {
        struct sigaction sa {};
        sa.sa_sigaction = on_segv;
        sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
        sigemptyset(&sa.sa_mask);
        sigaction(SIGSEGV, &sa, &prev_segv);
        sigaction(SIGILL, &sa, &prev_ill);
        return true;
    }();
    (void)once;
}

// Gives the fault handler a stack of its own on this OS thread (a fault on a fiber's guard
// page cannot run on the fiber's stack). A thread that already has one (Rust's threads do,
// for their stack-overflow handler) keeps it.
void ensure_altstack() {
    static thread_local std::vector<unsigned char> alt;
    if (!alt.empty()) return;
    stack_t cur{};
    if (sigaltstack(nullptr, &cur) == 0 && !(cur.ss_flags & SS_DISABLE) && cur.ss_size >= 16 * 1024) return;
    alt.resize(64 * 1024);
    stack_t ss{};
    ss.ss_sp = alt.data();
    ss.ss_size = alt.size();
    sigaltstack(&ss, nullptr);
}

[[noreturn]] void fiber_main() {
    Launch* l = cur_launch;
    l->k->invoke(l->args);
    cur_thread->wait = Wait::Done;
    mkv_emu_switch(&cur_thread->ctx, l->sched_sp);
    abort();  // an exited fiber is never resumed
}

// The fiber stacks of this OS thread, kept between launches.
std::vector<Guarded>& stack_pool(size_t n) {
    static thread_local std::vector<Guarded> pool;
    while (pool.size() < n) {
        Guarded g;
        if (!g.map(kStack, false)) break;
        pool.push_back(g);
    }
    return pool;
}

// A fresh fiber on `stack` whose first switch enters fiber_main (see mkv_emu_switch: six
// callee-saved registers, then the return address; entry with rsp % 16 == 8).
void* fresh_fiber(const Guarded& stack) {
    uintptr_t top = ((uintptr_t)(stack.guard + page() + kStack)) & ~(uintptr_t)15;
    void** sp = (void**)top;
    *--sp = nullptr;                     // fiber_main's (never used) return address
    *--sp = (void*)&fiber_main;          // popped by mkv_emu_switch's ret
    for (int i = 0; i < 6; ++i) *--sp = nullptr;  // r15 r14 r13 r12 rbx rbp
    return sp;
}

const char* wait_name(const Thread& t) {
    switch (t.wait) {
        case Wait::Run: return "running";
        case Wait::Barrier: return "__syncthreads";
        case Wait::Warp: return t.what;
        case Wait::Done: return "exited";
    }
    return "?";
}

std::string where(const Thread& t) {
    if (t.wait == Wait::Done) return "exited";
    return std::string(wait_name(t)) + " at line " + std::to_string(t.site);
}

// Completes the warp operation lane `t` waits at if every lane of its mask is there.
bool try_warp(Launch& l, Thread& t, int first_of_warp, int nthreads) {
    const unsigned m = t.mask;
    for (int i = 0; i < 32; ++i) {
        if (!((m >> i) & 1u)) continue;
        const int idx = first_of_warp + i;
        if (idx >= nthreads) return false;
        const Thread& o = l.threads[idx];
        if (o.wait != Wait::Warp || o.site != t.site || o.mask != m || o.op != t.op || o.width != t.width) return false;
    }
    unsigned ballot = 0;
    for (int i = 0; i < 32; ++i)
        if ((m >> i) & 1u) ballot |= (l.threads[first_of_warp + i].value != 0 ? 1u : 0u) << i;
    for (int i = 0; i < 32; ++i) {
        if (!((m >> i) & 1u)) continue;
        Thread& o = l.threads[first_of_warp + i];
        const int w = o.width, seg = i & ~(w - 1);
        int src = i;
        switch (o.op) {
            case WarpOp::Xor: src = i ^ o.arg; if (src >= seg + w) src = i; break;
            case WarpOp::Up: src = i - o.arg; if (src < seg) src = i; break;
            case WarpOp::Down: src = i + o.arg; if (src >= seg + w) src = i; break;
            case WarpOp::Idx: src = seg + (o.arg & (w - 1)); break;
            case WarpOp::Ballot: case WarpOp::Sync: break;
        }
        if (o.op == WarpOp::Ballot) {
            o.result = ballot;
        } else if (o.op == WarpOp::Sync) {
            o.result = 0;
        } else {
            if (src < 0 || src > 31 || !((m >> src) & 1u)) {
                char buf[200];
                snprintf(buf, sizeof buf, "%s at line %d: lane %d reads lane %d, which is not in the mask 0x%08x",
                         o.what, o.site, i, src, m);
                l.error = buf;
                l.failed = true;
                return false;
            }
            o.result = l.threads[first_of_warp + src].value;
        }
    }
    for (int i = 0; i < 32; ++i)
        if ((m >> i) & 1u) l.threads[first_of_warp + i].wait = Wait::Run;
    return true;
}

// Describes why no thread of the block can continue.
std::string stuck_report(Launch& l) {
    const int n = (int)l.threads.size();
    const Block& b = l.block;
    char head[160];
    snprintf(head, sizeof head, "kernel %s, block (%u,%u,%u): ", l.k->name, b.bid.x, b.bid.y, b.bid.z);
    for (int i = 0; i < n; ++i) {
        const Thread& t = l.threads[i];
        if (t.wait != Wait::Warp) continue;
        const int w0 = (i / 32) * 32;
        std::string arrived, missing;
        for (int j = 0; j < 32; ++j) {
            if (!((t.mask >> j) & 1u)) continue;
            if (w0 + j >= n) { missing += " lane " + std::to_string(j) + " (no such thread)"; continue; }
            const Thread& o = l.threads[w0 + j];
            if (o.wait == Wait::Warp && o.site == t.site && o.mask == t.mask) arrived += " " + std::to_string(j);
            else if (missing.size() < 400) missing += " lane " + std::to_string(j) + " (" + where(o) + ")";
        }
        char buf[200];
        snprintf(buf, sizeof buf, "divergent warp operation: %s at line %d with mask 0x%08x in warp %d: arrived lanes",
                 t.what, t.site, t.mask, i / 32);
        return head + std::string(buf) + arrived + "; not arrived:" + missing;
    }
    int at_barrier = 0, done = 0, site = -1;
    bool mixed = false;
    for (const Thread& t : l.threads) {
        if (t.wait == Wait::Barrier) {
            if (site >= 0 && site != t.site) mixed = true;
            site = t.site;
            ++at_barrier;
        }
        if (t.wait == Wait::Done) ++done;
    }
    std::string s = head;
    if (mixed) s += "threads wait at __syncthreads calls on different lines:";
    else s += "__syncthreads at line " + std::to_string(site) + " reached by " + std::to_string(at_barrier) +
              " of " + std::to_string(n) + " threads; the others:";
    int shown = 0;
    for (const Thread& t : l.threads) {
        if ((t.wait == Wait::Barrier && !mixed) || shown >= 8) continue;
        s += " thread " + std::to_string(t.linear) + " (" + where(t) + ")";
        ++shown;
    }
    (void)done;
    return s;
}

// Runs one block to completion; false (with l.error) on a fault.
bool run_block(Launch& l) {
    const int n = (int)l.threads.size();
    for (int i = 0; i < n; ++i) {
        Thread& t = l.threads[i];
        t.wait = Wait::Run;
        t.ctx = fresh_fiber((*l.stacks)[i]);
    }
    if (l.block.dyn_smem) memset(l.block.dyn_smem, 0xff, l.block.dyn_bytes);  // uninitialized: NaN floats
    for (;;) {
        // Run every runnable fiber until it waits or exits.
        bool ran = false;
        for (int i = 0; i < n; ++i) {
            Thread& t = l.threads[i];
            if (t.wait != Wait::Run) continue;
            ran = true;
            cur_thread = &t;
            mkv_emu_switch(&l.sched_sp, t.ctx);
            cur_thread = nullptr;
            if (l.failed) return false;
        }
        (void)ran;
        // Complete every warp operation whose lanes have all arrived.
        bool progressed = false;
        for (int i = 0; i < n; ++i) {
            Thread& t = l.threads[i];
            if (t.wait == Wait::Warp && try_warp(l, t, (i / 32) * 32, n)) progressed = true;
            if (l.failed) return false;
        }
        if (progressed) continue;
        int done = 0, barrier = 0, site = -1;
        bool mixed = false, warp = false;
        for (const Thread& t : l.threads) {
            if (t.wait == Wait::Done) ++done;
            if (t.wait == Wait::Warp) warp = true;
            if (t.wait == Wait::Barrier) {
                if (site >= 0 && t.site != site) mixed = true;
                site = t.site;
                ++barrier;
            }
        }
        if (done == n) return true;
        if (!warp && !mixed && barrier == n) {
            for (Thread& t : l.threads) t.wait = Wait::Run;
            continue;
        }
        l.error = stuck_report(l);
        l.failed = true;
        return false;
    }
}

}  // namespace

void yield() {
    Thread* t = cur_thread;
    mkv_emu_switch(&t->ctx, cur_launch->sched_sp);
}

void fault(const char* fmt, ...) {
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    Launch* l = cur_launch;
    l->error = buf;
    l->failed = true;
    cur_thread->wait = Wait::Done;
    mkv_emu_switch(&cur_thread->ctx, l->sched_sp);
    abort();  // never resumed
}

uint16_t d2h(double d) {
    const uint64_t b = to_bits(d);
    const uint16_t sign = (uint16_t)((b >> 48) & 0x8000u);
    if (std::isnan(d)) return (uint16_t)(sign | 0x7e00u);
    const double x = std::fabs(d);
    if (x >= 65520.0) return (uint16_t)(sign | 0x7c00u);  // rounds to +-inf (65504 is the largest half)
    if (x < 0x1p-14) {
        // Subnormal (or zero): multiples of 2^-24; rint rounds half to even.
        const double q = std::rint(x * 0x1p24);  // exact scaling by a power of two
        return (uint16_t)(sign | (uint16_t)q);   // q == 1024 is the smallest normal, correctly
    }
    int e;
    const double m = std::frexp(x, &e);       // x = m * 2^e, m in [0.5, 1)
    double q = std::rint(m * 2048.0);          // 11 significant bits
    if (q == 2048.0) { q = 1024.0; ++e; }
    const int be = e - 1 + 15;                 // biased exponent of 1.f * 2^(e-1)
    if (be >= 31) return (uint16_t)(sign | 0x7c00u);
    return (uint16_t)(sign | (uint16_t)(be << 10) | (uint16_t)((int)q - 1024));
}

namespace {
int fe_mode(int mode) {
    switch (mode) {
        case RZ: return FE_TOWARDZERO;
        case RU: return FE_UPWARD;
        case RD: return FE_DOWNWARD;
        default: return FE_TONEAREST;
    }
}
struct Round {
    int old;
    explicit Round(int mode) : old(fegetround()) { fesetround(fe_mode(mode)); }
    ~Round() { fesetround(old); }
};
}  // namespace

// The operations are on volatile operands so no constant folding crosses the mode change
// (the file is compiled with -frounding-math as well).
float fadd_r(float a, float b, int mode) { Round r(mode); volatile float x = a, y = b; volatile float z = x + y; return z; }
float fmul_r(float a, float b, int mode) { Round r(mode); volatile float x = a, y = b; volatile float z = x * y; return z; }
float fdiv_r(float a, float b, int mode) { Round r(mode); volatile float x = a, y = b; volatile float z = x / y; return z; }
float fmaf_r(float a, float b, float c, int mode) { Round r(mode); volatile float x = a, y = b, w = c; volatile float z = std::fmaf(x, y, w); return z; }
double dadd_r(double a, double b, int mode) { Round r(mode); volatile double x = a, y = b; volatile double z = x + y; return z; }
double dmul_r(double a, double b, int mode) { Round r(mode); volatile double x = a, y = b; volatile double z = x * y; return z; }
double ddiv_r(double a, double b, int mode) { Round r(mode); volatile double x = a, y = b; volatile double z = x / y; return z; }
double dfma_r(double a, double b, double c, int mode) { Round r(mode); volatile double x = a, y = b, w = c; volatile double z = std::fma(x, y, w); return z; }
float d2f_r(double d, int mode) { Round r(mode); volatile double x = d; volatile float z = (float)x; return z; }

}  // namespace mkv_emu

using namespace mkv_emu;

namespace {
std::vector<const KernelEntry*>& registry() {
    static std::vector<const KernelEntry*> all = [] {
        std::vector<const KernelEntry*> v;
        mkv_emu_register_kernels(v);
        mkv_emu_register_divergent(v);
        mkv_emu_register_selftest(v);
        return v;
    }();
    return all;
}
const KernelEntry* find(const char* name) {
    for (const KernelEntry* k : registry())
        if (std::strcmp(k->name, name) == 0) return k;
    return nullptr;
}
void put(char* err, size_t len, const std::string& s) {
    if (!err || len == 0) return;
    snprintf(err, len, "%s", s.c_str());
}
}  // namespace

extern "C" {

size_t mkv_emu_kernel_count() { return registry().size(); }
const char* mkv_emu_kernel_name(size_t i) { return i < registry().size() ? registry()[i]->name : nullptr; }

// Return codes: 0 ok, 1 unknown kernel, 2 argument count or sizes differ from the kernel's
// signature, 3 the launch exceeds a device limit, 4 a fault while running (report in err).
int mkv_emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                   unsigned bz, size_t dyn_smem, size_t max_dyn_smem, void** args, const size_t* arg_sizes,
                   size_t nargs, char* err, size_t err_len) {
    const KernelEntry* k = find(name);
    if (!k) { put(err, err_len, std::string("no emulated kernel named ") + name); return 1; }
    if (nargs != k->nargs) {
        put(err, err_len, std::string(name) + ": " + std::to_string(nargs) + " arguments given, the kernel takes " +
                              std::to_string(k->nargs));
        return 2;
    }
    for (size_t i = 0; i < nargs; ++i)
        if (arg_sizes[i] != k->sizes[i]) {
            put(err, err_len, std::string(name) + ": argument " + std::to_string(i) + " has " +
                                  std::to_string(arg_sizes[i]) + " bytes, the kernel's parameter " +
                                  std::to_string(k->sizes[i]));
            return 2;
        }
    const unsigned long long threads = (unsigned long long)bx * by * bz;
    std::string lim;
    if (gx == 0 || gy == 0 || gz == 0 || threads == 0) lim = "an empty grid or block";
    else if (gx > 0x7fffffffu || gy > 65535u || gz > 65535u) lim = "grid dimensions past (2^31-1, 65535, 65535)";
    else if (threads > 1024) lim = std::to_string(threads) + " threads per block (the limit is 1024)";
    else if (k->launch_bound && threads > k->launch_bound)
        lim = std::to_string(threads) + " threads per block, past its __launch_bounds__(" +
              std::to_string(k->launch_bound) + ")";
    else if (dyn_smem > max_dyn_smem)
        lim = std::to_string(dyn_smem) + " B of dynamic shared memory, past the " + std::to_string(max_dyn_smem) +
              " B the launch opted in to";
    if (!lim.empty()) { put(err, err_len, std::string(name) + ": launch with " + lim); return 3; }

    install_segv();
    ensure_altstack();
    Launch l;
    l.k = k;
    l.args = args;
    l.threads.resize(threads);
    l.stacks = &stack_pool(threads);
    if (l.stacks->size() < threads) { put(err, err_len, "emulation: cannot map fiber stacks"); return 4; }
    if (dyn_smem > 0) {
        if (!l.smem.map(dyn_smem, true)) { put(err, err_len, "emulation: cannot map shared memory"); return 4; }
        // Ends exactly at the guard page (16-byte aligned start; up to 15 bytes of slack).
        l.block.dyn_smem = (unsigned char*)(((uintptr_t)(l.smem.guard - dyn_smem)) & ~(uintptr_t)15);
        l.block.dyn_bytes = dyn_smem;
    }
    for (unsigned long long i = 0; i < threads; ++i) {
        Thread& t = l.threads[i];
        t.linear = (int)i;
        t.tid = {(unsigned)(i % bx), (unsigned)((i / bx) % by), (unsigned)(i / ((unsigned long long)bx * by))};
        t.lane = (int)(i % 32);
        t.warp = (int)(i / 32);
    }
    l.block.bdim = {bx, by, bz};
    l.block.gdim = {gx, gy, gz};
    Launch* prev_launch = cur_launch;
    Block* prev_block = cur_block;
    cur_launch = &l;
    cur_block = &l.block;
    volatile int rc = 0;
    if (sigsetjmp(l.segv_jump, 1) == 0) {
        l.segv_armed = true;
        for (unsigned z = 0; z < gz && rc == 0; ++z)
            for (unsigned y = 0; y < gy && rc == 0; ++y)
                for (unsigned x = 0; x < gx && rc == 0; ++x) {
                    l.block.bid = {x, y, z};
                    if (!run_block(l)) rc = 4;
                }
    } else {
        rc = 4;
    }
    l.segv_armed = false;
    cur_thread = nullptr;
    cur_launch = prev_launch;
    cur_block = prev_block;
    l.smem.unmap();
    if (rc) put(err, err_len, std::string(name) + ": " + l.error);
    return rc;
}

}  // extern "C"
