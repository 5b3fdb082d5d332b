//! An approximate radix tree of the request text one worker has seen (SGLang
//! router's "approximate tree"): the router never asks workers what they
//! cache, it remembers what it sent them and forgets the least recently used
//! text first.
//!
//! Text is kept as `char`s (a prompt's characters, not its tokens: the router
//! has no tokenizer). Nodes live in an arena; slot 0 is the root, whose label
//! is empty. Invariants: every child's label is non-empty and starts with the
//! character its parent keys it by; `size` is the sum of all live labels'
//! lengths; eviction removes leaves only, so every string still matched is a
//! prefix of one that was inserted.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

#[derive(Debug, Default)]
struct Node {
    label: Vec<char>,
    children: HashMap<char, usize>,
    parent: usize,
    last_access: u64,
}

/// One worker's approximate prefix tree.
#[derive(Debug)]
pub struct PrefixTree {
    nodes: Vec<Node>,
    free: Vec<usize>,
    size: usize,
    tick: u64,
}

impl Default for PrefixTree {
    fn default() -> Self {
        Self::new()
    }
}

fn common_prefix(a: &[char], b: &[char]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl PrefixTree {
    /// An empty tree.
    pub fn new() -> Self {
        Self {
            nodes: vec![Node::default()],
            free: Vec::new(),
            size: 0,
            tick: 0,
        }
    }

    /// Characters stored.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Forgets everything.
    pub fn clear(&mut self) {
        *self = Self::new();
    }

    /// The length of the longest prefix of `text` in the tree.
    pub fn match_len(&self, text: &[char]) -> usize {
        let (mut node, mut pos) = (0, 0);
        while let Some(&c) = text.get(pos) {
            let Some(&child) = self.nodes[node].children.get(&c) else {
                break;
            };
            let label = &self.nodes[child].label;
            let common = common_prefix(label, &text[pos..]);
            pos += common;
            if common < label.len() {
                break;
            }
            node = child;
        }
        pos
    }

    fn alloc(&mut self, node: Node) -> usize {
        match self.free.pop() {
            Some(i) => {
                self.nodes[i] = node;
                i
            }
            None => {
                self.nodes.push(node);
                self.nodes.len() - 1
            }
        }
    }

    /// Adds `text`, marking its whole path as just used.
    pub fn insert(&mut self, text: &[char]) {
        self.tick += 1;
        let tick = self.tick;
        let (mut node, mut pos) = (0, 0);
        self.nodes[0].last_access = tick;
        while let Some(&c) = text.get(pos) {
            let Some(&child) = self.nodes[node].children.get(&c) else {
                let leaf = self.alloc(Node {
                    label: text[pos..].to_vec(),
                    children: HashMap::new(),
                    parent: node,
                    last_access: tick,
                });
                self.nodes[node].children.insert(c, leaf);
                self.size += text.len() - pos;
                return;
            };
            let common = common_prefix(&self.nodes[child].label, &text[pos..]);
            if common < self.nodes[child].label.len() {
                // Split `child` after `common` characters.
                let tail = self.nodes[child].label.split_off(common);
                let head = std::mem::take(&mut self.nodes[child].label);
                let mid = self.alloc(Node {
                    label: head,
                    children: HashMap::from([(tail[0], child)]),
                    parent: node,
                    last_access: tick,
                });
                self.nodes[child].label = tail;
                self.nodes[child].parent = mid;
                self.nodes[node].children.insert(c, mid);
                node = mid;
            } else {
                node = child;
                self.nodes[node].last_access = tick;
            }
            pos += common;
        }
    }

    /// Removes least recently used leaves until at most `max_chars`
    /// characters remain; returns how many were removed.
    pub fn evict_to(&mut self, max_chars: usize) -> usize {
        if self.size <= max_chars {
            return 0;
        }
        let before = self.size;
        let mut heap: BinaryHeap<Reverse<(u64, usize)>> = self
            .live()
            .filter(|&i| i != 0 && self.nodes[i].children.is_empty())
            .map(|i| Reverse((self.nodes[i].last_access, i)))
            .collect();
        while self.size > max_chars {
            let Some(Reverse((_, leaf))) = heap.pop() else {
                break;
            };
            let node = std::mem::take(&mut self.nodes[leaf]);
            self.size -= node.label.len();
            if let Some(first) = node.label.first() {
                self.nodes[node.parent].children.remove(first);
            }
            self.free.push(leaf);
            let parent = node.parent;
            if parent != 0 && self.nodes[parent].children.is_empty() {
                heap.push(Reverse((self.nodes[parent].last_access, parent)));
            }
        }
        before - self.size
    }

    fn live(&self) -> impl Iterator<Item = usize> + '_ {
        // The root is live; a freed slot has an empty label and no parent link
        // from any live node, so collect the reachable set.
        let mut stack = vec![0];
        let mut out = Vec::new();
        while let Some(i) = stack.pop() {
            out.push(i);
            stack.extend(self.nodes[i].children.values().copied());
        }
        out.into_iter()
    }

    #[cfg(test)]
    fn check(&self) {
        let mut total = 0;
        for i in self.live() {
            for (&c, &child) in &self.nodes[i].children {
                let n = &self.nodes[child];
                assert_eq!(n.label.first(), Some(&c));
                assert_eq!(n.parent, i);
                total += n.label.len();
            }
        }
        assert_eq!(total, self.size);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn chars(s: &str) -> Vec<char> {
        s.chars().collect()
    }

    #[test]
    fn matches_split_and_shared_prefixes() {
        let mut t = PrefixTree::new();
        t.insert(&chars("hello world"));
        t.insert(&chars("hello there"));
        t.insert(&chars("héllo"));
        t.check();
        assert_eq!(t.match_len(&chars("hello wor")), 9);
        assert_eq!(t.match_len(&chars("hello thumb")), 8);
        assert_eq!(t.match_len(&chars("hello")), 5);
        assert_eq!(t.match_len(&chars("hé")), 2);
        assert_eq!(t.match_len(&chars("x")), 0);
        // "h" + "ello " + "world" + "there" + "éllo".
        assert_eq!(t.size(), 1 + 5 + 5 + 5 + 4);
    }

    #[test]
    fn evicts_the_least_recently_used_first() {
        let mut t = PrefixTree::new();
        t.insert(&chars("aaaa1111"));
        t.insert(&chars("bbbb2222"));
        t.insert(&chars("aaaa3333"));
        // 20 characters; the leaf "1111" is the oldest, then "bbbb2222";
        // "aaaa" was refreshed by the third insert.
        assert_eq!(t.size(), 20);
        let removed = t.evict_to(12);
        t.check();
        assert_eq!(removed, 12);
        assert_eq!(t.match_len(&chars("aaaa1111")), 4);
        assert_eq!(t.match_len(&chars("bbbb2222")), 0);
        assert_eq!(t.match_len(&chars("aaaa3333")), 8);
        t.evict_to(0);
        t.check();
        assert_eq!(t.size(), 0);
        // Freed slots are reused.
        t.insert(&chars("cc"));
        assert_eq!(t.match_len(&chars("ccc")), 2);
    }

    proptest! {
        #[test]
        fn match_is_the_longest_common_prefix_with_an_inserted_text(
            texts in proptest::collection::vec("[ab]{0,12}", 1..30),
            queries in proptest::collection::vec("[abc]{0,14}", 1..20),
            budget in 0usize..80,
        ) {
            let mut t = PrefixTree::new();
            for s in &texts {
                t.insert(&chars(s));
                t.check();
            }
            for q in &queries {
                let q = chars(q);
                let best = texts.iter().map(|s| common_prefix(&chars(s), &q)).max().unwrap_or(0);
                prop_assert_eq!(t.match_len(&q), best);
            }
            t.evict_to(budget);
            t.check();
            prop_assert!(t.size() <= budget);
            for q in &queries {
                let q = chars(q);
                let best = texts.iter().map(|s| common_prefix(&chars(s), &q)).max().unwrap_or(0);
                prop_assert!(t.match_len(&q) <= best);
            }
        }
    }
}
