//! Inner kernels with three implementations, chosen at run time: AVX-512
//! (F/BW/VL/VBMI2, `crate::avx512`, for the hottest kernels; the rest as
//! AVX2), AVX2 + FMA + F16C (`std::arch`), and a portable scalar path
//! written in 8-lane arrays.
//!
//! [`Path::rotate_query`] and [`Path::score_blocks`] (MosaicKV's selection)
//! are bit-identical on every path: the rotated query is summed in f64 in
//! the reference's order, and the block score is exact integer arithmetic
//! on the int8 bounds and the int8-quantized query (SPEC.md section 8),
//! followed by the same f32 products. Quest's page scores
//! ([`Path::score_pages_f16`]) are f32: AVX2 and portable agree bit for bit,
//! the AVX-512 kernel uses FMA and 16 lanes and is held to the conformance
//! tolerance. Attention kernels may use FMA (their outputs are compared with
//! a tolerance).

use half::f16;

/// Tokens per attention tile (rows expanded to f32 and processed together).
pub const TILE: usize = 16;

/// Widest f16 key tile row ([`Path::half_tile`]).
pub const HALF_TILE_MAX_DP: usize = 128;

/// Which implementation of the inner kernels runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// `std::arch` AVX2, FMA and F16C, detected at run time.
    Avx2,
    /// AVX-512 F/BW/VL/VBMI2/VNNI on top of [`Path::Avx2`], detected at run time: bitmap
    /// expansion, key logits on the expanded tile, the fused value accumulation, the online
    /// softmax, block and page scores, the selection filter, the query rotation and the
    /// baselines' f16 value accumulation (`crate::avx512`); everything else as `Avx2`.
    Avx512,
    /// Plain Rust, no target features beyond the build's baseline.
    Portable,
}

impl Path {
    /// The fastest path this CPU supports, unless `MOSAICKV_FORCE_PORTABLE=1` (portable) or
    /// `MOSAICKV_FORCE_AVX2=1` (AVX2 even where AVX-512 exists).
    pub fn detect() -> Path {
        let set = |name: &str| std::env::var(name).map(|v| v == "1").unwrap_or(false);
        if set("MOSAICKV_FORCE_PORTABLE") {
            return Path::Portable;
        }
        if avx512_available() && !set("MOSAICKV_FORCE_AVX2") {
            Path::Avx512
        } else if avx2_available() {
            Path::Avx2
        } else {
            Path::Portable
        }
    }

    /// f16 -> f32, exact.
    #[inline]
    pub fn f16_to_f32(self, src: &[f16], dst: &mut [f32]) {
        assert_eq!(src.len(), dst.len());
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Path::Avx2` is only constructed after run-time detection of avx2/fma/f16c.
            Path::Avx2 | Path::Avx512 => unsafe { x86::f16_to_f32(src, dst) },
            _ => {
                for (d, s) in dst.iter_mut().zip(src) {
                    *d = f16_bits_to_f32(s.to_bits());
                }
            }
        }
    }

    /// SPEC.md section 8.1: `out[j] = f32(sum_i R[i][j] * q[i])` for `j < out.len()`, the sum
    /// in f64 over ascending i (product, then sum, or an FMA, which rounds the same since the
    /// f64 product of two f32 values is exact), as the reference computes it, so
    /// every path gives the same f32 values (the block score quantizes them). `rot` is the
    /// stored `d x dt` row-major rotation (`dt = out.len()`).
    #[inline]
    pub fn rotate_query(self, rot: &[f32], d: usize, q: &[f32], out: &mut [f32]) {
        let dt = out.len();
        assert!(rot.len() == d * dt && q.len() >= d && dt <= d);
        let mut stack = [0f64; QMAX_DT];
        let mut heap = Vec::new();
        let acc: &mut [f64] = if dt <= QMAX_DT {
            &mut stack[..dt]
        } else {
            heap.resize(dt, 0.0);
            &mut heap
        };
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: detected features; slice bounds asserted above.
            Path::Avx512 => unsafe {
                crate::avx512::rotate_queries_f64::<1>(rot, d, dt, q.as_ptr(), acc.as_mut_ptr())
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: detected features; slice bounds asserted above.
            Path::Avx2 => unsafe { x86::rotate_query_f64(rot, d, q, acc) },
            _ => {
                for i in 0..d {
                    let qi = f64::from(q[i]);
                    for (a, &r) in acc.iter_mut().zip(&rot[i * dt..(i + 1) * dt]) {
                        *a += f64::from(r) * qi;
                    }
                }
            }
        }
        for (o, &a) in out.iter_mut().zip(acc.iter()) {
            *o = a as f32;
        }
    }

    /// [`Path::rotate_query`] for `g` query rows (`q` `[g][d]`) into `out` rows `stride` apart
    /// (`out[h * stride ..][..dt]`, `dt = rot.len() / d`); the same f32 values row by row.
    pub fn rotate_queries(
        self,
        rot: &[f32],
        d: usize,
        q: &[f32],
        g: usize,
        out: &mut [f32],
        stride: usize,
    ) {
        let dt = rot.len() / d.max(1);
        assert!(
            rot.len() == d * dt
                && q.len() >= g * d
                && dt <= stride
                && (g == 0 || out.len() >= (g - 1) * stride + dt)
        );
        #[cfg(target_arch = "x86_64")]
        if self == Path::Avx512 && dt <= QMAX_DT {
            let mut acc = [0f64; 4 * QMAX_DT];
            let mut h0 = 0;
            while h0 < g {
                let n = (g - h0).min(4);
                let qp = q[h0 * d..].as_ptr();
                // SAFETY: AVX-512 detected; rot is d x dt, q holds n rows of d from h0, acc
                // holds 4 * QMAX_DT >= n * dt (all asserted above).
                unsafe {
                    use crate::avx512::rotate_queries_f64 as rq;
                    let ap = acc.as_mut_ptr();
                    match n {
                        1 => rq::<1>(rot, d, dt, qp, ap),
                        2 => rq::<2>(rot, d, dt, qp, ap),
                        3 => rq::<3>(rot, d, dt, qp, ap),
                        _ => rq::<4>(rot, d, dt, qp, ap),
                    }
                }
                for k in 0..n {
                    let o = &mut out[(h0 + k) * stride..][..dt];
                    for (o, &a) in o.iter_mut().zip(&acc[k * dt..(k + 1) * dt]) {
                        *o = a as f32;
                    }
                }
                h0 += n;
            }
            return;
        }
        for h in 0..g {
            self.rotate_query(rot, d, &q[h * d..(h + 1) * d], &mut out[h * stride..][..dt]);
        }
    }

    /// SPEC.md section 8.2: `f32(max_h (scale[b] * s_q,h) * (I_hb + W_b / 2))` over the `g`
    /// query rows of `q` (`[g][stride]`, first `dt` entries used), each quantized to int8 by
    /// [`quantize_query`]; `I` and `W` are exact integer sums over the `[blocks][dt]` int8
    /// bounds `min`/`max`, the products f64 in the reference's order: every path, and the
    /// reference, give the same f32 scores.
    #[allow(clippy::too_many_arguments)]
    pub fn score_blocks(
        self,
        q: &[f32],
        g: usize,
        stride: usize,
        dt: usize,
        min: &[i8],
        max: &[i8],
        scale: &[f32],
        out: &mut [f32],
    ) {
        let blocks = out.len();
        assert!(
            min.len() == blocks * dt
                && max.len() == blocks * dt
                && scale.len() == blocks
                && q.len() >= (g - 1) * stride + dt
        );
        if dt > QMAX_DT {
            // Wider than the stack buffers (head_dim > 256): the portable kernel on heap buffers.
            let (mut pos, mut neg) = (vec![0u8; dt], vec![0u8; dt]);
            for h in 0..g {
                let sq = quantize_query(&q[h * stride..h * stride + dt], &mut pos, &mut neg);
                portable_score_int::<1>(&pos, &neg, dt, &[sq; 4], dt, min, max, scale, h == 0, out);
            }
        } else {
            let mut pos = [0u8; 4 * QMAX_DT];
            let mut neg = [0u8; 4 * QMAX_DT];
            let mut h0 = 0;
            while h0 < g {
                let hn = (g - h0).min(4);
                let mut sq = [0f64; 4];
                for k in 0..hn {
                    let r = k * QMAX_DT..(k + 1) * QMAX_DT;
                    let qh = &q[(h0 + k) * stride..(h0 + k) * stride + dt];
                    sq[k] = quantize_query(qh, &mut pos[r.clone()], &mut neg[r]);
                }
                let first = h0 == 0;
                let (p, n) = (&pos[..], &neg[..]);
                macro_rules! run {
                    ($f:ident) => {
                        match hn {
                            1 => $f::<1>(p, n, QMAX_DT, &sq, dt, min, max, scale, first, out),
                            2 => $f::<2>(p, n, QMAX_DT, &sq, dt, min, max, scale, first, out),
                            3 => $f::<3>(p, n, QMAX_DT, &sq, dt, min, max, scale, first, out),
                            _ => $f::<4>(p, n, QMAX_DT, &sq, dt, min, max, scale, first, out),
                        }
                    };
                }
                match self {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: AVX-512 detected; every slice holds what the kernel reads (asserted
                    // above: `blocks * dt` bounds, `hn` quantized rows of `QMAX_DT >= dt` bytes).
                    Path::Avx512 => unsafe {
                        use crate::avx512::score_int;
                        run!(score_int)
                    },
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: AVX2 detected; as above.
                    Path::Avx2 => unsafe {
                        use x86::score_int;
                        run!(score_int)
                    },
                    _ => run!(portable_score_int),
                }
                h0 += 4;
            }
        }
    }

    /// Quest's page bound on f16 page metadata (SPEC.md section 12): `sum_j max(q_j M_j, q_j m_j)`,
    /// max over the `g` query rows of `q` (`[g][stride]`, first `dt` entries used). `min`/`max`
    /// are `[pages][dt]`. Bit-identical across paths.
    pub fn score_pages_f16(
        self,
        q: &[f32],
        g: usize,
        stride: usize,
        dt: usize,
        min: &[f16],
        max: &[f16],
        out: &mut [f32],
    ) {
        let blocks = out.len();
        assert!(
            min.len() == blocks * dt
                && max.len() == blocks * dt
                && q.len() >= (g - 1) * stride + dt
        );
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: detected features; sizes asserted above.
            Path::Avx512 if dt <= crate::avx512::SCORE_MAX_DT => unsafe {
                crate::avx512::score_pages_f16(
                    q,
                    g,
                    stride,
                    dt,
                    min.as_ptr(),
                    max.as_ptr(),
                    None,
                    out,
                )
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: detected features; sizes asserted above.
            Path::Avx2 | Path::Avx512 => unsafe {
                x86::score_pages_f16(q, g, stride, dt, min, max, out)
            },
            _ => portable_score_pages_f16(q, g, stride, dt, min, max, out),
        }
    }

    /// `out[h*TILE + t] = scale * (q_h . rows_t)` for `t < n`, `h < g`; `q` is `[g][dp]`, rows `[n][dp]`.
    #[inline]
    pub fn tile_logits(
        self,
        q: &[f32],
        g: usize,
        dp: usize,
        rows: &[f32],
        n: usize,
        scale: f32,
        out: &mut [f32],
    ) {
        assert!(
            q.len() >= g * dp
                && rows.len() >= n * dp
                && out.len() >= g * TILE
                && n <= TILE
                && dp % 8 == 0
        );
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: detected features; sizes asserted above.
            Path::Avx512 => unsafe {
                crate::avx512::tile_logits(
                    q.as_ptr(),
                    g,
                    dp,
                    rows.as_ptr(),
                    dp,
                    n,
                    scale,
                    out.as_mut_ptr(),
                )
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: detected features; sizes asserted above.
            Path::Avx2 => unsafe { x86::tile_logits(q, g, dp, rows, n, scale, out) },
            _ => {
                for h in 0..g {
                    for t in 0..n {
                        out[h * TILE + t] =
                            scale * dot8(&q[h * dp..(h + 1) * dp], &rows[t * dp..(t + 1) * dp]);
                    }
                }
            }
        }
    }

    /// `acc_h += sum_t p[h*TILE + t] * rows_t` for `h < g`; acc is `[g][dp]`.
    #[inline]
    pub fn tile_accumulate(
        self,
        p: &[f32],
        g: usize,
        dp: usize,
        rows: &[f32],
        n: usize,
        acc: &mut [f32],
    ) {
        assert!(
            acc.len() >= g * dp
                && rows.len() >= n * dp
                && p.len() >= g * TILE
                && n <= TILE
                && dp % 8 == 0
        );
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: detected features; sizes asserted above.
            Path::Avx2 | Path::Avx512 => unsafe { x86::tile_accumulate(p, g, dp, rows, n, acc) },
            _ => {
                for h in 0..g {
                    let a = &mut acc[h * dp..(h + 1) * dp];
                    for t in 0..n {
                        let pt = p[h * TILE + t];
                        for (x, &v) in a.iter_mut().zip(&rows[t * dp..(t + 1) * dp]) {
                            *x += pt * v;
                        }
                    }
                }
            }
        }
    }

    /// Software prefetch of every cache line `data` touches (SIMD paths; a no-op on the
    /// portable path).
    #[inline]
    pub fn prefetch<T>(self, data: &[T]) {
        #[cfg(target_arch = "x86_64")]
        if self != Path::Portable {
            // SAFETY: prefetch hints never fault and read nothing.
            unsafe { x86::prefetch(data.as_ptr() as *const u8, std::mem::size_of_val(data)) }
        }
    }

    /// Whether the fused f16-row tile kernels apply (SIMD paths, `d` a multiple of 8).
    #[inline]
    pub fn fused_f16(self, d: usize) -> bool {
        self != Path::Portable && d % 8 == 0
    }

    /// [`Path::tile_logits`] reading f16 rows `rows[t * stride ..][..dp]` directly. Only when
    /// [`Path::fused_f16`] holds.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub fn tile_logits_f16(
        self,
        q: &[f32],
        g: usize,
        dp: usize,
        rows: &[f16],
        stride: usize,
        n: usize,
        scale: f32,
        out: &mut [f32],
    ) {
        assert!(
            self.fused_f16(dp)
                && n <= TILE
                && (n == 0 || rows.len() >= (n - 1) * stride + dp)
                && q.len() >= g * dp
                && out.len() >= g * TILE
        );
        // The AVX-512 path too: a 16-lane, four-token version (as `avx512::tile_logits`) was
        // faster on L1-resident rows (11.4 vs 12.6 ns per token in `kernel_cost`) but not on
        // streamed rows: dense decode at 131K tokens 24 % slower with the column-ordered value
        // accumulation, 2.5 % slower with the row-ordered one; one- and two-token versions were
        // slower still (in-process A/B, docs/PERFORMANCE.md).
        #[cfg(target_arch = "x86_64")]
        // SAFETY: avx2/fma/f16c detected (fused_f16); every row read lies inside `rows` (asserted).
        unsafe {
            x86::tile_logits_f16(q, g, dp, rows.as_ptr(), stride, n, scale, out)
        }
    }

    /// [`Path::tile_accumulate`] reading f16 rows directly. Only when [`Path::fused_f16`] holds.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub fn tile_accumulate_f16(
        self,
        p: &[f32],
        g: usize,
        dp: usize,
        rows: &[f16],
        stride: usize,
        n: usize,
        acc: &mut [f32],
    ) {
        assert!(
            self.fused_f16(dp)
                && n <= TILE
                && (n == 0 || rows.len() >= (n - 1) * stride + dp)
                && acc.len() >= g * dp
                && p.len() >= g * TILE
        );
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in tile_logits_f16.
        unsafe {
            // Rows in order, accumulators in registers: slower on L1-resident rows (13.5 vs
            // 9.7 ns per token) but dense decode at 131K tokens 14 % and Quest 9.5 % faster
            // (in-process A/B): streamed rows want to be read in address order.
            if self == Path::Avx512 && dp <= 128 {
                crate::avx512::tile_accumulate_f16(
                    p.as_ptr(),
                    g,
                    dp,
                    rows.as_ptr(),
                    stride,
                    n,
                    acc.as_mut_ptr(),
                )
            } else {
                x86::tile_accumulate_f16(p, g, dp, rows.as_ptr(), stride, n, acc)
            }
        }
    }

    /// `sum_i a_i b_i` (f32; FMA on the AVX2 path).
    #[inline]
    pub fn dot(self, a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: detected features; equal lengths asserted.
            Path::Avx2 | Path::Avx512 => unsafe { x86::dot(a, b) },
            _ => dot8(a, b),
        }
    }

    /// Whether [`Path::packed_accumulate`] applies: the AVX-512 path,
    /// g = 1 bitmaps, `r <= 32` values, `Dt <= 128`, tile rows `dp <= 32 * ceil(Dt / 32)`.
    #[inline]
    pub fn fused_packed(self, group_size: usize, dt: usize, r: usize, dp: usize) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            self == Path::Avx512
                && group_size == 1
                && r <= 32
                && (1..=32 * crate::avx512::FUSED_MAX_GROUPS).contains(&dt)
                && (dt..=32 * dt.div_ceil(32)).contains(&dp)
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (group_size, dt, r, dp);
            false
        }
    }

    /// Whether keys of this geometry go through an f16 tile ([`Path::expand_records_h`] then
    /// [`Path::tile_logits_h`]): the AVX-512 path, g = 1 records with `r <= 32` and rows of
    /// whole 32-dim words (`dp = 32 * ceil(dt / 32) <= HALF_TILE_MAX_DP`). The expanded values
    /// are f16 anyway, so the tile holds exactly what an f32 tile holds in half the bytes (one
    /// 64-byte store per 32 dims instead of two conversions and two stores): -3.6 % per 131K
    /// decode step in an in-process A/B.
    #[inline]
    pub fn half_tile(self, group_size: usize, dt: usize, r: usize, dp: usize) -> bool {
        self == Path::Avx512
            && group_size == 1
            && r <= 32
            && dt > 0
            && dp == 32 * dt.div_ceil(32)
            && dp <= HALF_TILE_MAX_DP
    }

    /// [`Path::expand_records`] (g = 1) into f16 rows of `dp` halves. Only where
    /// [`Path::half_tile`] holds.
    #[inline]
    pub fn expand_records_h(
        self,
        records: (&[u8], usize, usize),
        n: usize,
        dt: usize,
        r: usize,
        dp: usize,
        out: &mut [f16],
    ) {
        let (bytes, rb, bb) = records;
        assert!(
            self.half_tile(1, dt, r, dp)
                && n <= TILE
                && bytes.len() >= n * rb
                && bb >= dp / 8
                && bb + 2 * r <= rb
                && out.len() >= n * dp
        );
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512 detected (half_tile); records and rows in bounds (asserted above).
        unsafe {
            crate::avx512::expand_g1_h(bytes.as_ptr(), n, rb, bb, r, dp / 32, out.as_mut_ptr())
        }
    }

    /// [`Path::tile_logits`] on an f16 tile (`n` rows of `dp` halves). Only where
    /// [`Path::half_tile`] holds for the tile's geometry.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub fn tile_logits_h(
        self,
        q: &[f32],
        g: usize,
        dp: usize,
        rows: &[f16],
        n: usize,
        scale: f32,
        out: &mut [f32],
    ) {
        assert!(
            self == Path::Avx512
                && n <= TILE
                && rows.len() >= n * dp
                && q.len() >= g * dp
                && out.len() >= g * TILE
        );
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512 detected; sizes asserted above.
        unsafe {
            let (qp, op) = (q.as_ptr(), out.as_mut_ptr());
            crate::avx512::tile_logits(qp, g, dp, rows.as_ptr(), dp, n, scale, op)
        }
    }

    /// `acc_h = corr[h] * acc_h` (the online-softmax rescale), then [`Path::expand_records`]
    /// (g = 1) followed by [`Path::tile_accumulate`], the values expanded in registers;
    /// bit-identical to the rescale and AVX2 tile accumulation. Only where
    /// [`Path::fused_packed`] holds.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub fn packed_accumulate(
        self,
        p: &[f32],
        g: usize,
        dp: usize,
        records: (&[u8], usize, usize),
        n: usize,
        dt: usize,
        r: usize,
        corr: &[f32],
        acc: &mut [f32],
    ) {
        let (bytes, rb, bb) = records;
        assert!(
            self.fused_packed(1, dt, r, dp)
                && n <= TILE
                && bytes.len() >= n * rb
                && bb >= 4 * dt.div_ceil(32)
                && bb + 2 * r <= rb
                && p.len() >= g * TILE
                && corr.len() >= g
                && acc.len() >= g * dp
        );
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512 detected (fused_packed); geometry and lengths asserted above.
        unsafe {
            crate::avx512::packed_accumulate(
                p.as_ptr(),
                g,
                dp,
                dt.div_ceil(32),
                bytes.as_ptr(),
                n,
                rb,
                bb,
                r,
                corr.as_ptr(),
                acc.as_mut_ptr(),
            )
        }
    }

    /// Expands packed records (SPEC.md section 6, f16 values) to dense rotated rows
    /// `[n][dp]` (`dp >= kept_dims`, multiple of 8; zeros at dims not kept).
    /// `bytes` holds `n` consecutive records of `rb` bytes starting at record 0;
    /// `tail` bytes of readable slack follow them in the underlying buffer; each record's
    /// bitmap is `bb` bytes (whole little-endian u32 words), its values follow.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub fn expand_records(
        self,
        bytes: &[u8],
        tail: usize,
        n: usize,
        rb: usize,
        bb: usize,
        g: usize,
        dt: usize,
        r: usize,
        dp: usize,
        out: &mut [f32],
    ) {
        assert!(
            bytes.len() >= n * rb
                && out.len() >= n * dp
                && dp >= dt
                && dp % 8 == 0
                && bb % 4 == 0
                && 8 * bb >= dt.div_ceil(g)
                && bb + 2 * r <= rb
        );
        #[cfg(target_arch = "x86_64")]
        if self == Path::Avx512 && g == 1 && dp <= 32 * dt.div_ceil(32) {
            // SAFETY: AVX-512 detected; records, rows and the bitmap bytes read are in bounds
            // (asserted above and in the condition).
            unsafe {
                crate::avx512::expand_g1(bytes.as_ptr(), n, rb, bb, r, dt, dp, out.as_mut_ptr())
            };
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if self != Path::Portable && g == 1 {
            for t in 0..n {
                let rec = &bytes[t * rb..(t + 1) * rb];
                // Bytes readable after this record's values: the rest of the record, later records, slack.
                let after = (rb - bb - 2 * r) + (n - 1 - t) * rb + tail;
                // SAFETY: detected features; the record and `out` row are in bounds (asserted above).
                unsafe { x86::expand_g1(rec, bb, r, dt, after, &mut out[t * dp..(t + 1) * dp]) };
            }
            return;
        }
        for t in 0..n {
            let rec = &bytes[t * rb..(t + 1) * rb];
            let row = &mut out[t * dp..(t + 1) * dp];
            row.fill(0.0);
            let mut k = 0usize;
            let vals = &rec[bb..bb + 2 * r];
            for w in 0..bb / 4 {
                let mut bits =
                    u32::from_le_bytes(rec[4 * w..4 * w + 4].try_into().expect("4 bytes"));
                while bits != 0 {
                    let grp = 32 * w + bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    for e in 0..g {
                        if k >= r {
                            break;
                        }
                        let dim = grp * g + e;
                        if dim < dt {
                            row[dim] =
                                f16_bits_to_f32(u16::from_le_bytes([vals[2 * k], vals[2 * k + 1]]));
                        }
                        k += 1;
                    }
                }
            }
        }
    }
}

/// Whether AVX-512 F, BW, VL, VBMI2 and VNNI are available on top of [`avx2_available`].
pub fn avx512_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        avx2_available()
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512vbmi2")
            && is_x86_feature_detected!("avx512vnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether AVX2, FMA, F16C and POPCNT are all available on this CPU.
pub fn avx2_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
            && is_x86_feature_detected!("popcnt")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Exact f16 -> f32 from the bit pattern (portable).
#[inline]
pub fn f16_bits_to_f32(h: u16) -> f32 {
    let sign = ((h as u32) & 0x8000) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    let bits = if exp == 0 {
        if man == 0 {
            sign
        } else {
            // Subnormal: value = man * 2^-24, exact in f32.
            let v = man as f32 * (1.0 / 16_777_216.0);
            return if sign != 0 { -v } else { v };
        }
    } else if exp == 31 {
        sign | 0x7f80_0000 | (man << 13)
    } else {
        sign | ((exp + 112) << 23) | (man << 13)
    };
    f32::from_bits(bits)
}

/// 8-lane dot product, lanes reduced in a fixed tree (portable).
#[inline]
fn dot8(a: &[f32], b: &[f32]) -> f32 {
    let n8 = a.len() / 8 * 8;
    let mut acc = [0f32; 8];
    for (ca, cb) in a[..n8].chunks_exact(8).zip(b[..n8].chunks_exact(8)) {
        for l in 0..8 {
            acc[l] += ca[l] * cb[l];
        }
    }
    let mut s = reduce8(&acc);
    for i in n8..a.len() {
        s += a[i] * b[i];
    }
    s
}

/// The reduction tree the AVX2 path uses: (hi128 + lo128), then movehl, then lane 1.
#[inline]
fn reduce8(a: &[f32; 8]) -> f32 {
    let s = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    let t = [s[0] + s[2], s[1] + s[3]];
    t[0] + t[1]
}

/// Widest `Dt` whose quantized queries [`Path::score_blocks`] keeps on the stack.
pub const QMAX_DT: usize = 256;

/// `round_ties_even` for `|x| < 2^51`, inline: adding and subtracting 1.5 * 2^52 rounds to an
/// integer in the default rounding mode (nearest, ties to even). The library call it replaces
/// was 1.7 % of a decode step.
#[inline(always)]
fn round_half_even(x: f64) -> f64 {
    const MAGIC: f64 = 6_755_399_441_055_744.0;
    (x + MAGIC) - MAGIC
}

/// SPEC.md section 8.2: quantizes one rotated query `q` (length `Dt`) to int8,
/// `a_j = round_half_even(q_j / s_q)` with `s_q = max_j |q_j| / 127` (f64), clamped to
/// `[-127, 127]`; writes `a_j` as two byte rows, `pos_j = max(a_j, 0)` and
/// `neg_j = max(-a_j, 0)` (zero past `Dt`), and returns `s_q` (0 for a zero query).
pub fn quantize_query(q: &[f32], pos: &mut [u8], neg: &mut [u8]) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if avx2_available() {
        // SAFETY: avx2 detected; the body only uses bounds-checked slices.
        return unsafe { quantize_avx2(q, pos, neg) };
    }
    quantize_body(q, pos, neg)
}

/// [`quantize_query`] compiled for AVX2: the same IEEE operations, vectorized (a scalar
/// `cvtss2sd` + `divsd` loop carried a false dependency through its register and was 3.5 %
/// of a decode step).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,popcnt")]
unsafe fn quantize_avx2(q: &[f32], pos: &mut [u8], neg: &mut [u8]) -> f64 {
    quantize_body(q, pos, neg)
}

#[inline(always)]
fn quantize_body(q: &[f32], pos: &mut [u8], neg: &mut [u8]) -> f64 {
    pos.fill(0);
    neg.fill(0);
    let m = q.iter().fold(0f32, |m, &x| m.max(x.abs()));
    if m == 0.0 {
        return 0.0;
    }
    let s = f64::from(m) / 127.0;
    for ((&x, p), n) in q.iter().zip(pos.iter_mut()).zip(neg.iter_mut()) {
        let a = round_half_even(f64::from(x) / s).clamp(-127.0, 127.0) as i32;
        *p = a.max(0) as u8;
        *n = (-a).max(0) as u8;
    }
    s
}

/// SPEC 8.2's last step for one block: `f32(max_h (s_b * sq[h]) * (I_h + W / 2))` in f64,
/// the reference's order of operations; the max with `prev` unless `first`.
#[inline(always)]
pub(crate) fn combine_scores<const N: usize>(
    sums: &[i32; 4],
    w: i32,
    sq: &[f64; 4],
    sb: f32,
    first: bool,
    prev: f32,
) -> f32 {
    let mut best = f64::NEG_INFINITY;
    for h in 0..N {
        best = best.max(f64::from(sb) * sq[h] * (f64::from(sums[h]) + 0.5 * f64::from(w)));
    }
    let v = best as f32;
    if first {
        v
    } else {
        prev.max(v)
    }
}

/// `out[b] = max(out[b], f32(max_h (scale[b] * sq[h]) * (I_hb + W_b / 2)))` (f64 products;
/// `out[b]` overwritten when `first`)
/// for N quantized heads at `pos/neg[h * qstride ..]`: `I_hb = sum_j pos_hj max_bj - neg_hj
/// min_bj` (= `sum_j max(a_j max_bj, a_j min_bj)`), `W_b = sum_j max(|max_bj|, |min_bj|)`.
#[allow(clippy::too_many_arguments)]
fn portable_score_int<const N: usize>(
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
    for (b, o) in out.iter_mut().enumerate() {
        let (mx, mn) = (&max[b * dt..(b + 1) * dt], &min[b * dt..(b + 1) * dt]);
        let w: i32 = mx
            .iter()
            .zip(mn)
            .map(|(&x, &y)| i32::from(x).abs().max(i32::from(y).abs()))
            .sum();
        let sums: [i32; 4] = std::array::from_fn(|h| {
            if h >= N {
                return 0;
            }
            let (p, n) = (&pos[h * qstride..], &neg[h * qstride..]);
            let mut i_sum = 0i32;
            for j in 0..dt {
                i_sum += i32::from(p[j]) * i32::from(mx[j]) - i32::from(n[j]) * i32::from(mn[j]);
            }
            i_sum
        });
        *o = combine_scores::<N>(&sums, w, sq, scale[b], first, *o);
    }
}

fn portable_score_pages_f16(
    q: &[f32],
    g: usize,
    stride: usize,
    dt: usize,
    min: &[f16],
    max: &[f16],
    out: &mut [f32],
) {
    let d8 = dt / 8 * 8;
    let mut mx = vec![0f32; dt];
    let mut mn = vec![0f32; dt];
    for (b, o) in out.iter_mut().enumerate() {
        for j in 0..dt {
            mx[j] = f16_bits_to_f32(max[b * dt + j].to_bits());
            mn[j] = f16_bits_to_f32(min[b * dt + j].to_bits());
        }
        let mut best = f32::NEG_INFINITY;
        for h in 0..g {
            let qh = &q[h * stride..h * stride + dt];
            let mut acc = [0f32; 8];
            for c in (0..d8).step_by(8) {
                for l in 0..8 {
                    let a = qh[c + l] * mx[c + l];
                    let bb = qh[c + l] * mn[c + l];
                    acc[l] += if a > bb { a } else { bb };
                }
            }
            let mut s = reduce8(&acc);
            for j in d8..dt {
                let a = qh[j] * mx[j];
                let bb = qh[j] * mn[j];
                s += if a > bb { a } else { bb };
            }
            if h == 0 || s > best {
                best = s;
            }
        }
        *o = best;
    }
}

/// `fast_exp`'s constants, shared by the SIMD versions (`exp256`, `avx512::exp512`), which must
/// stay lane for lane the same polynomial: `ln 2` split in a high part (exact in f32) and a
/// low correction, and the degree-5 coefficients of `(e^r - 1 - r) / r^2`, highest first.
pub(crate) const EXP_LN2_HI: f32 = 0.693_359_4;
pub(crate) const EXP_LN2_LO: f32 = -2.121_944_4e-4;
pub(crate) const EXP_POLY: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    5.000_000_1e-1,
];

/// Fast `exp` (Cephes-style polynomial, ~2 ulp), branch- and cast-free so loops over it vectorize.
#[inline(always)]
pub fn fast_exp(x: f32) -> f32 {
    let x = x.clamp(-87.0, 88.0);
    // Round to nearest integer: n is integral and |n| <= 127.
    let n = (x * std::f32::consts::LOG2_E + 12_582_912.0) - 12_582_912.0;
    let r = x - n * EXP_LN2_HI - n * EXP_LN2_LO;
    let r2 = r * r;
    let c = EXP_POLY;
    let p = ((((c[0] * r + c[1]) * r + c[2]) * r + c[3]) * r + c[4]) * r + c[5];
    let y = p * r2 + r + 1.0;
    // 2^n: n + 127 + 2^23 holds the integer n + 127 in its mantissa bits.
    let e = ((n + (127.0 + 8_388_608.0)).to_bits() & 0x7f_ffff) << 23;
    y * f32::from_bits(e)
}

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::online_softmax as x86_online_softmax;

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use super::TILE;
    use half::f16;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma,f16c,popcnt")]
    #[inline]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let t = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)))
    }

    #[target_feature(enable = "avx2,fma,f16c,popcnt")]
    #[inline]
    unsafe fn load_ph(p: *const f16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }

    #[target_feature(enable = "avx2,fma,f16c,popcnt")]
    pub unsafe fn f16_to_f32(src: &[f16], dst: &mut [f32]) {
        let n = src.len();
        let n8 = n / 8 * 8;
        let mut i = 0;
        while i < n8 {
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), load_ph(src.as_ptr().add(i)));
            i += 8;
        }
        for j in n8..n {
            dst[j] = super::f16_bits_to_f32(src[j].to_bits());
        }
    }

    /// `acc[j] += f64(R[i][j]) * f64(q[i])` over ascending i, 4 f64 lanes (mul then add, no
    /// FMA: bit-identical to the portable loop and to the reference).
    #[target_feature(enable = "avx2,fma,f16c,popcnt")]
    pub unsafe fn rotate_query_f64(rot: &[f32], d: usize, q: &[f32], acc: &mut [f64]) {
        let dt = acc.len();
        let d4 = dt / 4 * 4;
        for i in 0..d {
            let qi = f64::from(q[i]);
            let qv = _mm256_set1_pd(qi);
            let row = rot.as_ptr().add(i * dt);
            let mut j = 0;
            while j < d4 {
                let a = acc.as_mut_ptr().add(j);
                let r = _mm256_cvtps_pd(_mm_loadu_ps(row.add(j)));
                _mm256_storeu_pd(a, _mm256_add_pd(_mm256_loadu_pd(a), _mm256_mul_pd(r, qv)));
                j += 4;
            }
            for j in d4..dt {
                acc[j] += f64::from(*row.add(j)) * qi;
            }
        }
    }

    /// The four i32 lane sums of `a[0..4]` as one xmm `[sum a0, sum a1, sum a2, sum a3]`
    /// (three `vphaddd` and one add instead of four separate reductions).
    #[target_feature(enable = "avx2,fma,f16c,popcnt")]
    #[inline]
    pub(crate) unsafe fn hsum4_i32(a: &[__m256i; 4]) -> __m128i {
        let s01 = _mm256_hadd_epi32(a[0], a[1]);
        let s23 = _mm256_hadd_epi32(a[2], a[3]);
        let s = _mm256_hadd_epi32(s01, s23);
        _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s))
    }

    /// SPEC 8.2 integer scores (see `portable_score_int`): 32 bytes per step with
    /// `vpmaddubsw` (u8 query halves x i8 bounds; pair sums <= 2 * 127 * 128 never saturate)
    /// and `vpmaddwd` by ones; `W` from `vpabsb`, `vpmaxub`, `vpsadbw`. The last partial
    /// chunk of a row is copied to a zeroed local first (no read past the row).
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c,popcnt")]
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
        let ones = _mm256_set1_epi16(1);
        let zero = _mm256_setzero_si256();
        let d32 = dt / 32 * 32;
        let (pp, np) = (pos.as_ptr(), neg.as_ptr());
        for (b, o) in out.iter_mut().enumerate() {
            let (mxp, mnp) = (max.as_ptr().add(b * dt), min.as_ptr().add(b * dt));
            let mut acc = [zero; N];
            let mut wacc = zero;
            let mut c = 0;
            while c < dt {
                let (mut tx, mut tn) = ([0i8; 32], [0i8; 32]);
                let (mx, mn) = if c < d32 {
                    (
                        _mm256_loadu_si256(mxp.add(c) as *const __m256i),
                        _mm256_loadu_si256(mnp.add(c) as *const __m256i),
                    )
                } else {
                    tx[..dt - c].copy_from_slice(&max[b * dt + c..(b + 1) * dt]);
                    tn[..dt - c].copy_from_slice(&min[b * dt + c..(b + 1) * dt]);
                    (
                        _mm256_loadu_si256(tx.as_ptr() as *const __m256i),
                        _mm256_loadu_si256(tn.as_ptr() as *const __m256i),
                    )
                };
                let w = _mm256_max_epu8(_mm256_abs_epi8(mx), _mm256_abs_epi8(mn));
                wacc = _mm256_add_epi64(wacc, _mm256_sad_epu8(w, zero));
                for h in 0..N {
                    let p = _mm256_loadu_si256(pp.add(h * qstride + c) as *const __m256i);
                    let n = _mm256_loadu_si256(np.add(h * qstride + c) as *const __m256i);
                    let hi = _mm256_madd_epi16(_mm256_maddubs_epi16(p, mx), ones);
                    let lo = _mm256_madd_epi16(_mm256_maddubs_epi16(n, mn), ones);
                    acc[h] = _mm256_sub_epi32(_mm256_add_epi32(acc[h], hi), lo);
                }
                c += 32;
            }
            let ws = _mm_add_epi64(
                _mm256_castsi256_si128(wacc),
                _mm256_extracti128_si256::<1>(wacc),
            );
            let w = (_mm_cvtsi128_si64(ws) + _mm_extract_epi64::<1>(ws)) as i32;
            let mut d = [zero; 4];
            d[..N].copy_from_slice(&acc);
            let mut sums = [0i32; 4];
            _mm_storeu_si128(sums.as_mut_ptr() as *mut __m128i, hsum4_i32(&d));
            *o = super::combine_scores::<N>(&sums, w, sq, scale[b], first, *o);
        }
    }

    /// Lane sums of the Quest bound for N heads over the first `d8` dims of one block.
    #[target_feature(enable = "avx2,fma,f16c,popcnt")]
    #[inline]
    unsafe fn score_heads_f16<const N: usize>(
        q: *const f32,
        stride: usize,
        d8: usize,
        mxp: *const f16,
        mnp: *const f16,
        out: &mut [f32; 4],
    ) {
        let mut acc = [_mm256_setzero_ps(); N];
        let mut c = 0;
        while c < d8 {
            let mx = load_ph(mxp.add(c));
            let mn = load_ph(mnp.add(c));
            for k in 0..N {
                let qv = _mm256_loadu_ps(q.add(k * stride + c));
                // mul, mul, max, add (no FMA): bit-identical to the portable path.
                let t = _mm256_max_ps(_mm256_mul_ps(qv, mx), _mm256_mul_ps(qv, mn));
                acc[k] = _mm256_add_ps(acc[k], t);
            }
            c += 8;
        }
        for k in 0..N {
            out[k] = hsum(acc[k]);
        }
    }

    #[target_feature(enable = "avx2,fma,f16c,popcnt")]
    pub unsafe fn score_pages_f16(
        q: &[f32],
        g: usize,
        stride: usize,
        dt: usize,
        min: &[f16],
        max: &[f16],
        out: &mut [f32],
    ) {
        let d8 = dt / 8 * 8;
        for (b, o) in out.iter_mut().enumerate() {
            let mxp = max.as_ptr().add(b * dt);
            let mnp = min.as_ptr().add(b * dt);
            let mut best = f32::NEG_INFINITY;
            let mut h0 = 0;
            while h0 < g {
                let hn = (g - h0).min(4);
                let mut sums = [0f32; 4];
                let qp = q.as_ptr().add(h0 * stride);
                match hn {
                    1 => score_heads_f16::<1>(qp, stride, d8, mxp, mnp, &mut sums),
                    2 => score_heads_f16::<2>(qp, stride, d8, mxp, mnp, &mut sums),
                    3 => score_heads_f16::<3>(qp, stride, d8, mxp, mnp, &mut sums),
                    _ => score_heads_f16::<4>(qp, stride, d8, mxp, mnp, &mut sums),
                }
                for (k, &s0) in sums.iter().enumerate().take(hn) {
                    let h = h0 + k;
                    let mut s = s0;
                    for j in d8..dt {
                        let qj = q[h * stride + j];
                        let x = qj * super::f16_bits_to_f32((*mxp.add(j)).to_bits());
                        let y = qj * super::f16_bits_to_f32((*mnp.add(j)).to_bits());
                        s += if x > y { x } else { y };
                    }
                    if h == 0 || s > best {
                        best = s;
                    }
                }
                h0 += 4;
            }
            *o = best;
        }
    }

    #[target_feature(enable = "avx2,fma,f16c,popcnt")]
    pub unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len();
        let n8 = n / 8 * 8;
        let mut acc = _mm256_setzero_ps();
        let mut i = 0;
        while i < n8 {
            acc = _mm256_fmadd_ps(
                _mm256_loadu_ps(a.as_ptr().add(i)),
                _mm256_loadu_ps(b.as_ptr().add(i)),
                acc,
            );
            i += 8;
        }
        let mut s = hsum(acc);
        for j in n8..n {
            s += a[j] * b[j];
        }
        s
    }

    #[target_feature(enable = "avx2,fma,f16c,popcnt")]
    #[inline]
    unsafe fn ld_f32(p: *const f32) -> __m256 {
        _mm256_loadu_ps(p)
    }

    macro_rules! tile_kernels {
        ($logits:ident, $accum:ident, $logits_n:ident, $accum_n:ident, $t:ty, $load:ident) => {
            #[target_feature(enable = "avx2,fma,f16c,popcnt")]
            unsafe fn $logits_n<const N: usize>(
                q: *const f32,
                dp: usize,
                rows: *const $t,
                stride: usize,
                n: usize,
                scale: f32,
                out: *mut f32,
            ) {
                // Two tokens per pass: 2N independent FMA chains hide the FMA latency.
                let mut t = 0;
                while t + 2 <= n {
                    let (r0, r1) = (rows.add(t * stride), rows.add((t + 1) * stride));
                    let mut a0 = [_mm256_setzero_ps(); N];
                    let mut a1 = [_mm256_setzero_ps(); N];
                    let mut c = 0;
                    while c < dp {
                        let k0 = $load(r0.add(c));
                        let k1 = $load(r1.add(c));
                        for h in 0..N {
                            let qv = _mm256_loadu_ps(q.add(h * dp + c));
                            a0[h] = _mm256_fmadd_ps(qv, k0, a0[h]);
                            a1[h] = _mm256_fmadd_ps(qv, k1, a1[h]);
                        }
                        c += 8;
                    }
                    for h in 0..N {
                        *out.add(h * TILE + t) = scale * hsum(a0[h]);
                        *out.add(h * TILE + t + 1) = scale * hsum(a1[h]);
                    }
                    t += 2;
                }
                if t < n {
                    let row = rows.add(t * stride);
                    let mut acc = [_mm256_setzero_ps(); N];
                    let mut c = 0;
                    while c < dp {
                        let k = $load(row.add(c));
                        for h in 0..N {
                            acc[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q.add(h * dp + c)), k, acc[h]);
                        }
                        c += 8;
                    }
                    for h in 0..N {
                        *out.add(h * TILE + t) = scale * hsum(acc[h]);
                    }
                }
            }

            #[target_feature(enable = "avx2,fma,f16c,popcnt")]
            unsafe fn $accum_n<const N: usize>(
                p: *const f32,
                dp: usize,
                rows: *const $t,
                stride: usize,
                n: usize,
                acc: *mut f32,
            ) {
                // Two 8-wide column chunks per pass: 2N independent FMA chains.
                let mut c = 0;
                while c + 16 <= dp {
                    let mut a = [_mm256_setzero_ps(); N];
                    let mut b = [_mm256_setzero_ps(); N];
                    for h in 0..N {
                        a[h] = _mm256_loadu_ps(acc.add(h * dp + c));
                        b[h] = _mm256_loadu_ps(acc.add(h * dp + c + 8));
                    }
                    for t in 0..n {
                        let v0 = $load(rows.add(t * stride + c));
                        let v1 = $load(rows.add(t * stride + c + 8));
                        for h in 0..N {
                            let pv = _mm256_set1_ps(*p.add(h * TILE + t));
                            a[h] = _mm256_fmadd_ps(pv, v0, a[h]);
                            b[h] = _mm256_fmadd_ps(pv, v1, b[h]);
                        }
                    }
                    for h in 0..N {
                        _mm256_storeu_ps(acc.add(h * dp + c), a[h]);
                        _mm256_storeu_ps(acc.add(h * dp + c + 8), b[h]);
                    }
                    c += 16;
                }
                while c < dp {
                    let mut a = [_mm256_setzero_ps(); N];
                    for h in 0..N {
                        a[h] = _mm256_loadu_ps(acc.add(h * dp + c));
                    }
                    for t in 0..n {
                        let v = $load(rows.add(t * stride + c));
                        for h in 0..N {
                            a[h] = _mm256_fmadd_ps(_mm256_set1_ps(*p.add(h * TILE + t)), v, a[h]);
                        }
                    }
                    for h in 0..N {
                        _mm256_storeu_ps(acc.add(h * dp + c), a[h]);
                    }
                    c += 8;
                }
            }

            /// Logits of `g` heads (`q` `[g][dp]`) against `n` rows at `rows + t * stride` (dp elements each).
            #[target_feature(enable = "avx2,fma,f16c,popcnt")]
            pub unsafe fn $logits(
                q: &[f32],
                g: usize,
                dp: usize,
                rows: *const $t,
                stride: usize,
                n: usize,
                scale: f32,
                out: &mut [f32],
            ) {
                let mut h0 = 0;
                while h0 < g {
                    let (qp, op) = (q.as_ptr().add(h0 * dp), out.as_mut_ptr().add(h0 * TILE));
                    match g - h0 {
                        1 => $logits_n::<1>(qp, dp, rows, stride, n, scale, op),
                        2 => $logits_n::<2>(qp, dp, rows, stride, n, scale, op),
                        3 => $logits_n::<3>(qp, dp, rows, stride, n, scale, op),
                        _ => $logits_n::<4>(qp, dp, rows, stride, n, scale, op),
                    }
                    h0 += 4;
                }
            }

            /// `acc_h += sum_t p[h][t] row_t` for `g` heads.
            #[target_feature(enable = "avx2,fma,f16c,popcnt")]
            pub unsafe fn $accum(
                p: &[f32],
                g: usize,
                dp: usize,
                rows: *const $t,
                stride: usize,
                n: usize,
                acc: &mut [f32],
            ) {
                let mut h0 = 0;
                while h0 < g {
                    let (pp, ap) = (p.as_ptr().add(h0 * TILE), acc.as_mut_ptr().add(h0 * dp));
                    match g - h0 {
                        1 => $accum_n::<1>(pp, dp, rows, stride, n, ap),
                        2 => $accum_n::<2>(pp, dp, rows, stride, n, ap),
                        3 => $accum_n::<3>(pp, dp, rows, stride, n, ap),
                        _ => $accum_n::<4>(pp, dp, rows, stride, n, ap),
                    }
                    h0 += 4;
                }
            }
        };
    }

    tile_kernels!(
        tile_logits_p,
        tile_accumulate_p,
        tl_f32,
        ta_f32,
        f32,
        ld_f32
    );
    tile_kernels!(
        tile_logits_f16,
        tile_accumulate_f16,
        tl_f16,
        ta_f16,
        f16,
        load_ph
    );

    #[target_feature(enable = "avx2,fma,f16c,popcnt")]
    pub unsafe fn tile_logits(
        q: &[f32],
        g: usize,
        dp: usize,
        rows: &[f32],
        n: usize,
        scale: f32,
        out: &mut [f32],
    ) {
        tile_logits_p(q, g, dp, rows.as_ptr(), dp, n, scale, out)
    }

    #[target_feature(enable = "avx2,fma,f16c,popcnt")]
    pub unsafe fn tile_accumulate(
        p: &[f32],
        g: usize,
        dp: usize,
        rows: &[f32],
        n: usize,
        acc: &mut [f32],
    ) {
        tile_accumulate_p(p, g, dp, rows.as_ptr(), dp, n, acc)
    }

    #[target_feature(enable = "avx2,fma,f16c,popcnt")]
    #[inline]
    unsafe fn exp256(x: __m256) -> __m256 {
        let x = _mm256_min_ps(
            _mm256_max_ps(x, _mm256_set1_ps(-87.0)),
            _mm256_set1_ps(88.0),
        );
        let n = _mm256_round_ps(
            _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
        );
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(super::EXP_LN2_HI), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(super::EXP_LN2_LO), r);
        let mut p = _mm256_set1_ps(super::EXP_POLY[0]);
        for &c in &super::EXP_POLY[1..] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let y = _mm256_fmadd_ps(
            p,
            _mm256_mul_ps(r, r),
            _mm256_add_ps(r, _mm256_set1_ps(1.0)),
        );
        let e = _mm256_slli_epi32(
            _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
            23,
        );
        _mm256_mul_ps(y, _mm256_castsi256_ps(e))
    }

    /// Online softmax over one tile of `g` heads (see `attend::online_softmax`).
    #[target_feature(enable = "avx2,fma,f16c,popcnt")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn online_softmax(
        m: &mut [f32],
        l: &mut [f32],
        acc: &mut [f32],
        g: usize,
        dp: usize,
        logits: &mut [f32],
        n: usize,
        mut corr_out: Option<&mut [f32]>,
    ) {
        let nn = _mm256_set1_ps(n as f32);
        let mask0 = _mm256_cmp_ps(
            _mm256_setr_ps(0., 1., 2., 3., 4., 5., 6., 7.),
            nn,
            _CMP_LT_OQ,
        );
        let mask1 = _mm256_cmp_ps(
            _mm256_setr_ps(8., 9., 10., 11., 12., 13., 14., 15.),
            nn,
            _CMP_LT_OQ,
        );
        let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
        for h in 0..g {
            let lp = logits.as_mut_ptr().add(h * TILE);
            let a0 = _mm256_blendv_ps(ninf, _mm256_loadu_ps(lp), mask0);
            let a1 = _mm256_blendv_ps(ninf, _mm256_loadu_ps(lp.add(8)), mask1);
            let mx = _mm256_max_ps(a0, a1);
            let mx = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            let mx = _mm_max_ps(mx, _mm_movehl_ps(mx, mx));
            let mt = _mm_cvtss_f32(_mm_max_ss(mx, _mm_shuffle_ps(mx, mx, 1)));
            let m_old = m[h];
            let m_new = m_old.max(mt);
            let corr = if m_old == f32::NEG_INFINITY {
                0.0
            } else {
                super::fast_exp(m_old - m_new)
            };
            let mv = _mm256_set1_ps(m_new);
            let p0 = _mm256_and_ps(exp256(_mm256_sub_ps(a0, mv)), mask0);
            let p1 = _mm256_and_ps(exp256(_mm256_sub_ps(a1, mv)), mask1);
            _mm256_storeu_ps(lp, p0);
            _mm256_storeu_ps(lp.add(8), p1);
            l[h] = l[h] * corr + hsum(_mm256_add_ps(p0, p1));
            if let Some(c) = corr_out.as_deref_mut() {
                c[h] = corr;
            } else if corr != 1.0 {
                let cv = _mm256_set1_ps(corr);
                let a = &mut acc[h * dp..(h + 1) * dp];
                let mut c = 0;
                while c + 8 <= dp {
                    _mm256_storeu_ps(
                        a.as_mut_ptr().add(c),
                        _mm256_mul_ps(_mm256_loadu_ps(a.as_ptr().add(c)), cv),
                    );
                    c += 8;
                }
                for x in a[c..].iter_mut() {
                    *x *= corr;
                }
            }
            m[h] = m_new;
        }
    }

    /// pshufb masks: for a bitmap byte, where each of the 8 output f16 lanes takes its value from.
    static EXPAND_LUT: [[u8; 16]; 256] = {
        let mut t = [[0x80u8; 16]; 256];
        let mut b = 0;
        while b < 256 {
            let mut k = 0u8;
            let mut lane = 0;
            while lane < 8 {
                if (b >> lane) & 1 == 1 {
                    t[b][2 * lane] = 2 * k;
                    t[b][2 * lane + 1] = 2 * k + 1;
                    k += 1;
                }
                lane += 1;
            }
            b += 1;
        }
        t
    };

    /// g = 1 record expansion: per bitmap byte, one 16-byte load, pshufb, cvtph2ps.
    /// `after` = readable bytes after the record's values (in the same allocation).
    #[target_feature(enable = "avx2,fma,f16c,popcnt")]
    pub unsafe fn expand_g1(
        rec: &[u8],
        bb: usize,
        r: usize,
        dt: usize,
        after: usize,
        out: &mut [f32],
    ) {
        if after < 16 {
            return expand_g1_tail(rec, bb, r, dt, out);
        }
        expand_g1_from(rec, rec.as_ptr().add(bb), r, dt, out)
    }

    #[target_feature(enable = "avx2,fma,f16c,popcnt")]
    #[inline]
    unsafe fn expand_g1_from(rec: &[u8], src: *const u8, r: usize, dt: usize, out: &mut [f32]) {
        let chunks = dt.div_ceil(8);
        let mut off = 0usize;
        for c in 0..chunks {
            let byte = *rec.get_unchecked(c) as usize; // the bitmap is little-endian words: byte c = dims 8c..8c+8
            let v = _mm_loadu_si128(src.add(2 * off) as *const __m128i);
            let m = _mm_loadu_si128(EXPAND_LUT[byte].as_ptr() as *const __m128i);
            _mm256_storeu_ps(
                out.as_mut_ptr().add(8 * c),
                _mm256_cvtph_ps(_mm_shuffle_epi8(v, m)),
            );
            off += byte.count_ones() as usize;
            if off > r {
                off = r;
            }
        }
        for x in out.iter_mut().skip(8 * chunks) {
            *x = 0.0;
        }
    }

    /// The last records of a buffer: the values are copied to a padded local first.
    #[cold]
    #[target_feature(enable = "avx2,fma,f16c,popcnt")]
    unsafe fn expand_g1_tail(rec: &[u8], bb: usize, r: usize, dt: usize, out: &mut [f32]) {
        let mut local = [0u8; 16 + 2 * 256];
        if 2 * r + 16 <= local.len() {
            local[..2 * r].copy_from_slice(&rec[bb..bb + 2 * r]);
            return expand_g1_from(rec, local.as_ptr(), r, dt, out);
        }
        // Too large for the local copy: scalar, bounds-checked.
        out.fill(0.0);
        let mut k = 0;
        for dim in 0..dt {
            if (rec[dim / 8] >> (dim % 8)) & 1 == 1 && k < r {
                out[dim] = super::f16_bits_to_f32(u16::from_le_bytes([
                    rec[bb + 2 * k],
                    rec[bb + 2 * k + 1],
                ]));
                k += 1;
            }
        }
    }

    /// Hints cache lines into the cache (`prefetcht2`: on the AMD Zen 4 machine
    /// we measured, T2 made the MosaicKV step 9-12 % faster than T0 in three alternating
    /// pairs of `profile_step mosaic 131072 300`, and NTA was no better than T0).
    /// Every line from the one holding `ptr` to the one holding `ptr + len - 1`.
    #[target_feature(enable = "avx2,fma,f16c,popcnt")]
    pub unsafe fn prefetch(ptr: *const u8, len: usize) {
        let end = ptr as usize + len;
        let mut line = ptr as usize & !63;
        while line < end {
            _mm_prefetch(line as *const i8, _MM_HINT_T2);
            line += 64;
        }
    }
}

/// Asks the kernel to back `[ptr, ptr + bytes)` with transparent huge pages (Linux,
/// `madvise(MADV_HUGEPAGE)`; a no-op elsewhere) for `len` elements at `ptr`, which must lie in
/// one live allocation. Call it before the memory is first
/// touched. Decode steps stream hundreds of MB through 4 KiB pages otherwise, and TLB
/// misses halve the bandwidth at 131K tokens.
pub fn advise_huge_pages<T>(ptr: *const T, len: usize) {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let start = ptr as usize;
        let end = start + len * std::mem::size_of::<T>();
        let a = start.div_ceil(HUGE) * HUGE;
        let b = end / HUGE * HUGE;
        if b > a {
            // SAFETY: the caller passes a range of one live allocation; MADV_HUGEPAGE only changes
            // how the kernel backs those pages, never their contents or validity.
            unsafe {
                libc::madvise(a as *mut libc::c_void, b - a, libc::MADV_HUGEPAGE);
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (ptr, len);
}
