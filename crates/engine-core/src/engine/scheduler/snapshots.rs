//! Recurrent-state snapshots of cached prefixes (a hybrid model's prefix
//! reuse), and the scheduler's handling of recurrent state: a running
//! request's slot, the snapshots its steps take and keep, the match of a
//! prefix up to its deepest snapshot, and the per-draft states of NGRAM
//! verification.
//!
//! The radix cache keeps the attention layers' pages of a prefix; the
//! recurrent layers need their state exactly at the prefix's end. A
//! snapshot is a state slot holding every recurrent layer's state after a
//! prefix that ends on a page boundary, keyed by the namespace and the
//! prefix's tokens. A prefix is reusable up to the deepest page boundary
//! where the pages are cached and a snapshot exists.
//!
//! Invariants: an entry's slot is written once, by the step that took the
//! snapshot, before the entry is inserted (a step's snapshot is kept only
//! after the step succeeded); when the snapshot slots run out, entries are
//! evicted in the radix cache's eviction order (`--radix-eviction-policy`,
//! over the same access times, hit counts and priorities it keeps for its
//! nodes; least recently used without one), and an entry's slot returns to
//! the pool when its last holder (the store, or a request restoring from
//! it) drops it.

use super::{PrefillEntry, Scheduler};
use crate::engine::request::Req;
use crate::kv::prefix_cache::{CacheNamespace, EvictionPolicy, NodeMeta, PrefixMatch};
use crate::kv::state::{StatePool, StateSlot};
use crate::speculative::Draft;
use crate::step::{SeqOutput, SeqPlan};
use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;

struct Entry {
    /// The prefix (checked on a hit: the key is a hash).
    tokens: Arc<[u32]>,
    slot: Arc<StateSlot>,
    /// What the eviction policy reads (`tokens`: the prefix's length).
    meta: NodeMeta,
}

/// The snapshots of cached prefixes and their slots.
pub(crate) struct SnapshotStore {
    pool: StatePool,
    entries: HashMap<(CacheNamespace, u64), Entry>,
    clock: u64,
    /// The eviction order (`None`: least recently used).
    policy: Option<Arc<dyn EvictionPolicy>>,
}

/// The hash of every prefix of `tokens` that ends on a page boundary, up to
/// `max` tokens: `(length, hash)`, shortest first.
fn boundary_hashes(tokens: &[u32], max: usize, page_size: usize) -> Vec<(usize, u64)> {
    let mut h = DefaultHasher::new();
    let mut out = Vec::with_capacity(max / page_size.max(1));
    let mut end = 0;
    while end + page_size <= max.min(tokens.len()) {
        tokens[end..end + page_size].hash(&mut h);
        end += page_size;
        out.push((end, h.clone().finish()));
    }
    out
}

impl SnapshotStore {
    /// A store whose snapshots take slots from `pool`, evicted in
    /// `policy`'s order.
    pub(crate) fn new(pool: StatePool, policy: Option<Arc<dyn EvictionPolicy>>) -> Self {
        Self {
            pool,
            entries: HashMap::new(),
            clock: 0,
            policy,
        }
    }

    /// Snapshots kept.
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// The deepest snapshot of a prefix of `tokens` no longer than `max`
    /// tokens (on a page boundary): its length and slot.
    pub(crate) fn deepest(
        &mut self,
        ns: &CacheNamespace,
        tokens: &[u32],
        max: usize,
        page_size: usize,
    ) -> Option<(usize, Arc<StateSlot>)> {
        if self.entries.is_empty() {
            return None;
        }
        self.clock += 1;
        let now = self.clock;
        for (len, h) in boundary_hashes(tokens, max, page_size).into_iter().rev() {
            if let Some(e) = self.entries.get_mut(&(ns.clone(), h))
                && *e.tokens == tokens[..len]
            {
                e.meta.last_access = now;
                e.meta.hit_count += 1;
                return Some((len, e.slot.clone()));
            }
        }
        None
    }

    /// Whether a snapshot of exactly `tokens` is kept.
    pub(crate) fn contains(&self, ns: &CacheNamespace, tokens: &[u32], page_size: usize) -> bool {
        match boundary_hashes(tokens, tokens.len(), page_size).last() {
            Some(&(len, h)) if len == tokens.len() => self
                .entries
                .get(&(ns.clone(), h))
                .is_some_and(|e| *e.tokens == *tokens),
            _ => false,
        }
    }

    /// A free snapshot slot, evicting snapshots in the policy's order
    /// (least recently used first on ties) until one is free; `None` when
    /// every slot is held by requests restoring.
    pub(crate) fn alloc(&mut self) -> Option<StateSlot> {
        loop {
            if let Ok(s) = self.pool.alloc() {
                return Some(s);
            }
            let first = self
                .entries
                .iter()
                .min_by(|(_, a), (_, b)| {
                    let by_policy = match &self.policy {
                        Some(p) => p.key(&a.meta).total_cmp(&p.key(&b.meta)),
                        None => std::cmp::Ordering::Equal,
                    };
                    by_policy.then(a.meta.last_access.cmp(&b.meta.last_access))
                })
                .map(|(k, _)| k.clone())?;
            self.entries.remove(&first);
        }
    }

    /// Keeps `slot` as the snapshot of `tokens` (a whole number of pages)
    /// for a request of `priority`.
    pub(crate) fn insert(
        &mut self,
        ns: &CacheNamespace,
        tokens: &[u32],
        slot: StateSlot,
        page_size: usize,
        priority: i64,
    ) {
        let Some(&(len, h)) = boundary_hashes(tokens, tokens.len(), page_size).last() else {
            return;
        };
        if len != tokens.len() {
            return;
        }
        self.clock += 1;
        self.entries.insert(
            (ns.clone(), h),
            Entry {
                tokens: tokens.into(),
                slot: Arc::new(slot),
                meta: NodeMeta {
                    last_access: self.clock,
                    created: self.clock,
                    hit_count: 0,
                    priority,
                    tokens: len,
                },
            },
        );
    }

    /// Drops every snapshot (a flushed cache).
    pub(crate) fn clear(&mut self) {
        self.entries.clear();
    }
}

/// The scheduler's side of recurrent state: slots, snapshots, restores.
impl Scheduler {
    /// The cached prefix of a request of a model with recurrent layers: the
    /// radix cache's pages up to the deepest state snapshot within them
    /// (restored into the request's slot by its first chunk); nothing when
    /// no snapshot fits (pages without their state are not reused).
    pub(super) fn match_with_state(&mut self, r: &mut Req, toks: &[u32]) -> PrefixMatch {
        let cached = self.cache.peek_prefix(&r.ns, &toks[..toks.len() - 1]);
        let deepest = self
            .snapshots
            .as_mut()
            .and_then(|store| store.deepest(&r.ns, toks, cached, self.page_size));
        let len = deepest.as_ref().map_or(0, |d| d.0);
        let m = self.cache.match_prefix(&r.ns, &toks[..len]);
        r.restore = deepest.filter(|_| m.matched_tokens == len && len > 0);
        if r.restore.is_none() && m.matched_tokens > 0 {
            self.cache.match_prefix(&r.ns, &[])
        } else {
            m
        }
    }

    /// Drops every unlocked cached prefix, and the recurrent state
    /// snapshots with them.
    pub(super) fn flush_cache(&mut self) {
        self.release_all_holds();
        self.cache.flush();
        if let Some(s) = &mut self.snapshots {
            s.clear();
        }
    }

    /// Moves the request's latest completed state snapshot into the store
    /// (its KV pages are inserted into the cache with it).
    pub(super) fn keep_snapshot(&mut self, r: &mut Req) {
        if let (Some(store), Some((len, slot))) = (self.snapshots.as_mut(), r.snapshot_done.take())
            && len <= r.computed
        {
            let toks = r.tokens();
            store.insert(&r.ns, &toks[..len], slot, self.page_size, r.priority);
        }
    }

    /// Whether `r` holds the state slot it needs (taking a free one if it
    /// has none); always true for a model without recurrent layers.
    pub(super) fn hold_state_slot(&mut self, r: &mut Req) -> bool {
        match &self.state_pool {
            Some(pool) if r.state_slot.is_none() => match pool.alloc() {
                Ok(slot) => {
                    r.state_slot = Some(slot);
                    true
                }
                Err(_) => false,
            },
            _ => true,
        }
    }

    /// Slots for the state at each draft token of the decoding requests of
    /// a model with recurrent layers (verification keeps the accepted
    /// one); a draft is cut to the slots there are (none without snapshot
    /// slots).
    pub(super) fn hold_draft_states(&mut self, decoding: &mut [Req], drafts: &mut [Draft]) {
        for (r, d) in decoding.iter_mut().zip(drafts.iter_mut()) {
            r.draft_states.clear();
            let Some(store) = self.snapshots.as_mut() else {
                d.truncate(0);
                continue;
            };
            while r.draft_states.len() < d.len() {
                match store.alloc() {
                    Some(slot) => r.draft_states.push(slot),
                    None => break,
                }
            }
            d.truncate(r.draft_states.len());
        }
    }

    /// Plans a recurrent state snapshot at the last page boundary within the
    /// `n` tokens a sequence computes from `start`, and not past `limit`
    /// (into the request's own snapshot slot, or a new one), unless the
    /// store has that prefix. A prompt's limit is its length less one: a
    /// later request with the same prompt matches at most that much.
    pub(super) fn plan_snapshot(
        &mut self,
        r: &mut Req,
        span: (usize, usize, usize),
        s: &mut SeqPlan,
    ) {
        let (start, n, limit) = span;
        s.state_ops.snapshots.clear();
        let ps = self.page_size;
        let end = (start + n).min(limit) / ps * ps;
        let Some(store) = self.snapshots.as_mut() else {
            return;
        };
        if r.state_slot.is_none() || end <= start || s.tree.is_some() {
            return;
        }
        let toks = r.tokens();
        if end > toks.len() || store.contains(&r.ns, &toks[..end], ps) {
            return;
        }
        let slot = match r.snapshot_done.take() {
            Some((_, slot)) => Some(slot),
            None => store.alloc(),
        };
        if let Some(slot) = slot {
            s.state_ops.snapshots.push((end - start, slot.index()));
            r.snapshot_next = Some((end, slot));
        }
    }

    /// After a step succeeded: a prompt chunk's snapshot goes to the store
    /// at once (it serves every request sharing the prompt once the pages
    /// are cached), a decoding request's becomes its latest (kept when its
    /// KV is cached). Restores due in this step are done.
    pub(super) fn settle_snapshots(
        &mut self,
        prefill: &mut [PrefillEntry],
        decoding: &mut [Req],
        outputs: &[SeqOutput],
    ) {
        let ps = self.page_size;
        for e in prefill.iter_mut() {
            let r = &mut e.req;
            r.restore = None;
            if let (Some(store), Some((len, slot))) =
                (self.snapshots.as_mut(), r.snapshot_next.take())
            {
                let toks = r.tokens();
                store.insert(&r.ns, &toks[..len], slot, ps, r.priority);
            }
        }
        let verified = outputs.get(prefill.len()..).unwrap_or_default();
        for (r, o) in decoding.iter_mut().zip(verified) {
            r.restore = None;
            if let Some(done) = r.snapshot_next.take() {
                r.snapshot_done = Some(done);
            }
            // Drafts verified: the state is right after all of them; after
            // `accepted` of them it is in draft slot `accepted`.
            let mut states = std::mem::take(&mut r.draft_states);
            if o.accepted < states.len() && o.error().is_none() {
                let slot = states.swap_remove(o.accepted);
                r.restore = Some((r.computed + 1 + o.accepted, std::sync::Arc::new(slot)));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_deepest_snapshot_within_the_cached_pages_wins() {
        let mut s = SnapshotStore::new(StatePool::over(4..6), None);
        let ns = CacheNamespace::default();
        let toks: Vec<u32> = (0..40).collect();
        let a = s.alloc().unwrap();
        assert!((4..6).contains(&(a.index() as usize)));
        s.insert(&ns, &toks[..16], a, 8, 0);
        let b = s.alloc().unwrap();
        s.insert(&ns, &toks[..32], b, 8, 0);
        assert!(s.contains(&ns, &toks[..16], 8));
        assert!(!s.contains(&ns, &toks[..24], 8));
        assert_eq!(s.deepest(&ns, &toks, 40, 8).map(|x| x.0), Some(32));
        assert_eq!(s.deepest(&ns, &toks, 31, 8).map(|x| x.0), Some(16));
        assert_eq!(s.deepest(&ns, &toks, 15, 8).map(|x| x.0), None);
        let other = CacheNamespace(Some("x".into()));
        assert!(s.deepest(&other, &toks, 40, 8).is_none());
        // A different token at position 3: no snapshot matches.
        let mut changed = toks.clone();
        changed[3] = 99;
        assert!(s.deepest(&ns, &changed, 40, 8).is_none());
        // Full: a third snapshot evicts the least recently used (16 was used last).
        s.deepest(&ns, &toks, 31, 8);
        let c = s.alloc().unwrap();
        s.insert(&ns, &toks[..8], c, 8, 0);
        assert_eq!(s.len(), 2);
        assert!(s.contains(&ns, &toks[..16], 8) && !s.contains(&ns, &toks[..32], 8));
        // A slot held by a restoring request outlives its entry's eviction.
        let held = s.deepest(&ns, &toks, 16, 8).unwrap().1;
        s.clear();
        assert!(s.alloc().is_some());
        drop(held);
    }

    /// Evicts by creation time (oldest first), whatever was used last.
    struct Fifo;
    impl EvictionPolicy for Fifo {
        fn name(&self) -> &str {
            "fifo"
        }
        fn key(&self, m: &NodeMeta) -> crate::kv::prefix_cache::EvictionKey {
            crate::kv::prefix_cache::EvictionKey(m.created as f64, 0.0)
        }
    }

    /// Evicts the lowest priority first, then the least recently used.
    struct ByPriority;
    impl EvictionPolicy for ByPriority {
        fn name(&self) -> &str {
            "priority"
        }
        fn key(&self, m: &NodeMeta) -> crate::kv::prefix_cache::EvictionKey {
            crate::kv::prefix_cache::EvictionKey(m.priority as f64, m.last_access as f64)
        }
    }

    /// Two snapshots, the first used after the second was taken, then a
    /// third: which one is left of the first two.
    fn survivor(policy: Option<Arc<dyn EvictionPolicy>>, priorities: [i64; 2]) -> usize {
        let mut s = SnapshotStore::new(StatePool::over(0..2), policy);
        let ns = CacheNamespace::default();
        let toks: Vec<u32> = (0..48).collect();
        let a = s.alloc().unwrap();
        s.insert(&ns, &toks[..16], a, 8, priorities[0]);
        let b = s.alloc().unwrap();
        s.insert(&ns, &toks[..32], b, 8, priorities[1]);
        assert_eq!(s.deepest(&ns, &toks, 31, 8).map(|x| x.0), Some(16));
        let c = s.alloc().unwrap();
        s.insert(&ns, &toks[..48], c, 8, 0);
        assert!(s.contains(&ns, &toks[..48], 8));
        let kept: Vec<usize> = [16, 32]
            .into_iter()
            .filter(|&n| s.contains(&ns, &toks[..n], 8))
            .collect();
        assert_eq!(kept.len(), 1, "{kept:?}");
        kept[0]
    }

    #[test]
    fn snapshots_are_evicted_in_the_caches_policy_order() {
        // Least recently used without a policy: the unused 32 goes.
        assert_eq!(survivor(None, [0, 0]), 16);
        // First in, first out: 16 goes though it was used last.
        assert_eq!(survivor(Some(Arc::new(Fifo)), [0, 0]), 32);
        // Priority: the low-priority request's snapshot goes first.
        assert_eq!(survivor(Some(Arc::new(ByPriority)), [0, 5]), 32);
        assert_eq!(survivor(Some(Arc::new(ByPriority)), [5, 0]), 16);
    }
}
