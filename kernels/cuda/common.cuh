// common.cuh: helpers shared by every MosaicKV kernel (no CUDA headers needed,
// so NVRTC compiles each .cu with this file as its only header).
//
// Conventions (see spec/SPEC.md):
// - f16 data is carried as raw IEEE binary16 bits (`u16`), converted with the
//   PTX `cvt` instructions below (round-to-nearest-even).
// - Logits are kept in the log2 domain: z2 = (q . k) * log2(e) / sqrt(D), so
//   softmax weights are exp2(z2 - m2). Partials store m in that domain too.
// - Every size/offset that can exceed 2^31 is an `i64`.
#pragma once

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define MKV_INF __int_as_float(0x7f800000)
#define MKV_NEG_INF __int_as_float(0xff800000)
// Largest head_dim any kernel supports; bitmaps then have at most 4 words.
#define MKV_MAX_D 256
#define MKV_MAX_WORDS 4
#define MKV_FULL_MASK 0xffffffffu
// log2(e) as an f32: natural-log logits (SPEC 9 on int8/int4 keys) into the log2 domain.
#define MKV_LOG2E 1.44269504088896340736f

#ifdef MKV_EMULATED
// Host versions for the CPU emulation (kernels/emu/cuda_emu.h): the same roundings.
__device__ __forceinline__ float mkv_h2f(u16 h) { return ::mkv_emu::h2f(h); }
__device__ __forceinline__ u16 mkv_f2h(float f) { return ::mkv_emu::d2h((double)f); }
__device__ __forceinline__ u16 mkv_d2h(double d) { return ::mkv_emu::d2h(d); }
#else
// Dynamic shared memory of a kernel: `MKV_EXTERN_SMEM(smem);` (the emulation gives
// each launch its own buffer).
#define MKV_EXTERN_SMEM(name) extern __shared__ __align__(16) unsigned char name[]

__device__ __forceinline__ float mkv_h2f(u16 h) {
    float f;
    asm("{ .reg .b16 t; mov.b16 t, %1; cvt.f32.f16 %0, t; }" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 mkv_f2h(float f) {
    u16 h;
    asm("{ .reg .b16 t; cvt.rn.f16.f32 t, %1; mov.b16 %0, t; }" : "=h"(h) : "f"(f));
    return h;
}

// One rounding from f64 to f16 (SPEC.md section 5 step 1: no double rounding via f32).
__device__ __forceinline__ u16 mkv_d2h(double d) {
    u16 h;
    asm("{ .reg .b16 t; cvt.rn.f16.f64 t, %1; mov.b16 %0, t; }" : "=h"(h) : "d"(d));
    return h;
}

#endif

__device__ __forceinline__ bool mkv_h_is_finite(u16 h) { return (h & 0x7c00u) != 0x7c00u; }

// Sum of an int over the 32 lanes of a warp (exact).
__device__ __forceinline__ int mkv_warp_sum_int(int v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(MKV_FULL_MASK, v, o);
    return v;
}

// Sum over aligned groups of `width` lanes (width a power of two <= 32), integers (exact).
__device__ __forceinline__ int mkv_group_sum_int(int v, int width) {
    for (int o = width >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(MKV_FULL_MASK, v, o);
    return v;
}

// Bytes of a record's bitmap for `groups` groups: whole little-endian u32 words
// (SPEC.md section 6); the record's values start here.
__device__ __forceinline__ int mkv_bitmap_bytes(int groups) { return 4 * ((groups + 31) / 32); }

// A record's bitmap as 64-bit views bm[0..MKV_MAX_WORDS), read with 4-byte loads
// (records are 4-byte aligned); bits past the stored words are 0.
__device__ __forceinline__ void mkv_load_bitmap(const u8* rec, int groups, u64 bm[MKV_MAX_WORDS]) {
    const u32* p = reinterpret_cast<const u32*>(rec);
    const int w32 = (groups + 31) / 32;
    #pragma unroll
    for (int w = 0; w < MKV_MAX_WORDS; ++w) {
        const u64 lo = 2 * w < w32 ? (u64)__ldg(p + 2 * w) : 0ull;
        const u64 hi = 2 * w + 1 < w32 ? (u64)__ldg(p + 2 * w + 1) : 0ull;
        bm[w] = lo | (hi << 32);
    }
}

// ---- Value dtypes of a record (SPEC.md section 6) ------------------------------------------
// Tags as in the strategy (`ValueDtype`): f16 values, or int8 / int4 codes after a per-record
// f16 minimum m and f16 scale s (4 bytes right after the bitmap).
#define MKV_F16 1
#define MKV_INT8 2
#define MKV_INT4 3

__device__ __forceinline__ bool mkv_is_quantized(int dtype) { return dtype != MKV_F16; }
// Bytes of the per-record minimum and scale: 0 (f16), 4 (int8, int4).
__device__ __forceinline__ int mkv_scale_bytes(int dtype) { return mkv_is_quantized(dtype) ? 4 : 0; }
// Largest code: 255 (int8), 15 (int4).
__device__ __forceinline__ int mkv_qmax(int dtype) { return dtype == MKV_INT8 ? 255 : 15; }

// A record's dequantization parameters (SPEC.md section 6): m and s widened to f32 (exact).
struct QuantParams {
    float m, s;
};
// Reads m and s (two little-endian f16 at the 4-byte aligned offset `bb`, the bitmap's end);
// f16 records get {0, 0} (unused).
__device__ __forceinline__ QuantParams mkv_load_quant(const u8* rec, int bb, int dtype) {
    QuantParams p = {0.0f, 0.0f};
    if (mkv_is_quantized(dtype)) {
        const u32 w = __ldg(reinterpret_cast<const u32*>(rec + bb));
        p.m = mkv_h2f((u16)(w & 0xffffu));
        p.s = mkv_h2f((u16)(w >> 16));
    }
    return p;
}

// SPEC.md section 6, Quantization step 4 (the decoded value): m + c * s in f32. The product
// is exact (at most 8 + 11 significant bits), so the fused multiply-add rounds once, like
// the host's multiply-then-add.
__device__ __forceinline__ float mkv_dequant(QuantParams p, u32 code) {
    return __fmaf_rn((float)code, p.s, p.m);
}

// Code i of a record's codes (the bytes after m and s): int8 one byte each, int4 two per
// byte (low nibble for even i).
__device__ __forceinline__ u32 mkv_read_code(const u8* codes, int dtype, int i) {
    if (dtype == MKV_INT8) return codes[i];
    return (codes[i >> 1] >> (4 * (i & 1))) & 0x0fu;
}

// Decoded value vi of a record whose values start at `vals` (f16 values, or codes with `p`).
__device__ __forceinline__ float mkv_record_value(const u8* vals, int dtype, QuantParams p, int vi) {
    if (dtype == MKV_F16) return mkv_h2f(reinterpret_cast<const u16*>(vals)[vi]);
    return mkv_dequant(p, mkv_read_code(vals, dtype, vi));
}

// Values 4c .. 4c + 4 of a record (f16 pairs in two u32), reading nothing past value r - 1's
// 4-byte word (so nothing past the 4-byte padded record).
__device__ __forceinline__ uint2 mkv_load_values4(const u8* vals, int c, int r) {
    const u32* p = reinterpret_cast<const u32*>(vals) + 2 * c;
    return make_uint2(__ldg(p), 4 * c + 2 < r ? __ldg(p + 1) : 0u);
}

// Decoded values 4c .. 4c + 4 of a record whose values start at `vals` (4-byte aligned), for
// any dtype, with aligned 4-byte loads that stay inside the 4-byte padded record: f16 two
// u32 (mkv_load_values4); int8 the one u32 holding codes 4c..4c+3; int4 the u32 holding
// bytes 2c, 2c+1 (word c/2, its low or high half). Entries past r - 1 are garbage; callers
// skip them (mkv_chunk_dims gives -1).
__device__ __forceinline__ void mkv_load_decoded4(const u8* vals, int c, int r, int dtype, QuantParams p,
                                                  float v[4]) {
    if (dtype == MKV_F16) {
        const uint2 raw = mkv_load_values4(vals, c, r);
        v[0] = mkv_h2f((u16)(raw.x & 0xffffu));
        v[1] = mkv_h2f((u16)(raw.x >> 16));
        v[2] = mkv_h2f((u16)(raw.y & 0xffffu));
        v[3] = mkv_h2f((u16)(raw.y >> 16));
        return;
    }
    u32 codes;
    if (dtype == MKV_INT8) {
        codes = __ldg(reinterpret_cast<const u32*>(vals) + c);  // bytes 4c .. 4c+3
    } else {
        const u32 w = __ldg(reinterpret_cast<const u32*>(vals) + (c >> 1));
        const u32 hw = (c & 1) ? (w >> 16) : (w & 0xffffu);  // bytes 2c, 2c+1: 4 nibbles
        codes = (hw & 0xfu) | ((hw & 0xf0u) << 4) | ((hw & 0xf00u) << 8) | ((hw & 0xf000u) << 12);
    }
    #pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = mkv_dequant(p, (codes >> (8 * i)) & 0xffu);
}

// Codes 4c .. 4c + 4 of an int8/int4 record whose codes start at `vals` (4-byte aligned), one
// byte each in a u32 (code 4c in the low byte), with the aligned loads of mkv_load_decoded4.
// Entries past r - 1 are garbage; callers give them a zero query byte.
__device__ __forceinline__ u32 mkv_load_codes4(const u8* vals, int c, int dtype) {
    if (dtype == MKV_INT8) return __ldg(reinterpret_cast<const u32*>(vals) + c);
    const u32 w = __ldg(reinterpret_cast<const u32*>(vals) + (c >> 1));
    const u32 hw = (c & 1) ? (w >> 16) : (w & 0xffffu);
    return (hw & 0xfu) | ((hw & 0xf0u) << 4) | ((hw & 0xf00u) << 8) | ((hw & 0xf000u) << 12);
}

// SPEC.md section 9, logits on int8/int4 key records: f32((s_q * (s * I_c + m * I_k)) / sqrt(D))
// in f64, every operation rounded to nearest (the products are exact), so the float is the
// host's (spec::layout::key_logit_q8). `qmax` is max_j |q'_j| (s_q = qmax / 127, f64).
__device__ __forceinline__ float mkv_key_logit_q8(float qmax, QuantParams p, int ic, int ik, int D) {
    const double sq = __ddiv_rn((double)qmax, 127.0);
    const double inv = __ddiv_rn(1.0, sqrt((double)D));
    const double sum = __dadd_rn(__dmul_rn((double)p.s, (double)ic), __dmul_rn((double)p.m, (double)ik));
    return __double2float_rn(__dmul_rn(__dmul_rn(sq, sum), inv));
}

// Position (0..63) of the k-th (0-based) set bit of a 64-bit word; k < popcount(w).
__device__ __forceinline__ int mkv_nth_bit64(u64 w, int k) {
    u32 lo = (u32)w;
    int clo = __popc(lo);
    if (k < clo) return (int)__fns(lo, 0u, k + 1);
    return 32 + (int)__fns((u32)(w >> 32), 0u, k - clo + 1);
}

// Bit position of the k-th set bit of a bitmap of `words` u64 words, or -1.
// The loops below run over the MKV_MAX_WORDS slots with constant indices so a
// caller's bitmap array stays in registers.
__device__ __forceinline__ int mkv_bitmap_kth(const u64* bm, int words, int k) {
    int found = -1;
    #pragma unroll
    for (int w = 0; w < MKV_MAX_WORDS; ++w) {
        int c = w < words ? __popcll(bm[w]) : 0;
        if (found < 0 && k < c) found = 64 * w + mkv_nth_bit64(bm[w], k);
        k -= c;
    }
    return found;
}

// First set bit strictly after `pos`, or -1.
__device__ __forceinline__ int mkv_bitmap_next(const u64* bm, int words, int pos) {
    int found = -1;
    #pragma unroll
    for (int w = 0; w < MKV_MAX_WORDS; ++w) {
        int lo = 64 * w;
        u64 cur = 0ull;
        if (w < words && pos + 1 < lo + 64) {
            int b = pos + 1 - lo;
            cur = b <= 0 ? bm[w] : (bm[w] & (~0ull << b));
        }
        if (found < 0 && cur != 0ull) found = lo + __ffsll((i64)cur) - 1;
    }
    return found;
}

// Value index of rotated dim `d` in a record (SPEC.md section 6), or -1 when
// its group is not kept: rank of group d/g among kept groups, times g, plus d%g.
__device__ __forceinline__ int mkv_value_index(const u64* bm, int g, int d) {
    int k = d / g;
    int kw = k >> 6;
    int b = k & 63;
    int rank = 0;
    bool set = false;
    #pragma unroll
    for (int w = 0; w < MKV_MAX_WORDS; ++w) {
        if (w < kw) rank += __popcll(bm[w]);
        if (w == kw) {
            set = ((bm[w] >> b) & 1ull) != 0ull;
            rank += __popcll(bm[w] & ((1ull << b) - 1ull));
        }
    }
    return set ? rank * g + (d - k * g) : -1;
}

// Dims of the (up to) four values `4*c .. 4*c+3` of a record with r values
// and group size g; -1 for indices >= r.
__device__ __forceinline__ void mkv_chunk_dims(const u64* bm, int words, int r, int g, int c, int dims[4]) {
    int pos = -1;
    int prev_group = -1;
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        int v = 4 * c + i;
        if (v >= r) {
            dims[i] = -1;
            continue;
        }
        int gr = v / g;
        if (gr != prev_group) {
            pos = prev_group < 0 ? mkv_bitmap_kth(bm, words, gr) : mkv_bitmap_next(bm, words, pos);
            prev_group = gr;
        }
        dims[i] = pos < 0 ? -1 : pos * g + (v - gr * g);
    }
}

__device__ __forceinline__ float mkv_warp_sum(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(MKV_FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float mkv_warp_max(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(MKV_FULL_MASK, v, o));
    return v;
}

// Sum over aligned groups of `width` lanes (width a power of two <= 32).
__device__ __forceinline__ float mkv_group_sum(float v, int width) {
    for (int o = width >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(MKV_FULL_MASK, v, o);
    return v;
}

// Smallest power of two >= x (x >= 1), capped at 32.
__device__ __forceinline__ int mkv_pow2_lanes(int x) {
    int p = 1;
    while (p < x && p < 32) p <<= 1;
    return p;
}

// Per (segment, KV head) description of one head's part of a segment, shared
// by the encode/score/attention kernels. Mirrors `SegHeadDesc` in
// optimized/src/cuda/layout.rs (96 bytes; checked there at compile time).
struct SegHead {
    i64 key_rec_off;   // byte offset of record 0 of the keys in the packed-K buffer
    i64 val_rec_off;   // byte offset of record 0 of the values in the packed-V buffer
    i64 key_rot_off;   // f32 offset of R_k (D x D, row-major) in the rotation buffer
    i64 val_rot_off;   // f32 offset of R_v
    i64 meta_off;      // i8 offset of block 0's min row (and max row) in the meta buffers
    i64 scale_off;     // f32 offset of block 0's scale in the meta scale buffer (SPEC.md 7)
    int seg_len;       // tokens in the segment
    int block_size;    // b
    int key_dt, key_r, key_g, key_rb;  // Dt, r, g, record bytes of the K side
    int val_dt, val_r, val_g, val_rb;  // same for the V side
    int key_dtype, val_dtype;          // value dtype tags (MKV_F16 / MKV_INT8 / MKV_INT4)
};

// One block of one KV head's global block order (SPEC.md section 8.3).
struct BlockRef {
    int gseg;    // global segment index (into the seg tables, batch-flattened)
    int block;   // block index within the segment
    int start;   // first token of the block within the segment
    int len;     // tokens in the block
};
