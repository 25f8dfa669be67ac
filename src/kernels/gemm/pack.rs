//! Packing of GEMM operands into the panels the AVX-512 kernel of [`super`] streams: `op(A)`
//! into 12-row panels and `op(B)` into 32-column panels, depth-major and zero-padded. A transposed
//! operand is read 16×16 at a time and turned with register transposes, so every load and store is
//! a full vector whatever the layout.

use super::View;
use std::arch::x86_64::*;

/// Rows of the AVX-512 register tile (broadcast from packed A).
pub(crate) const MR: usize = 12;
/// Columns of the AVX-512 register tile (two 16-lane vectors of packed B).
pub(crate) const NR: usize = 32;

/// Packs rows `i0..i0+mc` × depth `p0..p0+kc` of a transposed op(A) into MR-row panels (`kc·MR`
/// each, depth-major, the last one zero-padded): at each depth a panel's rows are contiguous.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn pack_a_cols(a: View, i0: usize, mc: usize, p0: usize, kc: usize, out: &mut [f32]) {
    for (pi, panel) in out.chunks_exact_mut(kc * MR).take(mc.div_ceil(MR)).enumerate() {
        let lanes = lane_mask(MR.min(mc - pi * MR));
        let first = a.data.as_ptr().add(p0 * a.cs + i0 + pi * MR);
        for p in 0..kc {
            let v = _mm512_maskz_loadu_ps(lanes, first.add(p * a.cs));
            _mm512_mask_storeu_ps(panel.as_mut_ptr().add(p * MR), lane_mask(MR), v);
        }
    }
}

/// Packs depth `p0..p0+kc` × columns `j0..j0+nc` of a row-major op(B) into NR-column panels (`kc·NR`
/// each, depth-major, the last one zero-padded): each depth's 32 columns are contiguous.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn pack_b_rows(b: View, p0: usize, kc: usize, j0: usize, nc: usize, out: &mut [f32]) {
    for (pj, panel) in out.chunks_exact_mut(kc * NR).take(nc.div_ceil(NR)).enumerate() {
        let cols = NR.min(nc - pj * NR);
        let (m0, m1) = (lane_mask(cols), lane_mask(cols.saturating_sub(16)));
        let first = b.data.as_ptr().add(p0 * b.rs + j0 + pj * NR);
        for p in 0..kc {
            let src = first.add(p * b.rs);
            let dst = panel.as_mut_ptr().add(p * NR);
            _mm512_storeu_ps(dst, _mm512_maskz_loadu_ps(m0, src));
            _mm512_storeu_ps(dst.add(16), _mm512_maskz_loadu_ps(m1, src.add(16)));
        }
    }
}

/// [`pack_a_cols`] for a row-major op(A): 16 depths of 12 rows at a time through a register transpose.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn pack_a_rows(a: View, i0: usize, mc: usize, p0: usize, kc: usize, out: &mut [f32]) {
    for (pi, panel) in out.chunks_exact_mut(kc * MR).take(mc.div_ceil(MR)).enumerate() {
        let rows = MR.min(mc - pi * MR);
        let first = a.data.as_ptr().add((i0 + pi * MR) * a.rs + p0);
        for pb in (0..kc).step_by(16) {
            let depth = 16.min(kc - pb);
            let lanes = lane_mask(depth);
            let mut r = [_mm512_setzero_ps(); 16];
            for (i, v) in r.iter_mut().enumerate().take(rows) {
                *v = _mm512_maskz_loadu_ps(lanes, first.add(i * a.rs + pb));
            }
            let t = transpose16(r);
            for (q, v) in t.iter().enumerate().take(depth) {
                _mm512_mask_storeu_ps(panel.as_mut_ptr().add((pb + q) * MR), lane_mask(MR), *v);
            }
        }
    }
}

/// [`pack_b_rows`] for a transposed op(B) (rows of W become columns), through register transposes.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn pack_b_transposed(b: View, p0: usize, kc: usize, j0: usize, nc: usize, out: &mut [f32]) {
    for (pj, panel) in out.chunks_exact_mut(kc * NR).take(nc.div_ceil(NR)).enumerate() {
        for g in 0..NR / 16 {
            let c0 = pj * NR + g * 16;
            let cols = if c0 >= nc { 0 } else { 16.min(nc - c0) };
            let first = b.data.as_ptr().add((j0 + c0) * b.cs + p0);
            for pb in (0..kc).step_by(16) {
                let depth = 16.min(kc - pb);
                let lanes = lane_mask(depth);
                let mut r = [_mm512_setzero_ps(); 16];
                for (i, v) in r.iter_mut().enumerate().take(cols) {
                    *v = _mm512_maskz_loadu_ps(lanes, first.add(i * b.cs + pb));
                }
                let t = transpose16(r);
                for (q, v) in t.iter().enumerate().take(depth) {
                    _mm512_storeu_ps(panel.as_mut_ptr().add((pb + q) * NR + g * 16), *v);
                }
            }
        }
    }
}

fn lane_mask(n: usize) -> __mmask16 {
    if n >= 16 {
        0xffff
    } else {
        ((1u32 << n) - 1) as __mmask16
    }
}

/// 16×16 transpose: lane `j` of output `i` is lane `i` of input `j`.
#[target_feature(enable = "avx512f")]
fn transpose16(r: [__m512; 16]) -> [__m512; 16] {
    let lo = |x, y| _mm512_unpacklo_ps(x, y);
    let hi = |x, y| _mm512_unpackhi_ps(x, y);
    let lo2 = |x: __m512, y: __m512| _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(x), _mm512_castps_pd(y)));
    let hi2 = |x: __m512, y: __m512| _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(x), _mm512_castps_pd(y)));
    let mut t = [_mm512_setzero_ps(); 16];
    for i in 0..8 {
        t[2 * i] = lo(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = hi(r[2 * i], r[2 * i + 1]);
    }
    let mut u = [_mm512_setzero_ps(); 16];
    for q in 0..4 {
        let b = 4 * q;
        u[b] = lo2(t[b], t[b + 2]);
        u[b + 1] = hi2(t[b], t[b + 2]);
        u[b + 2] = lo2(t[b + 1], t[b + 3]);
        u[b + 3] = hi2(t[b + 1], t[b + 3]);
    }
    // u[4q + j] holds, in each 128-bit lane L, column 4L + j of rows 4q..4q+4.
    for h in 0..2 {
        let b = 8 * h;
        for j in 0..4 {
            t[b + j] = _mm512_shuffle_f32x4::<0x88>(u[b + j], u[b + 4 + j]);
            t[b + 4 + j] = _mm512_shuffle_f32x4::<0xdd>(u[b + j], u[b + 4 + j]);
        }
    }
    let mut o = [_mm512_setzero_ps(); 16];
    for j in 0..8 {
        o[j] = _mm512_shuffle_f32x4::<0x88>(t[j], t[8 + j]);
        o[8 + j] = _mm512_shuffle_f32x4::<0xdd>(t[j], t[8 + j]);
    }
    o
}

#[cfg(test)]
#[test]
fn transpose16_transposes() {
    if !std::arch::is_x86_feature_detected!("avx512f") {
        return;
    }
    let m: Vec<f32> = (0..256).map(|v| v as f32).collect();
    let mut out = [0.0f32; 256];
    // SAFETY: AVX-512F detected above; all pointers stay inside the 256-element arrays.
    unsafe {
        let r: [__m512; 16] = std::array::from_fn(|i| _mm512_loadu_ps(m.as_ptr().add(16 * i)));
        for (i, v) in transpose16(r).iter().enumerate() {
            _mm512_storeu_ps(out.as_mut_ptr().add(16 * i), *v);
        }
    }
    for i in 0..16 {
        for j in 0..16 {
            assert_eq!(out[16 * i + j], m[16 * j + i], "({i}, {j})");
        }
    }
}
