//! The split: integer batch sizes with `Σ b_i = B` within per-rank bounds that minimise the
//! slowest rank's predicted time ([`equalize`]), for lines `t = α + β·b` and any other increasing
//! cost ([`Cost`]).
//!
//! The continuous optimum sets every unconstrained rank to the same finishing time `T` (Newton's
//! steps within a bisection's bracket), and rounding hands the leftover samples one by one to the
//! ranks whose predicted time grows least. Everything here is a pure function of its inputs, so
//! every rank computes bit-identical sizes (f64 arithmetic in a fixed order; Rust never contracts
//! it into FMAs behind our back).

use serde::{Deserialize, Serialize};
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// A fitted compute-time line `t(b) = alpha + beta·b` (seconds).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Line {
    pub alpha: f64,
    pub beta: f64,
}

impl Line {
    pub fn at(&self, b: usize) -> f64 {
        self.at_f(b as f64)
    }

    /// The line `m` times slower: fixed and per-sample costs stretched alike.
    pub fn scaled(&self, m: f64) -> Line {
        Line { alpha: self.alpha * m, beta: self.beta * m }
    }
}

/// The slowest predicted time of a split.
pub fn predicted_max(lines: &[Line], sizes: &[usize]) -> f64 {
    lines.iter().zip(sizes).map(|(l, &b)| l.at(b)).fold(f64::NEG_INFINITY, f64::max)
}

/// A rank's compute time as a function of its batch: increasing in `b`.
pub trait Cost {
    /// Seconds to compute `b` samples.
    fn at_f(&self, b: f64) -> f64;
    /// The (fractional) size computed in `t` seconds: the inverse of [`Cost::at_f`].
    fn size_at(&self, t: f64) -> f64;
    /// Samples per second at `t` seconds (the slope of [`Cost::size_at`]; 0 where it is flat).
    fn rate_at(&self, t: f64) -> f64;
}

impl Cost for Line {
    fn at_f(&self, b: f64) -> f64 {
        self.alpha + self.beta * b
    }

    fn size_at(&self, t: f64) -> f64 {
        (t - self.alpha) / self.beta
    }

    fn rate_at(&self, _t: f64) -> f64 {
        1.0 / self.beta
    }
}

/// Integer sizes with `Σ b_i = total` and `bounds[i].0 ≤ b_i ≤ bounds[i].1` that minimise the
/// predicted slowest time (up to one sample of rounding per rank). Requires `Σ lo ≤ total ≤ Σ hi`
/// and `beta > 0` on every line.
pub fn equalize(lines: &[Line], total: usize, bounds: &[(usize, usize)]) -> Vec<usize> {
    equalize_by(lines, total, bounds)
}

/// [`equalize`] for any increasing costs.
pub fn equalize_by<C: Cost>(lines: &[C], total: usize, bounds: &[(usize, usize)]) -> Vec<usize> {
    let n = lines.len();
    assert_eq!(bounds.len(), n);
    let (lo_sum, hi_sum) = bounds.iter().fold((0, 0), |s, b| (s.0 + b.0, s.1 + b.1));
    assert!(lo_sum <= total && total <= hi_sum, "no split of {total} within the bounds");
    let t_lo = finishing_time(lines, total, bounds);
    let at = |t: f64, i: usize| lines[i].size_at(t).clamp(bounds[i].0 as f64, bounds[i].1 as f64);
    let mut sizes: Vec<usize> =
        (0..n).map(|i| (at(t_lo, i).floor() as usize).clamp(bounds[i].0, bounds[i].1)).collect();
    // Floors lose < 1 per rank, so at most n samples remain (more only where a cost's inverse is
    // flat). They go one at a time to the rank whose predicted time after taking one more is
    // smallest (ties to the lower rank): for increasing per-rank costs this greedy fill reaches
    // the optimal integer max. Usually each of those ranks takes one: the `left` smallest
    // next-sample times are then found by selection, and the heap is needed only when some rank's
    // second sample would come before them.
    let mut left = total.saturating_sub(sizes.iter().sum::<usize>());
    if left == 0 {
        return sizes;
    }
    let key = |i: usize, s: usize| (ordered(lines[i].at_f((s + 1) as f64)), i);
    let mut next: Vec<(u64, usize)> = (0..n).filter(|&i| sizes[i] < bounds[i].1).map(|i| key(i, sizes[i])).collect();
    if left <= next.len() {
        let (chosen, pivot, _) = next.select_nth_unstable(left - 1);
        let pivot = *pivot;
        let second_later =
            chosen.iter().chain([&pivot]).all(|&(_, i)| sizes[i] + 1 >= bounds[i].1 || key(i, sizes[i] + 1) > pivot);
        if second_later {
            for &(_, i) in chosen.iter().chain([&pivot]) {
                sizes[i] += 1;
            }
            return sizes;
        }
    }
    let mut heap: BinaryHeap<Reverse<(u64, usize)>> = next.into_iter().map(Reverse).collect();
    while left > 0 {
        let Reverse((_, i)) = heap.pop().expect("Σ hi ≥ total leaves a rank with room");
        sizes[i] += 1;
        left -= 1;
        if sizes[i] < bounds[i].1 {
            heap.push(Reverse(key(i, sizes[i])));
        }
    }
    sizes
}

/// The continuous optimum's finishing time, from below: a `T` whose sizes `b_i(T) = clamp((T −
/// α_i)/β_i, lo_i, hi_i)` sum to less than `total` by at most a sample (or within a relative 1e-9
/// of the optimum).
fn finishing_time<C: Cost>(lines: &[C], total: usize, bounds: &[(usize, usize)]) -> f64 {
    // Continuous sizes at finishing time T: b_i(T) = clamp(size_at_i(T), lo_i, hi_i), monotone in
    // T (piecewise linear for lines). Returns Σ b_i(T) and its slope over the unclamped ranks.
    let sum_at = |t: f64| {
        let (mut sum, mut slope) = (0.0, 0.0);
        for (l, &(lo, hi)) in lines.iter().zip(bounds) {
            let raw = l.size_at(t);
            sum += raw.clamp(lo as f64, hi as f64);
            if raw > lo as f64 && raw < hi as f64 {
                slope += l.rate_at(t);
            }
        }
        (sum, slope)
    };
    let (mut t_lo, mut t_hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for (l, b) in lines.iter().zip(bounds) {
        t_lo = t_lo.min(l.at_f(b.0 as f64));
        t_hi = t_hi.max(l.at_f(b.1 as f64));
    }
    // Newton's steps aimed half a sample short of B land on a time just below the optimum once the
    // clamped set is right (the sum is linear between its kinks); a step outside the bracket
    // bisects instead. Done once the sum is within a sample of B from below, or the bracket is a
    // relative 1e-9 wide (sizes then move by far less than a sample).
    let target = total as f64;
    let mut t = t_lo;
    for _ in 0..100 {
        let (sum, slope) = sum_at(t);
        if sum < target {
            t_lo = t_lo.max(t);
            if sum >= target - 1.0 {
                break;
            }
        } else {
            t_hi = t_hi.min(t);
        }
        if t_hi - t_lo <= 1e-9 * t_hi.abs() {
            break;
        }
        let newton = t + (target - 0.5 - sum) / slope;
        t = if slope > 0.0 && newton > t_lo && newton < t_hi { newton } else { 0.5 * (t_lo + t_hi) };
        if t <= t_lo || t >= t_hi {
            break;
        }
    }
    t_lo
}

/// A key whose order is `f64::total_cmp`'s, for the heap: the sign bit flips the rest.
fn ordered(x: f64) -> u64 {
    x.to_bits() ^ ((x.to_bits() as i64 >> 63) as u64 | 1 << 63)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_lines_give_equal_split() {
        let l = vec![Line { alpha: 0.0, beta: 1.0 }; 3];
        assert_eq!(equalize(&l, 10, &[(1, 10); 3]), vec![4, 3, 3]);
    }

    #[test]
    fn three_times_slower_rank_gets_a_quarter() {
        let l = [Line { alpha: 0.0, beta: 1.0 }, Line { alpha: 0.0, beta: 3.0 }];
        assert_eq!(equalize(&l, 128, &[(1, 128); 2]), vec![96, 32]);
    }
}
