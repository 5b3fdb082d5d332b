//! The shared n-gram trie: an arena of nodes, recency-ordered child lists, an
//! exact LRU order kept lazily, and eviction of least recently used subtrees.
//!
//! A node at depth `d` stands for one `d`-token n-gram (the tokens on its path
//! from the root); its `freq` counts the occurrences of that n-gram seen since
//! the node was created, and it is *touched* each time an occurrence ends at
//! an observed token. Children are kept in a doubly linked list in recency
//! order (most recently touched first), and every node caches its `best`
//! child: the highest `freq`, ties going to the most recent. A node with more
//! than [`HUB`] children is a *hub*: its children are also indexed in one edge
//! map (others are found by scanning their short list), and, when the trie is
//! built with `top_k > 0`, it caches its `top_k` best children in order.
//!
//! Recency is a stamp per node plus a queue of `(node, stamp)` in touch
//! order; an entry whose stamp is no longer its node's is stale. The first
//! fresh entry is therefore the exact least recently used node. The queue is
//! compacted when it holds twice as many entries as live nodes.
//!
//! Invariants (checked by `check` in tests):
//! - every live non-root node is in its parent's child list once, its depth is
//!   its parent's plus one, and its parent's `child_count` counts it; it is in
//!   the edge map under `(parent, token)` exactly when its parent is a hub;
//! - every live node has exactly one fresh queue entry; the root has none;
//! - `live` (non-root nodes) never exceeds `capacity`;
//! - `best` of every node is the first child, in list order, of highest
//!   `freq`; a hub's cached top list is the first `top_k` children in the
//!   order (`freq` descending, then list order);
//! - a freed slot has a new generation, so a [`NodeRef`] taken before it was
//!   freed no longer resolves.
//!
//! Eviction takes the least recently used node together with its whole
//! subtree, so the trie stays prefix-closed. A descendant is only touched as
//! the extension of an occurrence of its ancestor a few tokens earlier, so a
//! subtree's nodes are nearly as old as its root and eviction stays close to
//! exact LRU. The node a new child is being attached to, and its ancestors,
//! are never evicted for that child (they are touched instead).

use hashbrown::HashMap;
use std::collections::VecDeque;

/// No node.
pub(crate) const NIL: u32 = u32::MAX;
/// The root: the empty n-gram, never evicted.
pub(crate) const ROOT: u32 = 0;
/// Most children a node has before it becomes a hub (indexed children).
pub(crate) const HUB: u32 = 4;

/// A node id with the generation it had when taken; stale after eviction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct NodeRef {
    id: u32,
    generation: u32,
}

impl NodeRef {
    /// A reference that never resolves.
    pub(crate) const DEAD: NodeRef = NodeRef {
        id: NIL,
        generation: 0,
    };
}

#[derive(Clone, Copy, Debug)]
struct Node {
    token: u32,
    parent: u32,
    depth: u32,
    freq: u32,
    generation: u32,
    first_child: u32,
    prev_sib: u32,
    next_sib: u32,
    best: u32,
    child_count: u32,
    stamp: u32,
}

impl Node {
    fn empty(generation: u32) -> Self {
        Self {
            token: 0,
            parent: NIL,
            depth: 0,
            freq: 0,
            generation,
            first_child: NIL,
            prev_sib: NIL,
            next_sib: NIL,
            best: NIL,
            child_count: 0,
            stamp: 0,
        }
    }
}

fn edge(parent: u32, token: u32) -> u64 {
    (u64::from(parent) << 32) | u64::from(token)
}

/// The n-gram trie shared by all requests.
pub(crate) struct Trie {
    nodes: Vec<Node>,
    free: Vec<u32>,
    edges: HashMap<u64, u32>,
    tops: HashMap<u32, Vec<u32>>,
    top_k: usize,
    lru: VecDeque<(u32, u32)>,
    tick: u32,
    live: usize,
    capacity: usize,
    evicted: u64,
    stack: Vec<u32>,
}

impl Trie {
    /// An empty trie of at most `capacity` nodes (the root not counted) whose
    /// hubs cache their `top_k` best children (none when 0); storage grows as
    /// nodes are created.
    pub(crate) fn new(capacity: usize, top_k: usize) -> Self {
        Self {
            nodes: vec![Node::empty(0)],
            free: Vec::new(),
            edges: HashMap::new(),
            tops: HashMap::new(),
            top_k,
            lru: VecDeque::new(),
            tick: 0,
            live: 0,
            capacity,
            evicted: 0,
            stack: Vec::new(),
        }
    }

    /// Live nodes (the root not counted).
    pub(crate) fn len(&self) -> usize {
        self.live
    }

    /// Most nodes kept.
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// Nodes evicted so far.
    pub(crate) fn evicted(&self) -> u64 {
        self.evicted
    }

    /// Bytes held by the arena, the queue and the maps (approximate).
    pub(crate) fn memory_bytes(&self) -> usize {
        self.nodes.capacity() * std::mem::size_of::<Node>()
            + self.free.capacity() * 4
            + self.lru.capacity() * 8
            + self.edges.capacity() * 17
            + self.tops.capacity() * 33
            + self.tops.values().map(|v| v.capacity() * 4).sum::<usize>()
    }

    /// A reference to the live node `id`.
    pub(crate) fn node_ref(&self, id: u32) -> NodeRef {
        NodeRef {
            id,
            generation: self.nodes[id as usize].generation,
        }
    }

    fn alive(&self, id: u32) -> bool {
        id == ROOT || self.nodes[id as usize].parent != NIL
    }

    /// The node `r` names, if it is still live.
    pub(crate) fn resolve(&self, r: NodeRef) -> Option<u32> {
        let n = self.nodes.get(r.id as usize)?;
        (n.generation == r.generation && self.alive(r.id)).then_some(r.id)
    }

    /// The token on the edge into `id`.
    pub(crate) fn token(&self, id: u32) -> u32 {
        self.nodes[id as usize].token
    }

    /// The most frequent child of `id` (ties: most recent), or `NIL`.
    pub(crate) fn best(&self, id: u32) -> u32 {
        self.nodes[id as usize].best
    }

    /// Whether `id` has a child.
    pub(crate) fn has_children(&self, id: u32) -> bool {
        self.nodes[id as usize].first_child != NIL
    }

    /// The most recently touched child of `id`, or `NIL`.
    pub(crate) fn first_child(&self, id: u32) -> u32 {
        self.nodes[id as usize].first_child
    }

    /// The next older sibling of `id`, or `NIL`.
    pub(crate) fn next_sibling(&self, id: u32) -> u32 {
        self.nodes[id as usize].next_sib
    }

    /// The first `k` children of `id` by `freq` (descending, then most recent
    /// first), with their `freq`, into `out`.
    pub(crate) fn top_children(&self, id: u32, k: usize, out: &mut Vec<(u32, u32)>) {
        if k <= self.top_k
            && let Some(top) = self.tops.get(&id)
        {
            out.clear();
            out.extend(
                top.iter()
                    .take(k)
                    .map(|&c| (c, self.nodes[c as usize].freq)),
            );
            return;
        }
        self.scan_top(id, k, out);
    }

    /// [`top_children`](Self::top_children) by a scan of the child list.
    fn scan_top(&self, id: u32, k: usize, out: &mut Vec<(u32, u32)>) {
        out.clear();
        let mut c = self.nodes[id as usize].first_child;
        while c != NIL {
            let f = self.nodes[c as usize].freq;
            if out.len() < k || out.last().is_some_and(|&(_, g)| f > g) {
                let at = out.partition_point(|&(_, g)| g >= f);
                if out.len() == k {
                    out.pop();
                }
                out.insert(at, (c, f));
            }
            c = self.nodes[c as usize].next_sib;
        }
    }

    /// The child of `id` along `token`.
    pub(crate) fn child(&self, id: u32, token: u32) -> Option<u32> {
        let n = &self.nodes[id as usize];
        if n.child_count > HUB {
            return self.edges.get(&edge(id, token)).copied();
        }
        let mut c = n.first_child;
        while c != NIL {
            let m = &self.nodes[c as usize];
            if m.token == token {
                return Some(c);
            }
            c = m.next_sib;
        }
        None
    }

    /// The node of the n-gram `tokens`, walking from the root.
    pub(crate) fn walk(&self, tokens: &[u32]) -> Option<u32> {
        let mut cur = ROOT;
        for &t in tokens {
            cur = self.child(cur, t)?;
        }
        Some(cur)
    }

    /// Counts one occurrence of the n-gram `parent` + `token` that ends now:
    /// finds or creates the child, adds one to its frequency and touches it.
    /// `None` when the trie is too small to hold it beside `parent`'s path.
    pub(crate) fn extend(&mut self, parent: u32, token: u32) -> Option<u32> {
        if let Some(c) = self.child(parent, token) {
            let n = &mut self.nodes[c as usize];
            n.freq = n.freq.saturating_add(1);
            self.move_to_front_of_siblings(parent, c);
        } else {
            let c = self.alloc(parent)?;
            let depth = self.nodes[parent as usize].depth + 1;
            let generation = self.nodes[c as usize].generation;
            self.nodes[c as usize] = Node {
                token,
                parent,
                depth,
                freq: 1,
                ..Node::empty(generation)
            };
            self.link_first_sibling(parent, c);
            self.live += 1;
            let p = &mut self.nodes[parent as usize];
            p.child_count += 1;
            if p.child_count == HUB + 1 {
                self.make_hub(parent);
            } else if p.child_count > HUB {
                self.edges.insert(edge(parent, token), c);
            }
        }
        let c = self.nodes[parent as usize].first_child;
        self.update_best(parent, c);
        if self.top_k > 0 && self.nodes[parent as usize].child_count > HUB {
            self.top_touch(parent, c);
        }
        self.touch(c);
        Some(c)
    }

    fn make_hub(&mut self, id: u32) {
        let mut c = self.nodes[id as usize].first_child;
        while c != NIL {
            self.edges.insert(edge(id, self.nodes[c as usize].token), c);
            c = self.nodes[c as usize].next_sib;
        }
        if self.top_k > 0 {
            self.build_top(id);
        }
    }

    fn build_top(&mut self, id: u32) {
        let mut buf = Vec::with_capacity(self.top_k);
        self.scan_top(id, self.top_k, &mut buf);
        let top = self.tops.entry(id).or_default();
        top.clear();
        top.extend(buf.iter().map(|&(c, _)| c));
    }

    /// Drops the index of a node that is no longer a hub.
    fn unmake_hub(&mut self, id: u32) {
        let mut c = self.nodes[id as usize].first_child;
        while c != NIL {
            self.edges.remove(&edge(id, self.nodes[c as usize].token));
            c = self.nodes[c as usize].next_sib;
        }
        self.tops.remove(&id);
    }

    /// Keeps hub `id`'s top list exact after its child `c` was touched (the
    /// only key that changed: `c` is now the most recent, its `freq` higher).
    fn top_touch(&mut self, id: u32, c: u32) {
        let nodes = &self.nodes;
        let Some(top) = self.tops.get_mut(&id) else {
            return;
        };
        let f = nodes[c as usize].freq;
        if let Some(i) = top.iter().position(|&y| y == c) {
            top.remove(i);
        } else if top.len() >= self.top_k && top.last().is_some_and(|&y| nodes[y as usize].freq > f)
        {
            return;
        }
        let at = top
            .iter()
            .position(|&y| nodes[y as usize].freq <= f)
            .unwrap_or(top.len());
        top.insert(at, c);
        top.truncate(self.top_k);
    }

    fn update_best(&mut self, parent: u32, c: u32) {
        let b = self.nodes[parent as usize].best;
        if b == NIL || b == c || self.nodes[c as usize].freq >= self.nodes[b as usize].freq {
            self.nodes[parent as usize].best = c;
        }
    }

    fn recompute_best(&mut self, parent: u32) {
        let mut best = NIL;
        let mut best_freq = 0;
        let mut c = self.nodes[parent as usize].first_child;
        while c != NIL {
            let n = &self.nodes[c as usize];
            if best == NIL || n.freq > best_freq {
                best = c;
                best_freq = n.freq;
            }
            c = n.next_sib;
        }
        self.nodes[parent as usize].best = best;
    }

    fn link_first_sibling(&mut self, parent: u32, c: u32) {
        let old = self.nodes[parent as usize].first_child;
        self.nodes[c as usize].prev_sib = NIL;
        self.nodes[c as usize].next_sib = old;
        if old != NIL {
            self.nodes[old as usize].prev_sib = c;
        }
        self.nodes[parent as usize].first_child = c;
    }

    fn unlink_sibling(&mut self, parent: u32, c: u32) {
        let Node {
            prev_sib, next_sib, ..
        } = self.nodes[c as usize];
        if prev_sib == NIL {
            self.nodes[parent as usize].first_child = next_sib;
        } else {
            self.nodes[prev_sib as usize].next_sib = next_sib;
        }
        if next_sib != NIL {
            self.nodes[next_sib as usize].prev_sib = prev_sib;
        }
    }

    fn move_to_front_of_siblings(&mut self, parent: u32, c: u32) {
        if self.nodes[parent as usize].first_child != c {
            self.unlink_sibling(parent, c);
            self.link_first_sibling(parent, c);
        }
    }

    /// Makes `c` the most recently used node.
    fn touch(&mut self, c: u32) {
        self.tick = self.tick.wrapping_add(1);
        self.nodes[c as usize].stamp = self.tick;
        self.lru.push_back((c, self.tick));
        if self.lru.len() > 2 * self.live + 1024 {
            let nodes = &self.nodes;
            self.lru.retain(|&(n, s)| {
                let m = &nodes[n as usize];
                m.stamp == s && m.parent != NIL
            });
        }
    }

    /// Evicts least recently used subtrees until `n` more nodes fit, when the
    /// trie holds at least `2 n`; nodes on live paths may go (their
    /// references die). Extending `n` paths after this evicts nothing, so
    /// the path check of [`alloc`](Self::alloc) stays off the common path.
    pub(crate) fn make_room(&mut self, n: usize) {
        if self.capacity < 2 * n {
            return;
        }
        while self.live + n > self.capacity {
            let Some((v, s)) = self.lru.pop_front() else {
                return;
            };
            if self.alive(v) && self.nodes[v as usize].stamp == s {
                self.evict_subtree(v);
            }
        }
    }

    /// A free slot for a child of `protect`, evicting if the trie is full.
    fn alloc(&mut self, protect: u32) -> Option<u32> {
        if self.live >= self.capacity {
            self.evict_one(protect)?;
        }
        if let Some(id) = self.free.pop() {
            return Some(id);
        }
        let id = u32::try_from(self.nodes.len()).ok().filter(|&i| i != NIL)?;
        self.nodes.push(Node::empty(0));
        Some(id)
    }

    /// Whether `v` is `p` or one of its ancestors.
    fn is_on_path(&self, v: u32, p: u32) -> bool {
        let dv = self.nodes[v as usize].depth;
        let mut cur = p;
        while cur != NIL && self.nodes[cur as usize].depth > dv {
            cur = self.nodes[cur as usize].parent;
        }
        cur == v
    }

    /// Evicts the least recently used subtree that does not hold `protect`.
    fn evict_one(&mut self, protect: u32) -> Option<()> {
        let limit = self.nodes[protect as usize].depth;
        let mut spared = 0;
        while let Some((v, s)) = self.lru.pop_front() {
            if !self.alive(v) || self.nodes[v as usize].stamp != s {
                continue;
            }
            if self.is_on_path(v, protect) {
                self.touch(v);
                spared += 1;
                if spared > limit {
                    return None;
                }
                continue;
            }
            self.evict_subtree(v);
            return Some(());
        }
        None
    }

    fn evict_subtree(&mut self, v: u32) {
        let p = self.nodes[v as usize].parent;
        self.unlink_sibling(p, v);
        let pn = &mut self.nodes[p as usize];
        pn.child_count -= 1;
        let (was_hub, is_hub) = (pn.child_count >= HUB, pn.child_count > HUB);
        if pn.best == v {
            self.recompute_best(p);
        }
        if was_hub {
            self.edges.remove(&edge(p, self.nodes[v as usize].token));
            if !is_hub {
                self.unmake_hub(p);
            } else if self.tops.get(&p).is_some_and(|t| t.contains(&v)) {
                self.build_top(p);
            }
        }
        let mut stack = std::mem::take(&mut self.stack);
        stack.push(v);
        while let Some(u) = stack.pop() {
            let n = self.nodes[u as usize];
            let hub = n.child_count > HUB;
            let mut c = n.first_child;
            while c != NIL {
                stack.push(c);
                if hub {
                    self.edges.remove(&edge(u, self.nodes[c as usize].token));
                }
                c = self.nodes[c as usize].next_sib;
            }
            if hub {
                self.tops.remove(&u);
            }
            self.nodes[u as usize] = Node::empty(n.generation.wrapping_add(1));
            self.free.push(u);
            self.live -= 1;
            self.evicted += 1;
        }
        self.stack = stack;
    }

    /// Checks every invariant of the module doc; the error names the first broken one.
    #[cfg(test)]
    pub(crate) fn check(&self) -> Result<(), String> {
        if self.live > self.capacity {
            return Err(format!(
                "{} nodes over capacity {}",
                self.live, self.capacity
            ));
        }
        let mut fresh = vec![0u8; self.nodes.len()];
        for &(n, s) in &self.lru {
            if self.alive(n) && n != ROOT && self.nodes[n as usize].stamp == s {
                fresh[n as usize] += 1;
            }
        }
        let mut edges = 0;
        let mut reached = 0usize;
        let mut stack = vec![ROOT];
        let mut buf = Vec::new();
        while let Some(u) = stack.pop() {
            let n = &self.nodes[u as usize];
            if u != ROOT && fresh[u as usize] != 1 {
                return Err(format!(
                    "node {u} has {} fresh lru entries",
                    fresh[u as usize]
                ));
            }
            let hub = n.child_count > HUB;
            let (mut best, mut best_freq, mut prev, mut count) = (NIL, 0, NIL, 0);
            let mut c = n.first_child;
            while c != NIL {
                let m = &self.nodes[c as usize];
                if m.parent != u || m.depth != n.depth + 1 || m.prev_sib != prev {
                    return Err(format!("child {c} of {u} badly linked"));
                }
                let e = self.edges.get(&edge(u, m.token));
                if hub != (e == Some(&c)) {
                    return Err(format!("edge ({u}, {}) is {e:?}, hub {hub}", m.token));
                }
                edges += usize::from(hub);
                if best == NIL || m.freq > best_freq {
                    best = c;
                    best_freq = m.freq;
                }
                reached += 1;
                count += 1;
                stack.push(c);
                prev = c;
                c = m.next_sib;
            }
            if n.child_count != count {
                return Err(format!(
                    "node {u} counts {} children of {count}",
                    n.child_count
                ));
            }
            if n.best != best {
                return Err(format!("best child of {u} is {} not {best}", n.best));
            }
            if hub && self.top_k > 0 {
                self.scan_top(u, self.top_k, &mut buf);
                let want: Vec<u32> = buf.iter().map(|&(c, _)| c).collect();
                if self.tops.get(&u) != Some(&want) {
                    return Err(format!(
                        "top of {u} is {:?} not {want:?}",
                        self.tops.get(&u)
                    ));
                }
            } else if self.tops.contains_key(&u) {
                return Err(format!("node {u} has a top list but is no hub"));
            }
        }
        if reached != self.live || edges != self.edges.len() {
            return Err(format!(
                "{reached} nodes reachable of {}, {edges} hub edges of {}",
                self.live,
                self.edges.len()
            ));
        }
        if self.tops.len() > self.live {
            return Err("stale top lists".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_children_and_best() {
        let mut t = Trie::new(100, 3);
        let a = t.extend(ROOT, 1).unwrap();
        let b = t.extend(a, 2).unwrap();
        let c = t.extend(a, 3).unwrap();
        assert_eq!(t.best(a), c, "tie goes to the most recent");
        t.extend(a, 2).unwrap();
        assert_eq!(t.best(a), b);
        assert_eq!(t.nodes[b as usize].freq, 2);
        assert_eq!(t.first_child(a), b);
        assert_eq!(t.next_sibling(b), c);
        assert_eq!(t.walk(&[1, 3]), Some(c));
        assert_eq!(t.walk(&[1, 4]), None);
        t.check().unwrap();
    }

    #[test]
    fn eviction_takes_lru_subtrees_and_spares_the_path() {
        let mut t = Trie::new(3, 3);
        let a = t.extend(ROOT, 1).unwrap();
        let b = t.extend(a, 2).unwrap();
        let r = t.node_ref(b);
        let c = t.extend(ROOT, 5).unwrap();
        t.check().unwrap();
        // Full: a child of c evicts the oldest subtree (a and b).
        let d = t.extend(c, 6).unwrap();
        t.check().unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(t.resolve(r), None);
        assert_eq!(t.walk(&[5, 6]), Some(d));
        // Only the path itself left: nothing can be evicted for its child.
        let mut t = Trie::new(2, 3);
        let a = t.extend(ROOT, 1).unwrap();
        let b = t.extend(a, 2).unwrap();
        assert_eq!(t.extend(b, 3), None);
        t.check().unwrap();
        assert_eq!(t.walk(&[1, 2]), Some(b));
    }

    #[test]
    fn hubs_index_children_and_keep_their_top_list() {
        let mut t = Trie::new(12, 3);
        let a = t.extend(ROOT, 1).unwrap();
        let mut kids = Vec::new();
        for tok in 10..18 {
            kids.push(t.extend(a, tok).unwrap());
            t.check().unwrap();
        }
        t.extend(a, 12).unwrap();
        t.extend(a, 12).unwrap();
        t.extend(a, 15).unwrap();
        t.check().unwrap();
        let mut top = Vec::new();
        t.top_children(a, 3, &mut top);
        assert_eq!(top, vec![(kids[2], 3), (kids[5], 2), (kids[7], 1)]);
        assert_eq!(t.child(a, 13), Some(kids[3]));
        // Evicting children (the oldest first) drops the index below the threshold.
        for tok in 0..20 {
            t.extend(ROOT, 100 + tok).unwrap();
            t.check().unwrap();
        }
        assert!(t.len() <= 12);
    }
}
