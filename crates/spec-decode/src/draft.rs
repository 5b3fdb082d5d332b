//! Building one request's draft from its matched trie nodes ("anchors").
//!
//! This module owns the three ways of reading a draft out of the trie:
//! - [`chain`]: from the longest anchor, the most frequent child at each step
//!   (ties: the most recently seen);
//! - [`bfs`] (SGLang's `BFS`, its recency build): each anchor, longest first,
//!   is expanded level by level; a node keeps its most recent children, as
//!   many as the breadth of its level allows;
//! - [`prob`] (SGLang's `PROB`, its frequency build): the nodes of highest
//!   estimated probability, the product along the path of each child's share
//!   of its parent's top `max_bfs_breadth` children.
//!
//! Invariants of what it returns: at most `max_tokens` tokens, no deeper than
//! `max_trie_depth` below the anchor; a tree is merged across anchors (one
//! draft node per distinct path), lists parents before children, and lists
//! each node's children best first, so [`Draft::first_chain`] is the greedy
//! guess. A tree that is a single path comes back as a chain (`parents: None`).

use crate::trie::{NIL, Trie};
use arbor_engine_core::Draft;
use arbor_engine_core::speculative::NgramOptions;
use std::cmp::Ordering;
use std::collections::{BinaryHeap, VecDeque};

/// A matched suffix: its trie node and its length.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Anchor {
    /// The node of the suffix's n-gram (it has children).
    pub(crate) node: u32,
    /// Tokens matched.
    pub(crate) len: usize,
}

/// The greedy chain from the longest anchor.
pub(crate) fn chain(trie: &Trie, anchors: &[Anchor], max_tokens: usize, depth: usize) -> Draft {
    let Some(a) = anchors.first() else {
        return Draft::default();
    };
    let mut tokens = Vec::with_capacity(max_tokens.min(depth));
    let mut cur = a.node;
    while tokens.len() < max_tokens.min(depth) {
        let b = trie.best(cur);
        if b == NIL {
            break;
        }
        tokens.push(trie.token(b));
        cur = b;
    }
    Draft::chain(tokens)
}

/// A draft tree under construction, merged across anchors.
pub(crate) struct Tree {
    tokens: Vec<u32>,
    parents: Vec<Option<u32>>,
    first_child: Vec<u32>,
    last_child: Vec<u32>,
    next_sib: Vec<u32>,
    root_first: u32,
    root_last: u32,
    max: usize,
}

impl Tree {
    fn new(max: usize) -> Self {
        Self {
            tokens: Vec::with_capacity(max),
            parents: Vec::with_capacity(max),
            first_child: Vec::with_capacity(max),
            last_child: Vec::with_capacity(max),
            next_sib: Vec::with_capacity(max),
            root_first: NIL,
            root_last: NIL,
            max,
        }
    }

    fn full(&self) -> bool {
        self.tokens.len() >= self.max
    }

    /// The draft node for `token` under `parent` (`None`: the request's last
    /// token), added as its last child if new. `None` when new and full.
    fn child(&mut self, parent: Option<u32>, token: u32) -> Option<u32> {
        let mut c = match parent {
            None => self.root_first,
            Some(p) => self.first_child[p as usize],
        };
        while c != NIL {
            if self.tokens[c as usize] == token {
                return Some(c);
            }
            c = self.next_sib[c as usize];
        }
        if self.full() {
            return None;
        }
        let id = self.tokens.len() as u32;
        self.tokens.push(token);
        self.parents.push(parent);
        self.first_child.push(NIL);
        self.last_child.push(NIL);
        self.next_sib.push(NIL);
        let last = match parent {
            None => &mut self.root_last,
            Some(p) => &mut self.last_child[p as usize],
        };
        let prev = std::mem::replace(last, id);
        if prev == NIL {
            match parent {
                None => self.root_first = id,
                Some(p) => self.first_child[p as usize] = id,
            }
        } else {
            self.next_sib[prev as usize] = id;
        }
        Some(id)
    }

    fn finish(self) -> Draft {
        let is_chain = self
            .parents
            .iter()
            .enumerate()
            .all(|(i, p)| *p == i.checked_sub(1).map(|q| q as u32));
        if is_chain {
            return Draft::chain(self.tokens);
        }
        Draft {
            tokens: self.tokens,
            parents: Some(self.parents),
            probs: Vec::new(),
        }
    }
}

/// SGLang's BFS build. Match length `m` starts at breadth
/// `min_bfs + (max_window - m) * s` with `s = (max_bfs - min_bfs) /
/// (max_window - min_window + 1)`, one level down has `s` less, never under
/// `min_bfs`; a node keeps that many of its most recent children.
pub(crate) fn bfs(trie: &Trie, anchors: &[Anchor], max_tokens: usize, o: &NgramOptions) -> Draft {
    let mut tree = Tree::new(max_tokens);
    let scale = (o.max_bfs_breadth - o.min_bfs_breadth) as f64
        / (o.max_match_window_size - o.min_match_window_size + 1) as f64;
    let mut queue: VecDeque<(Option<u32>, f64, u32, usize)> = VecDeque::new();
    for a in anchors {
        if tree.full() {
            break;
        }
        let start =
            o.min_bfs_breadth as f64 + o.max_match_window_size.saturating_sub(a.len) as f64 * scale;
        queue.clear();
        queue.push_back((None, start, a.node, 0));
        while let Some((parent, breadth, node, depth)) = queue.pop_front() {
            if tree.full() {
                break;
            }
            if depth >= o.max_trie_depth {
                continue;
            }
            let keep = (breadth.max(0.0) as usize).max(o.min_bfs_breadth);
            let mut c = trie.first_child(node);
            let mut taken = 0;
            while c != NIL && taken < keep {
                let Some(pos) = tree.child(parent, trie.token(c)) else {
                    break;
                };
                queue.push_back((Some(pos), breadth - scale, c, depth + 1));
                taken += 1;
                c = trie.next_sibling(c);
            }
        }
    }
    tree.finish()
}

struct Candidate {
    prob: f64,
    seq: u64,
    parent: Option<u32>,
    node: u32,
    depth: usize,
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
    /// Higher probability first, then the earlier pushed.
    fn cmp(&self, other: &Self) -> Ordering {
        self.prob
            .total_cmp(&other.prob)
            .then_with(|| other.seq.cmp(&self.seq))
    }
}

/// Scratch space of the PROB build, kept across calls.
#[derive(Default)]
pub(crate) struct ProbScratch {
    heap: BinaryHeap<Candidate>,
    top: Vec<(u32, u32)>,
    seq: u64,
}

impl ProbScratch {
    /// Pushes the top `k` children of `node` (by frequency, ties to the most
    /// recent), each with its share of their frequencies times `prob`.
    fn push_children(
        &mut self,
        trie: &Trie,
        k: usize,
        parent: Option<u32>,
        node: u32,
        prob: f64,
        depth: usize,
    ) {
        trie.top_children(node, k, &mut self.top);
        let sum: f64 = self.top.iter().map(|&(_, f)| f64::from(f)).sum();
        let sum = if sum > 0.0 { sum } else { 1.0 };
        for &(c, f) in &self.top {
            self.seq += 1;
            self.heap.push(Candidate {
                prob: f64::from(f) / sum * prob,
                seq: self.seq,
                parent,
                node: c,
                depth,
            });
        }
    }
}

/// SGLang's PROB build: repeatedly takes the candidate of highest
/// probability; a taken node offers its top `max_bfs_breadth` children.
pub(crate) fn prob(
    trie: &Trie,
    anchors: &[Anchor],
    max_tokens: usize,
    o: &NgramOptions,
    s: &mut ProbScratch,
) -> Draft {
    let mut tree = Tree::new(max_tokens);
    let k = o.max_bfs_breadth;
    for a in anchors {
        if tree.full() {
            break;
        }
        s.heap.clear();
        s.seq = 0;
        s.push_children(trie, k, None, a.node, 1.0, 1);
        while !tree.full() {
            let Some(c) = s.heap.pop() else {
                break;
            };
            let Some(pos) = tree.child(c.parent, trie.token(c.node)) else {
                break;
            };
            if c.depth < o.max_trie_depth {
                s.push_children(trie, k, Some(pos), c.node, c.prob, c.depth + 1);
            }
        }
    }
    tree.finish()
}
