//! The engine's many-token products on Intel AMX (issue 36: long prompts whose prefill took
//! most of an evaluation's time): `out = x · wᵀ` with `x` and `w` rounded to bf16 (round to
//! nearest even) and the products summed in f32 by `TDPBF16PS` on 16 x 16 tiles, as
//! llama.cpp's and oneDNN's AMX paths compute bf16 products. Only where the CPU has AMX-TILE
//! and AMX-BF16 and Linux grants the tile state ([`amx_available`]); everywhere else the
//! engine keeps its f32 GEMM.
//!
//! Layout: `w` (`n x k`, row-major, a weight matrix as stored) is packed into 1 KB tiles of 16
//! output columns by 32 inputs in the pair-interleaved order `TDPBF16PS` reads (tile row `p`
//! holds `w[j][32 kb + 2p]`, `w[j][32 kb + 2p + 1]` for its 16 columns `j`), `x` (`m x k`)
//! into bf16 rows padded to whole tiles. Each task multiplies a chunk of rows by a chunk of
//! columns whose packed weights fit in L2, 32 x 32 outputs (four accumulator tiles) at a time
//! over the whole of `k`, so every output is written once.

use half::bf16;
use rayon::prelude::*;
use std::sync::OnceLock;

/// The environment switch that turns the AMX products off (`MOSAICKV_NO_AMX=1`): the engine
/// then multiplies in f32 as on a CPU without AMX. `MOSAICKV_FORCE_PORTABLE=1` and
/// `MOSAICKV_FORCE_AVX2=1` turn it off too.
pub const NO_AMX: &str = "MOSAICKV_NO_AMX";

/// Whether [`matmul_t_bf16`] runs here: an x86-64 CPU with AMX-TILE and AMX-BF16 (and the
/// AVX-512 F/BW and AVX512-BF16 its row kernels use), Linux's
/// permission for the tile data state granted to this process (`arch_prctl`
/// `ARCH_REQ_XCOMP_PERM`, asked once), and none of the switches set ([`NO_AMX`],
/// `MOSAICKV_FORCE_PORTABLE`, `MOSAICKV_FORCE_AVX2`).
pub fn amx_available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        let set = |name: &str| std::env::var(name).is_ok_and(|v| v == "1");
        !set(NO_AMX) && !set(super::FORCE_PORTABLE) && !set(super::FORCE_AVX2) && detect()
    })
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn detect() -> bool {
    // CPUID leaf 7: EDX bit 22 AMX-BF16, bit 24 AMX-TILE.
    let (max, edx) = {
        use std::arch::x86_64::__cpuid_count;
        (__cpuid_count(0, 0).eax, __cpuid_count(7, 0).edx)
    };
    if max < 7 || (edx >> 22) & 1 == 0 || (edx >> 24) & 1 == 0 {
        return false;
    }
    // the attention's row kernels: AVX-512 F/BW and AVX512-BF16 (every AMX CPU has them)
    if !(std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512bf16")
        && std::arch::is_x86_feature_detected!("fma"))
    {
        return false;
    }
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: a plain system call with integer arguments; it fails (non-zero) where the
    // kernel does not know it or refuses the state.
    unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) == 0
    }
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn detect() -> bool {
    false
}

/// Rows and columns of one tile, and the inputs one tile step consumes.
const TR: usize = 16;
const TK: usize = 32;
/// bf16 elements of one packed weight tile (16 rows of 64 bytes).
const TILE_ELEMS: usize = TR * TK;

/// `w` (`n x k`, row-major) as bf16 tiles: `n` padded to 32 columns (two tiles), `k` to 32.
pub struct PackedBf16 {
    n: usize,
    k: usize,
    /// Tiles of 16 columns `jb` by 32 inputs `kb`, at `(jb * kblocks + kb) * TILE_ELEMS`.
    tiles: Vec<u16>,
}

impl PackedBf16 {
    /// Packs `w` (`n x k` f32, row-major): each value rounded to bf16 (nearest even), zero
    /// past `n` and `k`.
    pub fn new(w: &[f32], n: usize, k: usize) -> Self {
        assert_eq!(w.len(), n * k, "weight of {n} x {k}");
        Self::from_rows(n, k, |j0, rows| {
            rows.copy_from_slice(&w[j0 * k..j0 * k + rows.len()]);
            Ok::<(), std::convert::Infallible>(())
        })
        .unwrap_or_else(|e| match e {})
    }

    /// Packs an `n x k` matrix whose rows `fill(j0, rows)` writes, `rows.len() / k` (at most
    /// 16) of them from row `j0`, in parallel over groups of 16 rows: a matrix kept in blocks
    /// is dequantized straight into its tiles, with no f32 copy of the whole of it.
    pub fn from_rows<E: Send>(
        n: usize,
        k: usize,
        fill: impl Fn(usize, &mut [f32]) -> Result<(), E> + Sync,
    ) -> Result<Self, E> {
        let kb = k.div_ceil(TK);
        let jbs = n.div_ceil(2 * TR) * 2;
        let mut tiles = vec![0u16; jbs * kb * TILE_ELEMS];
        // (`max(1)`: a matrix of no inputs has no tiles, and no chunks to fill)
        tiles
            .par_chunks_mut((kb * TILE_ELEMS).max(1))
            .enumerate()
            .try_for_each_init(Vec::new, |rows, (jb, col_tiles)| {
                let j0 = jb * TR;
                if j0 >= n {
                    return Ok(());
                }
                let count = TR.min(n - j0);
                rows.resize(count * k, 0f32);
                fill(j0, rows)?;
                for (jj, row) in rows.chunks_exact(k.max(1)).enumerate() {
                    for (i, &v) in row.iter().enumerate() {
                        // tile i / 32, tile row (i % 32) / 2, element 2 jj + i % 2
                        let (t, p, e) = (i / TK, (i % TK) / 2, i % 2);
                        col_tiles[t * TILE_ELEMS + p * TK + 2 * jj + e] =
                            bf16::from_f32(v).to_bits();
                    }
                }
                Ok(())
            })?;
        Ok(PackedBf16 { n, k, tiles })
    }

    /// Output columns (the matrix's rows).
    pub fn rows(&self) -> usize {
        self.n
    }

    fn kblocks(&self) -> usize {
        self.k.div_ceil(TK)
    }
}

/// A row operand of the tile products: bf16 rows `stride` elements apart (a multiple of 32,
/// zero past the row's inputs), the rows padded with zeros to a multiple of 32.
pub struct Bf16Rows {
    rows: usize,
    stride: usize,
    data: Vec<u16>,
}

impl Bf16Rows {
    /// `m` zero rows of `k` inputs (rounded up to 32).
    pub fn zeros(m: usize, k: usize) -> Self {
        let stride = k.div_ceil(TK) * TK;
        Bf16Rows {
            rows: m,
            stride,
            data: vec![0u16; m.div_ceil(2 * TR) * 2 * TR * stride],
        }
    }

    /// `x` (`m x k` f32, row-major), each value rounded to bf16 (nearest even), rows in
    /// parallel.
    pub fn new(x: &[f32], m: usize, k: usize) -> Self {
        assert_eq!(x.len(), m * k, "rows of {m} x {k}");
        let mut a = Self::zeros(m, k);
        let stride = a.stride;
        a.data
            .par_chunks_mut(stride.max(1))
            .take(m)
            .enumerate()
            .for_each(|(i, row)| to_bf16(&x[i * k..(i + 1) * k], row));
        a
    }

    /// Row `i` (`stride` elements; its inputs first, then zeros), to fill in place.
    pub fn row_mut(&mut self, i: usize) -> &mut [u16] {
        assert!(i < self.rows, "row {i} of {}", self.rows);
        &mut self.data[i * self.stride..(i + 1) * self.stride]
    }
}

/// `out[i] = bf16(x[i])` (nearest even, NaN kept NaN) for `i < x.len()`.
pub fn to_bf16(x: &[f32], out: &mut [u16]) {
    assert!(out.len() >= x.len());
    #[cfg(target_arch = "x86_64")]
    if amx_available() {
        // SAFETY: AVX-512 F/BW and AVX512-BF16 are part of `amx_available`; reads `x`, writes
        // `out[..x.len()]` (asserted).
        unsafe { to_bf16_avx512(x, out) };
        return;
    }
    for (o, &v) in out.iter_mut().zip(x) {
        *o = bf16::from_f32(v).to_bits();
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn to_bf16_avx512(x: &[f32], out: &mut [u16]) {
    use std::arch::x86_64::*;
    let n = x.len();
    let mut j = 0;
    while j < n {
        let k: __mmask16 = if n - j >= 16 {
            0xffff
        } else {
            (1u16 << (n - j)) - 1
        };
        let h = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(k, x.as_ptr().add(j)));
        _mm256_mask_storeu_epi16(
            out.as_mut_ptr().add(j) as *mut i16,
            k,
            std::mem::transmute::<__m256bh, __m256i>(h),
        );
        j += 16;
    }
}

/// One row of the prefill attention's online softmax on AMX machines: of the row's logits
/// `row[..vis]` (the keys the query sees; the rest is masked), with `m_old` the row's running
/// maximum, returns `(m_new, sum)`: `m_new = max(m_old, max row[..vis])` and the sum of the
/// numerators `exp(row[j] - m_new)`, which are written as bf16 (nearest even) to `p[..vis]`;
/// `p[vis..]` is zeroed. `row[..vis]` is left holding the f32 numerators.
pub fn softmax_row_bf16(row: &mut [f32], vis: usize, m_old: f32, p: &mut [u16]) -> (f32, f32) {
    assert!(amx_available() && vis <= row.len() && vis <= p.len());
    // SAFETY: AVX-512 F/BW, FMA and AVX512-BF16 are part of `amx_available` (asserted); the
    // kernel reads `row[..vis]` and writes `row[..vis]` and `p`.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        softmax_row_avx512(&mut row[..vis], m_old, p)
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("AMX is x86-64 only")
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,fma")]
unsafe fn softmax_row_avx512(row: &mut [f32], m_old: f32, p: &mut [u16]) -> (f32, f32) {
    use std::arch::x86_64::*;
    let n = row.len();
    let lanes = |k: usize| -> __mmask16 {
        if k >= 16 {
            0xffff
        } else {
            (1u16 << k) - 1
        }
    };
    let mut mx = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut j = 0;
    while j < n {
        let x = _mm512_maskz_loadu_ps(lanes(n - j), row.as_ptr().add(j));
        mx = _mm512_mask_max_ps(mx, lanes(n - j), mx, x);
        j += 16;
    }
    let m_new = m_old.max(_mm512_reduce_max_ps(mx));
    if n > 0 {
        crate::simd::exp_shifted_in_place(row, m_new);
    }
    let mut sum = _mm512_setzero_ps();
    j = 0;
    while j < n {
        let k = lanes(n - j);
        let x = _mm512_maskz_loadu_ps(k, row.as_ptr().add(j));
        sum = _mm512_add_ps(sum, x);
        let h = _mm512_cvtneps_pbh(x);
        _mm256_mask_storeu_epi16(
            p.as_mut_ptr().add(j) as *mut i16,
            k,
            std::mem::transmute::<__m256bh, __m256i>(h),
        );
        j += 16;
    }
    p[n..].fill(0);
    (m_new, _mm512_reduce_add_ps(sum))
}

/// Columns `j0..j0 + cols` of a [`PackedBf16`] over inputs `32 kb0 .. 32 (kb0 + kbs)`: the
/// right-hand operand of [`product`].
#[derive(Clone, Copy)]
pub struct Cols<'a> {
    tiles: &'a [u16],
    /// Tiles between one 16-column group and the next.
    stride: usize,
    kbs: usize,
    cols: usize,
}

impl PackedBf16 {
    /// Columns `j0..j0 + cols` (`j0` a multiple of 32) over the inputs of tile blocks
    /// `kb0..kb0 + kbs` (32 inputs each).
    pub fn cols(&self, j0: usize, cols: usize, kb0: usize, kbs: usize) -> Cols<'_> {
        let kb = self.kblocks();
        assert!(
            j0 % (2 * TR) == 0 && j0 + cols <= self.n && kb0 + kbs <= kb,
            "columns {j0}+{cols} of {}, blocks {kb0}+{kbs} of {kb}",
            self.n
        );
        Cols {
            tiles: &self.tiles[(j0 / TR) * kb * TILE_ELEMS + kb0 * TILE_ELEMS..],
            stride: kb,
            kbs,
            cols,
        }
    }
}

/// `out[i * os + j] = sum_l a[i][l] * w[j][l]` for `i < a`'s rows, `j < w.cols`, `l` over
/// `w`'s inputs (`a`'s first `32 w.kbs` inputs), summed in f32 by `TDPBF16PS` on this thread.
/// Panics unless [`amx_available`] and the sizes agree.
pub fn product(a: &Bf16Rows, w: Cols<'_>, out: &mut [f32], os: usize) {
    assert!(
        amx_available(),
        "AMX products asked for where they do not run"
    );
    let (m, n) = (a.rows, w.cols);
    if m == 0 || n == 0 {
        return;
    }
    let groups = n.div_ceil(2 * TR) * 2;
    assert!(
        a.stride >= w.kbs * TK
            && out.len() >= (m - 1) * os + n
            && os >= n
            && w.tiles.len() >= ((groups - 1) * w.stride + w.kbs) * TILE_ELEMS,
        "product of {m} rows by {n} columns"
    );
    // SAFETY: AMX available (asserted), tiles configured by `Tiles::new`; `a` holds its rows
    // padded to 32 (`Bf16Rows`), `w.tiles` every 16-column group's `kbs` tiles up to the
    // padded column count and `out` rows up to `m - 1` by `n` columns (asserted).
    unsafe {
        let tiles = Tiles::new();
        for i in (0..m).step_by(2 * TR) {
            for j in (0..n).step_by(2 * TR) {
                tiles.block(
                    a.data.as_ptr().add(i * a.stride),
                    a.stride * 2,
                    w.tiles.as_ptr().add((j / TR) * w.stride * TILE_ELEMS),
                    w.kbs,
                    w.stride,
                    out.as_mut_ptr(),
                    os,
                    m,
                    n,
                    i,
                    j,
                );
            }
        }
    }
}

/// `out[i][j] = sum_l bf16(x[i][l]) * bf16(w[j][l])` in f32 (`x` `m x k`, `w` packed from an
/// `n x k` matrix, `out` `m x n`, all row-major), the sums by `TDPBF16PS`, on all threads.
/// Panics unless [`amx_available`] and the sizes agree.
pub fn matmul_t_bf16(x: &[f32], m: usize, w: &PackedBf16, out: &mut [f32]) {
    let (n, k) = (w.n, w.k);
    assert!(
        amx_available(),
        "AMX products asked for where they do not run"
    );
    assert!(
        x.len() == m * k && out.len() == m * n,
        "x {m} x {k}, out {m} x {n}"
    );
    if m == 0 || n == 0 {
        return;
    }
    let a = Bf16Rows::new(x, m, k);
    let kb = w.kblocks();
    // Column chunks whose packed weights take at most 512 KB (L2 holds them while the rows
    // pass), row chunks of 256.
    let nc = ((512 << 10) / (kb * TK * 2 * 2 * TR).max(1)).clamp(1, 8) * 2 * TR;
    let mc = 8 * 2 * TR;
    let (mchunks, nchunks) = (m.div_ceil(mc), n.div_ceil(nc));
    let out_addr = out.as_mut_ptr() as usize;
    (0..mchunks * nchunks).into_par_iter().for_each(|task| {
        let (i0, j0) = ((task / nchunks) * mc, (task % nchunks) * nc);
        let (rows, cols) = (mc.min(m - i0), nc.min(n - j0));
        // SAFETY: AMX is available (asserted) and this thread's tile state is configured by
        // `Tiles::new`; every tile read lies inside `a` (rows padded to 32, k to 32) or the
        // packed weights (columns padded to 32); tasks write disjoint output blocks, rows
        // `i0..i0 + rows` by columns `j0..j0 + cols` of `out`.
        unsafe {
            let tiles = Tiles::new();
            for i in (0..rows).step_by(2 * TR) {
                for j in (0..cols).step_by(2 * TR) {
                    tiles.block(
                        a.data.as_ptr().add((i0 + i) * a.stride),
                        a.stride * 2,
                        w.tiles.as_ptr().add(((j0 + j) / TR) * kb * TILE_ELEMS),
                        kb,
                        kb,
                        (out_addr as *mut f32).add(i0 * n + j0),
                        n,
                        rows,
                        cols,
                        i,
                        j,
                    );
                }
            }
        }
    });
}

/// This thread's tile configuration while it lives: tiles 0-3 the 2 x 2 accumulators, 4-5
/// two row tiles of `x`, 6-7 two weight tiles, each 16 rows of 64 bytes.
struct Tiles;

#[repr(C, align(64))]
struct TileConfig([u8; 64]);

impl Tiles {
    /// # Safety
    /// AMX available and granted ([`amx_available`]).
    #[cfg(target_arch = "x86_64")]
    unsafe fn new() -> Tiles {
        let mut c = TileConfig([0; 64]);
        c.0[0] = 1; // palette 1
        for t in 0..8 {
            c.0[16 + 2 * t] = 64; // bytes per row (u16 little-endian, high byte 0)
            c.0[48 + t] = TR as u8; // rows
        }
        std::arch::asm!("ldtilecfg [{c}]", c = in(reg) c.0.as_ptr(), options(nostack));
        Tiles
    }

    /// The 32 x 32 outputs from row `i`, column `j`: `a` the bf16 rows from row `i` (`sa`
    /// bytes apart), `b` the packed tiles of the 16 columns from `j` (`kb` steps; the next 16
    /// columns' tiles `bs` tiles further); written into `out` (rows `os` floats apart; rows
    /// past `m` and columns past `n` not written).
    ///
    /// # Safety
    /// 32 rows of `sa >= 64 kb` bytes readable from `a`, tiles `0..kb` and `bs..bs + kb` from
    /// `b`, `out` holding row `m - 1` up to column `n`.
    #[cfg(target_arch = "x86_64")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn block(
        &self,
        a: *const u16,
        sa: usize,
        b: *const u16,
        kb: usize,
        bs: usize,
        out: *mut f32,
        os: usize,
        m: usize,
        n: usize,
        i: usize,
        j: usize,
    ) {
        use std::arch::asm;
        asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            options(nostack)
        );
        let a1 = a.add(TR * sa / 2);
        let b1 = b.add(bs * TILE_ELEMS);
        for t in 0..kb {
            asm!(
                "tileloadd tmm4, [{a0} + {sa}*1]",
                "tileloadd tmm5, [{a1} + {sa}*1]",
                "tileloadd tmm6, [{b0} + {sb}*1]",
                "tileloadd tmm7, [{b1} + {sb}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                a0 = in(reg) a.add(t * TK),
                a1 = in(reg) a1.add(t * TK),
                b0 = in(reg) b.add(t * TILE_ELEMS),
                b1 = in(reg) b1.add(t * TILE_ELEMS),
                sa = in(reg) sa,
                sb = in(reg) 64usize,
                options(nostack)
            );
        }
        // Whole tiles inside `out` are stored in place, the rest through a buffer.
        let mut buf = [0f32; TR * TR];
        macro_rules! store {
            ($tile:literal, $di:expr, $dj:expr) => {{
                let (r0, c0) = (i + $di, j + $dj);
                if r0 < m && c0 < n {
                    if r0 + TR <= m && c0 + TR <= n {
                        asm!(
                            concat!("tilestored [{p} + {s}*1], tmm", $tile),
                            p = in(reg) out.add(r0 * os + c0),
                            s = in(reg) os * 4,
                            options(nostack)
                        );
                    } else {
                        asm!(
                            concat!("tilestored [{p} + {s}*1], tmm", $tile),
                            p = in(reg) buf.as_mut_ptr(),
                            s = in(reg) TR * 4,
                            options(nostack)
                        );
                        for r in 0..TR.min(m - r0) {
                            for c in 0..TR.min(n - c0) {
                                *out.add((r0 + r) * os + c0 + c) = buf[r * TR + c];
                            }
                        }
                    }
                }
            }};
        }
        store!("0", 0, 0);
        store!("1", 0, TR);
        store!("2", TR, 0);
        store!("3", TR, TR);
    }

    #[cfg(not(target_arch = "x86_64"))]
    unsafe fn new() -> Tiles {
        unreachable!("AMX is x86-64 only")
    }

    #[cfg(not(target_arch = "x86_64"))]
    #[allow(clippy::too_many_arguments)]
    unsafe fn block(
        &self,
        _: *const u16,
        _: usize,
        _: *const u16,
        _: usize,
        _: usize,
        _: *mut f32,
        _: usize,
        _: usize,
        _: usize,
        _: usize,
        _: usize,
    ) {
        unreachable!("AMX is x86-64 only")
    }
}

impl Drop for Tiles {
    fn drop(&mut self) {
        // SAFETY: this thread configured its tiles in `Tiles::new`; releasing returns it to
        // the init state (the next task configures again).
        #[cfg(target_arch = "x86_64")]
        unsafe {
            std::arch::asm!("tilerelease", options(nostack))
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The products in f64 on the bf16-rounded inputs: what the tiles sum in f32.
    fn want(x: &[f32], m: usize, w: &[f32], n: usize, k: usize) -> Vec<f64> {
        let r = |v: f32| f64::from(bf16::from_f32(v).to_f32());
        let mut o = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                o[i * n + j] = (0..k).map(|l| r(x[i * k + l]) * r(w[j * k + l])).sum();
            }
        }
        o
    }

    #[test]
    fn amx_products_match_the_bf16_rounded_sums() {
        if !amx_available() {
            eprintln!("AMX not available on this CPU (or switched off): nothing to check");
            return;
        }
        let mut s = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        // whole tiles, ragged rows / columns / inputs, one row, more than one task each way
        for (m, n, k) in [
            (32, 32, 32),
            (1, 16, 32),
            (33, 47, 70),
            (300, 70, 96),
            (64, 600, 1000),
            (5, 3, 5000),
            (3, 5, 0),
        ] {
            let x: Vec<f32> = (0..m * k).map(|_| next()).collect();
            let w: Vec<f32> = (0..n * k).map(|_| next()).collect();
            let mut out = vec![f32::NAN; m * n];
            matmul_t_bf16(&x, m, &PackedBf16::new(&w, n, k), &mut out);
            let want = want(&x, m, &w, n, k);
            for (idx, (&o, &e)) in out.iter().zip(&want).enumerate() {
                // f32 sums of exact products: |error| within k ulps of the sum of magnitudes
                let tol = 1e-6 * k as f64 * 0.25 + 1e-6;
                assert!(
                    (f64::from(o) - e).abs() <= tol,
                    "{m}x{n}x{k} at {idx}: {o} vs {e}"
                );
            }
        }
    }

    #[test]
    fn a_column_and_input_window_multiplies_only_its_part() {
        if !amx_available() {
            eprintln!("AMX not available on this CPU (or switched off): nothing to check");
            return;
        }
        // w 100 x 200; the window of columns 32..82 over inputs 64..160 (blocks 2..5), as the
        // prefill's attention takes a key chunk (columns) or a key range of V^T (inputs)
        let (n, k, m) = (100usize, 200usize, 40usize);
        let val = |i: usize| ((i * 7919 % 1009) as f32 / 1009.0) - 0.5;
        let w: Vec<f32> = (0..n * k).map(val).collect();
        let x: Vec<f32> = (0..m * 96).map(|i| val(i + 5)).collect();
        let packed = PackedBf16::new(&w, n, k);
        let a = Bf16Rows::new(&x, m, 96);
        let os = 60;
        let mut out = vec![f32::NAN; (m - 1) * os + 50];
        product(&a, packed.cols(32, 50, 2, 3), &mut out, os);
        let r = |v: f32| f64::from(bf16::from_f32(v).to_f32());
        for i in 0..m {
            for j in 0..50 {
                let e: f64 = (0..96)
                    .map(|l| r(x[i * 96 + l]) * r(w[(32 + j) * k + 64 + l]))
                    .sum();
                let o = out[i * os + j];
                assert!((f64::from(o) - e).abs() < 1e-4, "({i}, {j}): {o} vs {e}");
            }
            if i + 1 < m {
                // between rows: not written
                assert!(out[i * os + 50..(i + 1) * os].iter().all(|v| v.is_nan()));
            }
        }
    }
}
