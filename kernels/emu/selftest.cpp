// selftest.cpp: small kernels that break one rule each, and one that follows them, so
// kernels/tests/emu.rs can show the emulation reports each fault (and nothing else).
#include "cuda_emu.h"
#include "registry.h"
#include "../cuda/common.cuh"

// Follows every rule: block-wide sum via warp shuffles and a barrier; out[blockIdx.x] = sum.
extern "C" __global__ void emu_test_ok(const float* in, float* out) {
    __shared__ float red[32];
    float v = in[blockIdx.x * blockDim.x + threadIdx.x];
    v = mkv_warp_sum(v);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        float s = 0.0f;
        for (unsigned w = 0; w < blockDim.x / 32; ++w) s += red[w];
        out[blockIdx.x] = s;
    }
}

// Threads below `cut` skip the barrier.
extern "C" __global__ void emu_test_barrier(int cut, int* out) {
    if ((int)threadIdx.x >= cut) {
        __syncthreads();
        out[threadIdx.x] = 1;
    }
}

// Lanes below `cut` call a full-mask shuffle; the rest skip it.
extern "C" __global__ void emu_test_shuffle(int cut, float* out) {
    float v = (float)threadIdx.x;
    if ((int)(threadIdx.x & 31) < cut) v = __shfl_xor_sync(MKV_FULL_MASK, v, 1);
    out[threadIdx.x] = v;
}

// Writes dynamic shared memory at index `idx` (floats).
extern "C" __global__ void emu_test_dyn_smem(int idx, float* out) {
    MKV_EXTERN_SMEM(smem);
    float* s = reinterpret_cast<float*>(smem);
    if (threadIdx.x == 0) s[idx] = 1.0f;
    __syncthreads();
    if (threadIdx.x == 0) out[0] = s[idx];
}

// Writes a static shared array of 64 floats at index `idx`.
extern "C" __global__ void emu_test_static_smem(int idx, float* out) {
    __shared__ float s[64];
    if (threadIdx.x == 0) s[idx] = 2.0f;
    __syncthreads();
    if (threadIdx.x == 0) out[0] = s[idx];
}

// out[i] = the rounding intrinsics and f16 conversions on in[i] (host checks each).
extern "C" __global__ void emu_test_round(const double* in, i64 n, double* out) {
    for (i64 i = threadIdx.x; i < n; i += blockDim.x) {
        const double a = in[2 * i], b = in[2 * i + 1];
        double* o = out + 16 * i;
        o[0] = __double2float_rn(a);
        o[1] = __double2float_rz(a);
        o[2] = __double2float_ru(a);
        o[3] = __double2float_rd(a);
        o[4] = __fadd_rn((float)a, (float)b);
        o[5] = __fadd_ru((float)a, (float)b);
        o[6] = __fadd_rd((float)a, (float)b);
        o[7] = __fmul_ru((float)a, (float)b);
        o[8] = __fmul_rd((float)a, (float)b);
        o[9] = __dadd_ru(a, b);
        o[10] = __dadd_rd(a, b);
        o[11] = __dmul_ru(a, b);
        o[12] = __dmul_rd(a, b);
        o[13] = (double)mkv_d2h(a);
        o[14] = (double)mkv_f2h((float)a);
        o[15] = (double)mkv_h2f((u16)((u64)(i * 2654435761ull) & 0xffffu));
    }
}

void mkv_emu_register_selftest(std::vector<const mkv_emu::KernelEntry*>& v) {
    MKV_EMU_ENTRY(v, "emu_test_ok", emu_test_ok, 0);
    MKV_EMU_ENTRY(v, "emu_test_barrier", emu_test_barrier, 0);
    MKV_EMU_ENTRY(v, "emu_test_shuffle", emu_test_shuffle, 0);
    MKV_EMU_ENTRY(v, "emu_test_dyn_smem", emu_test_dyn_smem, 0);
    MKV_EMU_ENTRY(v, "emu_test_static_smem", emu_test_static_smem, 0);
    MKV_EMU_ENTRY(v, "emu_test_round", emu_test_round, 0);
}
