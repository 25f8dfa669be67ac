//! Single-precision matrix multiply used by every layer.
//!
//! Row-major `C (m×n) = alpha · op(A) · op(B) + beta · C`, where `op` optionally transposes. The
//! product is split into row blocks of `C` over the rayon pool (so the per-rank thread count set at
//! start-up governs it), each block computed by `matrixmultiply`'s packed micro-kernels.

use rayon::prelude::*;

/// Whether an operand is used as stored or transposed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trans {
    N,
    T,
}

/// `C = alpha · op(A) · op(B) + beta · C`, all row-major; `op(A)` is `m×k`, `op(B)` is `k×n`.
///
/// With `beta == 0`, `C` is overwritten (its old contents, even NaN, are ignored).
#[allow(clippy::too_many_arguments)]
pub fn gemm(
    ta: Trans,
    tb: Trans,
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    a: &[f32],
    b: &[f32],
    beta: f32,
    c: &mut [f32],
) {
    assert_eq!(a.len(), m * k, "gemm: A has {} elements, expected {m}×{k}", a.len());
    assert_eq!(b.len(), k * n, "gemm: B has {} elements, expected {k}×{n}", b.len());
    assert_eq!(c.len(), m * n, "gemm: C has {} elements, expected {m}×{n}", c.len());
    if m == 0 || n == 0 {
        return;
    }
    // Strides of op(A) and op(B) in row-major storage.
    let (rsa, csa) = match ta {
        Trans::N => (k as isize, 1),
        Trans::T => (1, m as isize),
    };
    let (rsb, csb) = match tb {
        Trans::N => (n as isize, 1),
        Trans::T => (1, k as isize),
    };
    let threads = rayon::current_num_threads();
    let flops = m * n * k;
    let blocks = if threads > 1 && flops >= 1 << 18 { threads.min(m.div_ceil(16)).max(1) } else { 1 };
    let rows_per = m.div_ceil(blocks);
    // Only the row block of op(A) changes between blocks; pointers stay inside `a`, `b`, `c`.
    let run = |row0: usize, rows: usize, cblk: &mut [f32]| {
        let a_off = row0 as isize * rsa;
        // SAFETY: the strides describe op(A) (m×k), op(B) (k×n) and the C block (rows×n) exactly
        // within the slices whose lengths were asserted above; blocks of C do not overlap.
        unsafe {
            matrixmultiply::sgemm(
                rows,
                k,
                n,
                alpha,
                a.as_ptr().offset(a_off),
                rsa,
                csa,
                b.as_ptr(),
                rsb,
                csb,
                beta,
                cblk.as_mut_ptr(),
                n as isize,
                1,
            )
        }
    };
    if blocks == 1 {
        run(0, m, c);
    } else {
        c.par_chunks_mut(rows_per * n).enumerate().for_each(|(i, cblk)| run(i * rows_per, cblk.len() / n, cblk));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(ta: Trans, tb: Trans, m: usize, n: usize, k: usize, a: &[f32], b: &[f32]) -> Vec<f32> {
        let at = |i: usize, p: usize| if ta == Trans::N { a[i * k + p] } else { a[p * m + i] };
        let bt = |p: usize, j: usize| if tb == Trans::N { b[p * n + j] } else { b[j * k + p] };
        let mut c = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k).map(|p| at(i, p) * bt(p, j)).sum();
            }
        }
        c
    }

    #[test]
    fn all_transpose_combinations_match_naive() {
        let mut rng = crate::rng::Rng::from_keys(&[3]);
        for &(m, n, k) in &[(1, 1, 1), (5, 7, 3), (70, 33, 65), (129, 64, 40)] {
            let a: Vec<f32> = (0..m * k).map(|_| rng.uniform(1.0)).collect();
            let b: Vec<f32> = (0..k * n).map(|_| rng.uniform(1.0)).collect();
            for ta in [Trans::N, Trans::T] {
                for tb in [Trans::N, Trans::T] {
                    let want = naive(ta, tb, m, n, k, &a, &b);
                    let mut c = vec![f32::NAN; m * n];
                    gemm(ta, tb, m, n, k, 1.0, &a, &b, 0.0, &mut c);
                    for (x, y) in c.iter().zip(&want) {
                        assert!((x - y).abs() < 1e-4, "{ta:?}{tb:?} {m}x{n}x{k}: {x} vs {y}");
                    }
                }
            }
        }
    }
}
