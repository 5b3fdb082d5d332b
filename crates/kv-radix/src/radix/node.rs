//! The radix tree's storage: arena nodes, the child-edge table and eviction candidates.
//!
//! Invariants (checked by `RadixCache::check_invariants`):
//! - A live non-root node has a non-empty edge of whole pages and owns exactly
//!   one page per `page_size` tokens of it; roots have no tokens and no pages.
//! - [`Edges`] holds one entry per live non-root node, found by
//!   `(parent, first page of its tokens)`; siblings never share a first page.
//!   An entry stores only the child's id: hash and equality read the arena, so
//!   a node's `parent` and first page must not change while it is in the table.
//! - A node is in the device candidate set exactly when it is a live non-root
//!   node with device pages, no lock and no child with device pages, under
//!   the key stored in its `key` field (without tiers: an unlocked leaf).
//! - With tiers, a node is in the host candidate set exactly when it is a
//!   live non-root leaf with host pages, no device pages and no lock.

use arbor_engine_core::{EvictionKey, HostPages, NodeMeta, PageKey, PageSet};
use hashbrown::{DefaultHashBuilder, HashTable};
use std::cmp::Ordering;
use std::hash::BuildHasher;

/// "No node": the parent of a root.
pub(crate) const NIL: u32 = u32::MAX;

/// One slot of the arena.
pub(crate) struct Node {
    /// Parent id, [`NIL`] for a root (the global root or a namespace root).
    pub parent: u32,
    /// Live children.
    pub children: u32,
    /// Live children that hold device pages.
    pub device_children: u32,
    /// Locks taken on this node or any descendant.
    pub lock_ref: u32,
    /// The slot holds a node (false: on the free list).
    pub live: bool,
    /// In the device eviction candidate set (under `key`).
    pub in_candidates: bool,
    /// In the host eviction candidate set (under `key`).
    pub in_host_candidates: bool,
    /// Tokens on the edge from the parent (whole pages).
    pub tokens: Box<[u32]>,
    /// The device KV pages of `tokens`; `None` for roots, free slots and
    /// nodes whose KV lives only in the host tier.
    pub pages: Option<PageSet>,
    /// Host-tier copies of the pages (tiers only).
    pub host: Option<HostPages>,
    /// The host pages came from the storage tier.
    pub from_storage: bool,
    /// Chained key of the node's last page (of its namespace root's chain
    /// start for a root); kept when a storage tier needs keys.
    pub last_key: Option<PageKey>,
    /// Logical time of the last match or insert through this node.
    pub last_access: u64,
    /// Logical time of creation.
    pub created: u64,
    /// Matches that reached this node.
    pub hit_count: u64,
    /// Highest priority of the inserts through this node.
    pub priority: i64,
    /// Eviction key while a candidate.
    pub key: EvictionKey,
}

impl Node {
    /// A root (global or namespace).
    pub fn root(now: u64) -> Self {
        Self {
            parent: NIL,
            children: 0,
            device_children: 0,
            lock_ref: 0,
            live: true,
            in_candidates: false,
            in_host_candidates: false,
            tokens: Box::new([]),
            pages: None,
            host: None,
            from_storage: false,
            last_key: None,
            last_access: now,
            created: now,
            hit_count: 0,
            priority: i64::MIN,
            key: EvictionKey(0.0, 0.0),
        }
    }

    /// A new node under `parent`.
    pub fn new(parent: u32, tokens: Box<[u32]>, pages: PageSet, now: u64, priority: i64) -> Self {
        Self {
            parent,
            tokens,
            pages: Some(pages),
            priority,
            ..Self::root(now)
        }
    }

    /// An empty slot on the free list.
    pub fn vacant() -> Self {
        Self {
            live: false,
            ..Self::root(0)
        }
    }

    /// True for the global root and namespace roots.
    pub fn is_root(&self) -> bool {
        self.parent == NIL
    }

    /// Device page indices of the edge (empty when the KV is only on the host).
    pub fn page_ids(&self) -> &[u32] {
        self.pages.as_ref().map(PageSet::pages).unwrap_or(&[])
    }

    /// The KV is on the device.
    pub fn on_device(&self) -> bool {
        self.pages.is_some()
    }

    /// Tokens whose KV is on the device (the edge, or none).
    pub fn device_tokens(&self) -> usize {
        if self.on_device() {
            self.tokens.len()
        } else {
            0
        }
    }

    /// Tokens whose KV has a host copy.
    pub fn host_tokens(&self) -> usize {
        if self.host.is_some() {
            self.tokens.len()
        } else {
            0
        }
    }

    /// What the eviction policy sees.
    pub fn meta(&self) -> NodeMeta {
        NodeMeta {
            last_access: self.last_access,
            created: self.created,
            hit_count: self.hit_count,
            priority: self.priority,
            tokens: self.tokens.len(),
        }
    }
}

/// An entry of the candidate set: ordered by key, then id.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Candidate {
    pub key: EvictionKey,
    pub id: u32,
}

impl PartialEq for Candidate {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Candidate {}
impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Candidate {
    fn cmp(&self, other: &Self) -> Ordering {
        self.key.total_cmp(&other.key).then(self.id.cmp(&other.id))
    }
}

/// Child edges of every node in one table keyed by `(parent, first page)`.
pub(crate) struct Edges {
    table: HashTable<u32>,
    hasher: DefaultHashBuilder,
    page_size: usize,
}

impl Edges {
    pub fn new(page_size: usize) -> Self {
        Self {
            table: HashTable::new(),
            hasher: DefaultHashBuilder::default(),
            page_size,
        }
    }

    fn hash(&self, parent: u32, first_page: &[u32]) -> u64 {
        self.hasher.hash_one((parent, first_page))
    }

    fn hash_of(&self, nodes: &[Node], id: u32) -> u64 {
        let n = &nodes[id as usize];
        self.hash(n.parent, &n.tokens[..self.page_size])
    }

    /// The child of `parent` whose edge starts with `first_page` (`page_size` tokens).
    pub fn find(&self, nodes: &[Node], parent: u32, first_page: &[u32]) -> Option<u32> {
        let h = self.hash(parent, first_page);
        self.table
            .find(h, |&c| {
                let n = &nodes[c as usize];
                n.parent == parent && *first_page == n.tokens[..first_page.len()]
            })
            .copied()
    }

    /// Adds the edge of `id` (already placed in `nodes`, with no sibling sharing its first page).
    pub fn insert(&mut self, nodes: &[Node], id: u32) {
        let h = self.hash_of(nodes, id);
        let (hasher, ps) = (&self.hasher, self.page_size);
        self.table.insert_unique(h, id, |&c| {
            let n = &nodes[c as usize];
            hasher.hash_one((n.parent, &n.tokens[..ps]))
        });
    }

    /// Removes the edge of `id` (whose `parent` and tokens are still those it was added with).
    pub fn remove(&mut self, nodes: &[Node], id: u32) -> bool {
        let h = self.hash_of(nodes, id);
        match self.table.find_entry(h, |&c| c == id) {
            Ok(entry) => {
                entry.remove();
                true
            }
            Err(_) => false,
        }
    }

    /// Edges held.
    pub fn len(&self) -> usize {
        self.table.len()
    }

    /// Approximate bytes of the table: one id and one control byte per bucket.
    pub fn memory_bytes(&self) -> usize {
        let cap = self.table.capacity();
        if cap == 0 {
            return 0;
        }
        // hashbrown keeps at most 7/8 of its power-of-two buckets full.
        let buckets = (cap * 8 / 7).next_power_of_two();
        buckets * (std::mem::size_of::<u32>() + 1)
    }
}
