//! Data parallelism (SGLang's `--dp-size`): an [`Engine`](super::Engine)
//! of several scheduler ranks, each a whole scheduler with its own executor,
//! page pool and prefix cache, behind one submit interface.
//!
//! - [`LoadBalance`] picks the rank of each new request (SGLang's
//!   `--load-balance-method`): in turn, or by the fewest requests or tokens
//!   in flight. The in-flight counts are the engine's own (a
//!   [`LoadGuard`] per request stream, released when the stream is
//!   dropped), so a burst of submits spreads at once instead of waiting for
//!   the schedulers to publish their queues.
//! - [`merged_stats`] sums the ranks' counters into one [`EngineStats`]
//!   (rates and ratios are recomputed or averaged, never summed).
//! - [`ImportAffinity`] remembers which rank imported the KV of which token
//!   prefix (prefill/decode disaggregation): a request whose prompt starts
//!   with an imported prefix goes to that rank, whatever the load balance
//!   says, so it matches the prefix instead of computing it again.
//!
//! Invariants: a rank's load counters equal the streams it was given that
//! are still alive; with one rank every function here is the identity. A
//! wrong affinity (a hash collision, an evicted prefix) costs compute,
//! never output: the request computes what its rank does not hold.

use super::EngineStats;
use crate::error::{CoreError, Result};
use crate::kv::prefix_cache::{CacheNamespace, TierStats};
use crate::model::moe::ExpertLoad;
use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt;
use std::hash::{Hash, Hasher};
use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// How requests are spread over data-parallel ranks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LoadBalance {
    /// Each request to the next rank in turn (SGLang's default).
    #[default]
    RoundRobin,
    /// To the rank with the fewest requests in flight.
    ShortestQueue,
    /// To the rank with the fewest tokens (prompt plus `max_new_tokens`) in flight.
    MinimumTokens,
}

impl LoadBalance {
    /// Every method's name, as `--load-balance-method` takes it.
    pub const NAMES: [&'static str; 3] = ["round_robin", "shortest_queue", "minimum_tokens"];

    fn name(self) -> &'static str {
        match self {
            LoadBalance::RoundRobin => Self::NAMES[0],
            LoadBalance::ShortestQueue => Self::NAMES[1],
            LoadBalance::MinimumTokens => Self::NAMES[2],
        }
    }
}

impl fmt::Display for LoadBalance {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for LoadBalance {
    type Err = CoreError;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "round_robin" => LoadBalance::RoundRobin,
            "shortest_queue" => LoadBalance::ShortestQueue,
            "minimum_tokens" => LoadBalance::MinimumTokens,
            other => {
                return Err(CoreError::Config(format!(
                    "unknown load balance method '{other}' (expected one of {})",
                    Self::NAMES.join(", ")
                )));
            }
        })
    }
}

/// What one rank has in flight.
#[derive(Debug, Default)]
pub(super) struct RankLoad {
    requests: AtomicUsize,
    tokens: AtomicUsize,
}

impl RankLoad {
    /// Counts a request of `tokens` until the returned guard drops.
    pub(super) fn take(self: &Arc<Self>, tokens: usize) -> LoadGuard {
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.tokens.fetch_add(tokens, Ordering::Relaxed);
        LoadGuard {
            load: self.clone(),
            tokens,
        }
    }

    fn requests(&self) -> usize {
        self.requests.load(Ordering::Relaxed)
    }

    fn tokens(&self) -> usize {
        self.tokens.load(Ordering::Relaxed)
    }
}

/// One request's share of its rank's load; releases it when dropped.
#[derive(Debug)]
pub(super) struct LoadGuard {
    load: Arc<RankLoad>,
    tokens: usize,
}

impl Drop for LoadGuard {
    fn drop(&mut self) {
        self.load.requests.fetch_sub(1, Ordering::Relaxed);
        self.load.tokens.fetch_sub(self.tokens, Ordering::Relaxed);
    }
}

/// Picks ranks for new requests.
#[derive(Debug, Default)]
pub(super) struct Dispatcher {
    balance: LoadBalance,
    next: AtomicUsize,
    imports: Mutex<ImportAffinity>,
}

impl Dispatcher {
    pub(super) fn new(balance: LoadBalance) -> Self {
        Self {
            balance,
            next: AtomicUsize::new(0),
            imports: Mutex::default(),
        }
    }

    fn imports(&self) -> std::sync::MutexGuard<'_, ImportAffinity> {
        self.imports.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The rank for a request of `prompt` in the namespace `ns` gives
    /// (asked only once some prefix was imported): the rank that imported
    /// the longest prefix of it, else [`Dispatcher::pick`]'s.
    pub(super) fn pick_for(
        &self,
        loads: &[&RankLoad],
        ns: impl FnOnce() -> CacheNamespace,
        prompt: &[u32],
    ) -> usize {
        let affinity = {
            let imports = self.imports();
            if imports.ranks.is_empty() {
                None
            } else {
                imports.rank_for(&ns(), prompt)
            }
        };
        match affinity {
            Some(r) if r < loads.len() => r,
            _ => self.pick(loads),
        }
    }

    /// Notes that `rank` imported the KV of `tokens` in `ns`.
    pub(super) fn imported(&self, ns: &CacheNamespace, tokens: &[u32], rank: usize) {
        self.imports().record(ns, tokens, rank);
    }

    /// The rank for the next request, of `loads` (one per rank, never empty).
    /// Ties go to the lowest rank after the round-robin position, so equal
    /// loads still rotate.
    pub(super) fn pick(&self, loads: &[&RankLoad]) -> usize {
        let n = loads.len().max(1);
        let start = self.next.fetch_add(1, Ordering::Relaxed) % n;
        let key = |r: usize| match self.balance {
            LoadBalance::RoundRobin => 0,
            LoadBalance::ShortestQueue => loads[r].requests(),
            LoadBalance::MinimumTokens => loads[r].tokens(),
        };
        (0..n)
            .map(|i| (start + i) % n)
            .min_by_key(|&r| key(r))
            .unwrap_or(0)
    }
}

/// Entries [`ImportAffinity`] keeps (the oldest go first).
const AFFINITY_ENTRIES: usize = 4096;

/// Which rank imported the KV of which token prefix (see the module doc).
#[derive(Debug, Default)]
pub(super) struct ImportAffinity {
    /// (hash of the namespace and the prefix, prefix length) → rank.
    ranks: HashMap<(u64, usize), usize>,
    /// Keys in insertion order, for the bound.
    order: VecDeque<(u64, usize)>,
    /// The prefix lengths present, with their entry counts.
    lengths: BTreeMap<usize, usize>,
}

impl ImportAffinity {
    fn hasher(ns: &CacheNamespace) -> DefaultHasher {
        let mut h = DefaultHasher::new();
        ns.hash(&mut h);
        h
    }

    /// Notes that `rank` holds the KV of `tokens` in `ns` (a later import
    /// of the same prefix moves it).
    pub(super) fn record(&mut self, ns: &CacheNamespace, tokens: &[u32], rank: usize) {
        if tokens.is_empty() {
            return;
        }
        let mut h = Self::hasher(ns);
        for &t in tokens {
            h.write_u32(t);
        }
        let key = (h.finish(), tokens.len());
        if self.ranks.insert(key, rank).is_none() {
            self.order.push_back(key);
            *self.lengths.entry(key.1).or_default() += 1;
        }
        while self.order.len() > AFFINITY_ENTRIES {
            let Some(old) = self.order.pop_front() else {
                break;
            };
            self.ranks.remove(&old);
            if let Some(n) = self.lengths.get_mut(&old.1) {
                *n -= 1;
                if *n == 0 {
                    self.lengths.remove(&old.1);
                }
            }
        }
    }

    /// The rank holding the longest recorded prefix of `prompt` in `ns`:
    /// one pass over the prompt, a lookup at each recorded length.
    pub(super) fn rank_for(&self, ns: &CacheNamespace, prompt: &[u32]) -> Option<usize> {
        if self.ranks.is_empty() {
            return None;
        }
        let mut h = Self::hasher(ns);
        let (mut hashed, mut best) = (0, None);
        for &len in self.lengths.keys() {
            let Some(more) = prompt.get(hashed..len) else {
                break;
            };
            for &t in more {
                h.write_u32(t);
            }
            hashed = len;
            if let Some(&r) = self.ranks.get(&(h.clone().finish(), len)) {
                best = Some(r);
            }
        }
        best
    }
}

impl TierStats {
    /// Adds `o`'s counters to these.
    fn add(&mut self, o: &TierStats) {
        self.host_tokens += o.host_tokens;
        self.host_capacity_tokens += o.host_capacity_tokens;
        self.host_hit_tokens += o.host_hit_tokens;
        self.storage_hit_tokens += o.storage_hit_tokens;
        self.demoted_tokens += o.demoted_tokens;
        self.storage_read_pages += o.storage_read_pages;
        self.storage_read_bytes += o.storage_read_bytes;
        self.storage_read_seconds += o.storage_read_seconds;
        self.storage_write_pages += o.storage_write_pages;
        self.storage_write_bytes += o.storage_write_bytes;
        self.storage_write_seconds += o.storage_write_seconds;
        self.storage_errors += o.storage_errors;
        self.storage_corrupt += o.storage_corrupt;
    }
}

/// Sums per-layer expert counts (the ranks' layers in the same order).
fn add_expert_load(into: &mut Vec<ExpertLoad>, o: &[ExpertLoad]) {
    for l in o {
        match into.iter_mut().find(|x| x.layer == l.layer) {
            Some(x) => {
                if x.tokens.len() < l.tokens.len() {
                    x.tokens.resize(l.tokens.len(), 0);
                }
                for (a, b) in x.tokens.iter_mut().zip(&l.tokens) {
                    *a += b;
                }
            }
            None => into.push(l.clone()),
        }
    }
}

/// The ranks' counters as one engine's: counts and capacities summed, the
/// usage recomputed, per-rank rates (cache hit rate, new-token ratio,
/// acceptance length, draft budget) averaged, throughput summed.
pub(super) fn merged_stats(ranks: &[EngineStats]) -> EngineStats {
    let [first, rest @ ..] = ranks else {
        return EngineStats::default();
    };
    if rest.is_empty() {
        return first.clone();
    }
    let mut m = first.clone();
    for s in rest {
        m.num_running_reqs += s.num_running_reqs;
        m.num_queue_reqs += s.num_queue_reqs;
        m.num_queue_tokens += s.num_queue_tokens;
        m.num_used_tokens += s.num_used_tokens;
        m.max_total_tokens += s.max_total_tokens;
        m.used_state_slots += s.used_state_slots;
        m.max_state_slots += s.max_state_slots;
        m.cache_hit_rate += s.cache_hit_rate;
        m.gen_throughput += s.gen_throughput;
        m.prompt_tokens_total += s.prompt_tokens_total;
        m.generation_tokens_total += s.generation_tokens_total;
        m.cached_tokens_total += s.cached_tokens_total;
        m.num_requests_total += s.num_requests_total;
        m.num_aborted_requests_total += s.num_aborted_requests_total;
        m.num_retracted_reqs_total += s.num_retracted_reqs_total;
        m.cache_tokens += s.cache_tokens;
        m.evictable_tokens += s.evictable_tokens;
        m.held_tokens += s.held_tokens;
        m.new_token_ratio += s.new_token_ratio;
        m.iterations += s.iterations;
        m.jump_forward_tokens_total += s.jump_forward_tokens_total;
        m.given_first_tokens_total += s.given_first_tokens_total;
        m.overlap_admitted_total += s.overlap_admitted_total;
        m.constrained_tokens_total += s.constrained_tokens_total;
        m.spec_verify_ct_total += s.spec_verify_ct_total;
        m.spec_draft_tokens_total += s.spec_draft_tokens_total;
        m.spec_accepted_tokens_total += s.spec_accepted_tokens_total;
        m.spec_draft_tokens_skipped_total += s.spec_draft_tokens_skipped_total;
        m.spec_accept_length += s.spec_accept_length;
        m.spec_draft_budget += s.spec_draft_budget;
        m.tiers.add(&s.tiers);
        m.kv_copy.add(&s.kv_copy);
        m.lora_max_step_adapters = m.lora_max_step_adapters.max(s.lora_max_step_adapters);
        add_expert_load(&mut m.expert_load, &s.expert_load);
    }
    let n = ranks.len() as f64;
    m.cache_hit_rate /= n;
    m.new_token_ratio /= n;
    m.spec_accept_length /= n;
    m.spec_draft_budget /= n;
    m.token_usage = if m.max_total_tokens == 0 {
        0.0
    } else {
        m.num_used_tokens as f64 / m.max_total_tokens as f64
    };
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_imported_prefix_picks_the_rank() {
        let mut a = ImportAffinity::default();
        let ns = CacheNamespace::default();
        let salted = CacheNamespace::new(None, Some("tenant"));
        let prompt: Vec<u32> = (0..40).collect();
        assert_eq!(a.rank_for(&ns, &prompt), None);
        a.record(&ns, &prompt[..16], 1);
        a.record(&ns, &prompt[..32], 0);
        a.record(&ns, &[7, 7, 7], 1);
        assert_eq!(a.rank_for(&ns, &prompt), Some(0), "the 32-token prefix");
        assert_eq!(a.rank_for(&ns, &prompt[..20]), Some(1), "the 16-token one");
        assert_eq!(a.rank_for(&ns, &prompt[..10]), None, "shorter than any");
        assert_eq!(a.rank_for(&salted, &prompt), None, "another namespace");
        let mut other = prompt.clone();
        other[3] = 999;
        assert_eq!(a.rank_for(&ns, &other), None, "another prefix");
        // A later import of the same prefix moves it.
        a.record(&ns, &prompt[..32], 1);
        assert_eq!(a.rank_for(&ns, &prompt), Some(1));
        // The oldest entries go first.
        for i in 0..AFFINITY_ENTRIES as u32 {
            a.record(&ns, &[100_000 + i, 5], 0);
        }
        assert_eq!(a.rank_for(&ns, &prompt), None);
        assert_eq!(a.ranks.len(), AFFINITY_ENTRIES);
        assert_eq!(a.order.len(), AFFINITY_ENTRIES);
        assert_eq!(a.lengths.values().sum::<usize>(), AFFINITY_ENTRIES);
        assert_eq!(a.rank_for(&ns, &[100_000 + 17, 5, 9]), Some(0));
    }

    #[test]
    fn names_round_trip_and_unknown_ones_are_refused() {
        for name in LoadBalance::NAMES {
            assert_eq!(name.parse::<LoadBalance>().unwrap().to_string(), name);
        }
        let e = "least_loaded".parse::<LoadBalance>().unwrap_err();
        assert!(e.to_string().contains("round_robin, shortest_queue"), "{e}");
    }

    #[test]
    fn round_robin_rotates_and_the_others_follow_the_load() {
        let loads: Vec<Arc<RankLoad>> = (0..3).map(|_| Arc::default()).collect();
        fn view(l: &[Arc<RankLoad>]) -> Vec<&RankLoad> {
            l.iter().map(|x| &**x).collect()
        }
        let rr = Dispatcher::new(LoadBalance::RoundRobin);
        let picks: Vec<usize> = (0..6).map(|_| rr.pick(&view(&loads))).collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2]);

        // Requests held by rank 0 and 1: the shortest queue is rank 2 until
        // it holds as many.
        let sq = Dispatcher::new(LoadBalance::ShortestQueue);
        let _a = loads[0].take(100);
        let _b = loads[1].take(1);
        assert_eq!(sq.pick(&view(&loads)), 2);
        let c = loads[2].take(1);
        let p = sq.pick(&view(&loads));
        assert!(p < 3);
        // By tokens, rank 0's 100 lose to ranks 1 and 2's one each.
        let mt = Dispatcher::new(LoadBalance::MinimumTokens);
        for _ in 0..4 {
            assert_ne!(mt.pick(&view(&loads)), 0);
        }
        drop(c);
        assert_eq!(loads[2].requests(), 0);
        assert_eq!(loads[2].tokens(), 0);
        assert_eq!(mt.pick(&view(&loads)), 2);
    }

    #[test]
    fn merged_stats_sum_counts_and_recompute_usage() {
        let a = EngineStats {
            num_running_reqs: 2,
            num_used_tokens: 30,
            max_total_tokens: 100,
            token_usage: 0.3,
            cache_hit_rate: 0.5,
            generation_tokens_total: 7,
            expert_load: vec![ExpertLoad {
                layer: 1,
                tokens: vec![1, 2],
            }],
            ..Default::default()
        };
        let b = EngineStats {
            num_running_reqs: 1,
            num_used_tokens: 10,
            max_total_tokens: 100,
            token_usage: 0.1,
            cache_hit_rate: 0.0,
            generation_tokens_total: 5,
            expert_load: vec![ExpertLoad {
                layer: 1,
                tokens: vec![3, 4],
            }],
            ..Default::default()
        };
        assert_eq!(merged_stats(std::slice::from_ref(&a)), a);
        let m = merged_stats(&[a, b]);
        assert_eq!(m.num_running_reqs, 3);
        assert_eq!(m.max_total_tokens, 200);
        assert!((m.token_usage - 0.2).abs() < 1e-12);
        assert!((m.cache_hit_rate - 0.25).abs() < 1e-12);
        assert_eq!(m.generation_tokens_total, 12);
        assert_eq!(m.expert_load[0].tokens, [4, 6]);
    }
}
