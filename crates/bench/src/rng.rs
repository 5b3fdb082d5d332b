//! A small seeded random number generator (SplitMix64) and the draws the
//! benchmarks need: uniform integers, exponential intervals for Poisson
//! arrivals, choices and shuffles.
//!
//! Invariant: the same seed gives the same sequence on every platform, so a
//! `--seed` reproduces a data set and an arrival schedule exactly. (The
//! sequence differs from NumPy's, so prompts differ from SGLang's for the
//! same seed; the distributions are the same.)

/// SplitMix64: fast, 64-bit state, passes BigCrush; plenty for workloads.
#[derive(Clone, Debug)]
pub struct Rng {
    state: u64,
}

impl Rng {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// A generator for a sub-stream: mixes `seed` and `stream` so that
    /// different streams of one seed are independent.
    pub fn derived(seed: u64, stream: u64) -> Self {
        let mut r = Self::new(seed ^ stream.wrapping_mul(0xA076_1D64_78BD_642F));
        r.next_u64();
        r
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)` with 53 bits of precision.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform integer in `[0, n)`; `0` when `n == 0`.
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            return 0;
        }
        // Lemire's multiply-shift; the bias is below 2^-64 * n, negligible here.
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }

    /// Uniform integer in `[lo, hi]` (inclusive); `lo` when `hi <= lo`.
    pub fn range_inclusive(&mut self, lo: usize, hi: usize) -> usize {
        if hi <= lo {
            return lo;
        }
        lo + self.below((hi - lo) as u64 + 1) as usize
    }

    /// An exponential draw with the given rate (mean `1 / rate`): the gap
    /// between arrivals of a Poisson process.
    pub fn exponential(&mut self, rate: f64) -> f64 {
        // 1 - U is in (0, 1], so the logarithm is finite.
        -(1.0 - self.next_f64()).ln() / rate
    }

    /// Shuffles `xs` in place (Fisher-Yates).
    pub fn shuffle<T>(&mut self, xs: &mut [T]) {
        for i in (1..xs.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            xs.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_sequence() {
        let a: Vec<u64> = {
            let mut r = Rng::new(7);
            (0..5).map(|_| r.next_u64()).collect()
        };
        let b: Vec<u64> = {
            let mut r = Rng::new(7);
            (0..5).map(|_| r.next_u64()).collect()
        };
        assert_eq!(a, b);
        let mut c = Rng::derived(7, 1);
        assert_ne!(a[0], c.next_u64());
    }

    #[test]
    fn ranges_stay_in_bounds_and_cover_them() {
        let mut r = Rng::new(1);
        let mut seen = [false; 5];
        for _ in 0..1000 {
            let x = r.range_inclusive(3, 7);
            assert!((3..=7).contains(&x));
            seen[x - 3] = true;
            let f = r.next_f64();
            assert!((0.0..1.0).contains(&f));
        }
        assert!(seen.iter().all(|&s| s));
        assert_eq!(r.range_inclusive(4, 4), 4);
        assert_eq!(r.below(0), 0);
    }

    #[test]
    fn exponential_mean_matches_rate() {
        let mut r = Rng::new(42);
        let n = 200_000;
        let rate = 4.0;
        let m: f64 = (0..n).map(|_| r.exponential(rate)).sum::<f64>() / n as f64;
        assert!((m - 0.25).abs() < 0.25 * 0.02, "mean {m}");
    }

    #[test]
    fn shuffle_is_a_permutation() {
        let mut r = Rng::new(3);
        let mut v: Vec<u32> = (0..100).collect();
        r.shuffle(&mut v);
        let mut s = v.clone();
        s.sort_unstable();
        assert_eq!(s, (0..100).collect::<Vec<_>>());
        assert_ne!(v, s);
    }
}
