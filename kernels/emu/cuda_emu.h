// cuda_emu.h: a CPU emulation of the parts of the CUDA execution model the MosaicKV
// kernels use (feature `emulated` of mosaickv-kernels; testing infrastructure only).
//
// Every `kernels/cuda/*.cu` compiles as host C++ with this header included first
// (MKV_EMULATED defined). A launch runs each thread block's threads as cooperatively
// scheduled fibers on one OS thread (emu.cpp), blocks one after another, so a run is
// deterministic. Each fiber runs until it reaches a synchronization point:
//   __syncthreads        a barrier every thread of the block must reach (same call site);
//   __shfl_*_sync, votes every lane named in the mask must arrive at the same call
//                        (same call site, same mask) before any lane continues;
// and the scheduler reports, as a launch error, a barrier or warp operation that not all
// threads reached, an out-of-bounds access past the dynamic shared memory (a guard page)
// and a launch larger than the device limits the host code assumes.
// What it does not model: the memory model (fibers interleave only at those points),
// timing, real warp scheduling or independent thread scheduling inside a warp.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>

#define MKV_EMULATED 1

struct uint2 { unsigned int x, y; };
struct uint3 { unsigned int x, y, z; };
struct uint4 { unsigned int x, y, z, w; };
struct int3 { int x, y, z; };
struct dim3 { unsigned int x, y, z; };
inline uint2 make_uint2(unsigned int x, unsigned int y) { return {x, y}; }
inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) { return {x, y, z, w}; }
inline int3 make_int3(int x, int y, int z) { return {x, y, z}; }

namespace mkv_emu {

enum class Wait : int { Run, Barrier, Warp, Done };
enum class WarpOp : int { Xor, Up, Down, Idx, Ballot, Sync };

// One emulated thread (a fiber). The scheduler (emu.cpp) owns the array.
struct Thread {
    uint3 tid;
    int linear, lane, warp;
    Wait wait;
    int site;          // source line of the barrier / warp operation it waits at
    const char* what;  // its name, for reports
    // Warp operation in flight.
    WarpOp op;
    unsigned mask;
    int arg, width;
    uint64_t value;
    uint64_t result;
    void* ctx;  // the fiber's saved stack pointer (emu.cpp, mkv_emu_switch)
};

struct Block {
    uint3 bid, bdim, gdim;
    unsigned char* dyn_smem;
    size_t dyn_bytes;
};

extern thread_local Thread* cur_thread;
extern thread_local Block* cur_block;

// Suspends the current fiber until the scheduler resumes it.
void yield();
// Reports a fault of the current launch (printf format) and abandons the launch.
[[noreturn]] void fault(const char* fmt, ...);

inline void syncthreads(int line) {
    Thread* t = cur_thread;
    t->wait = Wait::Barrier;
    t->site = line;
    t->what = "__syncthreads";
    yield();
}

template <class T>
inline uint64_t to_bits(T v) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>);
    uint64_t b = 0;
    std::memcpy(&b, &v, sizeof(T));
    return b;
}
template <class T>
inline T from_bits(uint64_t b) {
    T v;
    std::memcpy(&v, &b, sizeof(T));
    return v;
}

inline uint64_t warp_op(WarpOp op, const char* what, unsigned mask, uint64_t value, int arg, int width, int line) {
    Thread* t = cur_thread;
    if (!((mask >> t->lane) & 1u))
        fault("%s at line %d: lane %d of warp %d calls it with mask 0x%08x, which does not name it", what, line,
              t->lane, t->warp, mask);
    if (width <= 0 || width > 32 || (width & (width - 1)) != 0)
        fault("%s at line %d: width %d is not a power of two in 1..32", what, line, width);
    t->wait = Wait::Warp;
    t->op = op;
    t->what = what;
    t->site = line;
    t->mask = mask;
    t->value = value;
    t->arg = arg;
    t->width = width;
    yield();
    return t->result;
}

template <class T>
inline T shfl(WarpOp op, const char* what, unsigned mask, T v, int arg, int width, int line) {
    return from_bits<T>(warp_op(op, what, mask, to_bits(v), arg, width, line));
}

// Host f16 (IEEE binary16 bits) conversions: exact widening, one round-to-nearest-even
// narrowing from f64 (a float widens to double exactly, so f32 -> f16 is one rounding too).
inline float h2f(uint16_t h) {
    const int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
    float v;
    if (e == 0) v = std::ldexp((float)m, -24);
    else if (e == 31) v = m ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
    else v = std::ldexp((float)(m | 1024), e - 25);
    return s ? -v : v;
}
uint16_t d2h(double d);

// Explicitly rounded arithmetic (emu.cpp, under fesetround with -frounding-math).
float fadd_r(float a, float b, int mode);
float fmul_r(float a, float b, int mode);
float fdiv_r(float a, float b, int mode);
float fmaf_r(float a, float b, float c, int mode);
double dadd_r(double a, double b, int mode);
double dmul_r(double a, double b, int mode);
double ddiv_r(double a, double b, int mode);
double dfma_r(double a, double b, double c, int mode);
float d2f_r(double d, int mode);
enum : int { RN = 0, RZ = 1, RU = 2, RD = 3 };

inline unsigned fns(unsigned mask, unsigned base, int offset) {
    if (base > 31) return 0xffffffffu;
    if (offset == 0) return ((mask >> base) & 1u) ? base : 0xffffffffu;
    if (offset > 0) {
        for (int b = (int)base; b < 32; ++b)
            if (((mask >> b) & 1u) && --offset == 0) return (unsigned)b;
    } else {
        for (int b = (int)base; b >= 0; --b)
            if (((mask >> b) & 1u) && ++offset == 0) return (unsigned)b;
    }
    return 0xffffffffu;
}

}  // namespace mkv_emu

// ---- Qualifiers and launch syntax ------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// Function-local static storage is one object per OS thread; the fibers of a block run
// on one OS thread and blocks run one after another, so it is per-block shared memory.
#define __shared__ static thread_local
// Dynamic shared memory (`MKV_EXTERN_SMEM(name)` in the kernels): the launch's buffer,
// which ends at a guard page.
#define MKV_EXTERN_SMEM(name) unsigned char* const name = ::mkv_emu::cur_block->dyn_smem

// ---- Builtin indices --------------------------------------------------------------------
#define threadIdx (::mkv_emu::cur_thread->tid)
#define blockIdx (::mkv_emu::cur_block->bid)
#define blockDim (::mkv_emu::cur_block->bdim)
#define gridDim (::mkv_emu::cur_block->gdim)
#define warpSize 32

// ---- Synchronization ----------------------------------------------------------------------
#define __syncthreads() ::mkv_emu::syncthreads(__LINE__)
#define __syncwarp(mask) ((void)::mkv_emu::warp_op(::mkv_emu::WarpOp::Sync, "__syncwarp", (mask), 0, 0, 32, __LINE__))
#define __shfl_xor_sync(mask, v, o, ...) \
    ::mkv_emu::shfl(::mkv_emu::WarpOp::Xor, "__shfl_xor_sync", (mask), (v), (o), mkv_emu_width(__VA_ARGS__), __LINE__)
#define __shfl_up_sync(mask, v, o, ...) \
    ::mkv_emu::shfl(::mkv_emu::WarpOp::Up, "__shfl_up_sync", (mask), (v), (o), mkv_emu_width(__VA_ARGS__), __LINE__)
#define __shfl_down_sync(mask, v, o, ...) \
    ::mkv_emu::shfl(::mkv_emu::WarpOp::Down, "__shfl_down_sync", (mask), (v), (o), mkv_emu_width(__VA_ARGS__), __LINE__)
#define __shfl_sync(mask, v, o, ...) \
    ::mkv_emu::shfl(::mkv_emu::WarpOp::Idx, "__shfl_sync", (mask), (v), (o), mkv_emu_width(__VA_ARGS__), __LINE__)
#define __ballot_sync(mask, p) \
    ((unsigned)::mkv_emu::warp_op(::mkv_emu::WarpOp::Ballot, "__ballot_sync", (mask), (p) ? 1u : 0u, 0, 32, __LINE__))
#define __any_sync(mask, p) (__ballot_sync((mask), (p)) != 0u)
#define __all_sync(mask, p) (__ballot_sync((mask), (p)) == (unsigned)(mask))
inline int mkv_emu_width() { return 32; }
inline int mkv_emu_width(int w) { return w; }

// ---- Atomics (fibers switch only at synchronization points, so these are atomic) ----
template <class T>
inline T atomicAdd(T* p, T v) { T o = *p; *p = o + v; return o; }
template <class T>
inline T atomicOr(T* p, T v) { T o = *p; *p = o | v; return o; }
template <class T>
inline T atomicAnd(T* p, T v) { T o = *p; *p = o & v; return o; }
template <class T>
inline T atomicMax(T* p, T v) { T o = *p; *p = o < v ? v : o; return o; }
template <class T>
inline T atomicMin(T* p, T v) { T o = *p; *p = v < o ? v : o; return o; }
template <class T>
inline T atomicExch(T* p, T v) { T o = *p; *p = v; return o; }
template <class T>
inline T atomicCAS(T* p, T cmp, T v) { T o = *p; if (o == cmp) *p = v; return o; }

// ---- Loads, bits, reinterpretation ------------------------------------------------------
template <class T>
inline T __ldg(const T* p) { return *p; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
// Four signed byte products of a and b added to c (PTX dp4a.s32.s32): exact integers.
inline int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; ++i) c += (int)(signed char)((unsigned)a >> (8 * i)) * (int)(signed char)((unsigned)b >> (8 * i));
    return c;
}
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }
inline unsigned __brev(unsigned x) {
    unsigned r = 0;
    for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
    return r;
}
inline unsigned __fns(unsigned mask, unsigned base, int offset) { return ::mkv_emu::fns(mask, base, offset); }
inline float __int_as_float(int x) { return ::mkv_emu::from_bits<float>((uint32_t)x); }
inline int __float_as_int(float x) { return (int)(uint32_t)::mkv_emu::to_bits(x); }
inline float __uint_as_float(unsigned x) { return ::mkv_emu::from_bits<float>(x); }
inline unsigned __float_as_uint(float x) { return (uint32_t)::mkv_emu::to_bits(x); }
inline double __longlong_as_double(long long x) { return ::mkv_emu::from_bits<double>((uint64_t)x); }
inline long long __double_as_longlong(double x) { return (long long)::mkv_emu::to_bits(x); }

// ---- min / max as CUDA overloads them (both operands converted to their common type) ----
template <class A, class B>
inline std::common_type_t<A, B> min(A a, B b) {
    using C = std::common_type_t<A, B>;
    return (C)b < (C)a ? (C)b : (C)a;
}
template <class A, class B>
inline std::common_type_t<A, B> max(A a, B b) {
    using C = std::common_type_t<A, B>;
    return (C)a < (C)b ? (C)b : (C)a;
}
// fmaxf, exp2f, rint, fma, ... are the C library's (<cmath>): the device's exp2f is an
// approximation, so outputs built on it compare within a tolerance, never bit for bit.

// ---- Explicitly rounded arithmetic: the rounding each name says ----------------------------
#define MKV_EMU_ROUNDED(sfx, mode)                                                                          \
    inline float __fadd_##sfx(float a, float b) { return ::mkv_emu::fadd_r(a, b, mode); }                  \
    inline float __fmul_##sfx(float a, float b) { return ::mkv_emu::fmul_r(a, b, mode); }                  \
    inline float __fdiv_##sfx(float a, float b) { return ::mkv_emu::fdiv_r(a, b, mode); }                  \
    inline float __fmaf_##sfx(float a, float b, float c) { return ::mkv_emu::fmaf_r(a, b, c, mode); }      \
    inline double __dadd_##sfx(double a, double b) { return ::mkv_emu::dadd_r(a, b, mode); }               \
    inline double __dmul_##sfx(double a, double b) { return ::mkv_emu::dmul_r(a, b, mode); }               \
    inline double __ddiv_##sfx(double a, double b) { return ::mkv_emu::ddiv_r(a, b, mode); }               \
    inline double __fma_##sfx(double a, double b, double c) { return ::mkv_emu::dfma_r(a, b, c, mode); }   \
    inline float __double2float_##sfx(double d) { return ::mkv_emu::d2f_r(d, mode); }
MKV_EMU_ROUNDED(rn, ::mkv_emu::RN)
MKV_EMU_ROUNDED(rz, ::mkv_emu::RZ)
MKV_EMU_ROUNDED(ru, ::mkv_emu::RU)
MKV_EMU_ROUNDED(rd, ::mkv_emu::RD)
#undef MKV_EMU_ROUNDED
