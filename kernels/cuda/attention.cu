// attention.cu: SPEC.md section 9 (PackedAttention) and the dense baselines.
//   mkv_packed_attention  flash-decoding over the selected blocks of each segment (one
//                         work item = a run of one segment's selected blocks) plus one
//                         item for the dense sink + update buffer; writes partials
//   mkv_dense_decode      full attention (or Quest: only listed pages) over a dense f16
//                         cache, split-K across thread blocks, 16-byte loads; partials
//   mkv_merge             merges partials (online-softmax rescale) into the output
// Partials for (b, KV head j) = bj: m, l [bj][part][G] and o [bj][part][G][D], f32,
// unnormalized, logits in the log2 domain (see common.cuh).
#include "common.cuh"

#define MKV_ATT_THREADS 128
#define MKV_ATT_TILE 64
#define MKV_HCHUNK 8

// Dynamic shared memory of mkv_packed_attention: sq [G][D] + so [G][D] + p [G][TILE] + 4*G
// scalars + sv [TILE][D] (a tile's decoded value rows, expanded).
// Host: (2 * G * D + G * MKV_ATT_TILE + 4 * G + MKV_ATT_TILE * D) * 4 bytes.
//
// grid: (1 + max_items, kv_heads, batch), block MKV_ATT_THREADS.
// Part 0 = dense rows (sink then buffer) of sequence b: dense rows
// [dense_base[b], dense_base[b] + dense_count[b]) of a [rows][kv_heads][D] f16 array.
// Part k >= 1 = items[bj][k-1] = (gseg, first, end) into sel (see mkv_plan_items).
extern "C" __global__ void __launch_bounds__(MKV_ATT_THREADS)
mkv_packed_attention(const float* __restrict__ q, const float* __restrict__ qrot, const SegHead* __restrict__ sh,
                     const BlockRef* __restrict__ blocks, const i64* __restrict__ base, const int* __restrict__ sel,
                     const int3* __restrict__ items, const int* __restrict__ item_count, int max_items,
                     const u8* __restrict__ packed_k, const u8* __restrict__ packed_v, const u16* __restrict__ rot,
                     const u16* __restrict__ dense_k, const u16* __restrict__ dense_v,
                     const i64* __restrict__ dense_base, const int* __restrict__ dense_count,
                     int kv_heads, int q_heads, int D, float scale_log2,
                     float* __restrict__ part_m, float* __restrict__ part_l, float* __restrict__ part_o) {
    MKV_EXTERN_SMEM(smem);
    const int G = q_heads / kv_heads;
    float* sq = reinterpret_cast<float*>(smem);  // [G][D] queries (rotated for packed items)
    float* so = sq + G * D;                      // [G][D] output accumulator
    float* sp = so + G * D;                      // [G][TILE] logits, then weights
    float* sm = sp + G * MKV_ATT_TILE;           // [G] running max (log2 domain)
    float* sl = sm + G;                          // [G] running sum
    float* ss = sl + G;                          // [G] rescale factor of this tile
    float* sqm = ss + G;                         // [G] max_j |q'_j| of the int8 query (SPEC 8.2)
    float* sv = sqm + G;                         // [TILE][D] decoded value rows of a tile
    const int part = blockIdx.x, j = blockIdx.y, b = blockIdx.z;
    const int bj = b * kv_heads + j;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int nwarps = MKV_ATT_THREADS / 32;
    const int parts = max_items + 1;
    const i64 pbase = (i64)bj * parts + part;
    if (part > 0 && part - 1 >= item_count[bj]) return;  // unused slot: the merge never reads it

    for (int i = tid; i < G * D; i += MKV_ATT_THREADS) so[i] = 0.0f;
    for (int h = tid; h < G; h += MKV_ATT_THREADS) { sm[h] = MKV_NEG_INF; sl[h] = 0.0f; }

    // Online-softmax update for a tile of `T` logits already in sp: computes the new
    // max, turns logits into weights, rescales so and sl. Ends with a barrier.
    auto softmax_tile = [&](int T) {
        __syncthreads();
        for (int h = warp; h < G; h += nwarps) {
            float mx = MKV_NEG_INF;
            for (int t = lane; t < T; t += 32) mx = fmaxf(mx, sp[h * MKV_ATT_TILE + t]);
            mx = mkv_warp_max(mx);
            float m_old = sm[h];
            float m_new = fmaxf(m_old, mx);
            float scale = (m_new == MKV_NEG_INF) ? 1.0f : exp2f(m_old - m_new);
            float sum = 0.0f;
            for (int t = lane; t < T; t += 32) {
                float z = sp[h * MKV_ATT_TILE + t];
                float p = (m_new == MKV_NEG_INF) ? 0.0f : exp2f(z - m_new);
                sp[h * MKV_ATT_TILE + t] = p;
                sum += p;
            }
            sum = mkv_warp_sum(sum);
            if (lane == 0) { sm[h] = m_new; sl[h] = sl[h] * scale + sum; ss[h] = scale; }
        }
        __syncthreads();
        for (int i = tid; i < G * D; i += MKV_ATT_THREADS) so[i] *= ss[i / D];
        __syncthreads();
    };

    if (part == 0) {
        // Sink + update buffer: dense f16 rows, unrotated queries.
        const float* qb = q + ((i64)b * q_heads + (i64)j * G) * D;
        for (int i = tid; i < G * D; i += MKV_ATT_THREADS) sq[i] = qb[i];
        const i64 r0 = dense_base[b];
        const int nd = dense_count[b];
        __syncthreads();
        for (int t0 = 0; t0 < nd; t0 += MKV_ATT_TILE) {
            const int T = min(MKV_ATT_TILE, nd - t0);
            // One warp per (token, head) dot product.
            for (int w = warp; w < T * G; w += nwarps) {
                const int t = w / G, h = w % G;
                const u16* k = dense_k + ((r0 + t0 + t) * kv_heads + j) * D;
                float acc = 0.0f;
                for (int d = lane; d < D; d += 32) acc += sq[h * D + d] * mkv_h2f(k[d]);
                acc = mkv_warp_sum(acc);
                if (lane == 0) sp[h * MKV_ATT_TILE + t] = acc * scale_log2;
            }
            softmax_tile(T);
            for (int i = tid; i < G * D; i += MKV_ATT_THREADS) {
                const int h = i / D, d = i % D;
                float acc = so[i];
                for (int t = 0; t < T; ++t)
                    acc += sp[h * MKV_ATT_TILE + t] * mkv_h2f(dense_v[((r0 + t0 + t) * kv_heads + j) * D + d]);
                so[i] = acc;
            }
            __syncthreads();
        }
        for (int i = tid; i < G * D; i += MKV_ATT_THREADS) part_o[pbase * G * D + i] = so[i];
        for (int h = tid; h < G; h += MKV_ATT_THREADS) { part_m[pbase * G + h] = sm[h]; part_l[pbase * G + h] = sl[h]; }
        return;
    }

    // A run of selected blocks of one segment.
    const int3 it = items[(i64)bj * max_items + part - 1];
    const int gseg = it.x;
    const SegHead s = sh[(i64)gseg * kv_heads + j];
    const i64 b0 = base[bj];
    const float* qb = qrot + ((i64)gseg * q_heads + (i64)j * G) * D;
    for (int i = tid; i < G * D; i += MKV_ATT_THREADS) sq[i] = qb[i];
    __syncthreads();
    const bool qkeys = mkv_is_quantized(s.key_dtype);
    if (qkeys) {
        // SPEC 9 on int8/int4 key records multiplies SPEC 8.2's int8 query: per head (one
        // warp) the max |q'_j| over j < Dt, then a_j = rint(q'_j / s_q) in [-127, 127] (0 for
        // a zero query), kept as exact floats in sq.
        for (int h = warp; h < G; h += nwarps) {
            float m = 0.0f;
            for (int d = lane; d < s.key_dt; d += 32) m = fmaxf(m, fabsf(sq[h * D + d]));
            m = mkv_warp_max(m);
            const double sqs = (double)m / 127.0;
            for (int d = lane; d < s.key_dt; d += 32) {
                int a = 0;
                if (m > 0.0f) a = min(127, max(-127, (int)rint(__ddiv_rn((double)sq[h * D + d], sqs))));
                sq[h * D + d] = (float)a;
            }
            if (lane == 0) sqm[h] = m;
        }
        __syncthreads();
    }

    const int kw = (s.key_dt / s.key_g + 63) / 64, vw = (s.val_dt / s.val_g + 63) / 64;
    const int kbb = mkv_bitmap_bytes(s.key_dt / s.key_g), vbb = mkv_bitmap_bytes(s.val_dt / s.val_g);
    // Where each side's values start: after the bitmap and, for int8 / int4, the record's
    // f16 minimum and scale (SPEC.md section 6).
    const int kvo = kbb + mkv_scale_bytes(s.key_dtype), vvo = vbb + mkv_scale_bytes(s.val_dtype);
    const int kchunks = (s.key_r + 3) / 4, vchunks = (s.val_r + 3) / 4;
    const int kl = mkv_pow2_lanes(kchunks), vl = mkv_pow2_lanes(vchunks);  // lanes per token
    const u8* kseg = packed_k + s.key_rec_off;
    const u8* vseg = packed_v + s.val_rec_off;

    const int bs = s.block_size;
    const int span = (it.z - it.y) * bs;  // token slots of the run (partial blocks leave holes)
    for (int ts = 0; ts < span; ts += MKV_ATT_TILE) {
        const int T = min(MKV_ATT_TILE, span - ts);
        // Slot t of the tile: block it.y + (ts + t) / bs, offset (ts + t) % bs; a hole when
        // the offset is past that block's length.
        // Phase A: logits q'.k^ from K records (any value dtype), kl lanes per token, 4 values
        // per lane-chunk.
        for (int t_base = 0; t_base < T; t_base += MKV_ATT_THREADS / kl) {
            const int t = t_base + tid / kl, sub = tid % kl;
            int tok = -1;
            if (t < T) {
                const BlockRef br = blocks[b0 + sel[b0 + it.y + (ts + t) / bs]];
                const int off = (ts + t) % bs;
                if (off < br.len) tok = br.start + off;
            }
            for (int h0 = 0; h0 < G && qkeys; h0 += MKV_HCHUNK) {
                // int8/int4 keys: exact integer sums on the codes as stored (SPEC 9), the
                // codes offset by -128 into signed bytes for the signed __dp4a:
                // sum a c = sum a (c - 128) + 128 sum a.
                int ic[MKV_HCHUNK], ik[MKV_HCHUNK];
                #pragma unroll
                for (int h = 0; h < MKV_HCHUNK; ++h) ic[h] = ik[h] = 0;
                QuantParams qp = {0.0f, 0.0f};
                if (tok >= 0) {
                    const u8* rec = kseg + (i64)tok * s.key_rb;
                    u64 bm[MKV_MAX_WORDS];
                    mkv_load_bitmap(rec, s.key_dt / s.key_g, bm);
                    qp = mkv_load_quant(rec, kbb, s.key_dtype);
                    for (int c = sub; c < kchunks; c += kl) {
                        const int codes = (int)(mkv_load_codes4(rec + kvo, c, s.key_dtype) ^ 0x80808080u);
                        int dims[4];
                        mkv_chunk_dims(bm, kw, s.key_r, s.key_g, c, dims);
                        #pragma unroll
                        for (int h = 0; h < MKV_HCHUNK; ++h) {
                            if (h0 + h >= G) continue;
                            u32 a4 = 0;
                            #pragma unroll
                            for (int i = 0; i < 4; ++i)
                                if (dims[i] >= 0) a4 |= ((u32)(int)sq[(h0 + h) * D + dims[i]] & 0xffu) << (8 * i);
                            ic[h] = __dp4a(codes, (int)a4, ic[h]);
                            ik[h] = __dp4a(0x01010101, (int)a4, ik[h]);
                        }
                    }
                }
                #pragma unroll
                for (int h = 0; h < MKV_HCHUNK; ++h) {
                    const int sk = mkv_group_sum_int(ik[h], kl);
                    const int sc = mkv_group_sum_int(ic[h], kl) + 128 * sk;
                    if (sub == 0 && t < T && h0 + h < G) {
                        const float z = mkv_key_logit_q8(sqm[h0 + h], qp, sc, sk, D);
                        sp[(h0 + h) * MKV_ATT_TILE + t] = tok >= 0 ? z * MKV_LOG2E : MKV_NEG_INF;
                    }
                }
            }
            for (int h0 = 0; h0 < G && !qkeys; h0 += MKV_HCHUNK) {
                float acc[MKV_HCHUNK];
                #pragma unroll
                for (int h = 0; h < MKV_HCHUNK; ++h) acc[h] = 0.0f;
                if (tok >= 0) {
                    const u8* rec = kseg + (i64)tok * s.key_rb;
                    u64 bm[MKV_MAX_WORDS];
                    mkv_load_bitmap(rec, s.key_dt / s.key_g, bm);
                    const QuantParams qp = mkv_load_quant(rec, kbb, s.key_dtype);
                    for (int c = sub; c < kchunks; c += kl) {
                        // The decoded key k^ (SPEC.md 6 step 4: f16, or m + code * s in f32).
                        float kv4[4];
                        mkv_load_decoded4(rec + kvo, c, s.key_r, s.key_dtype, qp, kv4);
                        int dims[4];
                        mkv_chunk_dims(bm, kw, s.key_r, s.key_g, c, dims);
                        #pragma unroll
                        for (int i = 0; i < 4; ++i) {
                            if (dims[i] < 0) continue;
                            const float v = kv4[i];
                            #pragma unroll
                            for (int h = 0; h < MKV_HCHUNK; ++h)
                                if (h0 + h < G) acc[h] += v * sq[(h0 + h) * D + dims[i]];
                        }
                    }
                }
                #pragma unroll
                for (int h = 0; h < MKV_HCHUNK; ++h) {
                    const float dot = mkv_group_sum(acc[h], kl);
                    if (sub == 0 && t < T && h0 + h < G)
                        sp[(h0 + h) * MKV_ATT_TILE + t] = tok >= 0 ? dot * scale_log2 : MKV_NEG_INF;
                }
            }
        }
        softmax_tile(T);
        // Phase C: so[h][d] += sum_t p[h][t] * v^[t][d] (SPEC.md 9 step 4). First the tile's
        // decoded value rows are expanded into sv (positions rebuilt from the V bitmap, zeros
        // where a dim is not kept or a slot is a hole), then each output element is summed by
        // one thread in token order: the same bits on every run (shared-memory atomics, the
        // first version, summed in whatever order the hardware ran them).
        for (int i = tid; i < T * D; i += MKV_ATT_THREADS) sv[i] = 0.0f;
        __syncthreads();
        for (int t_base = 0; t_base < T; t_base += MKV_ATT_THREADS / vl) {
            const int t = t_base + tid / vl, sub = tid % vl;
            if (t >= T) continue;
            const BlockRef br = blocks[b0 + sel[b0 + it.y + (ts + t) / bs]];
            const int off = (ts + t) % bs;
            if (off >= br.len) continue;
            const u8* rec = vseg + (i64)(br.start + off) * s.val_rb;
            u64 bm[MKV_MAX_WORDS];
            mkv_load_bitmap(rec, s.val_dt / s.val_g, bm);
            const QuantParams qp = mkv_load_quant(rec, vbb, s.val_dtype);
            for (int c = sub; c < vchunks; c += vl) {
                // The decoded value v^ (SPEC.md 6 step 4: f16, or m + code * s in f32).
                float vv4[4];
                mkv_load_decoded4(rec + vvo, c, s.val_r, s.val_dtype, qp, vv4);
                int dims[4];
                mkv_chunk_dims(bm, vw, s.val_r, s.val_g, c, dims);
                #pragma unroll
                for (int i = 0; i < 4; ++i)
                    if (dims[i] >= 0) sv[t * D + dims[i]] = vv4[i];
            }
        }
        __syncthreads();
        for (int i = tid; i < G * D; i += MKV_ATT_THREADS) {
            const int h = i / D, d = i % D;
            if (d >= s.val_dt) continue;  // past the kept dims so stays 0
            float acc = so[i];
            for (int t = 0; t < T; ++t) acc += sp[h * MKV_ATT_TILE + t] * sv[t * D + d];
            so[i] = acc;
        }
        __syncthreads();
    }

    // Rotate the value accumulator back once: o[h][i] = sum_{d<Dt_v} R_v[i][d] so[h][d].
    // A warp per output row i, lanes over d (coalesced reads of R_v's row).
    const u16* Rv = rot + s.val_rot_off;  // f16 bits (SPEC.md section 3)
    for (int i = warp; i < D; i += nwarps) {
        for (int h0 = 0; h0 < G; h0 += MKV_HCHUNK) {
            float acc[MKV_HCHUNK];
            #pragma unroll
            for (int h = 0; h < MKV_HCHUNK; ++h) acc[h] = 0.0f;
            for (int d = lane; d < s.val_dt; d += 32) {
                const float rv = mkv_h2f(__ldg(Rv + (i64)i * s.val_dt + d));  // R_v stored D x Dt_v
                #pragma unroll
                for (int h = 0; h < MKV_HCHUNK; ++h)
                    if (h0 + h < G) acc[h] += rv * so[(h0 + h) * D + d];
            }
            #pragma unroll
            for (int h = 0; h < MKV_HCHUNK; ++h) {
                const float v = mkv_warp_sum(acc[h]);
                if (lane == 0 && h0 + h < G) part_o[(pbase * G + h0 + h) * D + i] = v;
            }
        }
    }
    for (int h = tid; h < G; h += MKV_ATT_THREADS) { part_m[pbase * G + h] = sm[h]; part_l[pbase * G + h] = sl[h]; }
}

#define MKV_DENSE_THREADS 128
#define MKV_DENSE_GC 4   // query heads per thread block (a GQA group is split into chunks of 4)
#define MKV_DENSE_U 4    // tokens in flight per lane slot

// Full-attention decode over a dense f16 cache K, V: [batch][n][kv_heads][D] (sequence
// stride seq_stride elements). D % 8 == 0 and D <= 256: each lane loads 16 bytes (8 dims)
// of a row; a row takes lpr = pow2(D/8) lanes, a warp holds 32/lpr rows at once and
// MKV_DENSE_U tokens per lane slot in flight (K and V loads issued together).
// grid: (splits, kv_heads * ceil(G/4), batch). Split s covers work items
// [s*per_split, (s+1)*per_split): tokens, or, when pages != null, entries of
// pages[bj] (Quest: selected pages of page_size tokens, page_count[bj] of them).
// Partials: [bj][splits][G] m, l and [bj][splits][G][D] o.
extern "C" __global__ void __launch_bounds__(MKV_DENSE_THREADS)
mkv_dense_decode(const float* __restrict__ q, const u16* __restrict__ K, const u16* __restrict__ V,
                 i64 n, i64 seq_stride, int kv_heads, int q_heads, int D, float scale_log2,
                 i64 per_split, const int* __restrict__ pages, const i64* __restrict__ page_base,
                 const int* __restrict__ page_count, int page_size,
                 float* __restrict__ part_m, float* __restrict__ part_l, float* __restrict__ part_o) {
    __shared__ float red_m[MKV_DENSE_THREADS / 32][MKV_DENSE_GC];
    __shared__ float red_l[MKV_DENSE_THREADS / 32][MKV_DENSE_GC];
    __shared__ __align__(16) float red_o[MKV_DENSE_THREADS / 32][MKV_DENSE_GC][MKV_MAX_D];
    const int G = q_heads / kv_heads;
    const int chunks = (G + MKV_DENSE_GC - 1) / MKV_DENSE_GC;
    const int split = blockIdx.x, splits = gridDim.x;
    const int j = blockIdx.y / chunks, h0 = (blockIdx.y % chunks) * MKV_DENSE_GC;
    const int b = blockIdx.z;
    const int bj = b * kv_heads + j;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int lpr = mkv_pow2_lanes(D / 8);
    const int slots = 32 / lpr;
    const int slot = lane / lpr, sub = lane % lpr;
    const bool active = sub * 8 < D;
    const int d0 = sub * 8;

    // Work range of this split.
    const i64 total = pages ? (i64)page_count[bj] * page_size : n;
    const i64 w0 = (i64)split * per_split;
    const i64 w1 = min(total, w0 + per_split);

    float qr[MKV_DENSE_GC][8];
    #pragma unroll
    for (int h = 0; h < MKV_DENSE_GC; ++h) {
        #pragma unroll
        for (int e = 0; e < 8; ++e) {
            const int hh = h0 + h;
            qr[h][e] = (active && hh < G) ? q[((i64)b * q_heads + (i64)j * G + hh) * D + d0 + e] * scale_log2 : 0.0f;
        }
    }
    float m[MKV_DENSE_GC], l[MKV_DENSE_GC], o[MKV_DENSE_GC][8];
    #pragma unroll
    for (int h = 0; h < MKV_DENSE_GC; ++h) {
        m[h] = MKV_NEG_INF;
        l[h] = 0.0f;
        #pragma unroll
        for (int e = 0; e < 8; ++e) o[h][e] = 0.0f;
    }
    const u16* Kb = K + (i64)b * seq_stride;
    const u16* Vb = V + (i64)b * seq_stride;
    const i64 pb = pages ? page_base[bj] : 0;
    const int rows_per_iter = (MKV_DENSE_THREADS / 32) * slots * MKV_DENSE_U;
    // The loop runs the same trip count in every lane of a warp (its bound tests the warp's
    // first row), so the full-mask shuffles of mkv_group_sum inside it are reached by all 32
    // lanes; lane slots past w1 load nothing and contribute -inf logits.
#ifdef MKV_DENSE_DIVERGENT_LOOP
    // The pre-fix shape, kept only as the emulation's negative case (kernels/emu/divergent.cpp):
    // the start depends on `slot`, so slots of one warp can run different trip counts.
    for (i64 it = w0 + (i64)(warp * slots + slot) * MKV_DENSE_U; it < w1; it += rows_per_iter) {
#else
    for (i64 wbase = w0 + (i64)warp * slots * MKV_DENSE_U; wbase < w1; wbase += rows_per_iter) {
        const i64 it = wbase + (i64)slot * MKV_DENSE_U;
#endif
        uint4 kr[MKV_DENSE_U], vr[MKV_DENSE_U];
        bool ok[MKV_DENSE_U];
        #pragma unroll
        for (int u = 0; u < MKV_DENSE_U; ++u) {
            const i64 w = it + u;
            i64 t = w;
            if (pages && w < w1) t = (i64)pages[pb + w / page_size] * page_size + w % page_size;
            ok[u] = w < w1 && t < n;
            const i64 off = (t * kv_heads + j) * D + d0;
            kr[u] = (ok[u] && active) ? __ldg(reinterpret_cast<const uint4*>(Kb + off)) : make_uint4(0, 0, 0, 0);
            vr[u] = (ok[u] && active) ? __ldg(reinterpret_cast<const uint4*>(Vb + off)) : make_uint4(0, 0, 0, 0);
        }
        #pragma unroll
        for (int h = 0; h < MKV_DENSE_GC; ++h) {
            float z[MKV_DENSE_U];
            #pragma unroll
            for (int u = 0; u < MKV_DENSE_U; ++u) {
                const u32 w4[4] = {kr[u].x, kr[u].y, kr[u].z, kr[u].w};
                float acc = 0.0f;
                #pragma unroll
                for (int e = 0; e < 4; ++e) {
                    acc += qr[h][2 * e] * mkv_h2f((u16)(w4[e] & 0xffffu));
                    acc += qr[h][2 * e + 1] * mkv_h2f((u16)(w4[e] >> 16));
                }
                acc = mkv_group_sum(acc, lpr);
                z[u] = ok[u] ? acc : MKV_NEG_INF;
            }
            float mx = m[h];
            #pragma unroll
            for (int u = 0; u < MKV_DENSE_U; ++u) mx = fmaxf(mx, z[u]);
            if (mx == MKV_NEG_INF) continue;
            const float sc = exp2f(m[h] - mx);
            l[h] *= sc;
            #pragma unroll
            for (int e = 0; e < 8; ++e) o[h][e] *= sc;
            #pragma unroll
            for (int u = 0; u < MKV_DENSE_U; ++u) {
                const float p = exp2f(z[u] - mx);
                l[h] += p;
                const u32 w4[4] = {vr[u].x, vr[u].y, vr[u].z, vr[u].w};
                #pragma unroll
                for (int e = 0; e < 4; ++e) {
                    o[h][2 * e] += p * mkv_h2f((u16)(w4[e] & 0xffffu));
                    o[h][2 * e + 1] += p * mkv_h2f((u16)(w4[e] >> 16));
                }
            }
            m[h] = mx;
        }
    }
    // Merge the lane slots of the warp (same dims, different tokens).
    #pragma unroll
    for (int h = 0; h < MKV_DENSE_GC; ++h) {
        for (int off = lpr; off < 32; off <<= 1) {
            const float m2 = __shfl_xor_sync(MKV_FULL_MASK, m[h], off);
            const float l2 = __shfl_xor_sync(MKV_FULL_MASK, l[h], off);
            const float mx = fmaxf(m[h], m2);
            const float s1 = mx == MKV_NEG_INF ? 0.0f : exp2f(m[h] - mx);
            const float s2 = mx == MKV_NEG_INF ? 0.0f : exp2f(m2 - mx);
            l[h] = l[h] * s1 + l2 * s2;
            #pragma unroll
            for (int e = 0; e < 8; ++e) {
                const float o2 = __shfl_xor_sync(MKV_FULL_MASK, o[h][e], off);
                o[h][e] = o[h][e] * s1 + o2 * s2;
            }
            m[h] = mx;
        }
    }
    if (slot == 0) {
        #pragma unroll
        for (int h = 0; h < MKV_DENSE_GC; ++h) {
            if (sub == 0) { red_m[warp][h] = m[h]; red_l[warp][h] = l[h]; }
            if (active) {
                #pragma unroll
                for (int e = 0; e < 8; ++e) red_o[warp][h][d0 + e] = o[h][e];
            }
        }
    }
    __syncthreads();
    // Merge the warps and write this split's partial.
    const int nw = MKV_DENSE_THREADS / 32;
    for (int i = tid; i < MKV_DENSE_GC * D; i += MKV_DENSE_THREADS) {
        const int h = i / D, d = i % D;
        if (h0 + h >= G) continue;
        float mx = MKV_NEG_INF;
        for (int w = 0; w < nw; ++w) mx = fmaxf(mx, red_m[w][h]);
        float lo = 0.0f, oo = 0.0f;
        for (int w = 0; w < nw; ++w) {
            const float sc = mx == MKV_NEG_INF ? 0.0f : exp2f(red_m[w][h] - mx);
            lo += red_l[w][h] * sc;
            oo += red_o[w][h][d] * sc;
        }
        const i64 pidx = ((i64)bj * splits + split) * G + h0 + h;
        part_o[pidx * D + d] = oo;
        if (d == 0) { part_m[pidx] = mx; part_l[pidx] = lo; }
    }
}

// out[b][h][:] = sum_p exp2(m_p - M) o_p / sum_p exp2(m_p - M) l_p over the parts of
// (b, h / G). counts == null: parts = max_parts for every bj; else counts[bj] + 1
// (part 0 = dense rows, parts 1.. = work items). grid: (q_heads, batch).
extern "C" __global__ void mkv_merge(const float* __restrict__ part_m, const float* __restrict__ part_l,
                                     const float* __restrict__ part_o, const int* __restrict__ counts, int max_parts,
                                     int kv_heads, int q_heads, int D, float* __restrict__ out) {
    const int h = blockIdx.x, b = blockIdx.y;
    const int G = q_heads / kv_heads;
    const int j = h / G, hh = h % G;
    const int bj = b * kv_heads + j;
    const int parts = counts ? min(counts[bj] + 1, max_parts) : max_parts;
    float M = MKV_NEG_INF;
    for (int p = 0; p < parts; ++p) M = fmaxf(M, part_m[((i64)bj * max_parts + p) * G + hh]);
    float L = 0.0f;
    for (int p = 0; p < parts; ++p) {
        const float mp = part_m[((i64)bj * max_parts + p) * G + hh];
        if (mp != MKV_NEG_INF) L += part_l[((i64)bj * max_parts + p) * G + hh] * exp2f(mp - M);
    }
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float acc = 0.0f;
        for (int p = 0; p < parts; ++p) {
            const i64 pi = ((i64)bj * max_parts + p) * G + hh;
            const float mp = part_m[pi];
            if (mp != MKV_NEG_INF) acc += part_o[pi * D + d] * exp2f(mp - M);
        }
        out[((i64)b * q_heads + h) * D + d] = L > 0.0f ? acc / L : 0.0f;
    }
}
