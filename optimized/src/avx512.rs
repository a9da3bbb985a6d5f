//! AVX-512 (F, BW, VL, VBMI2, VNNI) versions of the kernels where it pays on
//! the machine we measured (AMD Zen 4, which runs 512-bit arithmetic on
//! 256-bit units): bitmap expansion, the value side of packed attention, the
//! logits of an expanded key tile, the online-softmax step, MosaicKV's block
//! scores, Quest's page scores, the baselines' f16 value accumulation and the
//! query rotation. Every other kernel of [`crate::simd::Path::Avx512`] is the
//! AVX2 one. Measured and not kept (docs/PERFORMANCE.md): 16-lane tile
//! accumulation on stored f32 tiles (no faster); 16-lane logits on streamed
//! f16 rows (faster on L1-resident rows, slower for dense decode); fused
//! expansion + logits kernels (21-23 ns per token against 17.7 for expansion
//! then tile logits; later, with four tokens per pass, 16.4 against 14.5).
//!
//! What changes against AVX2:
//! - Expansion (SPEC.md section 6, g = 1): one `vpexpandw` per 32 dims places
//!   the packed f16 values at the set bits of the bitmap, instead of one
//!   table-driven `pshufb` per 8 dims. Keys are expanded into an f16 tile
//!   ([`expand_g1_h`]: one 64-byte store per 32 dims, no conversion), which
//!   the logits widen as they load it.
//! - Key logits on the expanded tile: four tokens x four heads per pass, so each
//!   query chunk is loaded once per four tokens and a head's four sums come out
//!   of one transposed reduction ([`tile_logits`], on f32 or f16 rows).
//! - Online softmax: the four heads' maxima and sums by transposed reductions,
//!   the rescale factors by a 4-lane copy of the scalar `fast_exp`.
//! - Dense / Quest value accumulation on f16 rows: rows read in address order
//!   with every accumulator in registers ([`tile_accumulate_f16`]).
//! - Value accumulation (SPEC.md section 9): each value record is expanded in
//!   registers and multiplied straight into accumulators that stay in
//!   registers for the whole tile, rescaled by the online-softmax factor on
//!   load ([`packed_accumulate`], with [`tile_softmax`] giving the factors); no expanded tile is
//!   stored. Lane for lane the same operations as the AVX2 sequence, so the
//!   same bits.
//! - Block scores (SPEC.md section 8.2, exact integers): `vpdpbusd` sums four
//!   u8 x i8 products per i32 lane in one instruction, where AVX2 needs
//!   `vpmaddubsw` + `vpmaddwd` + `vpaddd`; same integers, same f64 products.
//! - Query rotation (SPEC.md section 8.1): the rotation read row by row, each
//!   widened row shared by up to 4 query rows, f64 FMAs (exact products, so the
//!   same sums).
//! - Quest's page scores (SPEC.md section 12, f32): `max(q M, q m) = q+ M +
//!   q- m` for `M >= m` (`q+ = max(q, 0)`, `q- = min(q, 0)`), two FMAs per lane
//!   instead of mul, mul, max, add, 4 pages per pass; the same bound, only the
//!   rounding differs (FMA, 16-lane sums).
//!
//! Callers check [`crate::simd::avx512_available`] before calling anything here.

use half::f16;
use std::arch::x86_64::*;

/// Widest `Dt` the score kernels keep `q+` / `q-` for on the stack (callers fall back above it).
pub const SCORE_MAX_DT: usize = 256;

/// Lane mask of the first `n` of 16 lanes.
#[inline(always)]
fn lanes16(n: usize) -> u16 {
    if n >= 16 {
        u16::MAX
    } else {
        (1u16 << n) - 1
    }
}

/// A record's `r <= 32` f16 values as one register (lanes past `r` zero). A masked load only
/// when `r < 32` (on Zen 4 a masked 512-bit load costs more than a plain one even with every
/// lane enabled: a 16-lane tile-logits kernel took 11.5 ns per token with masked loads, 10.2
/// with plain ones, in `kernel_cost`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
#[inline]
unsafe fn load_values(p: *const u8, r: usize) -> __m512i {
    if r >= 32 {
        _mm512_loadu_si512(p as *const __m512i)
    } else {
        _mm512_maskz_loadu_epi16((1u32 << r) - 1, p as *const i16)
    }
}

/// Expands `n` g = 1 records (`rb` bytes each, bitmap of `bb` bytes, `r` f16 values) to
/// dense rows of `dp` floats at `out + t * dp`. Dims past `dt` come out 0 (their bits are 0 in
/// a valid record). Reads only inside each record's bitmap and values (masked loads).
///
/// # Safety
/// AVX-512 F/BW/VL/VBMI2 available; `bytes` holds `n * rb` bytes; `out` holds `n * dp` floats;
/// `dp >= dt`, `dp <= 32 * ceil(dt / 32)`, `bb + 2 * r <= rb`, `bb >= 4 * ceil(dt / 32)`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
pub unsafe fn expand_g1(
    bytes: *const u8,
    n: usize,
    rb: usize,
    bb: usize,
    r: usize,
    dt: usize,
    dp: usize,
    out: *mut f32,
) {
    let groups = dt.div_ceil(32);
    if r <= 32 && dp == 32 * groups {
        // All values fit one register: one load per record, independent of the bitmap; group
        // c's values are lanes off_c.. of it (`vpermw` by iota + off_c), so no load address
        // waits for a popcount.
        let iota = iota16();
        for t in 0..n {
            let rec = bytes.add(t * rb);
            let row = out.add(t * dp);
            let vall = load_values(rec.add(bb), r);
            let mut off = 0i16;
            for c in 0..groups {
                let (lo, hi) = expand_word(rec, c, vall, iota, &mut off);
                _mm512_storeu_ps(row.add(32 * c), lo);
                _mm512_storeu_ps(row.add(32 * c + 16), hi);
            }
        }
        return;
    }
    for t in 0..n {
        let rec = bytes.add(t * rb);
        let src = rec.add(bb) as *const i16;
        let row = out.add(t * dp);
        let mut off = 0usize;
        for c in 0..groups {
            // Little-endian u32 bitmap word c: dims 32c .. 32c + 32.
            let mask = u32::from_le((rec.add(4 * c) as *const u32).read_unaligned());
            let avail = r - off;
            let lm = if avail >= 32 {
                u32::MAX
            } else {
                (1u32 << avail) - 1
            };
            let v = _mm512_maskz_loadu_epi16(lm, src.add(off));
            let e = _mm512_maskz_expand_epi16(mask, v);
            let lo = _mm512_cvtph_ps(_mm512_castsi512_si256(e));
            let hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(e));
            let base = 32 * c;
            if base + 32 <= dp {
                _mm512_storeu_ps(row.add(base), lo);
                _mm512_storeu_ps(row.add(base + 16), hi);
            } else {
                _mm512_mask_storeu_ps(row.add(base), lanes16(dp - base), lo);
                if dp > base + 16 {
                    _mm512_mask_storeu_ps(row.add(base + 16), lanes16(dp - base - 16), hi);
                }
            }
            off = (off + mask.count_ones() as usize).min(r);
        }
    }
}

/// [`expand_g1`] into f16 rows of `32 * groups` halves (`r <= 32`, `dp = 32 * groups`): each
/// expanded word is stored as it is, the conversion to f32 left to the loads of
/// [`tile_logits`].
///
/// # Safety
/// As [`expand_g1`] with `r <= 32` and `dp = 32 * groups`; `out` holds `n * 32 * groups` halves.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
pub unsafe fn expand_g1_h(
    bytes: *const u8,
    n: usize,
    rb: usize,
    bb: usize,
    r: usize,
    groups: usize,
    out: *mut f16,
) {
    let iota = iota16();
    for t in 0..n {
        let rec = bytes.add(t * rb);
        let row = out.add(t * 32 * groups) as *mut __m512i;
        let vall = load_values(rec.add(bb), r);
        let mut off = 0i16;
        for c in 0..groups {
            _mm512_storeu_si512(row.add(c), expand_word_h(rec, c, vall, iota, &mut off));
        }
    }
}

/// The selection filter of `attend::top_blocks`: writes the rank keys (`attend::rank_key`) of
/// the scores whose key is at most `pivot` to `out`, in any order, and returns how many. Sixteen
/// scores per step: the keys' two 32-bit halves (inverted monotone score, index) are compared
/// with the pivot's, the kept lanes compressed and interleaved into 64-bit keys.
///
/// # Safety
/// AVX-512 F available; `out` holds `scores.len() + 16` keys; `scores.len() < 2^32`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
pub unsafe fn filter_rank_keys(scores: &[f32], pivot: u64, out: *mut u64) -> usize {
    let n = scores.len();
    let ph = _mm512_set1_epi32((pivot >> 32) as u32 as i32);
    let pl = _mm512_set1_epi32(pivot as u32 as i32);
    let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
    let sign = _mm512_set1_epi32(i32::MIN);
    // Little-endian u64 key j = (index_j, inverted_j): dword 2j from `a` (indices), 2j + 1 from
    // `b` (inverted monotone scores, table entries 16..).
    let lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    let hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    let mut idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    let mut c = 0;
    let mut i = 0;
    while i < n {
        let m = lanes16(n - i);
        // rank_key: NaN ranks as -inf, -0 as +0 (`+ 0.0`), then the monotone map, inverted.
        let s = _mm512_add_ps(
            _mm512_maskz_loadu_ps(m, scores.as_ptr().add(i)),
            _mm512_setzero_ps(),
        );
        let s = _mm512_mask_mov_ps(s, _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(s, s), ninf);
        let b = _mm512_castps_si512(s);
        let mono = _mm512_xor_si512(b, _mm512_or_si512(_mm512_srai_epi32::<31>(b), sign));
        let inv = _mm512_xor_si512(mono, _mm512_set1_epi32(-1));
        let keep = (_mm512_cmplt_epu32_mask(inv, ph)
            | (_mm512_cmpeq_epu32_mask(inv, ph) & _mm512_cmple_epu32_mask(idx, pl)))
            & m;
        let ci = _mm512_maskz_compress_epi32(keep, idx);
        let cs = _mm512_maskz_compress_epi32(keep, inv);
        _mm512_storeu_si512(
            out.add(c) as *mut __m512i,
            _mm512_permutex2var_epi32(ci, lo, cs),
        );
        _mm512_storeu_si512(
            out.add(c + 8) as *mut __m512i,
            _mm512_permutex2var_epi32(ci, hi, cs),
        );
        c += keep.count_ones() as usize;
        idx = _mm512_add_epi32(idx, _mm512_set1_epi32(16));
        i += 16;
    }
    c
}

/// Defines `$name(a) -> [op a0, op a1, op a2, op a3]` (one xmm): the horizontal reductions of
/// four registers by one transposition (about 13 shuffles and `$op`s instead of 4 separate
/// reductions of ~8 each), `$op512` / `$op256` / `$op128` the operation at each width.
macro_rules! transposed_reduce4 {
    ($(#[$doc:meta])* $name:ident, $op512:ident, $op256:ident, $op128:ident) => {
        $(#[$doc])*
        #[target_feature(
            enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt"
        )]
        #[inline]
        unsafe fn $name(a: &[__m512]) -> __m128 {
            let t0 = $op512(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
            let t1 = $op512(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
            let u = $op512(
                _mm512_shuffle_ps::<0x44>(t0, t1),
                _mm512_shuffle_ps::<0xEE>(t0, t1),
            );
            let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(u)));
            let v = $op256(_mm512_castps512_ps256(u), hi);
            $op128(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v))
        }
    };
}

transposed_reduce4!(
    /// The four horizontal sums of `a[0..4]`, as one xmm `[sum a0, sum a1, sum a2, sum a3]`.
    hsum4, _mm512_add_ps, _mm256_add_ps, _mm_add_ps
);
transposed_reduce4!(
    /// The four horizontal maxima of `a[0..4]`, as one xmm.
    hmax4, _mm512_max_ps, _mm256_max_ps, _mm_max_ps
);

/// Horizontal sums of `N` accumulators into `out[..N]`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
#[inline]
unsafe fn hsums<const N: usize>(a: &[__m512; N], out: &mut [f32; 4]) {
    if N == 4 {
        _mm_storeu_ps(out.as_mut_ptr(), hsum4(a));
    } else {
        for k in 0..N {
            out[k] = _mm512_reduce_add_ps(a[k]);
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
#[inline]
unsafe fn ld_f16(p: *const f16) -> __m512 {
    _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
#[inline]
unsafe fn ldm_f16(p: *const f16, k: u16) -> __m512 {
    _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, p as *const i16))
}

/// Rows of a tile the logits kernel reads 16 at a time as f32: f32 rows as they are, f16
/// rows widened as they are loaded (exactly, so both give the same logits for the same values).
pub trait TileRow: Copy {
    /// 16 elements at `p`, as f32.
    ///
    /// # Safety
    /// AVX-512 F available (callers are `#[target_feature]` kernels); 16 elements readable.
    unsafe fn load16(p: *const Self) -> __m512;
    /// The first lanes of `k` at `p`, the others 0; reads only those lanes.
    ///
    /// # Safety
    /// As [`TileRow::load16`], for the lanes of `k`.
    unsafe fn load16_masked(p: *const Self, k: u16) -> __m512;
}

impl TileRow for f32 {
    #[inline(always)]
    unsafe fn load16(p: *const f32) -> __m512 {
        _mm512_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn load16_masked(p: *const f32, k: u16) -> __m512 {
        _mm512_maskz_loadu_ps(k, p)
    }
}

impl TileRow for f16 {
    #[inline(always)]
    unsafe fn load16(p: *const f16) -> __m512 {
        ld_f16(p)
    }
    #[inline(always)]
    unsafe fn load16_masked(p: *const f16, k: u16) -> __m512 {
        ldm_f16(p, k)
    }
}

/// T tokens x N heads of [`tile_logits`]: `4 N` (T = 4) accumulators, each query chunk loaded
/// once for the T tokens; the T sums of a head come out of one [`hsum4`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
#[inline]
unsafe fn tile_logits_pass<R: TileRow, const N: usize, const T: usize>(
    q: *const f32,
    dp: usize,
    rows: *const R,
    stride: usize,
    scale: f32,
    out: *mut f32,
) {
    let mut acc = [[_mm512_setzero_ps(); T]; N];
    let d16 = dp / 16 * 16;
    let mut c = 0;
    while c < dp {
        let mut k = [_mm512_setzero_ps(); T];
        let m = lanes16(dp - c);
        for (j, kj) in k.iter_mut().enumerate() {
            let p = rows.add(j * stride + c);
            *kj = if c < d16 {
                R::load16(p)
            } else {
                R::load16_masked(p, m)
            };
        }
        for (h, ah) in acc.iter_mut().enumerate() {
            let qp = q.add(h * dp + c);
            let qv = if c < d16 {
                _mm512_loadu_ps(qp)
            } else {
                _mm512_maskz_loadu_ps(m, qp)
            };
            for j in 0..T {
                ah[j] = _mm512_fmadd_ps(qv, k[j], ah[j]);
            }
        }
        c += 16;
    }
    let sv = _mm_set1_ps(scale);
    for (h, ah) in acc.iter().enumerate() {
        let o = out.add(h * crate::simd::TILE);
        if T == 4 {
            _mm_storeu_ps(o, _mm_mul_ps(sv, hsum4(ah)));
        } else {
            for (j, &x) in ah.iter().enumerate() {
                *o.add(j) = scale * _mm512_reduce_add_ps(x);
            }
        }
    }
}

/// Logits `out[h * TILE + t] = scale * q_h . row_t` for `g` heads (`q` `[g][dp]`) and
/// `n <= TILE` rows at `rows + t * stride` (`dp` elements each, f32 or f16): four tokens x up
/// to four heads per pass, 16 lanes per FMA. The sums run in a different order than the AVX2
/// kernel's (16 lanes, then a tree), so the logits agree to rounding, not bit for bit; f16
/// rows give exactly the logits of the same values as f32 rows.
///
/// # Safety
/// AVX-512 available; `q` holds `g * dp` floats, `out` `(g - 1) * TILE + n`; row `t < n`
/// holds `dp` elements at `rows + t * stride`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn tile_logits<R: TileRow>(
    q: *const f32,
    g: usize,
    dp: usize,
    rows: *const R,
    stride: usize,
    n: usize,
    scale: f32,
    out: *mut f32,
) {
    macro_rules! pass {
        ($N:literal, $qp:expr, $rp:expr, $op:expr, $left:expr) => {
            match $left {
                1 => tile_logits_pass::<R, $N, 1>($qp, dp, $rp, stride, scale, $op),
                2 => tile_logits_pass::<R, $N, 2>($qp, dp, $rp, stride, scale, $op),
                3 => tile_logits_pass::<R, $N, 3>($qp, dp, $rp, stride, scale, $op),
                _ => tile_logits_pass::<R, $N, 4>($qp, dp, $rp, stride, scale, $op),
            }
        };
    }
    let mut h0 = 0;
    while h0 < g {
        let (qp, op) = (q.add(h0 * dp), out.add(h0 * crate::simd::TILE));
        let mut t = 0;
        while t < n {
            let (rp, o) = (rows.add(t * stride), op.add(t));
            match g - h0 {
                1 => pass!(1, qp, rp, o, n - t),
                2 => pass!(2, qp, rp, o, n - t),
                3 => pass!(3, qp, rp, o, n - t),
                _ => pass!(4, qp, rp, o, n - t),
            }
            t += 4;
        }
        h0 += 4;
    }
}

/// N heads of [`tile_accumulate_f16`]: `N x ceil(dp / 16)` accumulators in registers, rows in
/// order, each row converted once per pass.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
#[inline]
unsafe fn tile_accumulate_f16_pass<const N: usize, const C: usize>(
    p: *const f32,
    dp: usize,
    rows: *const f16,
    stride: usize,
    n: usize,
    acc: *mut f32,
) {
    let mut m = [u16::MAX; C];
    for (c, x) in m.iter_mut().enumerate() {
        *x = lanes16(dp.saturating_sub(16 * c));
    }
    let mut a = [[_mm512_setzero_ps(); C]; N];
    for (h, ah) in a.iter_mut().enumerate() {
        for (c, x) in ah.iter_mut().enumerate() {
            *x = _mm512_maskz_loadu_ps(m[c], acc.add(h * dp + 16 * c));
        }
    }
    for t in 0..n {
        let row = rows.add(t * stride);
        let mut pv = [_mm512_setzero_ps(); N];
        for (h, x) in pv.iter_mut().enumerate() {
            *x = _mm512_set1_ps(*p.add(h * crate::simd::TILE + t));
        }
        for c in 0..C {
            let v = if m[c] == u16::MAX {
                ld_f16(row.add(16 * c))
            } else {
                ldm_f16(row.add(16 * c), m[c])
            };
            for h in 0..N {
                a[h][c] = _mm512_fmadd_ps(pv[h], v, a[h][c]);
            }
        }
    }
    for (h, ah) in a.iter().enumerate() {
        for (c, &x) in ah.iter().enumerate() {
            _mm512_mask_storeu_ps(acc.add(h * dp + 16 * c), m[c], x);
        }
    }
}

/// `acc_h += sum_t p[h * TILE + t] row_t` for `g` heads over `n <= TILE` f16 rows at `rows + t *
/// stride` (`dp <= 128` elements each): the rows are read in order (row by row, not column
/// chunk by column chunk across the tile), heads in passes that keep every accumulator in
/// registers. Per lane the same FMAs in the same order as the AVX2 kernel: the same bits.
///
/// # Safety
/// AVX-512 available; `dp <= 128`; `p` holds `g * TILE` floats, `acc` `g * dp`; row `t < n`
/// holds `dp` elements at `rows + t * stride`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
pub unsafe fn tile_accumulate_f16(
    p: *const f32,
    g: usize,
    dp: usize,
    rows: *const f16,
    stride: usize,
    n: usize,
    acc: *mut f32,
) {
    // One pass of up to N heads with C chunks (N * C <= 24 accumulators); evaluates to N.
    macro_rules! pass {
        ($C:literal, $N:literal, $pp:expr, $ap:expr, $left:expr) => {{
            match $left.min($N) {
                1 => tile_accumulate_f16_pass::<1, $C>($pp, dp, rows, stride, n, $ap),
                2 => tile_accumulate_f16_pass::<2, $C>($pp, dp, rows, stride, n, $ap),
                3 => tile_accumulate_f16_pass::<3, $C>($pp, dp, rows, stride, n, $ap),
                _ => tile_accumulate_f16_pass::<4, $C>($pp, dp, rows, stride, n, $ap),
            }
            $N
        }};
    }
    let chunks = dp.div_ceil(16);
    let mut h0 = 0;
    while h0 < g {
        let (pp, ap) = (p.add(h0 * crate::simd::TILE), acc.add(h0 * dp));
        h0 += match chunks {
            0 | 1 => pass!(1, 4, pp, ap, g - h0),
            2 => pass!(2, 4, pp, ap, g - h0),
            3 => pass!(3, 4, pp, ap, g - h0),
            4 => pass!(4, 4, pp, ap, g - h0),
            5 => pass!(5, 4, pp, ap, g - h0),
            6 => pass!(6, 4, pp, ap, g - h0),
            7 => pass!(7, 3, pp, ap, g - h0),
            _ => pass!(8, 3, pp, ap, g - h0),
        };
    }
}

macro_rules! score_kernel_512 {
    ($name:ident, $heads:ident, $t:ty, $load:ident, $loadm:ident) => {
        /// Sums of the bound for N heads over B consecutive blocks (`qp`/`qn`:
        /// `[N][SCORE_MAX_DT]`), into `out[b][k]`. B blocks share every load of `q`, so the
        /// loop is bound by the FMAs (2 per dim, head and block), not by loads.
        #[target_feature(
            enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt"
        )]
        #[inline]
        unsafe fn $heads<const N: usize, const B: usize>(
            qp: *const f32,
            qn: *const f32,
            dt: usize,
            mxp: *const $t,
            mnp: *const $t,
            out: &mut [[f32; 4]; 4],
        ) {
            let mut acc = [[_mm512_setzero_ps(); N]; B];
            let d16 = dt / 16 * 16;
            let mut c = 0;
            while c < dt {
                let m = lanes16(dt - c);
                let mut mx = [_mm512_setzero_ps(); B];
                let mut mn = [_mm512_setzero_ps(); B];
                for b in 0..B {
                    if c < d16 {
                        mx[b] = $load(mxp.add(b * dt + c));
                        mn[b] = $load(mnp.add(b * dt + c));
                    } else {
                        mx[b] = $loadm(mxp.add(b * dt + c), m);
                        mn[b] = $loadm(mnp.add(b * dt + c), m);
                    }
                }
                for k in 0..N {
                    let o = k * SCORE_MAX_DT + c;
                    let (pv, nv) = (_mm512_loadu_ps(qp.add(o)), _mm512_loadu_ps(qn.add(o)));
                    for b in 0..B {
                        acc[b][k] = _mm512_fmadd_ps(pv, mx[b], acc[b][k]);
                        acc[b][k] = _mm512_fmadd_ps(nv, mn[b], acc[b][k]);
                    }
                }
                c += 16;
            }
            for b in 0..B {
                hsums::<N>(&acc[b], &mut out[b]);
            }
        }

        /// `out[b] = max_h sum_j (q+_hj max[b][j] + q-_hj min[b][j])` over the `g` query rows
        /// of `q` (`[g][stride]`, first `dt` used), times `scale[b]` when given.
        ///
        /// # Safety
        /// AVX-512 available; `dt <= SCORE_MAX_DT`; `min`/`max` hold `out.len() * dt`
        /// elements, `scale` (if any) `out.len()`; `q` holds `(g - 1) * stride + dt` floats.
        #[target_feature(
            enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt"
        )]
        pub unsafe fn $name(
            q: &[f32],
            g: usize,
            stride: usize,
            dt: usize,
            min: *const $t,
            max: *const $t,
            scale: Option<&[f32]>,
            out: &mut [f32],
        ) {
            let mut qp = [0f32; 4 * SCORE_MAX_DT];
            let mut qn = [0f32; 4 * SCORE_MAX_DT];
            let blocks = out.len();
            let mut h0 = 0;
            while h0 < g {
                let hn = (g - h0).min(4);
                for k in 0..hn {
                    for j in 0..dt {
                        let x = q[(h0 + k) * stride + j];
                        qp[k * SCORE_MAX_DT + j] = x.max(0.0);
                        qn[k * SCORE_MAX_DT + j] = x.min(0.0);
                    }
                }
                let (pp, np) = (qp.as_ptr(), qn.as_ptr());
                let mut b = 0;
                while b < blocks {
                    let nb = if blocks - b >= 4 { 4 } else { 1 };
                    let (mxp, mnp) = (max.add(b * dt), min.add(b * dt));
                    let mut sums = [[0f32; 4]; 4];
                    match (hn, nb) {
                        (1, 4) => $heads::<1, 4>(pp, np, dt, mxp, mnp, &mut sums),
                        (2, 4) => $heads::<2, 4>(pp, np, dt, mxp, mnp, &mut sums),
                        (3, 4) => $heads::<3, 4>(pp, np, dt, mxp, mnp, &mut sums),
                        (4, 4) => $heads::<4, 4>(pp, np, dt, mxp, mnp, &mut sums),
                        (1, _) => $heads::<1, 1>(pp, np, dt, mxp, mnp, &mut sums),
                        (2, _) => $heads::<2, 1>(pp, np, dt, mxp, mnp, &mut sums),
                        (3, _) => $heads::<3, 1>(pp, np, dt, mxp, mnp, &mut sums),
                        _ => $heads::<4, 1>(pp, np, dt, mxp, mnp, &mut sums),
                    }
                    for (i, s) in sums.iter().enumerate().take(nb) {
                        let o = &mut out[b + i];
                        let mut best = if h0 == 0 { s[0] } else { o.max(s[0]) };
                        for &x in &s[1..hn] {
                            best = best.max(x);
                        }
                        *o = best;
                    }
                    b += nb;
                }
                h0 += 4;
            }
            if let Some(scale) = scale {
                for (o, &s) in out.iter_mut().zip(scale) {
                    *o *= s;
                }
            }
        }
    };
}

score_kernel_512!(score_pages_f16, score_heads_f16, f16, ld_f16, ldm_f16);

/// SPEC.md section 8.2 integer block scores (see `simd::portable_score_int`), 32 dims per
/// step with `vpdpbusd` (AVX-512 VNNI on 256-bit registers: 4 u8 x i8 products summed into
/// each i32 lane, exact, no saturation). Blocks go four at a time ([`score_int_x4`]: each
/// query load serves four blocks, the f64 combination runs on four blocks per register);
/// the last `blocks % 4` one at a time. The last partial chunk of a row is a masked load
/// (nothing past the row is read).
///
/// # Safety
/// AVX-512 (with VNNI) available; `min`/`max` hold `out.len() * dt` bytes, `scale`
/// `out.len()` floats; `pos`/`neg` hold N rows of `qstride >= 32 * ceil(dt / 32)` bytes,
/// zero past `dt`; every bound is in `[-127, 127]` (SPEC.md section 7, checked on load).
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
pub unsafe fn score_int<const N: usize>(
    pos: &[u8],
    neg: &[u8],
    qstride: usize,
    sq: &[f64; 4],
    dt: usize,
    min: &[i8],
    max: &[i8],
    scale: &[f32],
    first: bool,
    out: &mut [f32],
) {
    let quads = out.len() / 4;
    for i in 0..quads {
        let b = 4 * i;
        score_int_x4::<N>(
            pos.as_ptr(),
            neg.as_ptr(),
            qstride,
            sq,
            dt,
            max.as_ptr().add(b * dt),
            min.as_ptr().add(b * dt),
            scale.as_ptr().add(b),
            first,
            out.as_mut_ptr().add(b),
        );
    }
    let b0 = 4 * quads;
    score_int_x1::<N>(
        pos,
        neg,
        qstride,
        sq,
        dt,
        &min[b0 * dt..],
        &max[b0 * dt..],
        &scale[b0..],
        first,
        &mut out[b0..],
    );
}

/// Bounds `max`/`min` of the 32-dim chunk at `c` of a `dt`-wide row (a masked load for the
/// last partial chunk).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
#[inline]
unsafe fn bound_chunk(mxp: *const i8, mnp: *const i8, dt: usize, c: usize) -> (__m256i, __m256i) {
    if dt - c >= 32 {
        (
            _mm256_loadu_si256(mxp.add(c) as *const __m256i),
            _mm256_loadu_si256(mnp.add(c) as *const __m256i),
        )
    } else {
        let k = (1u32 << (dt - c)) - 1;
        (
            _mm256_maskz_loadu_epi8(k, mxp.add(c)),
            _mm256_maskz_loadu_epi8(k, mnp.add(c)),
        )
    }
}

/// Four consecutive blocks of [`score_int`]. `I = sum pos max + sum neg (-min)` in one
/// accumulator per (block, head) (`-min` fits i8: bounds are never -128); `W` by `vpdpbusd`
/// of `max(|max|, |min|)` with ones. The sums are transposed so that each register holds one
/// head's (or W's) four blocks, then `(s_b * s_q) * (I + 0.5 W)` (the FMA is exact: `0.5 W`
/// and the sum are exact in f64), the max over heads and the f32 rounding run on four blocks
/// at once: per lane the scalar combination's operations, so the same bits.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
#[inline]
unsafe fn score_int_x4<const N: usize>(
    pp: *const u8,
    np: *const u8,
    qstride: usize,
    sq: &[f64; 4],
    dt: usize,
    mxp: *const i8,
    mnp: *const i8,
    scale: *const f32,
    first: bool,
    out: *mut f32,
) {
    let zero = _mm256_setzero_si256();
    let ones = _mm256_set1_epi8(1);
    let mut acc = [[zero; N]; 4];
    let mut wacc = [zero; 4];
    let mut c = 0;
    while c < dt {
        let mut mx = [zero; 4];
        let mut nmn = [zero; 4];
        for b in 0..4 {
            let (x, n) = bound_chunk(mxp.add(b * dt), mnp.add(b * dt), dt, c);
            // max(|max|, |min|) = max(max, -min) for min <= max (both >= 0 when both bounds
            // are >= 0, -min when both are <= 0, either when they straddle 0): one signed max
            // instead of two abs and an unsigned max, and the result is >= 0.
            let neg = _mm256_sub_epi8(zero, n);
            let w = _mm256_max_epi8(x, neg);
            wacc[b] = _mm256_dpbusd_epi32(wacc[b], w, ones);
            mx[b] = x;
            nmn[b] = neg;
        }
        for h in 0..N {
            let p = _mm256_loadu_si256(pp.add(h * qstride + c) as *const __m256i);
            let n = _mm256_loadu_si256(np.add(h * qstride + c) as *const __m256i);
            for b in 0..4 {
                acc[b][h] = _mm256_dpbusd_epi32(acc[b][h], p, mx[b]);
                acc[b][h] = _mm256_dpbusd_epi32(acc[b][h], n, nmn[b]);
            }
        }
        c += 32;
    }
    // Lanes are blocks from here on.
    let w = _mm256_cvtepi32_pd(crate::simd::x86::hsum4_i32(&wacc));
    let sb = _mm256_cvtps_pd(_mm_loadu_ps(scale));
    let half = _mm256_set1_pd(0.5);
    let mut best = _mm256_set1_pd(f64::NEG_INFINITY);
    for h in 0..N {
        let i = crate::simd::x86::hsum4_i32(&[acc[0][h], acc[1][h], acc[2][h], acc[3][h]]);
        let t = _mm256_fmadd_pd(half, w, _mm256_cvtepi32_pd(i));
        let v = _mm256_mul_pd(_mm256_mul_pd(sb, _mm256_set1_pd(sq[h])), t);
        best = _mm256_max_pd(best, v);
    }
    let v = _mm256_cvtpd_ps(best);
    let v = if first {
        v
    } else {
        _mm_max_ps(_mm_loadu_ps(out), v)
    };
    _mm_storeu_ps(out, v);
}

/// One block at a time (the last `blocks % 4` of [`score_int`]).
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
unsafe fn score_int_x1<const N: usize>(
    pos: &[u8],
    neg: &[u8],
    qstride: usize,
    sq: &[f64; 4],
    dt: usize,
    min: &[i8],
    max: &[i8],
    scale: &[f32],
    first: bool,
    out: &mut [f32],
) {
    let zero = _mm256_setzero_si256();
    let (pp, np) = (pos.as_ptr(), neg.as_ptr());
    for (b, o) in out.iter_mut().enumerate() {
        let (mxp, mnp) = (max.as_ptr().add(b * dt), min.as_ptr().add(b * dt));
        let mut hi = [zero; 4];
        let mut lo = [zero; 4];
        let mut wacc = zero;
        let mut c = 0;
        while c < dt {
            let (mx, mn) = bound_chunk(mxp, mnp, dt, c);
            let w = _mm256_max_epu8(_mm256_abs_epi8(mx), _mm256_abs_epi8(mn));
            wacc = _mm256_add_epi64(wacc, _mm256_sad_epu8(w, zero));
            for h in 0..N {
                let p = _mm256_loadu_si256(pp.add(h * qstride + c) as *const __m256i);
                let n = _mm256_loadu_si256(np.add(h * qstride + c) as *const __m256i);
                hi[h] = _mm256_dpbusd_epi32(hi[h], p, mx);
                lo[h] = _mm256_dpbusd_epi32(lo[h], n, mn);
            }
            c += 32;
        }
        let ws = _mm_add_epi64(
            _mm256_castsi256_si128(wacc),
            _mm256_extracti128_si256::<1>(wacc),
        );
        let w = (_mm_cvtsi128_si64(ws) + _mm_extract_epi64::<1>(ws)) as i32;
        let mut d = [zero; 4];
        for h in 0..N {
            d[h] = _mm256_sub_epi32(hi[h], lo[h]);
        }
        let mut sums = [0i32; 4];
        _mm_storeu_si128(
            sums.as_mut_ptr() as *mut __m128i,
            crate::simd::x86::hsum4_i32(&d),
        );
        *o = crate::simd::combine_scores::<N>(&sums, w, sq, scale[b], first, *o);
    }
}

/// [`rotate_queries_f64`] for `dt <= 128`, reading the rotation in address order: each row
/// is read whole (all `ceil(dt / 8)` f64 chunks of it) while `K` query rows keep every column
/// sum in registers (`K * C <= 24`), heads in passes of K. A column-chunk-first order reads
/// the rows in strided pieces, which the hardware prefetchers follow badly on streamed data.
/// Per column the same FMAs over ascending i: the same sums.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
unsafe fn rotate_rows_in_order(
    rot: *const f32,
    d: usize,
    dt: usize,
    n: usize,
    q: *const f32,
    acc: *mut f64,
) {
    // One pass of up to K query rows from row h0 with C chunks; evaluates to K.
    macro_rules! pass {
        ($C:literal, $K:literal, $h0:expr) => {{
            let (q, acc) = (q.add($h0 * d), acc.add($h0 * dt));
            match (n - $h0).min($K) {
                1 => rotate_rows_pass::<$C, 1>(rot, d, dt, q, acc),
                2 => rotate_rows_pass::<$C, 2>(rot, d, dt, q, acc),
                3 => rotate_rows_pass::<$C, 3>(rot, d, dt, q, acc),
                _ => rotate_rows_pass::<$C, 4>(rot, d, dt, q, acc),
            }
            $K
        }};
    }
    let chunks = dt.div_ceil(8);
    let mut h0 = 0;
    while h0 < n {
        h0 += if chunks <= 4 {
            pass!(4, 4, h0)
        } else if chunks <= 8 {
            pass!(8, 3, h0)
        } else if chunks <= 12 {
            pass!(12, 2, h0)
        } else {
            pass!(16, 1, h0)
        };
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
#[inline]
unsafe fn rotate_rows_pass<const C: usize, const K: usize>(
    rot: *const f32,
    d: usize,
    dt: usize,
    q: *const f32,
    acc: *mut f64,
) {
    let mut m = [0u8; C];
    for (k, mk) in m.iter_mut().enumerate() {
        let lo = 8 * k;
        *mk = if lo >= dt {
            0
        } else if dt - lo >= 8 {
            0xff
        } else {
            (1u8 << (dt - lo)) - 1
        };
    }
    let mut a = [[_mm512_setzero_pd(); C]; K];
    for i in 0..d {
        let row = rot.add(i * dt);
        let mut qv = [_mm512_setzero_pd(); K];
        for (h, x) in qv.iter_mut().enumerate() {
            *x = _mm512_set1_pd(f64::from(*q.add(h * d + i)));
        }
        for k in 0..C {
            if m[k] == 0 {
                continue;
            }
            // Masked-off columns past `dt` read nothing (wrapping_add: never dereferenced there).
            let p = row.wrapping_add(8 * k);
            let r = _mm512_cvtps_pd(if m[k] == 0xff {
                _mm256_loadu_ps(p)
            } else {
                _mm256_maskz_loadu_ps(m[k], p)
            });
            for h in 0..K {
                a[h][k] = _mm512_fmadd_pd(r, qv[h], a[h][k]);
            }
        }
    }
    for (h, ah) in a.iter().enumerate() {
        for k in 0..C {
            if m[k] != 0 {
                _mm512_mask_storeu_pd(acc.add(h * dt + 8 * k), m[k], ah[k]);
            }
        }
    }
}

/// SPEC.md section 8.1's sums for `N` queries (`q` rows `d` apart): `acc[h][j] = sum_i
/// f64(R[i][j]) * f64(q_h[i])` over ascending i, `R` the stored `d x dt` rotation, `acc` rows
/// `dt` apart. Up to `dt = 128` the rotation is read row by row ([`rotate_rows_in_order`],
/// 1.2 % faster decode steps at 131K tokens than the column-chunk order below, in-process
/// A/B); wider rotations go four 8-column chunks per pass, each rotation row loaded and
/// widened once for all N rows, 4N independent chains in registers. The f64 product of two f32 values
/// is exact, so `fma(r, q, a)` rounds exactly as `a + r * q` does: the reference's sums bit
/// for bit.
///
/// # Safety
/// AVX-512 available; `rot` holds `d * dt` floats, `q` `(N - 1) * d + d`, `acc` `N * dt`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
pub unsafe fn rotate_queries_f64<const N: usize>(
    rot: &[f32],
    d: usize,
    dt: usize,
    q: *const f32,
    acc: *mut f64,
) {
    if dt <= 128 {
        rotate_rows_in_order(rot.as_ptr(), d, dt, N, q, acc);
        return;
    }
    let mut c = 0;
    while c < dt {
        let mut a = [[_mm512_setzero_pd(); 4]; N];
        let mut m = [0u8; 4];
        for (k, mk) in m.iter_mut().enumerate() {
            let lo = c + 8 * k;
            *mk = if lo >= dt {
                0
            } else if dt - lo >= 8 {
                0xff
            } else {
                (1u8 << (dt - lo)) - 1
            };
        }
        for i in 0..d {
            let row = rot.as_ptr().add(i * dt + c);
            let mut r = [_mm512_setzero_pd(); 4];
            for k in 0..4 {
                // Masked-off chunks past `dt` read nothing (wrapping_add: the address may lie
                // past the slice, and is never dereferenced there).
                let p = row.wrapping_add(8 * k);
                r[k] = _mm512_cvtps_pd(if m[k] == 0xff {
                    _mm256_loadu_ps(p)
                } else {
                    _mm256_maskz_loadu_ps(m[k], p)
                });
            }
            for (h, ah) in a.iter_mut().enumerate() {
                let qv = _mm512_set1_pd(f64::from(*q.add(h * d + i)));
                for k in 0..4 {
                    ah[k] = _mm512_fmadd_pd(r[k], qv, ah[k]);
                }
            }
        }
        for (h, ah) in a.iter().enumerate() {
            for k in 0..4 {
                _mm512_mask_storeu_pd(acc.add(h * dt).wrapping_add(c + 8 * k), m[k], ah[k]);
            }
        }
        c += 32;
    }
}

/// Largest number of 32-dim bitmap words [`packed_accumulate`] handles (`Dt <= 128`).
pub const FUSED_MAX_GROUPS: usize = 4;

/// Lane masks of the 16-float chunks `0 .. 2G` of a `dp`-wide row (chunks past `dp` get 0).
#[inline(always)]
fn chunk_masks<const G: usize>(dp: usize) -> [u16; 8] {
    let mut m = [0u16; 8];
    for (c, x) in m.iter_mut().enumerate().take(2 * G) {
        *x = lanes16(dp.saturating_sub(16 * c));
    }
    m
}

/// One record's values, expanded by bitmap word `c`, as 32 f16 lanes (dims `32c .. 32c + 32`).
/// `vall` holds the record's `r <= 32` values; `off` is the number of values before word `c`
/// and is advanced past it.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
#[inline]
unsafe fn expand_word_h(
    rec: *const u8,
    c: usize,
    vall: __m512i,
    iota: __m512i,
    off: &mut i16,
) -> __m512i {
    let mask = u32::from_le((rec.add(4 * c) as *const u32).read_unaligned());
    // Word 0's values start at lane 0: no permute.
    let src = if c == 0 {
        vall
    } else {
        _mm512_permutexvar_epi16(_mm512_add_epi16(iota, _mm512_set1_epi16(*off)), vall)
    };
    *off += mask.count_ones() as i16;
    _mm512_maskz_expand_epi16(mask, src)
}

/// [`expand_word_h`] widened to two f32 registers (dims `32c .. 32c + 16` and `32c + 16 ..
/// 32c + 32`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
#[inline]
unsafe fn expand_word(
    rec: *const u8,
    c: usize,
    vall: __m512i,
    iota: __m512i,
    off: &mut i16,
) -> (__m512, __m512) {
    let e = expand_word_h(rec, c, vall, iota, off);
    (
        _mm512_cvtph_ps(_mm512_castsi512_si256(e)),
        _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(e)),
    )
}

/// Word lanes `0, 1, ..., 31` (the `vpermw` index base of [`expand_word`]).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
#[inline]
fn iota16() -> __m512i {
    _mm512_set_epi16(
        31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9,
        8, 7, 6, 5, 4, 3, 2, 1, 0,
    )
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
#[allow(clippy::too_many_arguments)]
unsafe fn packed_accumulate_n<const G: usize, const N: usize>(
    p: *const f32,
    dp: usize,
    bytes: *const u8,
    n: usize,
    rb: usize,
    bb: usize,
    r: usize,
    corr: *const f32,
    acc: *mut f32,
) {
    let iota = iota16();
    let cm = chunk_masks::<G>(dp);
    // The accumulators stay in registers for the whole tile (N * 2G of them), rescaled on load.
    let mut a = [[_mm512_setzero_ps(); 8]; N];
    for (h, ah) in a.iter_mut().enumerate() {
        let cv = _mm512_set1_ps(*corr.add(h));
        for (c, x) in ah.iter_mut().enumerate().take(2 * G) {
            *x = _mm512_mul_ps(_mm512_maskz_loadu_ps(cm[c], acc.add(h * dp + 16 * c)), cv);
        }
    }
    for t in 0..n {
        let rec = bytes.add(t * rb);
        let vall = load_values(rec.add(bb), r);
        let mut off = 0i16;
        for c in 0..G {
            let (lo, hi) = expand_word(rec, c, vall, iota, &mut off);
            for (h, ah) in a.iter_mut().enumerate() {
                let pv = _mm512_set1_ps(*p.add(h * crate::simd::TILE + t));
                ah[2 * c] = _mm512_fmadd_ps(pv, lo, ah[2 * c]);
                ah[2 * c + 1] = _mm512_fmadd_ps(pv, hi, ah[2 * c + 1]);
            }
        }
    }
    for (h, ah) in a.iter().enumerate() {
        for (c, &x) in ah.iter().enumerate().take(2 * G) {
            _mm512_mask_storeu_ps(acc.add(h * dp + 16 * c), cm[c], x);
        }
    }
}

/// Fused expansion + value accumulation (SPEC.md sections 6 and 9): `acc_h = corr[h] acc_h +
/// sum_t p[h * TILE + t] v_t` for `g` heads (`acc` `[g][dp]`), the values expanded in
/// registers. Per lane the same multiply and FMAs in the same order as the online-softmax
/// rescale, [`expand_g1`] and the AVX2 tile accumulation, so the result is bit-identical.
///
/// # Safety
/// AVX-512 F/BW/VL/VBMI2 available; `groups = ceil(dt / 32)` with `1 <= groups <=
/// FUSED_MAX_GROUPS`, `r <= 32`, `dt <= dp <= 32 * groups`, `bb >= 4 * groups`, `bb + 2 * r <=
/// rb`; `bytes` holds `n * rb` bytes, `p` `g * TILE` floats, `corr` `g`, `acc` `g * dp`;
/// `n <= TILE`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn packed_accumulate(
    p: *const f32,
    g: usize,
    dp: usize,
    groups: usize,
    bytes: *const u8,
    n: usize,
    rb: usize,
    bb: usize,
    r: usize,
    corr: *const f32,
    acc: *mut f32,
) {
    // Heads per pass: the accumulators (heads x 2G registers) plus one expanded word must fit
    // the 32 vector registers; wider rows take fewer heads per pass (and expand again).
    macro_rules! heads {
        ($G:literal, $N:literal, $pp:expr, $cp:expr, $ap:expr, $left:expr) => {
            match $left.min($N) {
                1 => packed_accumulate_n::<$G, 1>($pp, dp, bytes, n, rb, bb, r, $cp, $ap),
                2 => packed_accumulate_n::<$G, 2>($pp, dp, bytes, n, rb, bb, r, $cp, $ap),
                3 => packed_accumulate_n::<$G, 3>($pp, dp, bytes, n, rb, bb, r, $cp, $ap),
                _ => packed_accumulate_n::<$G, 4>($pp, dp, bytes, n, rb, bb, r, $cp, $ap),
            }
        };
    }
    let per = if groups <= 3 { 4 } else { 3 };
    let mut h0 = 0;
    while h0 < g {
        let (pp, cp, ap) = (
            p.add(h0 * crate::simd::TILE),
            corr.add(h0),
            acc.add(h0 * dp),
        );
        match groups {
            1 => heads!(1, 4, pp, cp, ap, g - h0),
            2 => heads!(2, 4, pp, cp, ap, g - h0),
            3 => heads!(3, 4, pp, cp, ap, g - h0),
            _ => heads!(4, 3, pp, cp, ap, g - h0),
        }
        h0 += per;
    }
}

/// `exp(x)` on 16 lanes: the AVX2 kernel's polynomial (`simd::x86::exp256`), lane for lane the
/// same operations, hence the same values.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
#[inline]
unsafe fn exp512(x: __m512) -> __m512 {
    let x = _mm512_min_ps(
        _mm512_max_ps(x, _mm512_set1_ps(-87.0)),
        _mm512_set1_ps(88.0),
    );
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
        _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
    );
    use crate::simd::{EXP_LN2_HI, EXP_LN2_LO, EXP_POLY};
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    let mut p = _mm512_set1_ps(EXP_POLY[0]);
    for &c in &EXP_POLY[1..] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    let y = _mm512_fmadd_ps(
        p,
        _mm512_mul_ps(r, r),
        _mm512_add_ps(r, _mm512_set1_ps(1.0)),
    );
    let e = _mm512_slli_epi32::<23>(_mm512_add_epi32(
        _mm512_cvtps_epi32(n),
        _mm512_set1_epi32(127),
    ));
    _mm512_mul_ps(y, _mm512_castsi512_ps(e))
}

/// The online-softmax step of one tile (`attend::online_softmax` with `corr` given): for each
/// of `g` heads, the tile's `n` logits (`logits[h * TILE ..]`) become `exp(x - m_new)`, `l` and
/// `m` are updated, and `corr[h] = exp(m_old - m_new)` (0 for an empty state) is the factor
/// the accumulators still have to be scaled by. One 16-lane register per head.
///
/// # Safety
/// AVX-512 available; `m`, `l`, `corr` hold `g` floats, `logits` `g * TILE`; `n <= TILE = 16`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
pub unsafe fn tile_softmax(
    m: *mut f32,
    l: *mut f32,
    g: usize,
    logits: *mut f32,
    n: usize,
    corr: *mut f32,
) {
    let mut h0 = 0;
    while h0 < g {
        let (mp, lp, gp, cp) = (
            m.add(h0),
            l.add(h0),
            logits.add(h0 * crate::simd::TILE),
            corr.add(h0),
        );
        match g - h0 {
            1 => tile_softmax_n::<1>(mp, lp, gp, n, cp),
            2 => tile_softmax_n::<2>(mp, lp, gp, n, cp),
            3 => tile_softmax_n::<3>(mp, lp, gp, n, cp),
            _ => tile_softmax_n::<4>(mp, lp, gp, n, cp),
        }
        h0 += 4;
    }
}

/// [`tile_softmax`] for `N <= 4` heads, written stage by stage over the heads so their
/// dependency chains (max tree, exps, sum tree) run side by side.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
#[inline]
unsafe fn tile_softmax_n<const N: usize>(
    m: *mut f32,
    l: *mut f32,
    logits: *mut f32,
    n: usize,
    corr: *mut f32,
) {
    // The N heads' reductions run side by side: one transposed max, one exp of the four
    // corrections, one transposed sum (lanes past N are -inf, or 0 after the exp).
    let mask = lanes16(n);
    let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut a = [ninf; 4];
    for (h, ah) in a.iter_mut().enumerate().take(N) {
        *ah = _mm512_mask_loadu_ps(ninf, mask, logits.add(h * crate::simd::TILE));
    }
    let hm = (1u8 << N) - 1;
    let m_old = _mm_mask_loadu_ps(_mm_set1_ps(f32::NEG_INFINITY), hm, m);
    let m_new = _mm_max_ps(m_old, hmax4(&a));
    let mut p = [_mm512_setzero_ps(); 4];
    for h in 0..N {
        let mh = _mm512_broadcastss_ps(_mm_permutevar_ps(m_new, _mm_set1_epi32(h as i32)));
        p[h] = _mm512_maskz_mov_ps(mask, exp512(_mm512_sub_ps(a[h], mh)));
        _mm512_storeu_ps(logits.add(h * crate::simd::TILE), p[h]);
    }
    // corr = exp(m_old - m_new), 0 where m_old = -inf (nothing accumulated yet).
    let live = _mm_cmp_ps_mask::<_CMP_NEQ_OQ>(m_old, _mm_set1_ps(f32::NEG_INFINITY));
    let c = _mm_maskz_mov_ps(live, fast_exp4(_mm_sub_ps(m_old, m_new)));
    let l_new = _mm_fmadd_ps(_mm_maskz_loadu_ps(hm, l), c, hsum4(&p));
    _mm_mask_storeu_ps(corr, hm, c);
    _mm_mask_storeu_ps(l, hm, l_new);
    _mm_mask_storeu_ps(m, hm, m_new);
}

/// `simd::fast_exp` on four lanes, operation for operation (separate multiplies and adds, no
/// FMA), so the same bits as the scalar function the AVX2 softmax uses for its corrections.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,avx2,fma,f16c,popcnt")]
#[inline]
unsafe fn fast_exp4(x: __m128) -> __m128 {
    use crate::simd::{EXP_LN2_HI, EXP_LN2_LO, EXP_POLY};
    let x = _mm_min_ps(_mm_max_ps(x, _mm_set1_ps(-87.0)), _mm_set1_ps(88.0));
    let big = _mm_set1_ps(12_582_912.0);
    let n = _mm_sub_ps(
        _mm_add_ps(_mm_mul_ps(x, _mm_set1_ps(std::f32::consts::LOG2_E)), big),
        big,
    );
    let r = _mm_sub_ps(
        _mm_sub_ps(x, _mm_mul_ps(n, _mm_set1_ps(EXP_LN2_HI))),
        _mm_mul_ps(n, _mm_set1_ps(EXP_LN2_LO)),
    );
    let r2 = _mm_mul_ps(r, r);
    let mut p = _mm_set1_ps(EXP_POLY[0]);
    for &c in &EXP_POLY[1..] {
        p = _mm_add_ps(_mm_mul_ps(p, r), _mm_set1_ps(c));
    }
    let y = _mm_add_ps(_mm_add_ps(_mm_mul_ps(p, r2), r), _mm_set1_ps(1.0));
    let e = _mm_slli_epi32::<23>(_mm_and_si128(
        _mm_castps_si128(_mm_add_ps(n, _mm_set1_ps(127.0 + 8_388_608.0))),
        _mm_set1_epi32(0x7f_ffff),
    ));
    _mm_mul_ps(y, _mm_castsi128_ps(e))
}
