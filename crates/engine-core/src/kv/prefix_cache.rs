//! The prefix-cache interface (RadixAttention's cache policy) and eviction policies.
//!
//! A prefix cache maps token sequences to the KV pages that hold them, so a new
//! request skips the prefill of its longest cached prefix. Pages are matched
//! and inserted in whole pages; the cache owns the pages of its nodes (as
//! [`PageSet`]s) and frees them when it evicts. A node that a running request
//! has locked is never evicted.
//!
//! Contract of [`PrefixCache::insert`]: `pages` covers `tokens` (one page per
//! `page_size` tokens, the last possibly partial). The cache keeps the pages of
//! the whole-page part that it does not hold yet; pages duplicating cached KV
//! and the unaligned tail are dropped, which returns them to the pool.
//!
//! Tiers (HiCache): a cache may keep evicted KV in host memory or storage and
//! load it back. It then allocates device pages itself (from the pool given
//! by [`PrefixCache::bind_pool`]), records the copies between device and host
//! that the next step must run first ([`PrefixCache::take_kv_ops`]), and may
//! fetch a new request's prefix from storage before it is admitted
//! ([`PrefixCache::prefetch`], [`PrefixCache::prefetch_poll`]). A cache
//! without tiers keeps the defaults, which do nothing.

use crate::error::Result;
pub use crate::kv::namespace::CacheNamespace;
use crate::kv::tier::KvTierOps;
use crate::kv::{PagePool, PageSet};
use std::cmp::Ordering;
use std::sync::Arc;

/// Stable id of a node in a prefix cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub u32);

/// Result of a prefix match.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrefixMatch {
    /// Pages holding the matched prefix, in order (owned by the cache).
    pub pages: Vec<u32>,
    /// Matched tokens (a multiple of the page size).
    pub matched_tokens: usize,
    /// The node where the match ends (the root when nothing matched); lock it while in use.
    pub node: NodeId,
    /// Of `matched_tokens`, those loaded back from the host tier by this match.
    pub host_tokens: usize,
    /// Of `host_tokens`, those that had come from the storage tier.
    pub storage_tokens: usize,
}

impl PrefixMatch {
    /// Nothing matched; the match ends at `node` (a root).
    pub fn empty(node: NodeId) -> Self {
        Self {
            pages: Vec::new(),
            matched_tokens: 0,
            node,
            host_tokens: 0,
            storage_tokens: 0,
        }
    }
}

/// Result of an insert.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InsertOutcome {
    /// Leading tokens that were already cached (their duplicate pages were freed).
    pub already_cached: usize,
    /// Tokens the cache now holds for this sequence (the whole-page part).
    pub cached: usize,
    /// The node covering the end of the cached part.
    pub node: NodeId,
}

/// Counters of a prefix cache.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PrefixCacheStats {
    /// Tokens held in the cache.
    pub cached_tokens: usize,
    /// Cached tokens no request has locked (can be evicted).
    pub evictable_tokens: usize,
    /// Cached tokens locked by running requests.
    pub protected_tokens: usize,
    /// Nodes, the root excluded.
    pub nodes: usize,
    /// Tokens matched by `match_prefix` since start.
    pub hit_tokens: u64,
    /// Tokens looked up by `match_prefix` since start.
    pub queried_tokens: u64,
    /// Tokens evicted since start.
    pub evicted_tokens: u64,
    /// The tiers below the device (all zero without them).
    pub tiers: TierStats,
}

/// Counters of the tiers below the device.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TierStats {
    /// Tokens whose KV the host tier holds.
    pub host_tokens: usize,
    /// Token capacity of the host tier.
    pub host_capacity_tokens: usize,
    /// Tokens matched from the host tier (loaded back) since start.
    pub host_hit_tokens: u64,
    /// Of those, tokens that had come from storage.
    pub storage_hit_tokens: u64,
    /// Tokens demoted from the device to the host instead of being dropped.
    pub demoted_tokens: u64,
    /// Pages read from storage, and the bytes and seconds it took.
    pub storage_read_pages: u64,
    /// Bytes read from storage.
    pub storage_read_bytes: u64,
    /// Seconds spent reading storage (on the tier's thread).
    pub storage_read_seconds: f64,
    /// Pages written to storage.
    pub storage_write_pages: u64,
    /// Bytes written to storage.
    pub storage_write_bytes: u64,
    /// Seconds spent writing storage (on the tier's thread).
    pub storage_write_seconds: f64,
    /// Storage operations that failed (the requests recomputed).
    pub storage_errors: u64,
    /// Stored entries found corrupt (skipped and removed).
    pub storage_corrupt: u64,
}

/// What an eviction policy knows about a node.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeMeta {
    /// Logical time of the last match or insert that touched the node.
    pub last_access: u64,
    /// Logical time the node was created.
    pub created: u64,
    /// Matches that reached the node.
    pub hit_count: u64,
    /// Highest priority of the requests that used the node.
    pub priority: i64,
    /// Tokens on the node's edge.
    pub tokens: usize,
}

/// Sort key of a node for eviction: the smallest key is evicted first.
/// Compared lexicographically.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EvictionKey(pub f64, pub f64);

impl EvictionKey {
    /// Total order (NaN sorts last).
    pub fn total_cmp(&self, other: &Self) -> Ordering {
        self.0.total_cmp(&other.0).then(self.1.total_cmp(&other.1))
    }
}

/// Chooses which unlocked leaf is evicted first.
pub trait EvictionPolicy: Send + Sync {
    /// Registered name.
    fn name(&self) -> &str;
    /// The node's eviction key; smaller is evicted sooner.
    fn key(&self, meta: &NodeMeta) -> EvictionKey;
}

/// How a prefix cache is created.
#[derive(Clone)]
pub struct PrefixCacheOptions {
    /// Tokens per KV page.
    pub page_size: usize,
    /// Eviction order.
    pub policy: Arc<dyn EvictionPolicy>,
}

/// A cache of KV pages keyed by token prefixes.
pub trait PrefixCache: Send {
    /// Registered name.
    fn name(&self) -> &str;
    /// Longest cached whole-page prefix of `tokens`; refreshes access time and hit count.
    fn match_prefix(&mut self, ns: &CacheNamespace, tokens: &[u32]) -> PrefixMatch;
    /// Caches `tokens` whose KV is in `pages` (see the module contract).
    fn insert(
        &mut self,
        ns: &CacheNamespace,
        tokens: &[u32],
        pages: PageSet,
        priority: i64,
    ) -> Result<InsertOutcome>;
    /// [`insert`](Self::insert) for a request that reused a cached prefix: its first
    /// `cached_prefix` tokens (whole pages, from a `match_prefix` whose node the caller
    /// still holds locked) are in the cache already, and `pages` covers only
    /// `tokens[cached_prefix..]`. Used at finish and for a chunked prefill's computed part.
    /// The default supports `cached_prefix == 0` only.
    fn insert_with_prefix(
        &mut self,
        ns: &CacheNamespace,
        tokens: &[u32],
        cached_prefix: usize,
        pages: PageSet,
        priority: i64,
    ) -> Result<InsertOutcome> {
        if cached_prefix == 0 {
            self.insert(ns, tokens, pages, priority)
        } else {
            Err(crate::error::CoreError::unsupported(format!(
                "prefix cache '{}' cannot insert after a cached prefix",
                self.name()
            )))
        }
    }
    /// Length of the longest cached whole-page prefix of `tokens`, without touching
    /// access times, hit counts or the tree's shape (for scheduling decisions).
    fn peek_prefix(&self, ns: &CacheNamespace, tokens: &[u32]) -> usize;
    /// Protects the path from `node` to the root from eviction.
    fn lock(&mut self, node: NodeId) -> Result<()>;
    /// Undoes one `lock` of `node`.
    fn unlock(&mut self, node: NodeId) -> Result<()>;
    /// Evicts unlocked leaves in policy order until `n_tokens` are freed or none is left;
    /// returns the tokens freed.
    fn evict(&mut self, n_tokens: usize) -> usize;
    /// Counters.
    fn stats(&self) -> PrefixCacheStats;
    /// Drops every unlocked node.
    fn flush(&mut self);
    /// A readable dump of the cache's structure.
    fn dump(&self) -> String;
    /// The eviction order it follows, for state kept beside its pages (a
    /// hybrid model's recurrent state snapshots); `None` for least recently
    /// used.
    fn eviction_policy(&self) -> Option<Arc<dyn EvictionPolicy>> {
        None
    }

    /// Takes the device page pool, for a cache that allocates device pages
    /// itself (to load KV back from a lower tier).
    fn bind_pool(&mut self, _pool: &PagePool) -> Result<()> {
        Ok(())
    }
    /// The copies between the device and lower tiers recorded since the last
    /// call; the next step runs them before its forward.
    fn take_kv_ops(&mut self) -> KvTierOps {
        KvTierOps::default()
    }
    /// Starts fetching from storage what the tiers in memory lack of the
    /// cached prefix of `tokens`, for the request `key` that just arrived.
    fn prefetch(&mut self, _key: u64, _ns: &CacheNamespace, _tokens: &[u32]) {}
    /// Whether request `key` may be admitted now: its prefetch is done or the
    /// prefetch policy stops waiting (then the key is forgotten). True for a
    /// key with no prefetch.
    fn prefetch_poll(&mut self, _key: u64) -> bool {
        true
    }
    /// Forgets the prefetch of an aborted request.
    fn prefetch_cancel(&mut self, _key: u64) {}
    /// Also clears the storage tier (`flush` keeps it).
    fn clear_storage(&mut self) -> Result<()> {
        Ok(())
    }
}
