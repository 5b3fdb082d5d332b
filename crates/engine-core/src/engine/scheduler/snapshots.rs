//! Recurrent-state snapshots of cached prefixes: a hybrid model's prefix
//! reuse.
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
//! after the step succeeded); entries are evicted least recently used when
//! the snapshot slots run out, and an entry's slot returns to the pool when
//! its last holder (the store, or a request restoring from it) drops it.

use crate::prefix_cache::CacheNamespace;
use crate::state::{StatePool, StateSlot};
use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;

struct Entry {
    /// The prefix (checked on a hit: the key is a hash).
    tokens: Arc<[u32]>,
    slot: Arc<StateSlot>,
    used: u64,
}

/// The snapshots of cached prefixes and their slots.
pub(crate) struct SnapshotStore {
    pool: StatePool,
    entries: HashMap<(CacheNamespace, u64), Entry>,
    clock: u64,
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
    /// A store whose snapshots take slots from `pool`.
    pub(crate) fn new(pool: StatePool) -> Self {
        Self {
            pool,
            entries: HashMap::new(),
            clock: 0,
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
                e.used = now;
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

    /// A free snapshot slot, evicting least recently used snapshots until
    /// one is free; `None` when every slot is held by requests restoring.
    pub(crate) fn alloc(&mut self) -> Option<StateSlot> {
        loop {
            if let Ok(s) = self.pool.alloc() {
                return Some(s);
            }
            let oldest = self
                .entries
                .iter()
                .min_by_key(|(_, e)| e.used)
                .map(|(k, _)| k.clone())?;
            self.entries.remove(&oldest);
        }
    }

    /// Keeps `slot` as the snapshot of `tokens` (a whole number of pages).
    pub(crate) fn insert(
        &mut self,
        ns: &CacheNamespace,
        tokens: &[u32],
        slot: StateSlot,
        page_size: usize,
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
                used: self.clock,
            },
        );
    }

    /// Drops every snapshot (a flushed cache).
    pub(crate) fn clear(&mut self) {
        self.entries.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_deepest_snapshot_within_the_cached_pages_wins() {
        let mut s = SnapshotStore::new(StatePool::over(4..6));
        let ns = CacheNamespace::default();
        let toks: Vec<u32> = (0..40).collect();
        let a = s.alloc().unwrap();
        assert!((4..6).contains(&(a.index() as usize)));
        s.insert(&ns, &toks[..16], a, 8);
        let b = s.alloc().unwrap();
        s.insert(&ns, &toks[..32], b, 8);
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
        s.insert(&ns, &toks[..8], c, 8);
        assert_eq!(s.len(), 2);
        assert!(s.contains(&ns, &toks[..16], 8) && !s.contains(&ns, &toks[..32], 8));
        // A slot held by a restoring request outlives its entry's eviction.
        let held = s.deepest(&ns, &toks, 16, 8).unwrap().1;
        s.clear();
        assert!(s.alloc().is_some());
        drop(held);
    }
}
