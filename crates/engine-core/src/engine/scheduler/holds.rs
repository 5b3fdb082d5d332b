//! Holds: finished requests' sequences kept cached for a caller (an open
//! session) against eviction, up to a budget of tokens.
//!
//! A request submitted with [`GenerateRequest::hold`](crate::engine::GenerateRequest)
//! leaves, when it finishes normally, a hold under that key: the radix node
//! that ends its sequence is locked, so the whole path from the root stays
//! cached while other prefixes are evicted. A key's new hold replaces the
//! key's holds whose sequences it extends (the path they lock is part of
//! the new one), so a conversation that continues holds one node.
//!
//! Holds yield, oldest first: when the held tokens pass the budget, and
//! when a running or admitted request needs pages that only releasing a
//! hold can free (a hold is a cache hint, never a reason to refuse or
//! retract a request). [`Engine::release_hold`](crate::engine::Engine::release_hold)
//! releases a key's holds; flushing the cache releases them all.
//!
//! Invariants: each hold locks its node exactly once, and unlocks it when
//! it is released; `held` is the sum of the holds' token counts (branches
//! that share a prefix count it once each, so the budget is conservative).

use super::Scheduler;
use crate::engine::request::Req;
use crate::kv::prefix_cache::{CacheNamespace, NodeId, PrefixCache};
use std::collections::VecDeque;
use std::sync::Arc;

/// One held sequence.
struct Hold {
    key: Arc<str>,
    ns: CacheNamespace,
    /// The sequence's tokens the cache matched (whole pages).
    tokens: Vec<u32>,
    node: NodeId,
}

/// The holds of one scheduler, oldest first.
#[derive(Default)]
pub(super) struct Holds {
    list: VecDeque<Hold>,
    /// Tokens of every hold together.
    held: usize,
    /// Most tokens held at once (0: holds are off).
    pub(super) budget: usize,
}

impl Holds {
    /// A budget of `ratio` of `pool_tokens`.
    pub(super) fn new(ratio: f64, pool_tokens: usize) -> Self {
        Self {
            budget: (ratio.clamp(0.0, 1.0) * pool_tokens as f64) as usize,
            ..Self::default()
        }
    }

    /// Tokens held.
    pub(super) fn held(&self) -> usize {
        self.held
    }

    pub(super) fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// Releases the oldest hold; false when there is none.
    fn release_oldest(&mut self, cache: &mut dyn PrefixCache) -> bool {
        match self.list.pop_front() {
            Some(h) => {
                self.unlock(cache, h);
                true
            }
            None => false,
        }
    }

    fn unlock(&mut self, cache: &mut dyn PrefixCache, h: Hold) {
        self.held -= h.tokens.len();
        if let Err(e) = cache.unlock(h.node) {
            tracing::error!("releasing the hold of '{}': {e}", h.key);
        }
    }

    /// Releases the holds `pred` picks.
    fn release_where(&mut self, cache: &mut dyn PrefixCache, pred: impl Fn(&Hold) -> bool) {
        let (gone, kept): (VecDeque<Hold>, VecDeque<Hold>) =
            std::mem::take(&mut self.list).into_iter().partition(pred);
        self.list = kept;
        for h in gone {
            self.unlock(cache, h);
        }
    }
}

impl Scheduler {
    /// Holds `r`'s finished sequence under its hold key (its KV is in the
    /// cache by now), releasing what the key's new hold extends and the
    /// oldest holds past the budget.
    /// `computed`: the tokens of `r` computed before its KV went to the cache.
    pub(super) fn hold_finished(&mut self, r: &Req, computed: usize) {
        let Some(key) = r.hold.clone() else {
            return;
        };
        if self.holds.budget == 0 || self.cfg.disable_radix_cache {
            return;
        }
        let toks = r.tokens();
        let m = self
            .cache
            .match_prefix(&r.ns, &toks[..computed.min(toks.len())]);
        if m.matched_tokens == 0 || m.matched_tokens > self.holds.budget {
            return;
        }
        if let Err(e) = self.cache.lock(m.node) {
            tracing::error!("holding the sequence of {}: {e}", r.rid);
            return;
        }
        let tokens = toks[..m.matched_tokens].to_vec();
        let ns = r.ns.clone();
        self.holds.release_where(&mut *self.cache, |h| {
            h.key == key && h.ns == ns && tokens.starts_with(&h.tokens)
        });
        self.holds.held += tokens.len();
        self.holds.list.push_back(Hold {
            key,
            ns,
            tokens,
            node: m.node,
        });
        while self.holds.held > self.holds.budget && self.holds.release_oldest(&mut *self.cache) {}
    }

    /// Releases every hold of `key`.
    pub(super) fn release_hold(&mut self, key: &str) {
        self.holds
            .release_where(&mut *self.cache, |h| &*h.key == key);
    }

    /// Releases every hold (the cache is about to be flushed).
    pub(super) fn release_all_holds(&mut self) {
        self.holds.release_where(&mut *self.cache, |_| true);
    }

    /// Releases holds, oldest first, until `pages` pages are free or
    /// evictable (or no hold is left): live requests come before holds.
    pub(super) fn yield_holds(&mut self, pages: usize) {
        while !self.holds.is_empty() && self.available_tokens() / self.page_size < pages {
            self.holds.release_oldest(&mut *self.cache);
        }
    }
}
