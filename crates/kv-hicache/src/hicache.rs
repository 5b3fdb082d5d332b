//! [`HiCache`]: the radix cache with its host tier, plus an optional storage
//! tier reached through the storage thread.
//!
//! The radix cache owns the tree and both in-memory tiers (see kv-radix's
//! `tiers`); this type adds the storage tier around it:
//! - a new request's prompt is looked up in storage (`prefetch`); pages the
//!   store has are read into host slots and hung under the tree as host-only
//!   nodes, from which the request's match loads them like any host KV;
//! - every new host copy is written to storage by the thread once its copy
//!   ran;
//! - `prefetch_poll` says when a waiting request may go, per the policy.
//!
//! The scheduler thread only queues jobs and drains results (at every call
//! that reads or changes the tree); it never waits on storage.

use crate::config::{HiCacheConfig, HiCacheError, PrefetchPolicy};
use crate::worker::{Done, Job, Worker};
use arbor_engine_core::{
    CacheNamespace, EvictionPolicy, HostKvPool, InsertOutcome, KvSpec, KvTier, KvTierOps, NodeId,
    PagePool, PageSet, PrefixCache, PrefixCacheStats, PrefixMatch, Result as CoreResult,
    TierIdentity,
};
use arbor_kv_radix::{RadixCache, TierOptions};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

/// Everything a [`HiCache`] is built from.
pub struct HiCacheOptions {
    /// The device KV cache's shape (page size, dtype, layers, pool size).
    pub kv: KvSpec,
    /// Eviction order of both tiers.
    pub policy: Arc<dyn EvictionPolicy>,
    /// The model's identity (keys of stored pages depend on it).
    pub model: String,
    /// Sizes and policies.
    pub config: HiCacheConfig,
    /// The storage tier, if any.
    pub storage: Option<Arc<dyn KvTier>>,
    /// Memory for the host tier's pages: the device's
    /// ([`Backend::host_memory`](arbor_engine_core::Backend::host_memory),
    /// pinned on GPUs), or `None` for the heap.
    pub host_memory: Option<Arc<dyn arbor_engine_core::HostMemory>>,
}

/// A request waiting on a storage fetch.
struct Pending {
    /// Past this, the `timeout` policy stops waiting.
    deadline: Instant,
    /// The fetch finished (found nothing, failed, or its pages are in the tree).
    done: bool,
}

/// The radix cache with host and storage tiers.
pub struct HiCache {
    radix: RadixCache,
    worker: Option<Worker>,
    config: HiCacheConfig,
    pending: HashMap<u64, Pending>,
    page_size: usize,
    store: Option<Arc<dyn KvTier>>,
}

impl std::fmt::Debug for HiCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HiCache")
            .field("radix", &self.radix)
            .field(
                "storage",
                &self.store.as_ref().map(|s| s.name().to_string()),
            )
            .finish()
    }
}

impl HiCache {
    /// A HiCache over a device pool of `options.kv`.
    pub fn new(options: HiCacheOptions) -> Result<Self, HiCacheError> {
        let HiCacheOptions {
            kv,
            policy,
            model,
            config,
            storage,
            host_memory,
        } = options;
        let host_pages = config.host_pages(&kv)?;
        let identity = TierIdentity::new(model, &kv);
        let host = HostKvPool::with_memory(identity.page_bytes(), host_pages, host_memory);
        let mut radix = RadixCache::with_policy(kv.page_size, policy)?;
        radix.enable_tiers(TierOptions {
            host,
            write_policy: config.write_policy,
            identity: storage.is_some().then_some(identity),
        })?;
        let worker = match &storage {
            Some(s) => Some(Worker::spawn(s.clone()).map_err(|e| {
                HiCacheError::Config(format!("starting the hicache storage thread: {e}"))
            })?),
            None => None,
        };
        Ok(Self {
            radix,
            worker,
            config,
            pending: HashMap::new(),
            page_size: kv.page_size,
            store: storage,
        })
    }

    /// The radix cache inside (for inspection and tests).
    pub fn radix(&self) -> &RadixCache {
        &self.radix
    }

    /// Applies the storage thread's results and queues new backups.
    fn pump(&mut self) {
        let Some(worker) = self.worker.as_ref() else {
            return;
        };
        while let Ok(done) = worker.done.try_recv() {
            match done {
                Done::Found {
                    key,
                    ns,
                    tokens,
                    start,
                    keys,
                } => {
                    // SGLang's prefetch_threshold: a short hit is not worth a fetch.
                    let worth = keys.len() * self.page_size >= self.config.prefetch_threshold;
                    let host = (worth && !keys.is_empty())
                        .then(|| self.radix.alloc_host_pages(keys.len()))
                        .flatten();
                    let sent = host.is_some_and(|host| {
                        worker.send(Job::Fetch {
                            key,
                            ns,
                            tokens,
                            start,
                            keys,
                            host,
                        })
                    });
                    if !sent && let Some(p) = self.pending.get_mut(&key) {
                        p.done = true;
                    }
                }
                Done::Fetched {
                    key,
                    ns,
                    tokens,
                    start,
                    mut host,
                    pages,
                } => {
                    drop(host.split_off(pages));
                    if pages > 0 {
                        self.radix.insert_host(&ns, &tokens, start, host);
                    }
                    if let Some(p) = self.pending.get_mut(&key) {
                        p.done = true;
                    }
                }
            }
        }
        for b in self.radix.take_backups() {
            worker.send(Job::Backup(b));
        }
    }
}

impl PrefixCache for HiCache {
    fn name(&self) -> &str {
        "hicache"
    }

    fn match_prefix(&mut self, ns: &CacheNamespace, tokens: &[u32]) -> PrefixMatch {
        self.pump();
        let m = self.radix.match_prefix(ns, tokens);
        self.pump();
        m
    }

    fn insert(
        &mut self,
        ns: &CacheNamespace,
        tokens: &[u32],
        pages: PageSet,
        priority: i64,
    ) -> CoreResult<InsertOutcome> {
        let out = self.radix.insert(ns, tokens, pages, priority);
        self.pump();
        out
    }

    fn insert_with_prefix(
        &mut self,
        ns: &CacheNamespace,
        tokens: &[u32],
        cached_prefix: usize,
        pages: PageSet,
        priority: i64,
    ) -> CoreResult<InsertOutcome> {
        let out = self
            .radix
            .insert_with_prefix(ns, tokens, cached_prefix, pages, priority);
        self.pump();
        out
    }

    fn peek_prefix(&self, ns: &CacheNamespace, tokens: &[u32]) -> usize {
        self.radix.peek_prefix(ns, tokens)
    }

    fn lock(&mut self, node: NodeId) -> CoreResult<()> {
        self.radix.lock(node)
    }

    fn unlock(&mut self, node: NodeId) -> CoreResult<()> {
        self.radix.unlock(node)
    }

    fn evict(&mut self, n_tokens: usize) -> usize {
        let freed = self.radix.evict(n_tokens);
        self.pump();
        freed
    }

    fn stats(&self) -> PrefixCacheStats {
        let mut s = self.radix.stats();
        if let Some(w) = &self.worker {
            let c = &w.counters;
            let t = &mut s.tiers;
            t.storage_read_pages = c.read_pages.load(Ordering::Relaxed);
            t.storage_read_bytes = c.read_bytes.load(Ordering::Relaxed);
            t.storage_read_seconds = c.read_micros.load(Ordering::Relaxed) as f64 * 1e-6;
            t.storage_write_pages = c.write_pages.load(Ordering::Relaxed);
            t.storage_write_bytes = c.write_bytes.load(Ordering::Relaxed);
            t.storage_write_seconds = c.write_micros.load(Ordering::Relaxed) as f64 * 1e-6;
            t.storage_errors = c.errors.load(Ordering::Relaxed);
            t.storage_corrupt = self.store.as_ref().map_or(0, |s| s.corrupt_removed());
        }
        s
    }

    fn flush(&mut self) {
        self.pump();
        self.radix.flush();
    }

    fn dump(&self) -> String {
        self.radix.dump()
    }

    fn bind_pool(&mut self, pool: &PagePool) -> CoreResult<()> {
        self.radix.bind_pool(pool)
    }

    fn take_kv_ops(&mut self) -> KvTierOps {
        self.pump();
        self.radix.take_kv_ops()
    }

    fn prefetch(&mut self, key: u64, ns: &CacheNamespace, tokens: &[u32]) {
        self.pump();
        let (Some(worker), Some(root)) = (self.worker.as_ref(), self.radix.root_key(ns)) else {
            return;
        };
        // The match covers all but the last prompt token, in whole pages.
        let ps = self.page_size;
        let usable = tokens.len().saturating_sub(1) / ps * ps;
        let start = self.radix.peek_prefix(ns, &tokens[..usable]);
        if usable < start + ps {
            return;
        }
        let sent = worker.send(Job::Lookup {
            key,
            ns: ns.clone(),
            root,
            tokens: tokens[..usable].into(),
            start,
            page_size: ps,
        });
        if sent {
            let wait = self.config.prefetch_timeout(usable - start);
            self.pending.insert(
                key,
                Pending {
                    deadline: Instant::now() + wait,
                    done: false,
                },
            );
        }
    }

    fn prefetch_poll(&mut self, key: u64) -> bool {
        self.pump();
        let Some(p) = self.pending.get(&key) else {
            return true;
        };
        let go = match self.config.prefetch_policy {
            PrefetchPolicy::BestEffort => true,
            PrefetchPolicy::WaitComplete => p.done,
            PrefetchPolicy::Timeout => p.done || Instant::now() >= p.deadline,
        };
        if go {
            self.pending.remove(&key);
        }
        go
    }

    fn prefetch_cancel(&mut self, key: u64) {
        self.pending.remove(&key);
    }

    fn clear_storage(&mut self) -> CoreResult<()> {
        if let Some(w) = &self.worker {
            w.send(Job::Clear);
        }
        Ok(())
    }
}
