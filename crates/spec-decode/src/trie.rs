//! The shared n-gram trie: an arena of nodes, one hash map of edges, an LRU
//! list, and eviction of least recently used subtrees.
//!
//! A node at depth `d` stands for one `d`-token n-gram (the tokens on its path
//! from the root); its `freq` counts the occurrences of that n-gram seen since
//! the node was created, and it is *touched* each time an occurrence ends at
//! an observed token. Children are kept in a doubly linked list in recency
//! order (most recently touched first), and every node caches its `best`
//! child: the highest `freq`, ties going to the most recent.
//!
//! Invariants (checked by `check` in tests):
//! - every live non-root node is in the edge map under `(parent, token)`, in
//!   its parent's child list, and in the LRU list, each exactly once; its
//!   depth is its parent's plus one; the root is in none of them;
//! - `live` (non-root nodes) never exceeds `capacity`;
//! - `best` of every node is the first child, in list order, of highest `freq`
//!   (`NIL` when it has no children);
//! - a freed slot has a new generation, so a [`NodeRef`] taken before it was
//!   freed no longer resolves.
//!
//! Eviction takes the tail of the LRU list together with its whole subtree,
//! so the trie stays prefix-closed. A descendant is only touched as the
//! extension of an occurrence of its ancestor a few tokens earlier, so a
//! subtree's nodes are nearly as old as its root and eviction stays close to
//! exact LRU. The node a new child is being attached to, and its ancestors,
//! are never evicted for that child (they are moved to the front instead).

use hashbrown::HashMap;

/// No node.
pub(crate) const NIL: u32 = u32::MAX;
/// The root: the empty n-gram, never evicted.
pub(crate) const ROOT: u32 = 0;

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
    lru_prev: u32,
    lru_next: u32,
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
            lru_prev: NIL,
            lru_next: NIL,
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
    lru_head: u32,
    lru_tail: u32,
    live: usize,
    capacity: usize,
    evicted: u64,
    stack: Vec<u32>,
}

impl Trie {
    /// An empty trie of at most `capacity` nodes (the root not counted);
    /// storage grows as nodes are created.
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            nodes: vec![Node::empty(0)],
            free: Vec::new(),
            edges: HashMap::new(),
            lru_head: NIL,
            lru_tail: NIL,
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

    /// Bytes held by the arena and the edge map (approximate).
    pub(crate) fn memory_bytes(&self) -> usize {
        self.nodes.capacity() * std::mem::size_of::<Node>()
            + self.free.capacity() * 4
            + self.edges.capacity() * (std::mem::size_of::<(u64, u32)>() + 1)
    }

    /// A reference to the live node `id`.
    pub(crate) fn node_ref(&self, id: u32) -> NodeRef {
        NodeRef {
            id,
            generation: self.nodes[id as usize].generation,
        }
    }

    /// The node `r` names, if it is still live.
    pub(crate) fn resolve(&self, r: NodeRef) -> Option<u32> {
        let n = self.nodes.get(r.id as usize)?;
        (n.generation == r.generation && (r.id == ROOT || n.parent != NIL)).then_some(r.id)
    }

    /// The token on the edge into `id`.
    pub(crate) fn token(&self, id: u32) -> u32 {
        self.nodes[id as usize].token
    }

    /// Occurrences counted for `id`'s n-gram.
    pub(crate) fn freq(&self, id: u32) -> u32 {
        self.nodes[id as usize].freq
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

    /// The child of `id` along `token`.
    pub(crate) fn child(&self, id: u32, token: u32) -> Option<u32> {
        let first = self.nodes[id as usize].first_child;
        if first == NIL {
            return None;
        }
        if self.nodes[first as usize].token == token {
            return Some(first);
        }
        self.edges.get(&edge(id, token)).copied()
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
            self.update_best(parent, c);
            self.lru_move_front(c);
            return Some(c);
        }
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
        self.edges.insert(edge(parent, token), c);
        self.lru_push_front(c);
        self.update_best(parent, c);
        self.live += 1;
        Some(c)
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

    fn lru_push_front(&mut self, c: u32) {
        let head = self.lru_head;
        self.nodes[c as usize].lru_prev = NIL;
        self.nodes[c as usize].lru_next = head;
        if head == NIL {
            self.lru_tail = c;
        } else {
            self.nodes[head as usize].lru_prev = c;
        }
        self.lru_head = c;
    }

    fn lru_unlink(&mut self, c: u32) {
        let Node {
            lru_prev, lru_next, ..
        } = self.nodes[c as usize];
        if lru_prev == NIL {
            self.lru_head = lru_next;
        } else {
            self.nodes[lru_prev as usize].lru_next = lru_next;
        }
        if lru_next == NIL {
            self.lru_tail = lru_prev;
        } else {
            self.nodes[lru_next as usize].lru_prev = lru_prev;
        }
    }

    fn lru_move_front(&mut self, c: u32) {
        if self.lru_head != c {
            self.lru_unlink(c);
            self.lru_push_front(c);
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
        loop {
            let v = self.lru_tail;
            if v == NIL {
                return None;
            }
            if self.is_on_path(v, protect) {
                spared += 1;
                if spared > limit {
                    return None;
                }
                self.lru_move_front(v);
                continue;
            }
            self.evict_subtree(v);
            return Some(());
        }
    }

    fn evict_subtree(&mut self, v: u32) {
        let p = self.nodes[v as usize].parent;
        self.unlink_sibling(p, v);
        if self.nodes[p as usize].best == v {
            self.recompute_best(p);
        }
        let mut stack = std::mem::take(&mut self.stack);
        stack.push(v);
        while let Some(u) = stack.pop() {
            let n = self.nodes[u as usize];
            self.edges.remove(&edge(n.parent, n.token));
            let mut c = n.first_child;
            while c != NIL {
                stack.push(c);
                c = self.nodes[c as usize].next_sib;
            }
            self.lru_unlink(u);
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
        let mut seen = 0usize;
        let mut cur = self.lru_head;
        let mut prev = NIL;
        while cur != NIL {
            let n = &self.nodes[cur as usize];
            if n.lru_prev != prev {
                return Err(format!("lru back link of {cur}"));
            }
            if cur == ROOT || n.parent == NIL {
                return Err(format!("node {cur} in the lru list is not live"));
            }
            seen += 1;
            if seen > self.live {
                return Err("lru list longer than the live nodes".into());
            }
            prev = cur;
            cur = n.lru_next;
        }
        if prev != self.lru_tail || seen != self.live {
            return Err(format!("lru list holds {seen} of {} nodes", self.live));
        }
        if self.edges.len() != self.live {
            return Err(format!(
                "{} edges for {} nodes",
                self.edges.len(),
                self.live
            ));
        }
        let mut reached = 0usize;
        let mut stack = vec![ROOT];
        while let Some(u) = stack.pop() {
            let n = &self.nodes[u as usize];
            let (mut best, mut best_freq, mut prev) = (NIL, 0, NIL);
            let mut c = n.first_child;
            while c != NIL {
                let m = &self.nodes[c as usize];
                if m.parent != u || m.depth != n.depth + 1 || m.prev_sib != prev {
                    return Err(format!("child {c} of {u} badly linked"));
                }
                if self.edges.get(&edge(u, m.token)) != Some(&c) {
                    return Err(format!("edge ({u}, {}) does not lead to {c}", m.token));
                }
                if best == NIL || m.freq > best_freq {
                    best = c;
                    best_freq = m.freq;
                }
                reached += 1;
                stack.push(c);
                prev = c;
                c = m.next_sib;
            }
            if n.best != best {
                return Err(format!("best child of {u} is {} not {best}", n.best));
            }
        }
        if reached != self.live {
            return Err(format!("{reached} nodes reachable of {}", self.live));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_children_and_best() {
        let mut t = Trie::new(100);
        let a = t.extend(ROOT, 1).unwrap();
        let b = t.extend(a, 2).unwrap();
        let c = t.extend(a, 3).unwrap();
        assert_eq!(t.best(a), c, "tie goes to the most recent");
        t.extend(a, 2).unwrap();
        assert_eq!(t.best(a), b);
        assert_eq!(t.freq(b), 2);
        assert_eq!(t.first_child(a), b);
        assert_eq!(t.next_sibling(b), c);
        assert_eq!(t.walk(&[1, 3]), Some(c));
        assert_eq!(t.walk(&[1, 4]), None);
        t.check().unwrap();
    }

    #[test]
    fn eviction_takes_lru_subtrees_and_spares_the_path() {
        let mut t = Trie::new(3);
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
        let mut t = Trie::new(2);
        let a = t.extend(ROOT, 1).unwrap();
        let b = t.extend(a, 2).unwrap();
        assert_eq!(t.extend(b, 3), None);
        t.check().unwrap();
        assert_eq!(t.walk(&[1, 2]), Some(b));
    }
}
