// encode.cu: SPEC.md sections 5-7 on the device.
//   mkv_encode      rotate rows by R (f64 accumulation, one f16 rounding), per-vector
//                   top-r groups (ties to the lower group), packed records (section 6)
//   mkv_decode      packed records -> dense rotated rows [n][Dt] (zeros where not kept)
//   mkv_block_meta  per-block, per-dim min/max of the decoded keys (section 7)
// One thread block per row (encode/decode) or per token block (meta); grid-stride loops.
#include "common.cuh"

// rows: f32, row i at rows + i * row_stride (D elements). R: D x D row-major f32,
// x' = R^T x. out: n records of `rb` bytes. status[0] gets bit 1 when a rotated
// value overflows f16 (the host reports NonFinite). blockDim.x must be a
// multiple of 32; dynamic shared memory: mkv_encode_smem(D, Dt/g) bytes.
extern "C" __global__ void mkv_encode(const float* __restrict__ rows, i64 n, i64 row_stride,
                                      const float* __restrict__ R, int D, int Dt, int r, int g,
                                      int rb, u8* __restrict__ out, int* __restrict__ status) {
    extern __shared__ __align__(16) unsigned char smem[];
    float* x = reinterpret_cast<float*>(smem);           // [D]
    float* imp = x + D;                                 // [groups]
    int* keep = reinterpret_cast<int*>(imp + Dt / g);   // [groups]
    u16* y = reinterpret_cast<u16*>(keep + Dt / g);     // [Dt]
    const int groups = Dt / g;
    const int kept = r / g;
    const int words = (groups + 63) / 64;
    for (i64 row = blockIdx.x; row < n; row += gridDim.x) {
        const float* src = rows + row * row_stride;
        for (int i = threadIdx.x; i < D; i += blockDim.x) x[i] = src[i];
        __syncthreads();
        // Step 1: y_j = f16(sum_i R[i][j] x_i), f64, ascending i. Each product of two
        // f32 is exact in f64, so the fused multiply-add rounds like add-after-multiply.
        for (int j = threadIdx.x; j < Dt; j += blockDim.x) {
            double acc = 0.0;
            for (int i = 0; i < D; ++i) acc = fma((double)R[(i64)i * D + j], (double)x[i], acc);
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
        // Bitmap words (little-endian u64; records are 8-byte aligned).
        for (int w = threadIdx.x; w < words; w += blockDim.x) {
            u64 bits = 0ull;
            for (int b = 0; b < 64 && 64 * w + b < groups; ++b)
                if (keep[64 * w + b]) bits |= 1ull << b;
            reinterpret_cast<u64*>(rec)[w] = bits;
        }
        // Values: kept groups in ascending order, dims inside a group ascending.
        u16* vals = reinterpret_cast<u16*>(rec + 8 * words);
        for (int k = threadIdx.x; k < groups; k += blockDim.x) {
            if (!keep[k]) continue;
            int pos = 0;
            for (int o = 0; o < k; ++o) pos += keep[o];
            for (int e = 0; e < g; ++e) vals[pos * g + e] = y[k * g + e];
        }
        // Zero padding up to the record size.
        for (int b = 8 * words + 2 * r + threadIdx.x; b < rb; b += blockDim.x) rec[b] = 0;
        __syncthreads();
    }
}

// packed: n records of layout (Dt, r, g, rb); out: [n][Dt] f32.
extern "C" __global__ void mkv_decode(const u8* __restrict__ packed, i64 n, int Dt, int r, int g, int rb,
                                      float* __restrict__ out) {
    const int words = (Dt / g + 63) / 64;
    for (i64 row = blockIdx.x; row < n; row += gridDim.x) {
        const u8* rec = packed + row * (i64)rb;
        u64 bm[MKV_MAX_WORDS];
        for (int w = 0; w < MKV_MAX_WORDS; ++w) bm[w] = w < words ? reinterpret_cast<const u64*>(rec)[w] : 0ull;
        const u16* vals = reinterpret_cast<const u16*>(rec + 8 * words);
        for (int d = threadIdx.x; d < Dt; d += blockDim.x) {
            int vi = mkv_value_index(bm, g, d);
            out[row * Dt + d] = vi < 0 ? 0.0f : mkv_h2f(vals[vi]);
        }
    }
}

// Block metadata of one (segment, head)'s packed keys: min and max are
// [blocks][Dt] f16 (u16 bits). One thread block per token block, one thread per dim.
// Fold order: the block's first token initializes, later tokens replace only on a
// strict < (min) or > (max), so -0 vs +0 keeps the earliest token's sign.
extern "C" __global__ void mkv_block_meta(const u8* __restrict__ packed, i64 n, int Dt, int r, int g, int rb,
                                          int block_size, u16* __restrict__ mn, u16* __restrict__ mx) {
    const int words = (Dt / g + 63) / 64;
    const i64 blocks = (n + block_size - 1) / block_size;
    for (i64 blk = blockIdx.x; blk < blocks; blk += gridDim.x) {
        i64 t0 = blk * block_size;
        i64 t1 = min(n, t0 + block_size);
        for (int d = threadIdx.x; d < Dt; d += blockDim.x) {
            float lo = 0.0f, hi = 0.0f;
            u16 lo_bits = 0, hi_bits = 0;
            for (i64 t = t0; t < t1; ++t) {
                const u8* rec = packed + t * (i64)rb;
                u64 bm[MKV_MAX_WORDS];
                for (int w = 0; w < MKV_MAX_WORDS; ++w) bm[w] = w < words ? reinterpret_cast<const u64*>(rec)[w] : 0ull;
                int vi = mkv_value_index(bm, g, d);
                u16 bits = vi < 0 ? (u16)0 : reinterpret_cast<const u16*>(rec + 8 * words)[vi];
                float v = mkv_h2f(bits);
                if (t == t0 || v < lo) { lo = v; lo_bits = bits; }
                if (t == t0 || v > hi) { hi = v; hi_bits = bits; }
            }
            mn[blk * Dt + d] = lo_bits;
            mx[blk * Dt + d] = hi_bits;
        }
    }
}
