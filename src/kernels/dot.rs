//! The `A·Bᵀ` GEMM without packing: every element of `C` is a dot product of two contiguous rows.
//!
//! A fully connected layer's forward pass is `y = x·Wᵀ` with `x` (`b×in`) and `W` (`out×in`) both
//! row-major, so row `i` of `x` and row `j` of `W` are contiguous over the reduction. The packed
//! kernel of [`crate::kernels::gemm`] must first transpose `W` into column panels, which a batch of
//! 64 rows hardly amortises. Here a 4×5 register tile keeps 20 accumulators of 16 lanes, loads 4 rows of `A` and 5 rows of `B` 16 depths at a time straight from memory (the 5 rows of `B`
//! stay in L1 while all row blocks of `A` pass by), and reduces the lanes once at the end.
//!
//! Every element is computed the same way wherever it sits: 16 lane sums over the depth in order
//! (a last partial step masked), then one fixed horizontal reduction. Tiles at the edges compute on
//! repeated rows and store only their real ones, so `C[i][j]` depends only on row `i` of `A` and
//! row `j` of `B`: the same bits whatever the thread count, the batch split or the other rows.
//!
//! The other tiers run [`generic::nt`]: the same 16 lane sums, each held in `16 / LANES` vectors of
//! the tier, and the same reduction tree, so on AVX2 every element has the bits of AVX-512's (and on
//! the portable tier the same order without fused multiply-adds). Its register tile is smaller,
//! `RM × RN` per tier, to fit 16 registers.

/// Rows of `A` in the register tile.
pub(crate) const RM: usize = 4;
/// Rows of `B` in the register tile.
pub(crate) const RN: usize = 5;
/// Longest reduction this kernel takes: beyond it the 5 rows of `B` no longer stay in L1.
pub(crate) const MAX_K: usize = 1024;
/// Rows of `A` per block (kept in L2 while the rows of `B` go by).
const MB: usize = 96;

/// The block of `C = alpha·A·Bᵀ + beta·C` at rows `i0..i0+m`, columns `j0..j0+n`: `a` holds the
/// whole `A` (row-major, `k` columns), `b` the whole `B` (row-major, `k` columns), `c` starts at the
/// block's first element with row stride `ldc`.
///
/// # Safety
/// The CPU must support AVX-512F; rows `i0..i0+m` of `a`, rows `j0..j0+n` of `b` and the block of
/// `c` must be in bounds; `k ≥ 1`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn nt(
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    a: &[f32],
    b: &[f32],
    beta: f32,
    c: *mut f32,
    ldc: usize,
    i0: usize,
    j0: usize,
) {
    debug_assert!(k >= 1 && a.len() >= (i0 + m) * k && b.len() >= (j0 + n) * k);
    for ib in (0..m).step_by(MB) {
        let mb = MB.min(m - ib);
        for jt in (0..n).step_by(RN) {
            let cols = RN.min(n - jt);
            // Missing rows repeat the last real one (computed, never stored).
            let brow: [*const f32; RN] = std::array::from_fn(|q| b.as_ptr().add((j0 + jt + q.min(cols - 1)) * k));
            for it in (ib..ib + mb).step_by(RM) {
                let rows = RM.min(ib + mb - it);
                let arow: [*const f32; RM] = std::array::from_fn(|r| a.as_ptr().add((i0 + it + r.min(rows - 1)) * k));
                let sums = tile(k, arow, brow);
                for (r, sums_r) in sums.iter().enumerate().take(rows) {
                    let out = c.add((it + r) * ldc + jt);
                    for (q, &s) in sums_r.iter().enumerate().take(cols) {
                        let o = out.add(q);
                        *o = if beta == 0.0 { alpha * s } else { alpha * s + beta * *o };
                    }
                }
            }
        }
    }
}

/// The 4×5 dot products of rows `a[r]` and `b[q]` over `k` depths.
///
/// Written with plain loops over the fixed-size arrays and no closures: a closure (`array::from_fn`,
/// `array::map`) is a separate function to LLVM, and whether it got inlined depended on unrelated code
/// elsewhere in the crate; when it was not, the 20 accumulators spilled and the kernel ran at half speed.
/// Full steps use plain loads; only a last partial step needs the mask.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::needless_range_loop)]
unsafe fn tile(k: usize, a: [*const f32; RM], b: [*const f32; RN]) -> [[f32; RN]; RM] {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); RN]; RM];
    let mut bv = [_mm512_setzero_ps(); RN];
    // `step!(row => load)`: one depth step of 16, each row's vector loaded by `load`.
    macro_rules! step {
        ($row:ident => $load:expr) => {
            for q in 0..RN {
                let $row = b[q];
                bv[q] = $load;
            }
            for r in 0..RM {
                let $row = a[r];
                let av = $load;
                for q in 0..RN {
                    acc[r][q] = _mm512_fmadd_ps(av, bv[q], acc[r][q]);
                }
            }
        };
    }
    let full = k / 16;
    for s in 0..full {
        step!(row => _mm512_loadu_ps(row.add(16 * s)));
    }
    let rest = k - 16 * full;
    if rest > 0 {
        let mask = ((1u32 << rest) - 1) as __mmask16;
        step!(row => _mm512_maskz_loadu_ps(mask, row.add(16 * full)));
    }
    // Columns 0..4 of the tile through one transposed reduction, the last column one by one.
    let mut first = [_mm512_setzero_ps(); 16];
    for r in 0..RM {
        for q in 0..4 {
            first[4 * r + q] = acc[r][q];
        }
    }
    let mut lanes = [0.0f32; 16];
    _mm512_storeu_ps(lanes.as_mut_ptr(), reduce16(first));
    let mut sums = [[0.0; RN]; RM];
    for r in 0..RM {
        for q in 0..4 {
            sums[r][q] = lanes[4 * q + r];
        }
        sums[r][4] = reduce(acc[r][4]);
    }
    sums
}

/// [`reduce`] of 16 vectors at once, the same additions in the same order (so the same bits), but
/// each level adds the halves of two vectors in one instruction: 15 additions and 30 shuffles
/// instead of 64 and 64. Input `4m + g` ends up in lane `4g + m`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::needless_range_loop)]
fn reduce16(v: [std::arch::x86_64::__m512; 16]) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    // Lanes j + (j + 8): inputs 2p and 2p+1 share a vector, 8 partial sums each.
    let mut h = [_mm512_setzero_ps(); 8];
    for p in 0..8 {
        let (x, y) = (v[2 * p], v[2 * p + 1]);
        h[p] = _mm512_add_ps(_mm512_shuffle_f32x4::<0b01_00_01_00>(x, y), _mm512_shuffle_f32x4::<0b11_10_11_10>(x, y));
    }
    // + (j + 4): inputs 4p..4p+4 in 128-bit lanes 0..4 of one vector, 4 partial sums each.
    let mut q = [_mm512_setzero_ps(); 4];
    for p in 0..4 {
        let (x, y) = (h[2 * p], h[2 * p + 1]);
        q[p] = _mm512_add_ps(_mm512_shuffle_f32x4::<0b10_00_10_00>(x, y), _mm512_shuffle_f32x4::<0b11_01_11_01>(x, y));
    }
    // + (j + 2), then + (j + 1), inside each 128-bit lane.
    let e0 =
        _mm512_add_ps(_mm512_shuffle_ps::<0b01_00_01_00>(q[0], q[1]), _mm512_shuffle_ps::<0b11_10_11_10>(q[0], q[1]));
    let e1 =
        _mm512_add_ps(_mm512_shuffle_ps::<0b01_00_01_00>(q[2], q[3]), _mm512_shuffle_ps::<0b11_10_11_10>(q[2], q[3]));
    _mm512_add_ps(_mm512_shuffle_ps::<0b10_00_10_00>(e0, e1), _mm512_shuffle_ps::<0b11_01_11_01>(e0, e1))
}

/// The sum of the 16 lanes in a fixed order, with 512-bit operations only (a 256/128-bit reduction
/// would confine the accumulators to the 16 registers VEX can address, and they would spill).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn reduce(v: std::arch::x86_64::__m512) -> f32 {
    use std::arch::x86_64::*;
    let v = _mm512_add_ps(v, _mm512_shuffle_f32x4::<0b01_00_11_10>(v, v));
    let v = _mm512_add_ps(v, _mm512_shuffle_f32x4::<0b10_11_00_01>(v, v));
    let v = _mm512_add_ps(v, _mm512_permute_ps::<0b01_00_11_10>(v));
    let v = _mm512_add_ps(v, _mm512_permute_ps::<0b10_11_00_01>(v));
    _mm512_cvtss_f32(v)
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use std::arch::x86_64::*;

    #[test]
    fn reduce16_is_sixteen_reduces_bit_for_bit() {
        if !is_x86_feature_detected!("avx512f") {
            return;
        }
        let mut rng = crate::data::rng::Rng::from_keys(&[16]);
        for _ in 0..50 {
            // Wide exponents so that any other order of additions rounds differently.
            let vals: Vec<[f32; 16]> = (0..16)
                .map(|_| std::array::from_fn(|_| rng.uniform(1.0) * 2f32.powi((rng.uniform(12.0)) as i32)))
                .collect();
            // SAFETY: AVX-512F checked above.
            unsafe {
                let v: [__m512; 16] = std::array::from_fn(|i| _mm512_loadu_ps(vals[i].as_ptr()));
                let mut lanes = [0.0f32; 16];
                _mm512_storeu_ps(lanes.as_mut_ptr(), reduce16(v));
                for (i, x) in v.iter().enumerate() {
                    let (m, g) = (i / 4, i % 4);
                    assert_eq!(lanes[4 * g + m].to_bits(), reduce(*x).to_bits(), "input {i}");
                }
            }
        }
    }
}

/// The dot-product kernel over [`Simd`], for the AVX2 and portable tiers.
pub(crate) mod generic {
    use super::MB;
    use crate::kernels::isa::Simd;

    /// Lanes of one dot product's partial sums, as on AVX-512.
    const W: usize = 16;

    /// [`super::nt`] with an `RM × RN` tile of `H = 16 / LANES` vectors per accumulator.
    ///
    /// # Safety
    /// As [`super::nt`], with the CPU supporting `S`'s tier.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn nt<S: Simd, const RM: usize, const RN: usize, const H: usize>(
        (m, n, k): (usize, usize, usize),
        alpha: f32,
        (a, b): (&[f32], &[f32]),
        beta: f32,
        (c, ldc): (*mut f32, usize),
        (i0, j0): (usize, usize),
    ) {
        debug_assert!(H * S::LANES == W && k >= 1 && a.len() >= (i0 + m) * k && b.len() >= (j0 + n) * k);
        for ib in (0..m).step_by(MB) {
            let mb = MB.min(m - ib);
            for jt in (0..n).step_by(RN) {
                let cols = RN.min(n - jt);
                let mut brow = [b.as_ptr(); RN];
                for (q, p) in brow.iter_mut().enumerate() {
                    *p = b.as_ptr().add((j0 + jt + q.min(cols - 1)) * k);
                }
                for it in (ib..ib + mb).step_by(RM) {
                    let rows = RM.min(ib + mb - it);
                    let mut arow = [a.as_ptr(); RM];
                    for (r, p) in arow.iter_mut().enumerate() {
                        *p = a.as_ptr().add((i0 + it + r.min(rows - 1)) * k);
                    }
                    let sums = tile::<S, RM, RN, H>(k, arow, brow);
                    for (r, sums_r) in sums.iter().enumerate().take(rows) {
                        let out = c.add((it + r) * ldc + jt);
                        for (q, &s) in sums_r.iter().enumerate().take(cols) {
                            let o = out.add(q);
                            *o = if beta == 0.0 { alpha * s } else { alpha * s + beta * *o };
                        }
                    }
                }
            }
        }
    }

    /// The `RM × RN` dot products of rows `a[r]` and `b[q]` over `k` depths: 16 lane sums each,
    /// then the reduction tree of AVX-512's `reduce` (lane `j` + lane `j+8`, then `j+4`, `j+2`, `j+1`).
    #[inline(always)]
    #[allow(clippy::needless_range_loop)]
    unsafe fn tile<S: Simd, const RM: usize, const RN: usize, const H: usize>(
        k: usize,
        a: [*const f32; RM],
        b: [*const f32; RN],
    ) -> [[f32; RN]; RM] {
        let mut acc = [[[S::zero(); H]; RN]; RM];
        let full = k / W;
        for s in 0..full {
            for h in 0..H {
                let at = W * s + h * S::LANES;
                let mut bv = [S::zero(); RN];
                for q in 0..RN {
                    bv[q] = S::load(b[q].add(at));
                }
                for r in 0..RM {
                    let av = S::load(a[r].add(at));
                    for q in 0..RN {
                        acc[r][q][h] = S::madd(av, bv[q], acc[r][q][h]);
                    }
                }
            }
        }
        let rest = k - W * full;
        if rest > 0 {
            // The last partial step on zero-padded copies (0·0 added to a partial leaves it as is,
            // as AVX-512's masked loads do).
            let tail = |p: *const f32| {
                let mut t = [0.0f32; W];
                std::ptr::copy_nonoverlapping(p.add(W * full), t.as_mut_ptr(), rest);
                t
            };
            let mut bt = [[0.0f32; W]; RN];
            for q in 0..RN {
                bt[q] = tail(b[q]);
            }
            for r in 0..RM {
                let at = tail(a[r]);
                for h in 0..H {
                    let av = S::load(at.as_ptr().add(h * S::LANES));
                    for q in 0..RN {
                        let bv = S::load(bt[q].as_ptr().add(h * S::LANES));
                        acc[r][q][h] = S::madd(av, bv, acc[r][q][h]);
                    }
                }
            }
        }
        let mut sums = [[0.0; RN]; RM];
        for r in 0..RM {
            for q in 0..RN {
                // The tree's first levels add whole vectors (lane j + lane j + 8 is vector h + vector
                // h + H/2), the last ones the lanes of one vector.
                let acc = &mut acc[r][q];
                let mut vectors = H;
                while vectors > 1 {
                    for h in 0..vectors / 2 {
                        acc[h] = S::add(acc[h], acc[h + vectors / 2]);
                    }
                    vectors /= 2;
                }
                let mut v = [0.0f32; W];
                S::store(v.as_mut_ptr(), acc[0]);
                let mut half = S::LANES / 2;
                while half > 0 {
                    for j in 0..half {
                        v[j] += v[j + half];
                    }
                    half /= 2;
                }
                sums[r][q] = v[0];
            }
        }
        sums
    }

    /// [`nt`] compiled for AVX2 + FMA, with a 2×3 tile (12 ymm accumulators; A, streamed from L2, is loaded once per 3 FMAs).
    ///
    /// # Safety
    /// As [`nt`]; the CPU must support AVX2 and FMA.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn nt_avx2(
        mnk: (usize, usize, usize),
        alpha: f32,
        ab: (&[f32], &[f32]),
        beta: f32,
        c: (*mut f32, usize),
        at: (usize, usize),
    ) {
        nt::<crate::kernels::isa::Avx2, { AVX2_TILE.0 }, { AVX2_TILE.1 }, 2>(mnk, alpha, ab, beta, c, at)
    }

    /// [`nt`] on the portable tier, with a 2×1 tile (8 accumulators of 4 lanes).
    ///
    /// # Safety
    /// As [`nt`].
    pub(crate) unsafe fn nt_portable(
        mnk: (usize, usize, usize),
        alpha: f32,
        ab: (&[f32], &[f32]),
        beta: f32,
        c: (*mut f32, usize),
        at: (usize, usize),
    ) {
        nt::<crate::kernels::isa::Portable, { PORTABLE_TILE.0 }, { PORTABLE_TILE.1 }, 4>(mnk, alpha, ab, beta, c, at)
    }

    /// Rows of A × rows of B in the register tile of each tier.
    #[cfg(target_arch = "x86_64")]
    pub(crate) const AVX2_TILE: (usize, usize) = (2, 3);
    pub(crate) const PORTABLE_TILE: (usize, usize) = (2, 1);
}
