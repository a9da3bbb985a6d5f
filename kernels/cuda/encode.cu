// encode.cu: SPEC.md sections 5-7 on the device.
//   mkv_encode      rotate rows by R (f64 accumulation, one f16 rounding), per-vector
//                   top-r groups (ties to the lower group), packed records (section 6):
//                   f16 values, or int8 / int4 codes with the record's minimum and scale
//   mkv_decode      packed records -> dense rotated rows [n][Dt] (zeros where not kept;
//                   int8 / int4 values decoded as m + code * s in f32)
//   mkv_block_meta  per-block, per-dim min/max of the decoded keys as int8 + f32 scale (section 7)
// One thread block per row (encode/decode) or per token block (meta); grid-stride loops.
#include "common.cuh"

// SPEC.md section 6, Quantization step 2 (the scale): the smallest f16 s with
// qmax * s >= a (qmax * s of an f16 is exact in f64): the nearest f16 to a / qmax, then
// moved by whole f16 steps; 0 when a = 0. a is finite and at most 2 * 65504.
__device__ __forceinline__ u16 mkv_quant_scale(double a, int qmax) {
    if (!(a > 0.0)) return 0;
    const double q = (double)qmax;
    u16 s = mkv_d2h(__ddiv_rn(a, q));
    while (q * (double)mkv_h2f(s) < a) s = (u16)(s + 1);
    while (s > 0 && q * (double)mkv_h2f((u16)(s - 1)) >= a) s = (u16)(s - 1);
    return s;
}

// SPEC.md section 6, Quantization step 3 (the codes): round_half_even((y - m) / s) in f64
// (y - m is exact; rint rounds half to even), clamped to [0, qmax]; 0 when s = 0.
__device__ __forceinline__ u8 mkv_quant_code(float y, float m, float s, int qmax) {
    if (s == 0.0f) return 0;
    const double c = rint(__ddiv_rn((double)y - (double)m, (double)s));
    return (u8)fmin((double)qmax, fmax(0.0, c));
}

__device__ __forceinline__ float mkv_warp_min(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fminf(v, __shfl_xor_sync(MKV_FULL_MASK, v, o));
    return v;
}

// rows: f32, row i at rows + i * row_stride (D elements). R: D x D row-major f32,
// x' = R^T x. out: n records of `rb` bytes, value dtype `dtype` (MKV_F16 / MKV_INT8 /
// MKV_INT4). status[0] gets bit 1 when a rotated value overflows f16 (the host reports
// NonFinite; the record's bytes are then meaningless). blockDim.x must be a multiple of
// 32 and at most 1024; dynamic shared memory: encode_smem_bytes(D, Dt, Dt/g) (kernels/src/lib.rs).
extern "C" __global__ void mkv_encode(const float* __restrict__ rows, i64 n, i64 row_stride,
                                      const u16* __restrict__ R, int D, int Dt, int r, int g,
                                      int rb, int dtype, u8* __restrict__ out, int* __restrict__ status) {
    MKV_EXTERN_SMEM(smem);
    float* x = reinterpret_cast<float*>(smem);           // [D]
    float* imp = x + D;                                 // [groups]
    int* keep = reinterpret_cast<int*>(imp + Dt / g);   // [groups]
    u16* y = reinterpret_cast<u16*>(keep + Dt / g);     // [Dt]
    u8* codes = reinterpret_cast<u8*>(y + Dt);          // [Dt] (int8 / int4: codes by value index)
    __shared__ float red_lo[32];
    __shared__ float red_hi[32];
    __shared__ u32 quant_word;  // the record's m (low half) and s (high half), f16 bits
    const int groups = Dt / g;
    const int kept = r / g;
    const int w32 = (groups + 31) / 32;
    for (i64 row = blockIdx.x; row < n; row += gridDim.x) {
        const float* src = rows + row * row_stride;
        for (int i = threadIdx.x; i < D; i += blockDim.x) x[i] = src[i];
        __syncthreads();
        // Step 1: y_j = f16(sum_i R[i][j] x_i), f64, ascending i (R's f16 widened). Each
        // product of an f16 and an f32 is exact in f64, so the fused multiply-add rounds like
        // add-after-multiply.
        for (int j = threadIdx.x; j < Dt; j += blockDim.x) {
            double acc = 0.0;
            for (int i = 0; i < D; ++i) acc = fma((double)mkv_h2f(R[(i64)i * Dt + j]), (double)x[i], acc);  // R stored D x Dt
            u16 h = mkv_d2h(acc);
            if (!mkv_h_is_finite(h)) atomicOr(status, 1);
            y[j] = h;
        }
        __syncthreads();
        // Step 2: group importance in f32, ascending dims, no contraction (matches the host).
        for (int k = threadIdx.x; k < groups; k += blockDim.x) {
            float s = 0.0f;
            for (int e = 0; e < g; ++e) {
                float v = mkv_h2f(y[k * g + e]);
                s = __fadd_rn(s, __fmul_rn(v, v));
            }
            imp[k] = s;
        }
        __syncthreads();
        // Step 3: group k is kept iff fewer than r/g groups beat it (higher importance,
        // or equal importance and a lower index).
        for (int k = threadIdx.x; k < groups; k += blockDim.x) {
            float ik = imp[k];
            int rank = 0;
            for (int o = 0; o < groups; ++o) {
                float io = imp[o];
                rank += (io > ik) || (io == ik && o < k);
            }
            keep[k] = rank < kept;
        }
        __syncthreads();
        u8* rec = out + row * (i64)rb;
        const bool quantized = mkv_is_quantized(dtype);
        if (quantized) {
            // SPEC.md section 6, Quantization step 1: m = min, M = max of the kept values
            // (f16 widened to f32, exact), block-wide; a = M - m in f64 (exact).
            float lo = MKV_INF, hi = MKV_NEG_INF;
            for (int j = threadIdx.x; j < Dt; j += blockDim.x) {
                if (!keep[j / g]) continue;
                const float v = mkv_h2f(y[j]);
                lo = fminf(lo, v);
                hi = fmaxf(hi, v);
            }
            lo = mkv_warp_min(lo);
            hi = mkv_warp_max(hi);
            if ((threadIdx.x & 31) == 0) {
                red_lo[threadIdx.x >> 5] = lo;
                red_hi[threadIdx.x >> 5] = hi;
            }
            __syncthreads();
            if (threadIdx.x == 0) {
                for (int w = 1; w < (int)((blockDim.x + 31) >> 5); ++w) {
                    lo = fminf(lo, red_lo[w]);
                    hi = fmaxf(hi, red_hi[w]);
                }
                // A -0 minimum is stored as +0 (-0 + 0 = +0; y - m is the same either way).
                const float m = __fadd_rn(lo, 0.0f);
                const double a = (double)hi - (double)m;
                // An overflowed kept value (already flagged in status) gets a zero scale:
                // the scale search below needs a finite range.
                const u16 sh = (a <= 131008.0) ? mkv_quant_scale(a, mkv_qmax(dtype)) : (u16)0;
                quant_word = (u32)mkv_f2h(m) | ((u32)sh << 16);
            }
            __syncthreads();
        }
        // Bitmap words (little-endian u32; records are 4-byte aligned).
        for (int w = threadIdx.x; w < w32; w += blockDim.x) {
            u32 bits = 0u;
            for (int b = 0; b < 32 && 32 * w + b < groups; ++b)
                if (keep[32 * w + b]) bits |= 1u << b;
            reinterpret_cast<u32*>(rec)[w] = bits;
        }
        // Step 4: kept values in ascending dim order (kept groups ascending, dims inside a
        // group ascending): f16 values, or (int8 / int4) their codes, staged by value index.
        u16* vals = reinterpret_cast<u16*>(rec + 4 * w32);
        const float qm = quantized ? mkv_h2f((u16)(quant_word & 0xffffu)) : 0.0f;
        const float qs = quantized ? mkv_h2f((u16)(quant_word >> 16)) : 0.0f;
        for (int k = threadIdx.x; k < groups; k += blockDim.x) {
            if (!keep[k]) continue;
            int pos = 0;
            for (int o = 0; o < k; ++o) pos += keep[o];
            for (int e = 0; e < g; ++e) {
                if (quantized)
                    codes[pos * g + e] = mkv_quant_code(mkv_h2f(y[k * g + e]), qm, qs, mkv_qmax(dtype));
                else
                    vals[pos * g + e] = y[k * g + e];
            }
        }
        int end = 4 * w32 + 2 * r;  // end of the values
        if (quantized) {
            __syncthreads();
            // SPEC.md section 6 layout: m and s (f16, little-endian), then the codes: int8
            // one byte each; int4 two per byte, low nibble for even i, an odd r's last high
            // nibble 0.
            u8* cb = rec + 4 * w32 + 4;
            if (threadIdx.x == 0) reinterpret_cast<u32*>(rec)[w32] = quant_word;
            if (dtype == MKV_INT8) {
                for (int i = threadIdx.x; i < r; i += blockDim.x) cb[i] = codes[i];
                end = 4 * w32 + 4 + r;
            } else {
                const int nb = (r + 1) / 2;
                for (int i = threadIdx.x; i < nb; i += blockDim.x)
                    cb[i] = (u8)(codes[2 * i] | (2 * i + 1 < r ? codes[2 * i + 1] << 4 : 0));
                end = 4 * w32 + 4 + nb;
            }
        }
        // Zero padding up to the record size.
        for (int b = end + threadIdx.x; b < rb; b += blockDim.x) rec[b] = 0;
        __syncthreads();
    }
}

// packed: n records of layout (Dt, r, g, rb, dtype); out: [n][Dt] f32. SPEC.md section 6,
// Decode: the stored value at kept dims (f16 widened, or m + code * s), 0 elsewhere.
extern "C" __global__ void mkv_decode(const u8* __restrict__ packed, i64 n, int Dt, int r, int g, int rb,
                                      int dtype, float* __restrict__ out) {
    const int bb = mkv_bitmap_bytes(Dt / g);
    const int vo = bb + mkv_scale_bytes(dtype);
    for (i64 row = blockIdx.x; row < n; row += gridDim.x) {
        const u8* rec = packed + row * (i64)rb;
        u64 bm[MKV_MAX_WORDS];
        mkv_load_bitmap(rec, Dt / g, bm);
        const QuantParams qp = mkv_load_quant(rec, bb, dtype);
        for (int d = threadIdx.x; d < Dt; d += blockDim.x) {
            int vi = mkv_value_index(bm, g, d);
            out[row * Dt + d] = vi < 0 ? 0.0f : mkv_record_value(rec + vo, dtype, qp, vi);
        }
    }
}

// SPEC.md section 7, the scale of one block: the smallest f32 s with 127 * s >= a
// (a = the largest |bound|, exact in f64; 127 * s of an f32 is exact in f64).
__device__ __forceinline__ float mkv_meta_scale(double a) {
    if (a <= 0.0) return 0.0f;
    float s = __double2float_ru(a / 127.0);
    while (127.0 * (double)s < a) s = __uint_as_float(__float_as_uint(s) + 1u);
    while (s > 0.0f && 127.0 * (double)__uint_as_float(__float_as_uint(s) - 1u) >= a)
        s = __uint_as_float(__float_as_uint(s) - 1u);
    return s;
}

// Section 7: ceil(hi / s) raised until q * s >= hi, floor(lo / s) lowered until
// q * s <= lo (f64), clamped to [-127, 127]. s > 0.
__device__ __forceinline__ signed char mkv_meta_qmax(double hi, double s) {
    double q = ceil(hi / s);
    if (q * s < hi) q += 1.0;
    return (signed char)fmin(127.0, fmax(-127.0, q));
}
__device__ __forceinline__ signed char mkv_meta_qmin(double lo, double s) {
    double q = floor(lo / s);
    if (q * s > lo) q -= 1.0;
    return (signed char)fmin(127.0, fmax(-127.0, q));
}

// Block metadata of one (segment, head)'s packed keys (SPEC.md section 7): the exact
// per-dim min m_j and max M_j over each token block's decoded keys (f16, 0, or the int8 /
// int4 decoded value m + code * s that attention reads), stored as int8
// qmin/qmax [blocks][Dt] with one f32 scale per block, rounded outward so that
// qmin_j * s <= m_j and qmax_j * s >= M_j. One thread block per token block, one
// thread per dim; Dt <= MKV_MAX_D.
extern "C" __global__ void mkv_block_meta(const u8* __restrict__ packed, i64 n, int Dt, int r, int g, int rb,
                                          int dtype, int block_size, signed char* __restrict__ mn,
                                          signed char* __restrict__ mx, float* __restrict__ scale) {
    __shared__ float lo_s[MKV_MAX_D];
    __shared__ float hi_s[MKV_MAX_D];
    __shared__ float red[32];
    __shared__ float s_shared;
    const int bb = mkv_bitmap_bytes(Dt / g);
    const int vo = bb + mkv_scale_bytes(dtype);
    const i64 blocks = (n + block_size - 1) / block_size;
    for (i64 blk = blockIdx.x; blk < blocks; blk += gridDim.x) {
        i64 t0 = blk * block_size;
        i64 t1 = min(n, t0 + block_size);
        float amax = 0.0f;
        for (int d = threadIdx.x; d < Dt; d += blockDim.x) {
            float lo = 0.0f, hi = 0.0f;
            for (i64 t = t0; t < t1; ++t) {
                const u8* rec = packed + t * (i64)rb;
                u64 bm[MKV_MAX_WORDS];
                mkv_load_bitmap(rec, Dt / g, bm);
                int vi = mkv_value_index(bm, g, d);
                float v = vi < 0 ? 0.0f : mkv_record_value(rec + vo, dtype, mkv_load_quant(rec, bb, dtype), vi);
                if (t == t0 || v < lo) lo = v;
                if (t == t0 || v > hi) hi = v;
            }
            lo_s[d] = lo;
            hi_s[d] = hi;
            amax = fmaxf(amax, fmaxf(fabsf(lo), fabsf(hi)));
        }
        amax = mkv_warp_max(amax);
        if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = amax;
        __syncthreads();
        if (threadIdx.x == 0) {
            float a = 0.0f;
            for (int w = 0; w < (int)((blockDim.x + 31) >> 5); ++w) a = fmaxf(a, red[w]);
            s_shared = mkv_meta_scale((double)a);
            scale[blk] = s_shared;
        }
        __syncthreads();
        const float s = s_shared;
        for (int d = threadIdx.x; d < Dt; d += blockDim.x) {
            signed char qlo = 0, qhi = 0;
            if (s > 0.0f) {
                qlo = mkv_meta_qmin((double)lo_s[d], (double)s);
                qhi = mkv_meta_qmax((double)hi_s[d], (double)s);
            }
            mn[blk * Dt + d] = qlo;
            mx[blk * Dt + d] = qhi;
        }
        __syncthreads();
    }
}
