//! How much a split oscillates, for the simulator's tables and the stress tests.

/// How much a run's split oscillates, counted as *reversals*: a rank's batch moving by at least 2%
/// of B (or a quarter of the equal share, where that is less: at scale 2% of B is many shares)
/// one way and then as much the other way at its next such move. Smaller moves are the
/// dead-band's and the rounding's and are not counted. A balancer that chased a rank
/// alternating its speed every iteration would reverse at every iteration (100 per 100).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Reversals {
    /// The move that counts, in samples, at least one.
    big: f64,
    last: Vec<usize>,
    /// Per rank: the sign of its last counted move (0 before one), and its reversals.
    sign: Vec<i8>,
    count: Vec<usize>,
    iterations: usize,
}

impl Reversals {
    pub fn new(global_batch: usize, world: usize) -> Reversals {
        let b = global_batch as f64;
        Reversals { big: (0.02 * b).min(0.25 * b / world.max(1) as f64).max(1.0), ..Reversals::default() }
    }

    /// Counts one iteration's split.
    pub fn record(&mut self, sizes: &[usize]) {
        self.iterations += 1;
        if self.last.len() != sizes.len() {
            self.sign = vec![0; sizes.len()];
            self.count = vec![0; sizes.len()];
        } else {
            for (i, (&b, &a)) in sizes.iter().zip(&self.last).enumerate() {
                let d = b as f64 - a as f64;
                if d.abs() >= self.big {
                    let s = if d > 0.0 { 1 } else { -1 };
                    self.count[i] += (self.sign[i] == -s) as usize;
                    self.sign[i] = s;
                }
            }
        }
        self.last.clear();
        self.last.extend_from_slice(sizes);
    }

    /// The worst rank's reversals per 100 iterations recorded.
    pub fn per_100(&self) -> f64 {
        let worst = self.count.iter().copied().max().unwrap_or(0);
        if self.iterations == 0 {
            0.0
        } else {
            100.0 * worst as f64 / self.iterations as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reversals_count_a_big_move_undone_at_the_next_big_move() {
        // B = 100: moves of 2 or more count; the 1-sample wobble does not.
        let mut r = Reversals::new(100, 2);
        for s in [[50, 50], [53, 47], [54, 46], [51, 49], [51, 49], [50, 50], [52, 48], [60, 40]] {
            r.record(&s);
        }
        // +3, (+1), -3: one reversal; (-1), +2: a second; +8 goes on the same way.
        assert_eq!(r.count, [2, 2]);
        assert_eq!(r.per_100(), 25.0);
        assert_eq!(Reversals::new(10, 2).big, 1.0);
        assert_eq!(Reversals::new(65536, 256).big, 64.0);
        assert_eq!(Reversals::new(100, 2).per_100(), 0.0);
    }
}
