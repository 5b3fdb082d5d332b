//! [`RadixCache`]: SGLang's RadixAttention prefix cache over an arena of nodes.
//!
//! The tree maps token sequences to the KV pages that hold them. Edges carry
//! runs of whole pages; a node owns the [`PageSet`] of its edge, so evicting a
//! node returns its pages to the pool. Nodes live in a `Vec` arena with a free
//! list, so a [`NodeId`] stays valid until its node is evicted or flushed (a
//! locked node never is; a split keeps the id on the lower part, so the id
//! still ends at the same token).
//!
//! Namespaces: the default namespace lives under the global root (id 0); every
//! other namespace has its own root, created on first insert and dropped when
//! it has no children and no locks, so namespaces never share nodes.
//!
//! Invariants (see [`RadixCache::check_invariants`]):
//! - no empty non-root node; children are keyed by their first page;
//! - `lock_ref` of a node counts the locks on it and on its descendants, so a
//!   parent's count is at least the sum of its children's;
//! - `evictable` is the token count of unlocked non-root nodes, `protected` of
//!   locked ones, and the candidate set holds exactly the unlocked leaves;
//! - every page is owned by exactly one node.
//!
//! Tiers ([`RadixCache::enable_tiers`], HiCache's host tier): a node's KV
//! lives on the device, in host memory, or both. Device residence is closed
//! upwards (a node on the device has its parent on the device), so a match
//! walks device nodes, then host-only ones, which it loads back. Evicting
//! from the device demotes a node to the host instead of dropping it; the
//! host tier evicts host-only leaves. See `tiers.rs`.

mod inspect;
mod node;
mod tiers;

pub use inspect::{MemoryUsage, NodeView};
pub use tiers::{SELECTIVE_HITS, StorageBackup, TierOptions, WritePolicy};

use crate::error::RadixError;
use crate::policy::Lru;
use arbor_engine_core::{
    CacheNamespace, EvictionPolicy, InsertOutcome, NodeId, PageSet, PrefixCache,
    PrefixCacheOptions, PrefixCacheStats, PrefixMatch, Result as CoreResult,
};
use node::{Candidate, Edges, NIL, Node};
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

/// Id of the global root (the default namespace's root).
const ROOT: u32 = 0;

/// Length of the common prefix of `a` and `b`.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    const CHUNK: usize = 16;
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut i = 0;
    while i + CHUNK <= n && a[i..i + CHUNK] == b[i..i + CHUNK] {
        i += CHUNK;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

/// What a walk collects besides its end: the device pages of the nodes it
/// passes and the nodes themselves with their start positions.
#[derive(Default)]
struct WalkOut<'a> {
    pages: Option<&'a mut Vec<u32>>,
    path: Option<&'a mut Vec<(u32, usize)>>,
}

/// A radix tree of cached KV pages with a pluggable eviction policy.
///
/// Metadata follows SGLang's `RadixCache` (0.5.23): every `match_prefix` and
/// `insert` is one tick of a logical clock and refreshes `last_access` of each
/// node on its path; `match_prefix` also counts a hit on each of them (so the
/// re-match after a chunked-prefill insert counts too; SGLang 0.5.23 counts
/// hits in `insert` instead, which only LFU and SLRU see); `insert` raises
/// each node's priority to the request's. A walk that ends inside a node
/// refreshes `last_access` of the whole node before splitting it (SGLang
/// stamps the child before `_split_node`), so the lower part carries the
/// access too; the new upper node takes the rest of the metadata of the node
/// it came from and then the walk's hit or priority, which the lower part
/// does not get. An insert that adds a leaf ticks once more for it, so the
/// leaf is newer than its path (SGLang's new node reads the clock after the
/// path's access time): of the lower part of a node it split and its new
/// sibling leaf, LRU evicts the lower part first. Under LRU no two unlocked
/// leaves ever share a `last_access`, so the node-id tie-break never decides,
/// and replaying a trace gives SGLang's matched and evicted totals exactly
/// (`tests/sglang_replay.rs`). `evict` frees whole leaves, so it may free more
/// than asked; `flush` is not counted in `evicted_tokens`.
pub struct RadixCache {
    page_size: usize,
    policy: Arc<dyn EvictionPolicy>,
    nodes: Vec<Node>,
    free: Vec<u32>,
    edges: Edges,
    candidates: BTreeSet<Candidate>,
    /// Host-only leaves that the host tier may evict (tiers only).
    host_candidates: BTreeSet<Candidate>,
    /// The host tier, when enabled.
    tiers: Option<tiers::Tiers>,
    /// Roots of the namespaces other than the default one, both ways.
    namespaces: HashMap<CacheNamespace, u32>,
    root_names: HashMap<u32, CacheNamespace>,
    /// Logical clock: one tick per match or insert, one more per new leaf.
    clock: u64,
    evictable: usize,
    protected: usize,
    live_nodes: usize,
    hit_tokens: u64,
    queried_tokens: u64,
    evicted_tokens: u64,
}

impl std::fmt::Debug for RadixCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RadixCache")
            .field("page_size", &self.page_size)
            .field("policy", &self.policy.name())
            .field("stats", &self.stats())
            .finish()
    }
}

impl RadixCache {
    /// A cache of `options.page_size`-token pages evicting in `options.policy` order.
    pub fn new(options: &PrefixCacheOptions) -> Result<Self, RadixError> {
        Self::with_policy(options.page_size, options.policy.clone())
    }

    /// A cache with the given page size and policy.
    pub fn with_policy(
        page_size: usize,
        policy: Arc<dyn EvictionPolicy>,
    ) -> Result<Self, RadixError> {
        if page_size == 0 {
            return Err(RadixError::ZeroPageSize);
        }
        Ok(Self {
            page_size,
            policy,
            nodes: vec![Node::root(0)],
            free: Vec::new(),
            edges: Edges::new(page_size),
            candidates: BTreeSet::new(),
            host_candidates: BTreeSet::new(),
            tiers: None,
            namespaces: HashMap::new(),
            root_names: HashMap::new(),
            clock: 0,
            evictable: 0,
            protected: 0,
            live_nodes: 0,
            hit_tokens: 0,
            queried_tokens: 0,
            evicted_tokens: 0,
        })
    }

    /// An LRU cache with the given page size.
    pub fn lru(page_size: usize) -> Result<Self, RadixError> {
        Self::with_policy(page_size, Arc::new(Lru))
    }

    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// The eviction policy.
    pub fn policy(&self) -> &dyn EvictionPolicy {
        &*self.policy
    }

    /// The logical clock (ticks once per `match_prefix` and `insert`, and once
    /// more for the leaf an `insert` adds).
    pub fn clock(&self) -> u64 {
        self.clock
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    fn node(&self, id: u32) -> &Node {
        &self.nodes[id as usize]
    }

    fn node_mut(&mut self, id: u32) -> &mut Node {
        &mut self.nodes[id as usize]
    }

    /// The live node named by a caller's id.
    fn checked(&self, id: NodeId) -> Result<u32, RadixError> {
        match self.nodes.get(id.0 as usize) {
            Some(n) if n.live => Ok(id.0),
            _ => Err(RadixError::UnknownNode(id.0)),
        }
    }

    fn root_of(&self, ns: &CacheNamespace) -> Option<u32> {
        if ns.0.is_none() {
            Some(ROOT)
        } else {
            self.namespaces.get(ns).copied()
        }
    }

    fn alloc(&mut self, node: Node) -> Option<u32> {
        if let Some(id) = self.free.pop() {
            self.nodes[id as usize] = node;
            Some(id)
        } else {
            let id = u32::try_from(self.nodes.len()).ok().filter(|&i| i != NIL)?;
            self.nodes.push(node);
            Some(id)
        }
    }

    fn root_or_create(&mut self, ns: &CacheNamespace) -> Result<u32, RadixError> {
        if let Some(r) = self.root_of(ns) {
            return Ok(r);
        }
        let now = self.clock;
        let mut root = Node::root(now);
        root.last_key = self.tiers.as_ref().and_then(|t| t.root_key(ns));
        let r = self.alloc(root).ok_or(RadixError::ArenaFull)?;
        self.namespaces.insert(ns.clone(), r);
        self.root_names.insert(r, ns.clone());
        Ok(r)
    }

    /// Drops a namespace root that has no children and no locks.
    fn maybe_drop_root(&mut self, r: u32) {
        let n = self.node(r);
        if r == ROOT || !n.is_root() || n.children > 0 || n.lock_ref > 0 {
            return;
        }
        if let Some(ns) = self.root_names.remove(&r) {
            self.namespaces.remove(&ns);
        }
        self.nodes[r as usize] = Node::vacant();
        self.free.push(r);
    }

    /// Puts `id` in the device or host candidate set or takes it out, as its
    /// state requires.
    fn refresh_candidate(&mut self, id: u32) {
        let n = self.node(id);
        let base = n.live && !n.is_root() && n.lock_ref == 0;
        let want_device = base && n.on_device() && n.device_children == 0;
        let want_host = base && !n.on_device() && n.host.is_some() && n.children == 0;
        let (in_device, in_host) = (n.in_candidates, n.in_host_candidates);
        if want_device == in_device && want_host == in_host {
            return;
        }
        let key = self.policy.key(&n.meta());
        let old = Candidate { key: n.key, id };
        if in_device {
            self.candidates.remove(&old);
        }
        if in_host {
            self.host_candidates.remove(&old);
        }
        let c = Candidate { key, id };
        if want_device {
            self.candidates.insert(c);
        }
        if want_host {
            self.host_candidates.insert(c);
        }
        let n = self.node_mut(id);
        n.key = key;
        n.in_candidates = want_device;
        n.in_host_candidates = want_host;
    }

    /// Records an access to `id` (a match when `hit`; an insert with `priority`).
    fn touch(&mut self, id: u32, now: u64, hit: bool, priority: Option<i64>) {
        let n = self.node(id);
        let (was, was_host) = (n.in_candidates, n.in_host_candidates);
        let old = Candidate { key: n.key, id };
        if was {
            self.candidates.remove(&old);
        }
        if was_host {
            self.host_candidates.remove(&old);
        }
        let n = self.node_mut(id);
        n.last_access = now;
        if hit {
            n.hit_count += 1;
        }
        if let Some(p) = priority {
            n.priority = n.priority.max(p);
        }
        if was || was_host {
            let key = self.policy.key(&self.node(id).meta());
            self.node_mut(id).key = key;
            if was {
                self.candidates.insert(Candidate { key, id });
            } else {
                self.host_candidates.insert(Candidate { key, id });
            }
        }
    }

    /// Splits `child` after its first `at` tokens (whole pages, `0 < at < len`).
    /// The new upper node takes the first part and returns its id; `child` keeps
    /// the rest (and its id, locks, candidacy and metadata).
    fn split(&mut self, child: u32, at: usize) -> Option<u32> {
        let upper = self.alloc(Node::vacant())?;
        self.edges.remove(&self.nodes, child);
        let ps = self.page_size;
        let c = &mut self.nodes[child as usize];
        let head_tokens: Box<[u32]> = c.tokens[..at].into();
        c.tokens = c.tokens[at..].into();
        let mut head_pages = c.pages.take();
        c.pages = head_pages.as_mut().map(|p| p.split_off(at / ps));
        // A fresh, exactly sized set for the head (split_off(0) copies the pages).
        let head_pages = head_pages.map(|mut p| p.split_off(0));
        let mut head_host = c.host.take();
        c.host = head_host.as_mut().map(|h| h.split_off(at / ps));
        let new = Node {
            parent: c.parent,
            children: 1,
            device_children: u32::from(c.pages.is_some()),
            lock_ref: c.lock_ref,
            live: true,
            in_candidates: false,
            in_host_candidates: false,
            tokens: head_tokens,
            pages: head_pages,
            host: head_host,
            from_storage: c.from_storage,
            last_key: None,
            last_access: c.last_access,
            created: c.created,
            hit_count: c.hit_count,
            priority: c.priority,
            key: c.key,
        };
        c.parent = upper;
        self.nodes[upper as usize] = new;
        self.edges.insert(&self.nodes, upper);
        self.edges.insert(&self.nodes, child);
        self.live_nodes += 1;
        self.set_last_key(upper);
        Some(upper)
    }

    /// Follows `tokens` (whole pages) down from `root`, splitting the node
    /// where the match ends inside it and touching every node on the path
    /// (the split node's lower part gets only the new `last_access`).
    /// Returns the last node reached and the tokens matched; appends the
    /// path's pages to `pages_out`.
    fn walk(
        &mut self,
        root: u32,
        tokens: &[u32],
        now: u64,
        hit: bool,
        priority: Option<i64>,
        mut out: WalkOut<'_>,
    ) -> (u32, usize) {
        let ps = self.page_size;
        let (mut node, mut pos) = (root, 0);
        while pos < tokens.len() {
            let rest = &tokens[pos..];
            let Some(child) = self.edges.find(&self.nodes, node, &rest[..ps]) else {
                break;
            };
            let edge = &self.node(child).tokens;
            let edge_len = edge.len();
            let m = common_prefix(edge, rest) / ps * ps;
            let target = if m < edge_len {
                self.touch(child, now, false, None);
                match self.split(child, m) {
                    Some(upper) => upper,
                    None => break,
                }
            } else {
                child
            };
            self.touch(target, now, hit, priority);
            if let Some(pages) = out.pages.as_deref_mut() {
                pages.extend_from_slice(self.node(target).page_ids());
            }
            if let Some(p) = out.path.as_deref_mut() {
                p.push((target, pos));
            }
            node = target;
            pos += m;
            if m < edge_len {
                break;
            }
        }
        (node, pos)
    }

    /// Removes the unlocked leaf `id`, freeing its device and host pages;
    /// returns the tokens it held on the device.
    fn remove_leaf(&mut self, id: u32) -> usize {
        let old = Candidate {
            key: self.node(id).key,
            id,
        };
        if self.node(id).in_candidates {
            self.candidates.remove(&old);
        }
        if self.node(id).in_host_candidates {
            self.host_candidates.remove(&old);
        }
        self.edges.remove(&self.nodes, id);
        let n = std::mem::replace(&mut self.nodes[id as usize], Node::vacant());
        self.free.push(id);
        let len = n.device_tokens();
        self.evictable -= len;
        if let Some(t) = self.tiers.as_mut() {
            t.host_tokens -= n.host_tokens();
            if let Some(h) = &n.host {
                t.forget_copies(h.slots());
            }
        }
        self.live_nodes -= 1;
        let parent = n.parent;
        let on_device = n.on_device();
        drop(n); // returns the pages to the pools
        let p = self.node_mut(parent);
        p.children -= 1;
        if on_device {
            p.device_children -= 1;
        }
        if p.is_root() {
            self.maybe_drop_root(parent);
        } else {
            self.refresh_candidate(parent);
        }
        len
    }

    /// Frees device tokens until `n_tokens` are freed or no candidate is
    /// left. With tiers and `demote`, a node moves to the host tier instead
    /// of being dropped when the host can take it.
    fn evict_inner(&mut self, n_tokens: usize, demote: bool) -> usize {
        let mut freed = 0;
        while freed < n_tokens {
            let Some(c) = self.candidates.pop_first() else {
                break;
            };
            self.node_mut(c.id).in_candidates = false;
            if demote
                && self.tiers.is_some()
                && let Some(len) = self.demote(c.id)
            {
                freed += len;
                continue;
            }
            freed += if self.node(c.id).children == 0 {
                self.remove_leaf(c.id)
            } else {
                self.remove_with_host_subtree(c.id)
            };
        }
        freed
    }

    fn insert_impl(
        &mut self,
        ns: &CacheNamespace,
        tokens: &[u32],
        cached_prefix: usize,
        mut pages: PageSet,
        priority: i64,
    ) -> Result<InsertOutcome, RadixError> {
        let ps = self.page_size;
        if !cached_prefix.is_multiple_of(ps) || cached_prefix > tokens.len() {
            return Err(RadixError::BadPrefix {
                prefix: cached_prefix,
                tokens: tokens.len(),
                page_size: ps,
            });
        }
        let expected = (tokens.len() - cached_prefix).div_ceil(ps);
        if pages.len() != expected {
            return Err(RadixError::PageCount {
                got: pages.len(),
                expected,
                prefix: cached_prefix,
                tokens: tokens.len(),
                page_size: ps,
            });
        }
        let aligned = tokens.len() / ps * ps;
        drop(pages.split_off((aligned - cached_prefix) / ps)); // the unaligned tail
        let now = self.tick();
        if aligned == 0 {
            let node = self.root_of(ns).unwrap_or(ROOT);
            return Ok(InsertOutcome {
                already_cached: 0,
                cached: 0,
                node: NodeId(node),
            });
        }
        let existed = self.root_of(ns).is_some();
        if !existed && cached_prefix > 0 {
            return Err(RadixError::PrefixNotCached {
                prefix: cached_prefix,
                found: 0,
            });
        }
        let root = self.root_or_create(ns)?;
        let tokens = &tokens[..aligned];
        let mut path = self.tiers.is_some().then(Vec::new);
        let out = WalkOut {
            pages: None,
            path: path.as_mut(),
        };
        let walked = self.walk(root, tokens, now, false, Some(priority), out);
        let (node, found) = walked;
        if found < cached_prefix {
            self.maybe_drop_root(root);
            return Err(RadixError::PrefixNotCached {
                prefix: cached_prefix,
                found,
            });
        }
        // Pages duplicating cached KV go back to the pool, except those of
        // nodes whose KV is only on the host: they are on the device again.
        for &(id, start) in path.iter().flatten() {
            if start < cached_prefix {
                continue;
            }
            let tail = pages.split_off(self.node(id).tokens.len() / ps);
            let here = std::mem::replace(&mut pages, tail);
            if !self.node(id).on_device() {
                self.attach_device(id, here);
            }
        }
        let rest = if path.is_some() {
            pages
        } else {
            pages.split_off((found - cached_prefix) / ps)
        };
        let mut end = node;
        if found < aligned {
            let leaf = Node::new(node, tokens[found..].into(), rest, self.tick(), priority);
            let Some(id) = self.alloc(leaf) else {
                self.maybe_drop_root(root);
                return Err(RadixError::ArenaFull);
            };
            self.edges.insert(&self.nodes, id);
            let parent = self.node_mut(node);
            parent.children += 1;
            parent.device_children += 1;
            self.refresh_candidate(node);
            self.evictable += aligned - found;
            self.live_nodes += 1;
            self.set_last_key(id);
            self.refresh_candidate(id);
            if self
                .tiers
                .as_ref()
                .is_some_and(|t| t.policy == WritePolicy::WriteThrough)
            {
                self.backup(id);
            }
            end = id;
        }
        Ok(InsertOutcome {
            already_cached: found,
            cached: aligned,
            node: NodeId(end),
        })
    }

    fn lock_impl(&mut self, id: NodeId) -> Result<(), RadixError> {
        let start = self.checked(id)?;
        // The root of the path carries the largest count.
        let mut top = start;
        while !self.node(top).is_root() {
            top = self.node(top).parent;
        }
        if self.node(top).lock_ref == u32::MAX {
            return Err(RadixError::LockOverflow(id.0));
        }
        let mut x = start;
        loop {
            let n = self.node_mut(x);
            n.lock_ref += 1;
            if n.is_root() {
                break;
            }
            let parent = n.parent;
            if n.lock_ref == 1 {
                let len = n.device_tokens();
                self.evictable -= len;
                self.protected += len;
                self.refresh_candidate(x);
            }
            x = parent;
        }
        Ok(())
    }

    fn unlock_impl(&mut self, id: NodeId) -> Result<(), RadixError> {
        let start = self.checked(id)?;
        if self.node(start).lock_ref == 0 {
            return Err(RadixError::NotLocked(id.0));
        }
        let mut x = start;
        loop {
            let n = self.node_mut(x);
            n.lock_ref -= 1;
            if n.is_root() {
                self.maybe_drop_root(x);
                break;
            }
            let parent = n.parent;
            if n.lock_ref == 0 {
                let len = n.device_tokens();
                self.protected -= len;
                self.evictable += len;
                self.refresh_candidate(x);
            }
            x = parent;
        }
        Ok(())
    }
}

impl PrefixCache for RadixCache {
    fn name(&self) -> &str {
        "radix"
    }

    fn eviction_policy(&self) -> Option<Arc<dyn EvictionPolicy>> {
        Some(self.policy.clone())
    }

    fn peek_prefix(&self, ns: &CacheNamespace, tokens: &[u32]) -> usize {
        RadixCache::peek_prefix(self, ns, tokens)
    }

    fn match_prefix(&mut self, ns: &CacheNamespace, tokens: &[u32]) -> PrefixMatch {
        self.queried_tokens += tokens.len() as u64;
        let aligned = tokens.len() / self.page_size * self.page_size;
        let root = self.root_of(ns);
        let Some(root) = root.filter(|_| aligned > 0) else {
            return PrefixMatch::empty(NodeId(root.unwrap_or(ROOT)));
        };
        let now = self.tick();
        let mut pages = Vec::new();
        let mut path = self.tiers.is_some().then(Vec::new);
        let out = WalkOut {
            pages: Some(&mut pages),
            path: path.as_mut(),
        };
        let (node, matched) = self.walk(root, &tokens[..aligned], now, true, None, out);
        let m = match path {
            Some(path) => self.finish_tiered_match(&path, pages, node),
            None => PrefixMatch {
                pages,
                matched_tokens: matched,
                node: NodeId(node),
                host_tokens: 0,
                storage_tokens: 0,
            },
        };
        self.hit_tokens += m.matched_tokens as u64;
        m
    }

    fn insert(
        &mut self,
        ns: &CacheNamespace,
        tokens: &[u32],
        pages: PageSet,
        priority: i64,
    ) -> CoreResult<InsertOutcome> {
        Ok(self.insert_impl(ns, tokens, 0, pages, priority)?)
    }

    fn insert_with_prefix(
        &mut self,
        ns: &CacheNamespace,
        tokens: &[u32],
        cached_prefix: usize,
        pages: PageSet,
        priority: i64,
    ) -> CoreResult<InsertOutcome> {
        Ok(self.insert_impl(ns, tokens, cached_prefix, pages, priority)?)
    }

    fn lock(&mut self, node: NodeId) -> CoreResult<()> {
        Ok(self.lock_impl(node)?)
    }

    fn unlock(&mut self, node: NodeId) -> CoreResult<()> {
        Ok(self.unlock_impl(node)?)
    }

    fn evict(&mut self, n_tokens: usize) -> usize {
        let freed = self.evict_inner(n_tokens, true);
        self.evicted_tokens += freed as u64;
        freed
    }

    fn stats(&self) -> PrefixCacheStats {
        PrefixCacheStats {
            cached_tokens: self.evictable + self.protected,
            evictable_tokens: self.evictable,
            protected_tokens: self.protected,
            nodes: self.live_nodes,
            hit_tokens: self.hit_tokens,
            queried_tokens: self.queried_tokens,
            evicted_tokens: self.evicted_tokens,
            tiers: self.tier_stats(),
        }
    }

    fn flush(&mut self) {
        // Every unlocked node is an unlocked leaf or becomes one as its
        // children go, so evicting without a limit removes exactly them;
        // then the host-only nodes left under locked paths go.
        self.evict_inner(usize::MAX, false);
        self.evict_host(usize::MAX);
    }

    fn dump(&self) -> String {
        self.dump_tree()
    }

    fn bind_pool(&mut self, pool: &arbor_engine_core::PagePool) -> CoreResult<()> {
        if let Some(t) = self.tiers.as_mut() {
            t.pool = Some(pool.clone());
        }
        Ok(())
    }

    fn take_kv_ops(&mut self) -> arbor_engine_core::KvTierOps {
        self.tiers
            .as_mut()
            .map(tiers::Tiers::take_ops)
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests;
