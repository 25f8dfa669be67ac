//! The sharder: which samples each rank processes.
//!
//! Every epoch all ranks draw the same permutation of the training set from `(seed, epoch)`.
//! Iteration `t` covers the global batch `perm[t·B .. (t+1)·B]` (the last one may be shorter, so
//! every sample is used exactly once per epoch), and rank `i` takes the contiguous slice of `b_i` of
//! those indices that starts after the slices of ranks `0..i`. Which rank sees a sample changes
//! with the batch sizes; which samples form the global batch never does.

use std::ops::Range;

/// The global batches of one epoch.
#[derive(Debug, Clone)]
pub struct EpochPlan {
    perm: Vec<usize>,
    global_batch: usize,
}

impl EpochPlan {
    pub fn new(n: usize, global_batch: usize, seed: u64, epoch: u64) -> EpochPlan {
        assert!(global_batch > 0);
        EpochPlan { perm: crate::data::rng::permutation(n, &[seed, 0xE90C, epoch]), global_batch }
    }
    /// Iterations in the epoch (the last batch may be partial).
    pub fn iterations(&self) -> usize {
        self.perm.len().div_ceil(self.global_batch)
    }
    /// Dataset indices of the global batch of iteration `t`.
    pub fn batch(&self, t: usize) -> &[usize] {
        let start = t * self.global_batch;
        &self.perm[start..(start + self.global_batch).min(self.perm.len())]
    }
}

/// Rank `rank`'s range within a global batch split as `sizes`.
pub fn slice_for(sizes: &[usize], rank: usize) -> Range<usize> {
    let start: usize = sizes[..rank].iter().sum();
    start..start + sizes[rank]
}

/// `total` split over `ranks` as evenly as possible, the remainder going to the lowest ranks.
pub fn equal_split(total: usize, ranks: usize) -> Vec<usize> {
    (0..ranks).map(|i| total / ranks + usize::from(i < total % ranks)).collect()
}

/// Scales `sizes` to sum to `total` keeping their proportions (largest-remainder rounding, ties to
/// the lower rank). Used for the short last batch of an epoch. Zero weights everywhere give an equal split.
pub fn rescale(sizes: &[usize], total: usize) -> Vec<usize> {
    let sum: usize = sizes.iter().sum();
    if sum == 0 {
        return equal_split(total, sizes.len());
    }
    let mut out: Vec<usize> = sizes.iter().map(|&s| s * total / sum).collect();
    let mut rem: Vec<(usize, usize)> = sizes.iter().enumerate().map(|(i, &s)| ((s * total) % sum, i)).collect();
    rem.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    let short = total - out.iter().sum::<usize>();
    for &(_, i) in rem.iter().take(short) {
        out[i] += 1;
    }
    out
}

/// [`rescale`] that keeps rank `i` at `lows[i]` or more wherever `total` allows it: each rank
/// keeps its lower bound and the rest of `total` is shared in proportion to what every size holds
/// above its bound. A full batch keeps its split. When `total` is below the bounds' sum (a batch
/// shorter than the ranks), some rank must go below its bound, and the plain proportional split is
/// used.
pub fn rescale_above(sizes: &[usize], total: usize, lows: &[usize]) -> Vec<usize> {
    assert_eq!(sizes.len(), lows.len(), "one lower bound per rank");
    let floor: usize = lows.iter().sum();
    if total < floor || sizes.iter().zip(lows).any(|(s, l)| s < l) {
        return rescale(sizes, total);
    }
    let above: Vec<usize> = sizes.iter().zip(lows).map(|(s, l)| s - l).collect();
    rescale(&above, total - floor).iter().zip(lows).map(|(a, l)| a + l).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_sample_once_per_epoch() {
        let plan = EpochPlan::new(1003, 128, 5, 2);
        assert_eq!(plan.iterations(), 8);
        let mut seen = vec![0; 1003];
        for t in 0..plan.iterations() {
            let batch = plan.batch(t);
            let sizes = equal_split(batch.len(), 3);
            for r in 0..3 {
                for &i in &batch[slice_for(&sizes, r)] {
                    seen[i] += 1;
                }
            }
        }
        assert!(seen.iter().all(|&c| c == 1));
    }

    #[test]
    fn every_sample_once_with_changing_sizes() {
        let mut rng = crate::data::rng::Rng::from_keys(&[11]);
        let plan = EpochPlan::new(777, 64, 3, 0);
        let mut seen = vec![0; 777];
        for t in 0..plan.iterations() {
            let batch = plan.batch(t);
            let raw: Vec<usize> = (0..4).map(|_| 1 + rng.below(40)).collect();
            let sizes = rescale(&raw, batch.len());
            assert_eq!(sizes.iter().sum::<usize>(), batch.len());
            for r in 0..4 {
                for &i in &batch[slice_for(&sizes, r)] {
                    seen[i] += 1;
                }
            }
        }
        assert!(seen.iter().all(|&c| c == 1));
    }

    #[test]
    fn splits() {
        assert_eq!(equal_split(10, 3), vec![4, 3, 3]);
        assert_eq!(slice_for(&[4, 3, 3], 2), 7..10);
        assert_eq!(rescale(&[64, 32, 32], 10), vec![5, 3, 2]);
        assert_eq!(rescale(&[0, 0], 5), vec![3, 2]);
        assert_eq!(rescale(&[7, 1, 13], 21), vec![7, 1, 13], "a full batch keeps its split");
        for total in 0..50 {
            assert_eq!(rescale(&[7, 1, 13], total).iter().sum::<usize>(), total);
        }
    }

    #[test]
    fn a_short_batch_keeps_every_rank_at_its_bound() {
        // Proportional rounding alone gives the last two 1-sample ranks nothing of 96.
        let sizes = [121, 1, 1, 1, 1, 1, 1, 1];
        assert_eq!(rescale(&sizes, 96), vec![91, 1, 1, 1, 1, 1, 0, 0]);
        let kept = rescale_above(&sizes, 96, &[1; 8]);
        assert_eq!(kept.iter().sum::<usize>(), 96);
        assert!(kept.iter().all(|&b| b >= 1), "{kept:?}");
        assert_eq!(rescale_above(&sizes, 128, &[1; 8]), sizes, "a full batch keeps its split");
        for total in 0..=128 {
            let got = rescale_above(&sizes, total, &[1; 8]);
            assert_eq!(got.iter().sum::<usize>(), total);
            assert!(got.iter().zip(&sizes).all(|(g, s)| g <= s), "a shorter batch grows no rank: {got:?}");
            if total >= 8 {
                assert!(got.iter().all(|&b| b >= 1), "{total}: {got:?}");
            }
        }
    }
}
