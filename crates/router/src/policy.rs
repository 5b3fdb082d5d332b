//! Routing policies: which worker takes a request.
//!
//! The choice is a pure function of the candidates' state (in-flight load,
//! how much of the request text each worker's tree matches, tree sizes) and
//! of a random source, so every rule is unit-tested without a network.
//! Candidates are the workers that may take a request now (healthy, circuit
//! closed or probing, not already tried for this request); the slice is
//! never empty when a policy is asked.
//!
//! `cache_aware` is SGLang's: when the loads are imbalanced (max − min above
//! `balance_abs_threshold` and max above `balance_rel_threshold` × min) the
//! least loaded worker wins; otherwise the worker whose tree matches the
//! longest prefix wins if that prefix is more than `cache_threshold` of the
//! text, else the worker with the smallest tree (the most room). With
//! `max_load_factor` c (bounded load, beyond SGLang) no worker whose
//! in-flight load would exceed ⌈c × (total + 1) / n⌉ is chosen for its
//! cache: the best match among those under the bound wins instead, so one
//! hot prefix spreads over several workers rather than melting one.

use serde::Serialize;

/// A routing policy (`--policy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyKind {
    /// Prefix affinity through approximate trees, with load balancing.
    #[value(name = "cache_aware")]
    CacheAware,
    /// Two random workers, the less loaded wins.
    #[value(name = "power_of_two")]
    PowerOfTwo,
    /// Workers in turn.
    #[value(name = "round_robin")]
    RoundRobin,
    /// A uniformly random worker.
    #[value(name = "random")]
    Random,
}

impl PolicyKind {
    /// The name used on the command line and in metrics.
    pub fn name(self) -> &'static str {
        match self {
            Self::CacheAware => "cache_aware",
            Self::PowerOfTwo => "power_of_two",
            Self::RoundRobin => "round_robin",
            Self::Random => "random",
        }
    }
}

/// Why a worker was chosen (the `decision` label of the routing metric).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// cache_aware: the best prefix match was above the threshold.
    CacheHit,
    /// cache_aware: no match above the threshold; the smallest tree won.
    CacheMiss,
    /// cache_aware: loads were imbalanced; the least loaded won.
    Balance,
    /// cache_aware: the best match was over the load bound; another won.
    BoundedLoad,
    /// power_of_two.
    PowerOfTwo,
    /// round_robin.
    RoundRobin,
    /// random.
    Random,
}

impl Decision {
    /// The metric label.
    pub fn name(self) -> &'static str {
        match self {
            Self::CacheHit => "cache_hit",
            Self::CacheMiss => "cache_miss",
            Self::Balance => "balance",
            Self::BoundedLoad => "bounded_load",
            Self::PowerOfTwo => "power_of_two",
            Self::RoundRobin => "round_robin",
            Self::Random => "random",
        }
    }
}

/// cache_aware's thresholds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CacheAwareSettings {
    /// Minimum matched fraction of the text for cache affinity.
    pub cache_threshold: f64,
    /// Imbalance needs max − min above this many in-flight requests...
    pub balance_abs_threshold: usize,
    /// ...and max above this multiple of min.
    pub balance_rel_threshold: f64,
    /// Bounded load: no worker above this multiple of the mean (None: off).
    pub max_load_factor: Option<f64>,
}

/// What a policy sees of one candidate.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CandidateState {
    /// Requests in flight on it through this router.
    pub load: usize,
    /// Characters of the request text its tree matches (cache_aware only).
    pub matched: usize,
    /// Characters in its tree (cache_aware only).
    pub tree_size: usize,
}

/// A small xorshift generator: routing needs speed and spread, not secrecy.
#[derive(Debug)]
pub struct Rng(u64);

impl Rng {
    /// Seeded (a zero seed is replaced: xorshift has a fixed point there).
    pub fn new(seed: u64) -> Self {
        Self(seed.max(1))
    }

    /// The next value.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn least_loaded(c: &[CandidateState], among: impl Iterator<Item = usize>) -> Option<usize> {
    among.min_by_key(|&i| (c[i].load, i))
}

/// Whether the loads are imbalanced by SGLang's two thresholds.
pub fn imbalanced(c: &[CandidateState], s: &CacheAwareSettings) -> bool {
    let (Some(max), Some(min)) = (
        c.iter().map(|x| x.load).max(),
        c.iter().map(|x| x.load).min(),
    ) else {
        return false;
    };
    max - min > s.balance_abs_threshold && max as f64 > s.balance_rel_threshold * min as f64
}

/// The largest load a worker may reach under the bound, if there is one.
pub fn load_bound(c: &[CandidateState], s: &CacheAwareSettings) -> Option<usize> {
    let f = s.max_load_factor?;
    let total: usize = c.iter().map(|x| x.load).sum();
    Some((f * (total + 1) as f64 / c.len().max(1) as f64).ceil() as usize)
}

/// cache_aware's choice for a text of `text_len` characters (module doc).
pub fn cache_aware(
    c: &[CandidateState],
    text_len: usize,
    s: &CacheAwareSettings,
) -> (usize, Decision) {
    if c.len() <= 1 {
        return (0, Decision::CacheHit);
    }
    if imbalanced(c, s) {
        return (least_loaded(c, 0..c.len()).unwrap_or(0), Decision::Balance);
    }
    let bound = load_bound(c, s);
    let fits = |i: usize| bound.is_none_or(|b| c[i].load < b);
    let rate = |i: usize| {
        if text_len == 0 {
            0.0
        } else {
            c[i].matched as f64 / text_len as f64
        }
    };
    // Best match first; among equal matches the less loaded, then the first.
    let by_match = |i: &usize| (std::cmp::Reverse(c[*i].matched), c[*i].load, *i);
    let best = (0..c.len()).min_by_key(by_match).unwrap_or(0);
    if rate(best) > s.cache_threshold {
        if fits(best) {
            return (best, Decision::CacheHit);
        }
        let next = (0..c.len())
            .filter(|&i| fits(i))
            .min_by_key(by_match)
            .unwrap_or(best);
        return (next, Decision::BoundedLoad);
    }
    let smallest = (0..c.len())
        .filter(|&i| fits(i))
        .min_by_key(|&i| (c[i].tree_size, c[i].load, i))
        .unwrap_or(0);
    (smallest, Decision::CacheMiss)
}

/// power_of_two's choice: two distinct random candidates, the less loaded.
pub fn power_of_two(c: &[CandidateState], rng: &mut Rng) -> usize {
    if c.len() <= 1 {
        return 0;
    }
    let a = rng.below(c.len());
    let mut b = rng.below(c.len() - 1);
    if b >= a {
        b += 1;
    }
    if c[b].load < c[a].load { b } else { a }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn st(load: usize, matched: usize, tree_size: usize) -> CandidateState {
        CandidateState {
            load,
            matched,
            tree_size,
        }
    }

    const SGLANG: CacheAwareSettings = CacheAwareSettings {
        cache_threshold: 0.3,
        balance_abs_threshold: 64,
        balance_rel_threshold: 1.5,
        max_load_factor: None,
    };

    #[test]
    fn a_match_above_the_threshold_wins() {
        let c = [st(0, 10, 50), st(3, 80, 90), st(0, 20, 10)];
        assert_eq!(cache_aware(&c, 100, &SGLANG), (1, Decision::CacheHit));
    }

    #[test]
    fn below_the_threshold_the_smallest_tree_wins() {
        let c = [st(0, 10, 50), st(0, 30, 90), st(5, 20, 10)];
        assert_eq!(cache_aware(&c, 100, &SGLANG), (2, Decision::CacheMiss));
        // An empty text matches nothing.
        assert_eq!(cache_aware(&c, 0, &SGLANG).1, Decision::CacheMiss);
    }

    #[test]
    fn imbalance_overrides_the_cache() {
        // 100 − 10 > 64 and 100 > 1.5 × 10.
        let c = [st(100, 100, 5), st(10, 0, 5), st(50, 0, 5)];
        assert_eq!(cache_aware(&c, 100, &SGLANG), (1, Decision::Balance));
        // Both thresholds are needed: 100 − 40 = 60 is not above 64.
        let c = [st(100, 100, 5), st(40, 0, 5)];
        assert_eq!(cache_aware(&c, 100, &SGLANG), (0, Decision::CacheHit));
        // 200 − 150 ≤ 64 too, and 200 < 1.5 × 150.
        let c = [st(200, 100, 5), st(150, 0, 5)];
        assert!(!imbalanced(&c, &SGLANG));
    }

    #[test]
    fn bounded_load_moves_a_hot_prefix_to_the_next_best_worker() {
        let s = CacheAwareSettings {
            max_load_factor: Some(1.25),
            ..SGLANG
        };
        // Total 6, bound ⌈1.25 × 7 / 3⌉ = 3: worker 0 (load 4) is full.
        let c = [st(4, 100, 10), st(1, 50, 10), st(1, 0, 10)];
        assert_eq!(load_bound(&c, &s), Some(3));
        assert_eq!(cache_aware(&c, 100, &s), (1, Decision::BoundedLoad));
        // Without the bound the hot worker keeps it.
        assert_eq!(cache_aware(&c, 100, &SGLANG), (0, Decision::CacheHit));
        // Under the bound the cache decides as usual.
        let c = [st(2, 100, 10), st(2, 50, 10), st(2, 0, 10)];
        assert_eq!(cache_aware(&c, 100, &s), (0, Decision::CacheHit));
    }

    #[test]
    fn a_hot_prefix_never_exceeds_the_bound() {
        // Route 30 concurrent requests of one prefix: the tree of the chosen
        // worker then matches it fully.
        let s = CacheAwareSettings {
            max_load_factor: Some(1.25),
            ..SGLANG
        };
        let mut c = [st(0, 0, 0); 3];
        for _ in 0..30 {
            let bound = load_bound(&c, &s).unwrap_or(usize::MAX);
            let (i, _) = cache_aware(&c, 100, &s);
            assert!(c[i].load < bound);
            c[i].load += 1;
            c[i].matched = 100;
            c[i].tree_size = 100;
        }
        let max = c.iter().map(|x| x.load).max().unwrap_or(0);
        assert!(max <= 13, "{c:?}");
        assert!(c.iter().all(|x| x.load > 0), "{c:?}");
    }

    #[test]
    fn power_of_two_takes_the_less_loaded_of_two_distinct() {
        let mut rng = Rng::new(7);
        let c = [st(5, 0, 0), st(0, 0, 0)];
        for _ in 0..20 {
            assert_eq!(power_of_two(&c, &mut rng), 1);
        }
        let c = [st(1, 0, 0), st(1, 0, 0), st(9, 0, 0)];
        let mut seen = [0; 3];
        for _ in 0..300 {
            seen[power_of_two(&c, &mut rng)] += 1;
        }
        assert_eq!(seen[2], 0);
        assert!(seen[0] > 50 && seen[1] > 50, "{seen:?}");
    }

    #[test]
    fn rng_spreads() {
        let mut rng = Rng::new(0);
        let mut seen = [0; 4];
        for _ in 0..4000 {
            seen[rng.below(4)] += 1;
        }
        assert!(seen.iter().all(|&n| n > 800), "{seen:?}");
        assert!((0.0..1.0).contains(&rng.unit()));
    }
}
