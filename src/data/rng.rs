//! Deterministic random streams.
//!
//! Everything random in lbbsp (initialisation, the per-epoch permutation, held-out splits, later dropout
//! masks) is drawn from a [`Rng`] keyed by explicit integers, so every rank derives the same numbers
//! without communicating and a run is reproducible from its recipe seed alone.

/// SplitMix64 finaliser: a bijective 64-bit mix used to derive stream seeds from keys.
pub fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// xoshiro256** generator, seeded through SplitMix64 from a list of keys.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    /// A stream identified by `keys` (e.g. `[seed, epoch]`); different key lists give independent streams.
    pub fn from_keys(keys: &[u64]) -> Self {
        let mut h = 0x6C62_6273_7000_0001u64;
        for &k in keys {
            h = mix64(h ^ mix64(k));
        }
        let mut s = [0u64; 4];
        for (i, slot) in s.iter_mut().enumerate() {
            h = mix64(h.wrapping_add(i as u64));
            *slot = h;
        }
        if s == [0; 4] {
            s[0] = 1;
        }
        Rng { s }
    }

    pub fn next_u64(&mut self) -> u64 {
        let result = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        result
    }

    /// Uniform in `[0, 1)` with 24 bits of precision.
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }

    /// Uniform in `[0, 1)` with 53 bits of precision.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform integer in `0..n` (Lemire's multiply-shift with rejection; unbiased).
    pub fn below(&mut self, n: usize) -> usize {
        assert!(n > 0, "Rng::below(0)");
        let n = n as u64;
        loop {
            let m = (self.next_u64() as u128) * (n as u128);
            let low = m as u64;
            if low >= n.wrapping_neg() % n {
                return (m >> 64) as usize;
            }
        }
    }

    /// Uniform in `[-bound, bound)`.
    pub fn uniform(&mut self, bound: f32) -> f32 {
        (self.next_f32() * 2.0 - 1.0) * bound
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f32 {
        let u1 = self.next_f64().max(f64::MIN_POSITIVE);
        let u2 = self.next_f64();
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    }
}

/// A uniformly random permutation of `0..n` drawn from the stream `keys` (Fisher–Yates).
pub fn permutation(n: usize, keys: &[u64]) -> Vec<usize> {
    let mut rng = Rng::from_keys(keys);
    let mut p: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = rng.below(i + 1);
        p.swap(i, j);
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permutation_is_a_permutation_and_keyed() {
        let p = permutation(1000, &[7, 0]);
        let mut s = p.clone();
        s.sort_unstable();
        assert_eq!(s, (0..1000).collect::<Vec<_>>());
        assert_eq!(p, permutation(1000, &[7, 0]));
        assert_ne!(p, permutation(1000, &[7, 1]));
    }

    #[test]
    fn uniform_floats_are_in_range_and_centred() {
        let mut r = Rng::from_keys(&[1]);
        let xs: Vec<f32> = (0..10_000).map(|_| r.next_f32()).collect();
        assert!(xs.iter().all(|&x| (0.0..1.0).contains(&x)));
        let mean = xs.iter().sum::<f32>() / xs.len() as f32;
        assert!((mean - 0.5).abs() < 0.02, "mean {mean}");
    }
}
