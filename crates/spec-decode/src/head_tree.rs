//! Draft trees from a [`HeadDrafter`]'s head (`--speculative-eagle-topk` >
//! 1), as EAGLE-2 / SGLang build them: the first level is the `topk` best
//! tokens of the kept logits; each further level expands the `topk` best
//! nodes of the level below (by cumulative log-probability), `topk`
//! children each; the draft is the `max_tokens` best nodes of all levels.
//!
//! For a request sampled at temperature > 0 the children of a node are
//! instead `topk` draws without replacement from the head's filtered
//! distribution `q` (in draw order, sharing `q`, which the draft returns for
//! recursive rejection sampling), and the draft keeps a prefix of the
//! nodes in breadth-first order, sibling groups by their parent's score:
//! how many children of a node are kept then never depends on what those
//! children are, which the exactness of verification needs (a "best nodes"
//! cut would keep a child for being likely under `q`).
//!
//! Each level is one head forward over a tree per request: its root re-runs
//! the extend's last position (the pending token with the target's fused
//! state), then every node expanded so far, each fed its token and its
//! parent's output state, attending to its ancestors only. Node `i` of the
//! forward's tree writes its KV at slot `len - 2 + i`, past the kept
//! sequence (the next extend rewrites those positions).
//!
//! Invariants of the returned draft: parents come before children, the set
//! is closed under ancestors (a child never scores above its parent), and
//! each node's children are listed best first (drawn: in draw order), so
//! `Draft::first_chain` is the greedy chain through the tree.

use crate::choose::{argmax, draw_distinct};
use crate::head_drafter::HeadDrafter;
use arbor_engine_core::attention::BatchLayout;
use arbor_engine_core::error::Result;
use arbor_engine_core::model::ForwardBatch;
use arbor_engine_core::{Draft, DraftDist, DraftRequest, SeqRng};
use std::sync::Arc;

/// One node of a request's draft tree.
struct Node {
    /// Target id.
    token: u32,
    /// Index of the parent node (`None`: a child of the pending token).
    parent: Option<usize>,
    depth: usize,
    /// Cumulative log-probability.
    score: f32,
    /// The node's output state, once it was expanded.
    state: Option<Vec<f32>>,
    /// The distribution it was drawn from (sampled requests).
    dist: Option<DraftDist>,
}

/// One request's tree under construction.
pub(crate) struct Growing<'a> {
    req: &'a DraftRequest<'a>,
    /// The pending token (the root's input id).
    root_token: u32,
    /// The root's fused input state and output state (the extend's).
    root_in: Vec<f32>,
    root_out: Vec<f32>,
    nodes: Vec<Node>,
    /// Nodes to expand next.
    frontier: Vec<usize>,
    /// Levels it may still expand (slots and depth allowing).
    levels: usize,
    /// Draws the children of a sampled request.
    rng: Option<SeqRng>,
}

/// A node's children from its logits row: `(log-probability, draft id)`
/// in order, with the distribution they were drawn from (in target ids).
type Children = (Vec<(f32, u32)>, Option<DraftDist>);

/// The `k` best (log-probability, draft id) of a logits row, best first.
fn top_k(row: &[f32], k: usize) -> Vec<(f32, u32)> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return vec![(0.0, argmax(row))];
    }
    let lse = max + row.iter().map(|&v| (v - max).exp()).sum::<f32>().ln();
    let mut ids: Vec<u32> = (0..row.len() as u32).collect();
    let k = k.min(ids.len());
    let desc = |a: &u32, b: &u32| row[*b as usize].total_cmp(&row[*a as usize]).then(a.cmp(b));
    if k < ids.len() {
        ids.select_nth_unstable_by(k - 1, desc);
        ids.truncate(k);
    }
    ids.sort_by(desc);
    ids.into_iter()
        .map(|i| (row[i as usize] - lse, i))
        .collect()
}

impl<'a> Growing<'a> {
    /// Starts `req`'s tree from its kept logits and states.
    pub(crate) fn new(
        d: &HeadDrafter,
        req: &'a DraftRequest<'a>,
        logits: &[f32],
        root_in: Vec<f32>,
        root_out: Vec<f32>,
        topk: usize,
        depth: usize,
    ) -> Result<Self> {
        let mut g = Self {
            req,
            root_token: req.tokens.last().copied().unwrap_or(0),
            root_in,
            root_out,
            nodes: Vec::new(),
            frontier: Vec::new(),
            levels: 0,
            rng: req.sampling.map(|s| SeqRng::new(s.seed)),
        };
        let (kids, dist) = g.children(d, logits, topk)?;
        for (lp, id) in kids {
            g.nodes.push(Node {
                token: d.target_id(id)?,
                parent: None,
                depth: 1,
                score: lp,
                state: None,
                dist: dist.clone(),
            });
        }
        g.frontier = (0..g.nodes.len()).collect();
        // Level j's forward holds 1 + topk * j nodes at slots from len - 2:
        // the last must fit the pages held (len + max_tokens slots).
        let slots = (req.pages.len() * d.page_size()).saturating_sub(req.len - 2);
        let mut levels = 0;
        while levels + 1 < depth && topk * (levels + 1) < slots {
            levels += 1;
        }
        g.levels = levels;
        Ok(g)
    }

    /// The children of a node whose head logits are `row`: its `k` best
    /// tokens, or for a sampled request `k` draws without replacement from
    /// the standard sampler's filtered distribution (a single argmax, as a
    /// point mass, when nothing is finite).
    fn children(&mut self, d: &HeadDrafter, row: &[f32], k: usize) -> Result<Children> {
        let (Some(rng), Some(s)) = (self.rng.as_mut(), self.req.sampling) else {
            return Ok((top_k(row, k), None));
        };
        let Some((drawn, cand)) = draw_distinct(row, s.params, rng, k) else {
            let t = argmax(row);
            let dist: DraftDist = Arc::from(vec![(1.0, d.target_id(t)?)]);
            return Ok((vec![(0.0, t)], Some(dist)));
        };
        let dist = cand
            .iter()
            .map(|&(w, t)| Ok((w, d.target_id(t)?)))
            .collect::<Result<DraftDist>>()?;
        Ok((
            drawn.iter().map(|&(w, t)| (w.ln(), t)).collect(),
            Some(dist),
        ))
    }

    /// The nodes of this level's forward (root first), with their parents
    /// in tree terms: every expanded node and the frontier.
    fn forward_nodes(&self) -> (Vec<usize>, Vec<i32>) {
        let mut order: Vec<usize> = (0..self.nodes.len())
            .filter(|&i| self.nodes[i].state.is_some() || self.frontier.contains(&i))
            .collect();
        order.sort_by_key(|&i| (self.nodes[i].depth, i));
        let mut parents = vec![-1];
        for &i in &order {
            let p = match self.nodes[i].parent {
                None => 0,
                Some(p) => 1 + order.iter().position(|&o| o == p).unwrap_or(0) as i32,
            };
            parents.push(p);
        }
        (order, parents)
    }

    /// The draft: the `max_tokens` best nodes, parents first, children best
    /// first; for a sampled request the first `max_tokens` in breadth-first
    /// order (see the module comment), children in draw order.
    fn finish(mut self) -> Draft {
        let n = self.req.max_tokens.min(self.nodes.len());
        let mut by_score: Vec<usize> = (0..self.nodes.len()).collect();
        let nodes = &self.nodes;
        if self.rng.is_some() {
            let parent_score = |i: usize| nodes[i].parent.map_or(0.0, |p| nodes[p].score);
            by_score.sort_by(|&a, &b| {
                (nodes[a].depth)
                    .cmp(&nodes[b].depth)
                    .then(parent_score(b).total_cmp(&parent_score(a)))
                    .then(nodes[a].parent.cmp(&nodes[b].parent))
                    .then(a.cmp(&b))
            });
            by_score.truncate(n);
        } else {
            let key = |i: &usize| (nodes[*i].depth, *i);
            by_score.sort_by(|a, b| {
                nodes[*b]
                    .score
                    .total_cmp(&nodes[*a].score)
                    .then(key(a).cmp(&key(b)))
            });
            by_score.truncate(n);
            // Parents first; siblings best first.
            by_score.sort_by(|a, b| {
                (nodes[*a].depth)
                    .cmp(&nodes[*b].depth)
                    .then(nodes[*b].score.total_cmp(&nodes[*a].score))
                    .then(a.cmp(b))
            });
        }
        let index = |i: usize| by_score.iter().position(|&x| x == i);
        let mut tokens = Vec::with_capacity(n);
        let mut parents = Vec::with_capacity(n);
        let mut probs = Vec::new();
        for &i in &by_score {
            tokens.push(self.nodes[i].token);
            parents.push(self.nodes[i].parent.and_then(index).map(|p| p as u32));
            probs.extend(self.nodes[i].dist.clone());
        }
        if probs.len() != tokens.len() {
            probs.clear();
        }
        self.nodes.clear();
        Draft {
            tokens,
            parents: Some(parents),
            probs,
        }
    }
}

impl HeadDrafter {
    /// Grows every request's tree level by level (one batched head forward
    /// per level), then returns the drafts in order.
    pub(crate) fn grow(&self, mut trees: Vec<Growing<'_>>, topk: usize) -> Result<Vec<Draft>> {
        let h = self.hidden_size();
        let ps = self.page_size();
        loop {
            let active: Vec<usize> = (0..trees.len())
                .filter(|&i| trees[i].levels > 0 && !trees[i].frontier.is_empty())
                .collect();
            if active.is_empty() {
                break;
            }
            let mut layout = BatchLayout::new(ps);
            let (mut ids, mut positions, mut rows, mut hidden) =
                (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            let mut orders = Vec::with_capacity(active.len());
            for &t in &active {
                let g = &trees[t];
                let (order, parents) = g.forward_nodes();
                let base = g.req.len - 2;
                layout.push_tree_seq(base, &parents, g.req.pages)?;
                let q0 = ids.len();
                ids.push(g.root_token);
                positions.push(base as u32);
                hidden.extend_from_slice(&g.root_in);
                for &i in &order {
                    let n = &g.nodes[i];
                    ids.push(n.token);
                    positions.push((base + n.depth) as u32);
                    let parent_state = match n.parent {
                        None => &g.root_out,
                        Some(p) => g.nodes[p].state.as_ref().unwrap_or(&g.root_out),
                    };
                    hidden.extend_from_slice(parent_state);
                }
                for (r, &i) in order.iter().enumerate() {
                    if g.frontier.contains(&i) {
                        rows.push((q0 + 1 + r) as u32);
                    }
                }
                orders.push(order);
            }
            let batch = ForwardBatch {
                input_ids: ids,
                positions,
                layout: Arc::new(layout),
                logits_rows: rows,
                hidden_layers: Vec::new(),
                lora: Vec::new(),
                exit_after: None,
                hidden_at_every_row: false,
            };
            let mut out = self.run_batch(&batch, hidden, h)?.into_iter();
            for (&t, order) in active.iter().zip(orders) {
                let g = &mut trees[t];
                let mut candidates: Vec<usize> = Vec::new();
                let expand: Vec<usize> = order
                    .into_iter()
                    .filter(|i| g.frontier.contains(i))
                    .collect();
                for i in expand {
                    let Some((logits, state)) = out.next() else {
                        break;
                    };
                    g.nodes[i].state = Some(state);
                    let (score, depth) = (g.nodes[i].score, g.nodes[i].depth);
                    let (kids, dist) = g.children(self, &logits, topk)?;
                    for (lp, id) in kids {
                        g.nodes.push(Node {
                            token: self.target_id(id)?,
                            parent: Some(i),
                            depth: depth + 1,
                            score: score + lp,
                            state: None,
                            dist: dist.clone(),
                        });
                        candidates.push(g.nodes.len() - 1);
                    }
                }
                candidates.sort_by(|a, b| g.nodes[*b].score.total_cmp(&g.nodes[*a].score));
                candidates.truncate(topk);
                g.frontier = candidates;
                g.levels -= 1;
            }
        }
        Ok(trees.into_iter().map(Growing::finish).collect())
    }
}
