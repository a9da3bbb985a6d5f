// select.cu: SPEC.md section 8 on the device, plus Quest's page selection (section 12).
//   mkv_rotate_queries  q'_{seg,h} = R_k(seg, h/G)^T q_h, first Dt dims (f64 over ascending i,
//                       product then sum, rounded to f32: the same values as every backend)
//   mkv_score_blocks    SPEC 8.2 integer bound per block (int8-quantized query), max over
//                       the G query heads of its KV head
//   mkv_select_topk     top-k blocks under a token budget, ties to the lower global index;
//                       result ascending (one thread block per (sequence, KV head))
//   mkv_plan_items      splits each head's selection into per-segment work items
//   mkv_page_meta       Quest: per-page per-dim min/max of the dense f16 keys
//   mkv_page_score      Quest: page scores from the unrotated queries
// Batches are flattened: sequence b's segments are gseg in [seg_base[b], seg_base[b+1]),
// and (b, KV head j) pairs are bj = b * kv_heads + j.
#include "common.cuh"

// q: [batch][q_heads][D] f32. qrot: [total_segs][q_heads][D] f32 (first Dt used).
// grid: (total_segs, q_heads); seg_batch[gseg] = sequence of the segment.
extern "C" __global__ void mkv_rotate_queries(const float* __restrict__ q, const SegHead* __restrict__ sh,
                                              const int* __restrict__ seg_batch, const u16* __restrict__ rot,
                                              int kv_heads, int q_heads, int D, float* __restrict__ qrot) {
    MKV_EXTERN_SMEM(smem);
    float* qs = reinterpret_cast<float*>(smem);  // [D]
    const int gseg = blockIdx.x;
    const int h = blockIdx.y;
    const int G = q_heads / kv_heads;
    const int b = seg_batch[gseg];
    const SegHead s = sh[(i64)gseg * kv_heads + h / G];
    const float* qh = q + ((i64)b * q_heads + h) * D;
    for (int i = threadIdx.x; i < D; i += blockDim.x) qs[i] = qh[i];
    __syncthreads();
    const u16* R = rot + s.key_rot_off;  // f16 bits (SPEC.md section 3)
    float* dst = qrot + ((i64)gseg * q_heads + h) * D;
    for (int j = threadIdx.x; j < D; j += blockDim.x) {
        double acc = 0.0;
        if (j < s.key_dt)
            for (int i = 0; i < D; ++i)  // R_k stored D x Dt_k; no FMA (SPEC.md 8.1)
                acc = __dadd_rn(acc, __dmul_rn((double)mkv_h2f(R[(i64)i * s.key_dt + j]), (double)qs[i]));
        dst[j] = __double2float_rn(acc);
    }
}

// s(block) = s_b * max_h s_q,h (I_h + W / 2) (SPEC.md 8.2) on the int8 bounds and per-block
// f32 scale s_b >= 0 of section 7, one warp per block: q'_h quantized to a_j =
// rint(q'_j / s_q), s_q = max_j |q'_j| / 127 (f64); I_h = sum_j max(a_j qmax_j, a_j qmin_j)
// and W = sum_j max(|qmax_j|, |qmin_j|) are exact integers, the products f64 in the
// reference's order, rounded once to f32: the same scores as every CPU path.
// An upper bound of q'.k^ (the quantization error is added back by W / 2).
// blocks: every (b, j)'s global block list, flattened; block_owner[i] = bj of entry i.
// -0 is stored as +0 so that equal scores tie exactly (section 8.3).
extern "C" __global__ void mkv_score_blocks(const BlockRef* __restrict__ blocks, const int* __restrict__ block_owner,
                                            i64 total_blocks, const SegHead* __restrict__ sh,
                                            const signed char* __restrict__ meta_min,
                                            const signed char* __restrict__ meta_max,
                                            const float* __restrict__ meta_scale, const float* __restrict__ qrot, int kv_heads, int q_heads, int D,
                                            float* __restrict__ scores) {
    const int lane = threadIdx.x & 31;
    const int warps = blockDim.x >> 5;
    const int G = q_heads / kv_heads;
    for (i64 i = (i64)blockIdx.x * warps + (threadIdx.x >> 5); i < total_blocks; i += (i64)gridDim.x * warps) {
        const BlockRef br = blocks[i];
        // A reserved entry past a list's end (CudaCache's spare block slots): no block to
        // score (warp-uniform: one warp per entry).
        if (br.len == 0) continue;
        const int j = block_owner[i] % kv_heads;
        const SegHead s = sh[(i64)br.gseg * kv_heads + j];
        const int Dt = s.key_dt;
        const signed char* mn = meta_min + s.meta_off + (i64)br.block * Dt;
        const signed char* mx = meta_max + s.meta_off + (i64)br.block * Dt;
        const float sb = meta_scale[s.scale_off + br.block];
        const float* qbase = qrot + ((i64)br.gseg * q_heads + (i64)j * G) * D;
        int w = 0;
        for (int d = lane; d < Dt; d += 32) w += max(abs((int)mx[d]), abs((int)mn[d]));
        w = mkv_warp_sum_int(w);
        double best = -__longlong_as_double(0x7ff0000000000000ll);  // -inf
        for (int h = 0; h < G; ++h) {
            const float* qh = qbase + (i64)h * D;
            float m = 0.0f;
            for (int d = lane; d < Dt; d += 32) m = fmaxf(m, fabsf(qh[d]));
            m = mkv_warp_max(m);
            const double sq = (double)m / 127.0;
            int acc = 0;
            if (m > 0.0f) {
                for (int d = lane; d < Dt; d += 32) {
                    int a = (int)rint(__ddiv_rn((double)qh[d], sq));
                    a = min(127, max(-127, a));
                    acc += max(a * (int)mx[d], a * (int)mn[d]);
                }
            }
            acc = mkv_warp_sum_int(acc);
            // (s_b * s_q) * (I + W / 2) in f64, the reference's order, then one rounding to f32.
            const double v = __dmul_rn(__dmul_rn((double)sb, sq), __dadd_rn((double)acc, __dmul_rn(0.5, (double)w)));
            best = fmax(best, v);
        }
        const float bf = __double2float_rn(best);
        if (lane == 0) scores[i] = bf == 0.0f ? 0.0f : bf;
    }
}

// Orderable key: a larger score gives a larger key (NaN never occurs: inputs are finite).
// -0 and +0 get the same key, so they tie (SPEC.md 8.3) even in scores the host passes in
// (select_blocks); before issue 17 -0 ranked below +0 (found by the emulated stamp).
__device__ __forceinline__ u32 mkv_score_key(float s) {
    u32 u = s == 0.0f ? 0u : __float_as_uint(s);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

#define MKV_SELECT_THREADS 1024

__device__ __forceinline__ u64 mkv_block_sum_u64(u64 v, u64* red) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(MKV_FULL_MASK, v, o);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    u64 t = 0;
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) t += red[w];
    return t;
}

// Inclusive scan of v over the thread block (blockDim.x = MKV_SELECT_THREADS); total in *total.
__device__ __forceinline__ u64 mkv_block_scan_u64(u64 v, u64* red, u64* total) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    #pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        u64 n = __shfl_up_sync(MKV_FULL_MASK, v, o);
        if (lane >= o) v += n;
    }
    __syncthreads();
    if (lane == 31) red[warp] = v;
    __syncthreads();
    u64 before = 0, all = 0;
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) {
        if (w < warp) before += red[w];
        all += red[w];
    }
    *total = all;
    return v + before;
}

// SPEC.md 8.3 for each bj (one thread block each, MKV_SELECT_THREADS threads):
// blocks sorted by score descending, ties by lower index, taken while fewer than
// budget tokens are taken; written ascending to sel[base[bj]..], count[bj].
// With K* = the largest key whose blocks-with-key->=K* hold >= budget tokens,
// block i is taken iff key_i > K*, or key_i == K* and the tokens of the blocks
// with key > K* plus those with key == K* and a lower index are < budget.
// K* is found bit by bit (32 block reductions), then one ordered scan writes the result.
// lens == null: every block has uniform_len tokens except the last, last_len.
// force_last != 0 (Quest): the last block is always taken and the others compete for the budget.
// ends == null: bj's blocks are [base[bj], base[bj + 1]); else [base[bj], ends[bj]) (a list
// with reserved entries after its end, CudaCache).
extern "C" __global__ void mkv_select_topk(const float* __restrict__ scores, const i64* __restrict__ base,
                                           const i64* __restrict__ ends,
                                           const int* __restrict__ lens, int uniform_len, int last_len,
                                           const i64* __restrict__ budget, int kv_heads, int force_last,
                                           int* __restrict__ sel, int* __restrict__ count) {
    __shared__ u64 red[32];
    const int bj = blockIdx.x;
    const i64 b0 = base[bj];
    const i64 n_all = (ends ? ends[bj] : base[bj + 1]) - b0;
    const i64 n = force_last ? n_all - 1 : n_all;
    const u64 B = (u64)budget[bj / kv_heads];
    const float* sc = scores + b0;
    auto len_of = [&](i64 i) -> u64 {
        if (lens) return (u64)lens[b0 + i];
        return (u64)(i == n_all - 1 ? last_len : uniform_len);
    };
    u32 kstar = 0u;
    u64 gt_tokens = 0;
    bool any = n > 0 && B > 0;
    if (any) {
        for (int bit = 31; bit >= 0; --bit) {
            u32 cand = kstar | (1u << bit);
            u64 part = 0;
            for (i64 i = threadIdx.x; i < n; i += blockDim.x)
                if (mkv_score_key(sc[i]) >= cand) part += len_of(i);
            u64 tot = mkv_block_sum_u64(part, red);
            if (tot >= B) kstar = cand;
        }
        u64 part = 0;
        for (i64 i = threadIdx.x; i < n; i += blockDim.x)
            if (mkv_score_key(sc[i]) > kstar) part += len_of(i);
        gt_tokens = mkv_block_sum_u64(part, red);
    }
    // Ordered pass: equal-key prefix and output compaction, chunk by chunk.
    u64 eq_carry = 0, out_carry = 0;
    for (i64 c0 = 0; c0 < n; c0 += blockDim.x) {
        i64 i = c0 + threadIdx.x;
        u32 key = i < n ? mkv_score_key(sc[i]) : 0u;
        u64 eq_len = (any && i < n && key == kstar) ? len_of(i) : 0;
        u64 eq_total;
        u64 eq_incl = mkv_block_scan_u64(eq_len, red, &eq_total);
        u64 eq_before = eq_carry + eq_incl - eq_len;
        bool take = any && i < n && (key > kstar || (key == kstar && gt_tokens + eq_before < B));
        u64 out_total;
        u64 out_incl = mkv_block_scan_u64(take ? 1 : 0, red, &out_total);
        if (take) sel[b0 + out_carry + out_incl - 1] = (int)i;
        eq_carry += eq_total;
        out_carry += out_total;
    }
    if (threadIdx.x == 0) {
        int c = (int)out_carry;
        if (force_last && n_all > 0) sel[b0 + c++] = (int)(n_all - 1);
        count[bj] = c;
    }
}

// Work items for mkv_packed_attention: for each bj, the selected blocks of each
// segment in runs of at most `per_item` blocks. items[(bj * max_items + k)] =
// (gseg, first, end) as indices into sel; item_count[bj] = items written (capped).
// One thread block per bj; thread per segment, chunked with a carried offset.
extern "C" __global__ void mkv_plan_items(const BlockRef* __restrict__ blocks, const i64* __restrict__ base,
                                          const int* __restrict__ sel, const int* __restrict__ count,
                                          const int* __restrict__ seg_base, int kv_heads, int per_item,
                                          int max_items, int3* __restrict__ items, int* __restrict__ item_count) {
    __shared__ u64 red[32];
    const int bj = blockIdx.x;
    const int b = bj / kv_heads;
    const i64 b0 = base[bj];
    const int nsel = count[bj];
    const int s0 = seg_base[b], s1 = seg_base[b + 1];
    u64 carry = 0;
    for (int c0 = s0; c0 < s1; c0 += blockDim.x) {
        int gseg = c0 + threadIdx.x;
        int lo = 0, hi = 0;
        if (gseg < s1) {
            // First selected entry with segment >= gseg, and first with segment > gseg.
            int a = 0, z = nsel;
            while (a < z) { int m = (a + z) >> 1; if (blocks[b0 + sel[b0 + m]].gseg < gseg) a = m + 1; else z = m; }
            lo = a;
            z = nsel;
            while (a < z) { int m = (a + z) >> 1; if (blocks[b0 + sel[b0 + m]].gseg <= gseg) a = m + 1; else z = m; }
            hi = a;
        }
        int n_items = (hi - lo + per_item - 1) / per_item;
        u64 total;
        u64 incl = mkv_block_scan_u64((u64)n_items, red, &total);
        u64 first = carry + incl - n_items;
        for (int k = 0; k < n_items; ++k) {
            u64 slot = first + k;
            if (slot < (u64)max_items) {
                int a = lo + k * per_item;
                items[(i64)bj * max_items + slot] = make_int3(gseg, a, min(hi, a + per_item));
            }
        }
        carry += total;
    }
    if (threadIdx.x == 0) item_count[bj] = (int)min(carry, (u64)max_items);
}

// Quest metadata: keys [batch][n][kv_heads][D] f16 (sequence stride seq_stride elements);
// mn/mx: [batch][kv_heads][pages][D]. grid: (pages, kv_heads, batch), thread per dim.
extern "C" __global__ void mkv_page_meta(const u16* __restrict__ keys, i64 n, i64 seq_stride, int kv_heads, int D,
                                         int page, u16* __restrict__ mn, u16* __restrict__ mx) {
    const i64 p = blockIdx.x;
    const int j = blockIdx.y, b = blockIdx.z;
    const i64 pages = (n + page - 1) / page;
    const u16* K = keys + (i64)b * seq_stride;
    const i64 t0 = p * page, t1 = min(n, t0 + page);
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float lo = 0.0f, hi = 0.0f;
        u16 lob = 0, hib = 0;
        for (i64 t = t0; t < t1; ++t) {
            u16 bits = K[(t * kv_heads + j) * D + d];
            float v = mkv_h2f(bits);
            if (t == t0 || v < lo) { lo = v; lob = bits; }
            if (t == t0 || v > hi) { hi = v; hib = bits; }
        }
        i64 o = (((i64)b * kv_heads + j) * pages + p) * D + d;
        mn[o] = lob;
        mx[o] = hib;
    }
}

// Quest page scores, one warp per page: scores[(b * kv_heads + j) * pages + p].
extern "C" __global__ void mkv_page_score(const float* __restrict__ q, const u16* __restrict__ mn,
                                          const u16* __restrict__ mx, i64 pages, int batch, int kv_heads,
                                          int q_heads, int D, float* __restrict__ scores) {
    const int lane = threadIdx.x & 31;
    const int warps = blockDim.x >> 5;
    const int G = q_heads / kv_heads;
    const i64 total = pages * kv_heads * batch;
    for (i64 i = (i64)blockIdx.x * warps + (threadIdx.x >> 5); i < total; i += (i64)gridDim.x * warps) {
        const i64 bj = i / pages;
        const int j = (int)(bj % kv_heads), b = (int)(bj / kv_heads);
        const u16* lo = mn + i * D;
        const u16* hi = mx + i * D;
        float best = MKV_NEG_INF;
        for (int h = 0; h < G; ++h) {
            const float* qh = q + ((i64)b * q_heads + (i64)j * G + h) * D;
            float acc = 0.0f;
            for (int d = lane; d < D; d += 32) {
                float qv = qh[d];
                acc += fmaxf(qv * mkv_h2f(hi[d]), qv * mkv_h2f(lo[d]));
            }
            best = fmaxf(best, mkv_warp_sum(acc));
        }
        if (lane == 0) scores[i] = best == 0.0f ? 0.0f : best;
    }
}
