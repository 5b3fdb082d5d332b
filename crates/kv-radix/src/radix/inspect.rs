//! Read-only views of a [`RadixCache`]: node listing, side-effect-free prefix
//! lookup, the debug dump, memory accounting and the invariant checker.
//!
//! Nothing here changes the tree or its metadata, so tests and metrics can
//! call these at any point without disturbing eviction order.

use super::node::Node;
use super::{ROOT, RadixCache, common_prefix};
use arbor_engine_core::{CacheNamespace, NodeId, NodeMeta};
use std::collections::{BTreeSet, HashMap, HashSet};
use std::fmt::Write as _;

static DEFAULT_NAMESPACE: CacheNamespace = CacheNamespace(None);

/// A live node as seen from outside.
#[derive(Clone, Copy, Debug)]
pub struct NodeView<'a> {
    /// The node's id.
    pub id: NodeId,
    /// Its parent; `None` for a root.
    pub parent: Option<NodeId>,
    /// For a root, the namespace it serves.
    pub namespace: Option<&'a CacheNamespace>,
    /// Tokens on the edge from the parent (whole pages; empty for roots).
    pub tokens: &'a [u32],
    /// KV pages of those tokens.
    pub pages: &'a [u32],
    /// Locks on the node and its descendants.
    pub lock_ref: u32,
    /// Live children.
    pub children: usize,
    /// What the eviction policy sees.
    pub meta: NodeMeta,
}

/// Bytes of host memory the cache's metadata takes (everything but the KV itself).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryUsage {
    /// Node slots (live and free) and the free list.
    pub arena: usize,
    /// Token ids of the edges.
    pub tokens: usize,
    /// Page indices held by nodes.
    pub pages: usize,
    /// The child-edge hash table (estimated from its capacity).
    pub edges: usize,
    /// The eviction candidate set (estimated: B-tree nodes about two-thirds full).
    pub candidates: usize,
    /// The namespace map.
    pub namespaces: usize,
}

impl MemoryUsage {
    /// Sum of all parts.
    pub fn total(&self) -> usize {
        self.arena + self.tokens + self.pages + self.edges + self.candidates + self.namespaces
    }
}

impl RadixCache {
    fn view<'a>(
        &'a self,
        id: u32,
        n: &'a Node,
        names: &HashMap<u32, &'a CacheNamespace>,
    ) -> NodeView<'a> {
        let root = n.is_root();
        NodeView {
            id: NodeId(id),
            parent: (!root).then_some(NodeId(n.parent)),
            namespace: if !root {
                None
            } else if id == ROOT {
                Some(&DEFAULT_NAMESPACE)
            } else {
                names.get(&id).copied()
            },
            tokens: &n.tokens,
            pages: n.page_ids(),
            lock_ref: n.lock_ref,
            children: n.children as usize,
            meta: n.meta(),
        }
    }

    fn root_names(&self) -> HashMap<u32, &CacheNamespace> {
        self.root_names.iter().map(|(&r, ns)| (r, ns)).collect()
    }

    /// Every live node (roots included), in id order.
    pub fn nodes(&self) -> Vec<NodeView<'_>> {
        let names = self.root_names();
        self.nodes
            .iter()
            .enumerate()
            .filter(|(_, n)| n.live)
            .map(|(i, n)| self.view(i as u32, n, &names))
            .collect()
    }

    /// The live node `id`, if any.
    pub fn node_view(&self, id: NodeId) -> Option<NodeView<'_>> {
        let n = self.nodes.get(id.0 as usize).filter(|n| n.live)?;
        Some(self.view(id.0, n, &self.root_names()))
    }

    /// Length of the longest cached whole-page prefix of `tokens`, without
    /// splitting nodes or refreshing access times (for schedulers that only
    /// rank requests, and for tests).
    pub fn peek_prefix(&self, ns: &CacheNamespace, tokens: &[u32]) -> usize {
        let ps = self.page_size;
        let tokens = &tokens[..tokens.len() / ps * ps];
        let Some(mut node) = self.root_of(ns) else {
            return 0;
        };
        let mut pos = 0;
        while pos < tokens.len() {
            let rest = &tokens[pos..];
            let Some(child) = self.edges.find(&self.nodes, node, &rest[..ps]) else {
                break;
            };
            let edge = &self.node(child).tokens;
            let m = common_prefix(edge, rest) / ps * ps;
            pos += m;
            if m < edge.len() {
                break;
            }
            node = child;
        }
        pos
    }

    /// Host memory taken by the cache's own structures.
    pub fn memory_usage(&self) -> MemoryUsage {
        let mut m = MemoryUsage {
            arena: self.nodes.capacity() * std::mem::size_of::<Node>()
                + self.free.capacity() * std::mem::size_of::<u32>(),
            edges: self.edges.memory_bytes(),
            candidates: self.candidates.len() * std::mem::size_of::<super::node::Candidate>() * 3
                / 2,
            ..MemoryUsage::default()
        };
        for n in self.nodes.iter().filter(|n| n.live) {
            m.tokens += std::mem::size_of_val(&n.tokens[..]);
            m.pages += std::mem::size_of_val(n.page_ids());
        }
        for ns in self.namespaces.keys() {
            // Each namespace is in both maps.
            m.namespaces += 2
                * (std::mem::size_of::<(CacheNamespace, u32)>()
                    + ns.0.as_ref().map_or(0, |s| s.capacity()));
        }
        m
    }

    /// A readable dump: a summary line, then each namespace's tree, children
    /// sorted by their first token.
    pub(super) fn dump_tree(&self) -> String {
        let s = arbor_engine_core::PrefixCache::stats(self);
        let mut out = format!(
            "radix cache: page size {}, policy {}, {} nodes, {} cached tokens \
             ({} evictable, {} protected), hits {}/{} tokens, {} evicted\n",
            self.page_size,
            self.policy.name(),
            s.nodes,
            s.cached_tokens,
            s.evictable_tokens,
            s.protected_tokens,
            s.hit_tokens,
            s.queried_tokens,
            s.evicted_tokens
        );
        let mut kids: HashMap<u32, Vec<u32>> = HashMap::new();
        for (i, n) in self.nodes.iter().enumerate() {
            if n.live && !n.is_root() {
                kids.entry(n.parent).or_default().push(i as u32);
            }
        }
        for v in kids.values_mut() {
            v.sort_by_key(|&c| (self.node(c).tokens.first().copied(), c));
        }
        let mut roots: Vec<(String, u32)> = vec![("default".into(), ROOT)];
        let mut named: Vec<(String, u32)> = self
            .namespaces
            .iter()
            .map(|(ns, &r)| (format!("{:?}", ns.0.as_deref().unwrap_or_default()), r))
            .collect();
        named.sort();
        roots.extend(named);
        for (name, r) in roots {
            let root = self.node(r);
            let _ = writeln!(out, "namespace {name}: root #{r} lock={}", root.lock_ref);
            let mut stack: Vec<(u32, usize)> = kids
                .get(&r)
                .map(|v| v.iter().rev().map(|&c| (c, 1)).collect())
                .unwrap_or_default();
            while let Some((id, depth)) = stack.pop() {
                let n = self.node(id);
                let more = if n.tokens.len() > 8 { " …" } else { "" };
                let toks: Vec<String> = n.tokens.iter().take(8).map(u32::to_string).collect();
                let pages = n.page_ids();
                let pmore = if pages.len() > 4 { " …" } else { "" };
                let pgs: Vec<String> = pages.iter().take(4).map(u32::to_string).collect();
                let _ = writeln!(
                    out,
                    "{:indent$}#{id} {} tokens [{}{more}] pages [{}{pmore}] lock={} hits={} \
                     last={} created={} prio={}",
                    "",
                    n.tokens.len(),
                    toks.join(" "),
                    pgs.join(" "),
                    n.lock_ref,
                    n.hit_count,
                    n.last_access,
                    n.created,
                    n.priority,
                    indent = 2 * depth
                );
                if let Some(v) = kids.get(&id) {
                    stack.extend(v.iter().rev().map(|&c| (c, depth + 1)));
                }
            }
        }
        out
    }

    /// Checks every structural invariant (O(nodes)); returns the first violation.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.check_roots()?;
        let mut recount = Recount::new(self.nodes.len());
        for (i, n) in self.nodes.iter().enumerate() {
            let id = i as u32;
            if !n.live || n.is_root() {
                if n.in_candidates || n.in_host_candidates {
                    return Err(format!("#{id} is a candidate but a root or free"));
                }
                continue;
            }
            self.check_node(id, n, &mut recount)?;
        }
        self.check_totals(&recount)
    }

    /// The global root, the free list, and the namespace roots and maps.
    fn check_roots(&self) -> Result<(), String> {
        let root = self.nodes.first().ok_or("no global root")?;
        if !root.live || !root.is_root() {
            return Err("the global root is not a live root".into());
        }
        let free: HashSet<u32> = self.free.iter().copied().collect();
        if free.len() != self.free.len() {
            return Err("a slot is on the free list twice".into());
        }
        let vacant = self.nodes.iter().filter(|n| !n.live).count();
        if vacant != free.len() || free.iter().any(|&f| self.nodes[f as usize].live) {
            return Err(format!(
                "{vacant} vacant slots but free list {:?}",
                self.free
            ));
        }
        for (ns, &r) in &self.namespaces {
            let n = self
                .nodes
                .get(r as usize)
                .ok_or("namespace root out of range")?;
            if r == ROOT || !n.live || !n.is_root() || ns.0.is_none() {
                return Err(format!("namespace {ns:?} has a bad root #{r}"));
            }
            if n.children == 0 && n.lock_ref == 0 {
                return Err(format!("namespace {ns:?} root #{r} is empty and unlocked"));
            }
        }
        let roots = self.nodes.iter().filter(|n| n.live && n.is_root()).count();
        let both_ways = self.root_names.len() == self.namespaces.len()
            && self
                .namespaces
                .iter()
                .all(|(ns, r)| self.root_names.get(r) == Some(ns));
        if !both_ways {
            return Err("the namespace maps disagree".into());
        }
        if roots != self.namespaces.len() + 1 {
            return Err(format!(
                "{roots} roots for {} namespaces",
                self.namespaces.len()
            ));
        }
        Ok(())
    }

    /// One live non-root node: its pages on each tier, its parent, its place
    /// under its parent's edges and in the candidate sets; adds it to `r`.
    fn check_node(&self, id: u32, n: &Node, r: &mut Recount) -> Result<(), String> {
        let ps = self.page_size;
        let t = n.tokens.len();
        let host_pages = n.host.as_ref().map_or(0, |h| h.len());
        let device_ok = !n.on_device() || n.page_ids().len() * ps == t;
        let host_ok = n.host.is_none() || host_pages * ps == t;
        if t == 0
            || !t.is_multiple_of(ps)
            || !device_ok
            || !host_ok
            || n.pages.is_none() && n.host.is_none()
        {
            return Err(format!(
                "#{id} has {t} tokens, {} device and {host_pages} host pages (page size {ps})",
                n.page_ids().len()
            ));
        }
        if let Some(h) = &n.host {
            if self.tiers.is_none() {
                return Err(format!("#{id} has host pages without tiers"));
            }
            for s in h.slots() {
                if !r.host_slots.insert(s.slot) {
                    return Err(format!("host slot {} is owned twice", s.slot));
                }
            }
            r.host_tokens += t;
        }
        for &p in n.page_ids() {
            if !r.pages.insert(p) {
                return Err(format!("page {p} is owned twice (again by #{id})"));
            }
        }
        let parent = self.nodes.get(n.parent as usize).filter(|p| p.live);
        let Some(parent) = parent else {
            return Err(format!("#{id} has a dead parent #{}", n.parent));
        };
        r.children[n.parent as usize] += 1;
        r.lock_sum[n.parent as usize] += u64::from(n.lock_ref);
        let dt = n.device_tokens();
        if n.on_device() {
            r.device_children[n.parent as usize] += 1;
            if !parent.is_root() && !parent.on_device() {
                return Err(format!("#{id} is on the device but its parent is not"));
            }
        }
        if n.lock_ref == 0 {
            r.evictable += dt;
        } else {
            r.protected += dt;
        }
        r.live += 1;
        if self.edges.find(&self.nodes, n.parent, &n.tokens[..ps]) != Some(id) {
            return Err(format!("#{id} is not found under its first page"));
        }
        self.check_candidacy(id, n, r)?;
        // The parent chain reaches a root.
        let (mut x, mut steps) = (n.parent, 0);
        while !self.nodes[x as usize].is_root() {
            x = self.nodes[x as usize].parent;
            steps += 1;
            if steps > self.nodes.len() {
                return Err(format!("#{id} is on a cycle"));
            }
        }
        Ok(())
    }

    /// A node is a device candidate exactly when it is an unlocked device
    /// leaf, a host candidate exactly when it is an unlocked host-only leaf,
    /// each under its current policy key.
    fn check_candidacy(&self, id: u32, n: &Node, r: &mut Recount) -> Result<(), String> {
        let leaf_unlocked = n.lock_ref == 0 && n.device_children == 0 && n.on_device();
        let host_leaf = n.lock_ref == 0 && n.children == 0 && !n.on_device();
        if leaf_unlocked != n.in_candidates || host_leaf != n.in_host_candidates {
            return Err(format!(
                "#{id}: unlocked device leaf {leaf_unlocked} / host leaf {host_leaf} but \
                 candidate {} / {}",
                n.in_candidates, n.in_host_candidates
            ));
        }
        if host_leaf {
            r.want_host += 1;
            let c = super::node::Candidate { key: n.key, id };
            let key = self.policy.key(&n.meta());
            if key.total_cmp(&n.key).is_ne() || !self.host_candidates.contains(&c) {
                return Err(format!("#{id} is missing from the host candidates"));
            }
        }
        if leaf_unlocked {
            r.want_candidates += 1;
            let key = self.policy.key(&n.meta());
            let c = super::node::Candidate { key: n.key, id };
            if key.total_cmp(&n.key).is_ne() || !self.candidates.contains(&c) {
                return Err(format!(
                    "#{id} is missing from the candidates or has a stale key"
                ));
            }
        }
        Ok(())
    }

    /// The recount against the nodes' child counts and locks, the edge and
    /// candidate sets, and the cache's counters.
    fn check_totals(&self, r: &Recount) -> Result<(), String> {
        for (i, n) in self.nodes.iter().enumerate().filter(|(_, n)| n.live) {
            if n.children != r.children[i] || n.device_children != r.device_children[i] {
                return Err(format!(
                    "#{i} counts {} children ({} on the device), has {} ({})",
                    n.children, n.device_children, r.children[i], r.device_children[i]
                ));
            }
            if u64::from(n.lock_ref) < r.lock_sum[i] {
                return Err(format!(
                    "#{i} has lock_ref {} below its children's {}",
                    n.lock_ref, r.lock_sum[i]
                ));
            }
        }
        let live = r.live;
        if self.edges.len() != live {
            return Err(format!("{} edges for {live} nodes", self.edges.len()));
        }
        let want_candidates = r.want_candidates;
        if self.candidates.len() != want_candidates {
            return Err(format!(
                "{} candidates, {want_candidates} unlocked leaves",
                self.candidates.len()
            ));
        }
        let seen: BTreeSet<u32> = self.candidates.iter().map(|c| c.id).collect();
        if seen.len() != self.candidates.len() {
            return Err("a node is a candidate twice".into());
        }
        let want_host = r.want_host;
        if self.host_candidates.len() != want_host {
            return Err(format!(
                "{} host candidates, {want_host} unlocked host-only leaves",
                self.host_candidates.len()
            ));
        }
        let counted_host = self.tiers.as_ref().map_or(0, |t| t.host_tokens);
        let host_tokens = r.host_tokens;
        if host_tokens != counted_host {
            return Err(format!(
                "host tokens: recount {host_tokens}, counter {counted_host}"
            ));
        }
        let (evictable, protected) = (r.evictable, r.protected);
        if (evictable, protected, live) != (self.evictable, self.protected, self.live_nodes) {
            return Err(format!(
                "recount: evictable {evictable}, protected {protected}, nodes {live}; \
                 counters: {}, {}, {}",
                self.evictable, self.protected, self.live_nodes
            ));
        }
        Ok(())
    }
}

/// What [`RadixCache::check_invariants`] recounts from the nodes, to compare
/// with the cache's counters and each node's own counts.
struct Recount {
    /// Per slot: live children, children on the device, and the sum of the
    /// children's locks.
    children: Vec<u32>,
    device_children: Vec<u32>,
    lock_sum: Vec<u64>,
    /// Device pages and host slots seen (each owned once).
    pages: HashSet<u32>,
    host_slots: HashSet<u32>,
    host_tokens: usize,
    /// Device tokens of unlocked and of locked nodes.
    evictable: usize,
    protected: usize,
    /// Live non-root nodes.
    live: usize,
    /// Unlocked device leaves and unlocked host-only leaves.
    want_candidates: usize,
    want_host: usize,
}

impl Recount {
    fn new(slots: usize) -> Self {
        Recount {
            children: vec![0; slots],
            device_children: vec![0; slots],
            lock_sum: vec![0; slots],
            pages: HashSet::new(),
            host_slots: HashSet::new(),
            host_tokens: 0,
            evictable: 0,
            protected: 0,
            live: 0,
            want_candidates: 0,
            want_host: 0,
        }
    }
}
