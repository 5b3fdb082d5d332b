//! The radix cache's host tier (HiCache L2): demotion, backup, load-back and
//! host eviction.
//!
//! Residence of a node's KV: device pages (`Node::pages`), host slots
//! (`Node::host`), or both; a live non-root node has at least one. Rules:
//! - device residence is closed upwards: a node on the device has its
//!   parent on the device (or is under a root), so every match is a run of
//!   device nodes followed by a run of host-only ones;
//! - device eviction takes device leaves (no child on the device); with
//!   room on the host it *demotes*: the pages are copied to host slots
//!   (unless a copy exists already) and only the device pages are freed;
//! - the host tier evicts host-only leaves, in the same policy order;
//! - a match loads the host-only part of its path back into device pages it
//!   allocates from the bound pool (evicting other device leaves first, with
//!   its own path locked so nothing on it moves), and records the copies;
//! - every copy is recorded in order in `Tiers::ops`; the scheduler hands
//!   them to the next step, which runs them before its forward, so a page
//!   demoted and then reused in the same step is copied out before it is
//!   overwritten; a node removed before its copies ran takes them with it
//!   (`Tiers::forget_copies`), so no recorded copy names a freed host slot;
//! - with a storage identity, every node keeps the chained key of its last
//!   page and each new host copy of device KV is queued as a
//!   [`StorageBackup`] for the storage tier (written once its copy ran).

use super::node::Node;
use super::{ROOT, RadixCache};
use arbor_engine_core::{
    CacheNamespace, CopyDirection, HostKvPool, HostPages, HostSlotRef, KvTierOps, NodeId, PageCopy,
    PageKey, PagePool, PageSet, TierIdentity, TierStats,
};
use std::sync::Arc;

/// When device KV gets its host copy (SGLang's `--hicache-write-policy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WritePolicy {
    /// At insert: every cached node has a host copy.
    WriteThrough,
    /// When a node's hit count reaches [`SELECTIVE_HITS`] (reused KV only).
    WriteThroughSelective,
    /// At eviction from the device.
    WriteBack,
}

/// Hits after which `write_through_selective` backs a node up (SGLang's threshold).
pub const SELECTIVE_HITS: u64 = 2;

impl WritePolicy {
    /// The flag values, in the order SGLang lists them.
    pub const NAMES: [&'static str; 3] = ["write_through", "write_through_selective", "write_back"];

    /// Parses a flag value.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "write_through" => Some(Self::WriteThrough),
            "write_through_selective" => Some(Self::WriteThroughSelective),
            "write_back" => Some(Self::WriteBack),
            _ => None,
        }
    }
}

/// How the host tier is set up.
#[derive(Clone, Debug)]
pub struct TierOptions {
    /// Host memory for pages (its page bytes match the device's).
    pub host: Arc<HostKvPool>,
    /// When device KV is copied to the host.
    pub write_policy: WritePolicy,
    /// Identity of the KV, when a storage tier needs page keys.
    pub identity: Option<TierIdentity>,
}

/// Pages with a fresh host copy, for the storage tier.
#[derive(Clone, Debug)]
pub struct StorageBackup {
    /// Chained keys of the pages.
    pub keys: Vec<PageKey>,
    /// Their host slots (readable once the step's copies ran).
    pub slots: Vec<HostSlotRef>,
    /// The pool the slots are in.
    pub pool: Arc<HostKvPool>,
}

pub(super) struct Tiers {
    pub host: Arc<HostKvPool>,
    pub policy: WritePolicy,
    identity: Option<TierIdentity>,
    pub pool: Option<PagePool>,
    ops: Vec<PageCopy>,
    backups: Vec<StorageBackup>,
    /// Tokens with a host copy.
    pub host_tokens: usize,
    stats: TierStats,
}

impl Tiers {
    pub fn root_key(&self, ns: &CacheNamespace) -> Option<PageKey> {
        self.identity.as_ref().map(|i| i.root_key(ns))
    }

    pub fn take_ops(&mut self) -> KvTierOps {
        KvTierOps {
            host: Some(self.host.clone()),
            copies: std::mem::take(&mut self.ops),
        }
    }

    /// Drops the recorded copies that have not run yet into or out of
    /// `slots`, whose node is leaving the cache: nothing reads those slots
    /// again (their next allocation has another generation), and its device
    /// pages, if any, are freed with it. Without this a host tier full
    /// enough to evict a leaf demoted since the last step would hand the
    /// step a copy into a freed slot.
    pub(super) fn forget_copies(&mut self, slots: &[HostSlotRef]) {
        if !self.ops.is_empty() {
            self.ops.retain(|c| !slots.contains(&c.host));
        }
    }

    fn copy(&mut self, direction: CopyDirection, device: &[u32], host: &[HostSlotRef]) {
        self.ops.extend(
            device
                .iter()
                .zip(host)
                .map(|(&device_page, &host)| PageCopy {
                    direction,
                    device_page,
                    host,
                }),
        );
    }
}

impl RadixCache {
    /// Turns on the host tier. The cache must be empty; call
    /// [`bind_pool`](arbor_engine_core::PrefixCache::bind_pool) before the
    /// first match so that host KV can be loaded back.
    pub fn enable_tiers(&mut self, options: TierOptions) -> Result<(), crate::RadixError> {
        if self.live_nodes > 0 {
            return Err(crate::RadixError::NotEmpty);
        }
        let tiers = Tiers {
            host: options.host,
            policy: options.write_policy,
            identity: options.identity,
            pool: None,
            ops: Vec::new(),
            backups: Vec::new(),
            host_tokens: 0,
            stats: TierStats::default(),
        };
        self.nodes[ROOT as usize].last_key = tiers.root_key(&CacheNamespace::default());
        self.tiers = Some(tiers);
        Ok(())
    }

    /// Host copies made since the last call, for the storage tier.
    pub fn take_backups(&mut self) -> Vec<StorageBackup> {
        self.tiers
            .as_mut()
            .map(|t| std::mem::take(&mut t.backups))
            .unwrap_or_default()
    }

    /// The host pool, when tiers are on.
    pub fn host_pool(&self) -> Option<&Arc<HostKvPool>> {
        self.tiers.as_ref().map(|t| &t.host)
    }

    pub(super) fn tier_stats(&self) -> TierStats {
        match &self.tiers {
            None => TierStats::default(),
            Some(t) => TierStats {
                host_tokens: t.host_tokens,
                host_capacity_tokens: t.host.total_pages() * self.page_size,
                ..t.stats
            },
        }
    }

    /// Sets `id`'s chained key from its parent's (when keys are kept).
    pub(super) fn set_last_key(&mut self, id: u32) {
        let n = self.node(id);
        let Some(prev) = self.nodes[n.parent as usize].last_key else {
            return;
        };
        let mut k = prev;
        for page in n.tokens.chunks_exact(self.page_size) {
            k = k.next(page);
        }
        self.node_mut(id).last_key = Some(k);
    }

    /// Keys of `id`'s pages, from its parent's key.
    fn keys_of(&self, id: u32) -> Option<Vec<PageKey>> {
        let n = self.node(id);
        let prev = self.nodes[n.parent as usize].last_key?;
        Some(arbor_engine_core::page_keys(
            prev,
            &n.tokens,
            self.page_size,
        ))
    }

    /// Gives the host-only node `id` device pages again (its parent is on the device).
    pub(super) fn attach_device(&mut self, id: u32, pages: PageSet) {
        let n = self.node_mut(id);
        n.pages = Some(pages);
        let (len, locked, parent) = (n.tokens.len(), n.lock_ref > 0, n.parent);
        if locked {
            self.protected += len;
        } else {
            self.evictable += len;
        }
        self.node_mut(parent).device_children += 1;
        self.refresh_candidate(parent);
        self.refresh_candidate(id);
    }

    /// The chain start of namespace `ns` (with a storage identity).
    pub fn root_key(&self, ns: &CacheNamespace) -> Option<PageKey> {
        self.tiers.as_ref().and_then(|t| t.root_key(ns))
    }

    /// Host slots for `n` pages, evicting host-only leaves as needed (also
    /// for pages fetched from storage).
    pub fn alloc_host_pages(&mut self, n: usize) -> Option<HostPages> {
        loop {
            let host = self.tiers.as_ref()?.host.clone();
            if let Some(h) = host.alloc(n) {
                return Some(h);
            }
            if self.evict_host(1) == 0 {
                return None;
            }
        }
    }

    /// Evicts host-only leaves until `n_tokens` are freed or none is left.
    pub(super) fn evict_host(&mut self, n_tokens: usize) -> usize {
        let mut freed = 0;
        while freed < n_tokens {
            let Some(c) = self.host_candidates.pop_first() else {
                break;
            };
            self.node_mut(c.id).in_host_candidates = false;
            freed += self.node(c.id).tokens.len();
            self.remove_leaf(c.id);
        }
        freed
    }

    /// Gives the device node `id` a host copy (recording the copies); false
    /// when the host has no room.
    pub(super) fn backup(&mut self, id: u32) -> bool {
        let n = self.node(id);
        if n.host.is_some() {
            return true;
        }
        if !n.on_device() || self.tiers.is_none() {
            return false;
        }
        let pages = n.tokens.len() / self.page_size;
        let Some(host) = self.alloc_host_pages(pages) else {
            return false;
        };
        let keys = self.keys_of(id);
        let n = &self.nodes[id as usize];
        let len = n.tokens.len();
        let Some(t) = self.tiers.as_mut() else {
            return false;
        };
        t.copy(CopyDirection::ToHost, n.page_ids(), host.slots());
        if let Some(keys) = keys {
            t.backups.push(StorageBackup {
                keys,
                slots: host.slots().to_vec(),
                pool: t.host.clone(),
            });
        }
        t.host_tokens += len;
        self.node_mut(id).host = Some(host);
        self.refresh_candidate(id);
        true
    }

    /// Moves the unlocked device leaf `id` to the host tier; the device
    /// tokens freed, or `None` when the host cannot take it.
    pub(super) fn demote(&mut self, id: u32) -> Option<usize> {
        if !self.backup(id) {
            return None;
        }
        let n = self.node_mut(id);
        let pages = n.pages.take();
        let (len, parent) = (n.tokens.len(), n.parent);
        drop(pages);
        self.evictable -= len;
        self.node_mut(parent).device_children -= 1;
        if !self.node(parent).is_root() {
            self.refresh_candidate(parent);
        }
        self.refresh_candidate(id);
        if let Some(t) = self.tiers.as_mut() {
            t.stats.demoted_tokens += len as u64;
        }
        Some(len)
    }

    /// Removes the unlocked device leaf `id` together with the host-only
    /// subtree under it (when the host could not take `id`); returns the
    /// device tokens freed.
    pub(super) fn remove_with_host_subtree(&mut self, id: u32) -> usize {
        // Rare (host full): one scan of the arena finds the subtree.
        let mut order = vec![id];
        let mut i = 0;
        while i < order.len() {
            let p = order[i];
            for (c, n) in self.nodes.iter().enumerate() {
                if n.live && !n.is_root() && n.parent == p {
                    order.push(c as u32);
                }
            }
            i += 1;
        }
        let mut freed = 0;
        for &x in order.iter().rev() {
            freed += self.remove_leaf(x);
        }
        freed
    }

    /// Ends a match: `path` is the walk's nodes with their start positions,
    /// device nodes then host-only ones; loads the host part back and, under
    /// `write_through_selective`, backs up nodes hit often enough.
    pub(super) fn finish_tiered_match(
        &mut self,
        path: &[(u32, usize)],
        mut pages: Vec<u32>,
        node: u32,
    ) -> arbor_engine_core::PrefixMatch {
        let split = path
            .iter()
            .position(|&(id, _)| !self.node(id).on_device())
            .unwrap_or(path.len());
        if self
            .tiers
            .as_ref()
            .is_some_and(|t| t.policy == WritePolicy::WriteThroughSelective)
        {
            for &(id, _) in &path[..split] {
                if self.node(id).hit_count >= SELECTIVE_HITS {
                    self.backup(id);
                }
            }
        }
        let (device_end, device_len) = match split {
            0 => (self.root_above(path, node), 0),
            s => {
                let (id, start) = path[s - 1];
                (id, start + self.node(id).tokens.len())
            }
        };
        let host_part: Vec<u32> = path[split..].iter().map(|&(id, _)| id).collect();
        let (loaded, host_tokens, storage_tokens) = self.load_host(&host_part, &mut pages);
        let end = if loaded > 0 {
            host_part[loaded - 1]
        } else {
            device_end
        };
        arbor_engine_core::PrefixMatch {
            pages,
            matched_tokens: device_len + host_tokens,
            node: NodeId(end),
            host_tokens,
            storage_tokens,
        }
    }

    /// The root a match path starts under (the node itself for an empty path).
    fn root_above(&self, path: &[(u32, usize)], node: u32) -> u32 {
        match path.first() {
            Some(&(id, _)) => self.node(id).parent,
            None => node,
        }
    }

    /// Loads the host-only nodes `ids` (a path, top first) into device pages,
    /// as many whole nodes as fit; returns how many, and the tokens loaded
    /// (all, and those that came from storage).
    fn load_host(&mut self, ids: &[u32], pages_out: &mut Vec<u32>) -> (usize, usize, usize) {
        let Some(&last) = ids.last() else {
            return (0, 0, 0);
        };
        let Some(pool) = self.tiers.as_ref().and_then(|t| t.pool.clone()) else {
            return (0, 0, 0);
        };
        let ps = self.page_size;
        if self.lock_impl(NodeId(last)).is_err() {
            return (0, 0, 0);
        }
        let need: usize = ids.iter().map(|&id| self.node(id).tokens.len() / ps).sum();
        let free = pool.free_pages();
        if free < need {
            self.evict_inner((need - free) * ps, true);
        }
        let (mut loaded, mut tokens, mut from_storage) = (0, 0, 0);
        for &id in ids {
            let n = self.node(id);
            let (len, stored) = (n.tokens.len(), n.from_storage);
            let slots: Vec<HostSlotRef> = n
                .host
                .as_ref()
                .map(|h| h.slots().to_vec())
                .unwrap_or_default();
            let Ok(set) = pool.alloc(len / ps) else {
                break;
            };
            if let Some(t) = self.tiers.as_mut() {
                t.copy(CopyDirection::ToDevice, set.pages(), &slots);
                t.stats.host_hit_tokens += len as u64;
                if stored {
                    t.stats.storage_hit_tokens += len as u64;
                }
            }
            if stored {
                from_storage += len;
            }
            pages_out.extend_from_slice(set.pages());
            self.attach_device(id, set);
            loaded += 1;
            tokens += len;
        }
        if let Err(e) = self.unlock_impl(NodeId(last)) {
            tracing::error!("radix cache: unlocking a loaded path: {e}");
        }
        (loaded, tokens, from_storage)
    }

    /// Adds host pages fetched from storage: `host` holds the pages of
    /// `tokens[start..]` (whole pages). The part the tree already has is
    /// dropped; nothing is added when the tree lost the prefix before
    /// `start` meanwhile. Returns the tokens added.
    pub fn insert_host(
        &mut self,
        ns: &CacheNamespace,
        tokens: &[u32],
        start: usize,
        mut host: HostPages,
    ) -> usize {
        let ps = self.page_size;
        let end = start + host.len() * ps;
        if self.tiers.is_none()
            || !start.is_multiple_of(ps)
            || end > tokens.len()
            || host.is_empty()
        {
            return 0;
        }
        let Ok(root) = self.root_or_create(ns) else {
            return 0;
        };
        let now = self.tick();
        let (node, found) = self.walk(root, &tokens[..end], now, false, None, Default::default());
        if found < start || found >= end {
            self.maybe_drop_root(root);
            return 0;
        }
        let rest = host.split_off((found - start) / ps);
        drop(host);
        let mut leaf = Node::root(now);
        leaf.parent = node;
        leaf.tokens = tokens[found..end].into();
        leaf.host = Some(rest);
        leaf.from_storage = true;
        let Some(id) = self.alloc(leaf) else {
            self.maybe_drop_root(root);
            return 0;
        };
        self.edges.insert(&self.nodes, id);
        self.node_mut(node).children += 1;
        if !self.node(node).is_root() {
            self.refresh_candidate(node);
        }
        self.live_nodes += 1;
        self.set_last_key(id);
        if let Some(t) = self.tiers.as_mut() {
            t.host_tokens += end - found;
        }
        self.refresh_candidate(id);
        end - found
    }
}
