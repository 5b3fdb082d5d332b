//! A model-checking harness for the radix cache.
//!
//! [`Harness`] drives a [`RadixCache`] the way a scheduler does (admit: match
//! and lock; chunked prefill: insert the computed part, re-match, move the
//! lock; finish: insert and unlock; abort; plain inserts; evict; flush) and
//! mirrors every step in a naive model: the set of cached whole-page prefixes
//! per namespace, each mapped to the page that holds its last page of KV and
//! to its own access metadata (the model keeps metadata per page; a node's
//! must equal that of each of its pages). Evictions are predicted from the
//! model's metadata by scanning every leaf, independently of the cache's
//! candidate set.
//! After every step [`Harness::check`] compares the whole cache with the
//! model and checks page ownership, locks and counters.

#![allow(dead_code)]
// A test harness: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use arbor_engine_core::{
    CacheNamespace, EvictionPolicy, NodeId, NodeMeta, PagePool, PageSet, PrefixCache,
};
use arbor_kv_radix::{RadixCache, builtin_policy};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// SplitMix64: a tiny seeded generator.
#[derive(Clone, Debug)]
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next_u64() % n as u64) as usize
        }
    }
}

/// How to make a token sequence: keep a prefix of an earlier one, add new tokens.
#[derive(Clone, Debug)]
pub struct SeqSpec {
    pub base: usize,
    pub keep: usize,
    pub extra: usize,
    pub seed: u64,
}

/// One step of a test.
#[derive(Clone, Debug)]
pub enum Op {
    /// Match, lock and allocate pages for the rest (a request starts).
    Admit { ns: usize, seq: SeqSpec },
    /// Cache the computed part of running request `req` (chunked prefill).
    Chunk { req: usize, pages: usize },
    /// Insert request `req` and unlock it (it finished).
    Finish { req: usize, priority: i64 },
    /// Unlock request `req` and free its pages without inserting.
    Abort { req: usize },
    /// Insert a sequence with pages for all of it (no prior match).
    Insert {
        ns: usize,
        seq: SeqSpec,
        priority: i64,
    },
    /// Match without locking.
    Match { ns: usize, seq: SeqSpec },
    /// Evict this many tokens.
    Evict { tokens: usize },
    /// Drop every unlocked node.
    Flush,
}

impl Op {
    /// A random op, weighted toward the request lifecycle.
    pub fn random(rng: &mut Rng) -> Op {
        let seq = |rng: &mut Rng| SeqSpec {
            base: rng.below(1000),
            keep: rng.below(1000),
            extra: rng.below(20),
            seed: rng.next_u64(),
        };
        let ns = |rng: &mut Rng| {
            if rng.below(4) == 0 {
                1 + rng.below(2)
            } else {
                0
            }
        };
        match rng.below(100) {
            0..=24 => Op::Admit {
                ns: ns(rng),
                seq: seq(rng),
            },
            25..=36 => Op::Chunk {
                req: rng.below(100),
                pages: 1 + rng.below(6),
            },
            37..=56 => Op::Finish {
                req: rng.below(100),
                priority: rng.below(5) as i64 - 2,
            },
            57..=61 => Op::Abort {
                req: rng.below(100),
            },
            62..=76 => Op::Insert {
                ns: ns(rng),
                seq: seq(rng),
                priority: rng.below(5) as i64 - 2,
            },
            77..=86 => Op::Match {
                ns: ns(rng),
                seq: seq(rng),
            },
            87..=97 => Op::Evict {
                tokens: rng.below(24),
            },
            _ => Op::Flush,
        }
    }
}

struct Req {
    ns: usize,
    tokens: Vec<u32>,
    /// Tokens whose KV the tree holds for this request (locked through `node`).
    prefix: usize,
    node: NodeId,
    /// The tree's pages of `tokens[..prefix]`.
    tree_pages: Vec<u32>,
    /// Pages the request owns, covering `tokens[prefix..]`.
    own: PageSet,
}

type Key = (usize, Vec<u32>);

/// What the model knows of one cached page-prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Entry {
    page: u32,
    created: u64,
    last_access: u64,
    hit_count: u64,
    priority: i64,
}

/// The cache under test, its pool, the running requests and the model.
pub struct Harness {
    pub ps: usize,
    pub pool: PagePool,
    pub cache: RadixCache,
    policy: Arc<dyn EvictionPolicy>,
    namespaces: [CacheNamespace; 3],
    model: HashMap<Key, Entry>,
    reqs: Vec<Req>,
    history: Vec<Vec<u32>>,
    alphabet: u32,
    hit: u64,
    queried: u64,
    evicted: u64,
    pub steps: usize,
    /// Ops that did work, by kind, and the largest node count seen.
    pub done: HashMap<&'static str, usize>,
    pub max_nodes: usize,
}

impl Harness {
    pub fn new(policy: &str, ps: usize, pool_pages: usize, alphabet: u32) -> Self {
        let policy = builtin_policy(policy).unwrap();
        Self {
            ps,
            pool: PagePool::new(pool_pages, ps),
            cache: RadixCache::with_policy(ps, policy.clone()).unwrap(),
            policy,
            namespaces: [
                CacheNamespace::default(),
                CacheNamespace::new(Some("lora-a"), None),
                CacheNamespace::new(None, Some("tenant-salt")),
            ],
            model: HashMap::new(),
            reqs: Vec::new(),
            history: Vec::new(),
            alphabet: alphabet.max(1),
            hit: 0,
            queried: 0,
            evicted: 0,
            steps: 0,
            done: HashMap::new(),
            max_nodes: 0,
        }
    }

    fn tokens(&mut self, s: &SeqSpec) -> Vec<u32> {
        let mut t = if self.history.is_empty() || s.base.is_multiple_of(5) {
            Vec::new()
        } else {
            let b = &self.history[s.base % self.history.len()];
            b[..s.keep % (b.len() + 1)].to_vec()
        };
        let mut rng = Rng(s.seed);
        for _ in 0..s.extra {
            t.push(rng.below(self.alphabet as usize) as u32);
        }
        if self.history.len() < 64 {
            self.history.push(t.clone());
        } else {
            let i = s.seed as usize % 64;
            self.history[i] = t.clone();
        }
        t
    }

    /// The model's longest cached prefix of `tokens` and its pages.
    fn model_match(&self, ns: usize, tokens: &[u32]) -> (usize, Vec<u32>) {
        let mut pages = Vec::new();
        let mut k = self.ps;
        while k <= tokens.len() {
            match self.model.get(&(ns, tokens[..k].to_vec())) {
                Some(e) => pages.push(e.page),
                None => break,
            }
            k += self.ps;
        }
        (pages.len() * self.ps, pages)
    }

    /// The pages after the first `len` tokens of `tokens` that share a node
    /// with the page before them (read from the cache before a walk): the part
    /// of the node a walk of `len` tokens splits off below its end.
    fn split_tail(&self, ns: usize, tokens: &[u32], len: usize) -> Vec<Key> {
        if len == 0 {
            return Vec::new();
        }
        let views = self.cache.nodes();
        let paths = self.paths();
        for v in &views {
            let (vns, path) = &paths[&v.id.0];
            let start = path.len() - v.tokens.len();
            if *vns == ns && start < len && len < path.len() && path[..len] == tokens[..len] {
                return (len + self.ps..=path.len())
                    .step_by(self.ps)
                    .map(|k| (ns, path[..k].to_vec()))
                    .collect();
            }
        }
        Vec::new()
    }

    /// Refreshes the first `len` tokens' pages at `now` (a match when `hit`),
    /// and the last access of `tail` (the lower part of a node the walk split).
    #[allow(clippy::too_many_arguments)]
    fn model_touch(
        &mut self,
        ns: usize,
        tokens: &[u32],
        len: usize,
        hit: bool,
        prio: Option<i64>,
        now: u64,
        tail: &[Key],
    ) {
        for k in (self.ps..=len).step_by(self.ps) {
            let e = self.model.get_mut(&(ns, tokens[..k].to_vec())).unwrap();
            e.last_access = now;
            e.hit_count += u64::from(hit);
            if let Some(p) = prio {
                e.priority = e.priority.max(p);
            }
        }
        for key in tail {
            self.model.get_mut(key).unwrap().last_access = now;
        }
    }

    /// Records an insert (just done) of `tokens` whose pages from token `from`
    /// on are `pages`; `found` is the model's match before it and `tail` the
    /// [`Self::split_tail`] of `found`. The path is stamped with the insert's
    /// tick and a new leaf with the next one (the cache's clock now).
    #[allow(clippy::too_many_arguments)]
    fn model_insert(
        &mut self,
        ns: usize,
        tokens: &[u32],
        found: usize,
        tail: &[Key],
        from: usize,
        pages: &[u32],
        prio: i64,
    ) {
        let now = self.cache.clock();
        let aligned = tokens.len() / self.ps * self.ps;
        let path_now = if aligned > found { now - 1 } else { now };
        self.model_touch(ns, tokens, found, false, Some(prio), path_now, tail);
        for k in (found / self.ps)..(aligned / self.ps) {
            let e = Entry {
                page: pages[k - from / self.ps],
                created: now,
                last_access: now,
                hit_count: 0,
                priority: prio,
            };
            self.model
                .insert((ns, tokens[..(k + 1) * self.ps].to_vec()), e);
        }
    }

    /// The model's metadata of the node that holds the page-prefix `key`.
    fn model_meta(&self, key: &Key, tokens: usize) -> NodeMeta {
        let e = &self.model[key];
        NodeMeta {
            last_access: e.last_access,
            created: e.created,
            hit_count: e.hit_count,
            priority: e.priority,
            tokens,
        }
    }

    /// Namespace and full token path of every live node.
    fn paths(&self) -> HashMap<u32, (usize, Vec<u32>)> {
        let views = self.cache.nodes();
        let by_id: HashMap<u32, _> = views.iter().map(|v| (v.id.0, v)).collect();
        let mut out = HashMap::new();
        for v in &views {
            let mut chain = vec![v.id.0];
            let mut x = v;
            while let Some(p) = x.parent {
                x = by_id[&p.0];
                chain.push(p.0);
            }
            let ns_id = x.namespace.expect("a root names its namespace");
            let ns = self.namespaces.iter().position(|n| n == ns_id).unwrap();
            let mut path = Vec::new();
            for id in chain.iter().rev() {
                path.extend_from_slice(by_id[id].tokens);
            }
            out.insert(v.id.0, (ns, path));
        }
        out
    }

    /// Pages, evicting first if the pool is short; `None` if even that fails.
    fn alloc(&mut self, n: usize) -> Option<PageSet> {
        let short = n.saturating_sub(self.pool.free_pages());
        if short > 0 {
            self.evict(short * self.ps);
        }
        self.pool.alloc(n).ok()
    }

    fn do_match(&mut self, ns: usize, tokens: &[u32]) -> arbor_engine_core::PrefixMatch {
        let (len, pages) = self.model_match(ns, tokens);
        let tail = self.split_tail(ns, tokens, len);
        assert_eq!(self.cache.peek_prefix(&self.namespaces[ns], tokens), len);
        let m = self.cache.match_prefix(&self.namespaces[ns], tokens);
        assert_eq!(m.matched_tokens, len, "match length of {tokens:?}");
        assert_eq!(m.pages, pages, "match pages of {tokens:?}");
        let now = self.cache.clock();
        self.model_touch(ns, tokens, len, true, None, now, &tail);
        self.queried += tokens.len() as u64;
        self.hit += len as u64;
        m
    }

    /// Evicts with the cache and with a naive simulation over a snapshot
    /// (keys from the model's metadata, every leaf scanned at each step).
    fn evict(&mut self, n: usize) -> usize {
        let paths = self.paths();
        let views = self.cache.nodes();
        let mut children: HashMap<u32, usize> = HashMap::new();
        let mut info = HashMap::new();
        for v in &views {
            children.insert(v.id.0, v.children);
            let (ns, path) = &paths[&v.id.0];
            let first = path.len() - v.tokens.len() + self.ps;
            let key = match v.parent {
                Some(_) => self
                    .policy
                    .key(&self.model_meta(&(*ns, path[..first].to_vec()), v.tokens.len())),
                None => arbor_engine_core::EvictionKey(0.0, 0.0),
            };
            info.insert(
                v.id.0,
                (v.parent, v.lock_ref, key, v.tokens.len(), v.pages.to_vec()),
            );
        }
        let mut cands: Vec<u32> = views
            .iter()
            .filter(|v| v.parent.is_some() && v.lock_ref == 0 && v.children == 0)
            .map(|v| v.id.0)
            .collect();
        let (mut freed, mut removed) = (0, Vec::new());
        while freed < n && !cands.is_empty() {
            let best = (0..cands.len())
                .min_by(|&a, &b| {
                    let (ka, kb) = (info[&cands[a]].2, info[&cands[b]].2);
                    ka.total_cmp(&kb).then(cands[a].cmp(&cands[b]))
                })
                .unwrap();
            let id = cands.swap_remove(best);
            let (parent, ..) = info[&id];
            freed += info[&id].3;
            removed.push(id);
            if let Some(p) = parent {
                let c = children.get_mut(&p.0).unwrap();
                *c -= 1;
                let (pp, lock, ..) = info[&p.0];
                if *c == 0 && lock == 0 && pp.is_some() {
                    cands.push(p.0);
                }
            }
        }
        drop(views);
        let got = self.cache.evict(n);
        assert_eq!(got, freed, "evict({n}) freed");
        self.evicted += freed as u64;
        let gone: HashSet<u32> = removed.iter().flat_map(|id| info[id].4.clone()).collect();
        for id in &removed {
            assert!(
                self.cache.node_view(NodeId(*id)).is_none(),
                "#{id} should be evicted"
            );
        }
        self.model.retain(|_, e| !gone.contains(&e.page));
        freed
    }

    fn did(&mut self, what: &'static str) {
        *self.done.entry(what).or_default() += 1;
    }

    pub fn apply(&mut self, op: &Op) {
        self.apply_inner(op);
        self.max_nodes = self.max_nodes.max(self.cache.stats().nodes);
    }

    fn apply_inner(&mut self, op: &Op) {
        self.steps += 1;
        let ps = self.ps;
        match op {
            Op::Admit { ns, seq } => {
                let tokens = self.tokens(seq);
                let m = self.do_match(*ns, &tokens);
                self.cache.lock(m.node).unwrap();
                let need = self.pool.pages_for(tokens.len() - m.matched_tokens);
                let Some(own) = self.alloc(need) else {
                    self.cache.unlock(m.node).unwrap();
                    return;
                };
                self.did(match (m.matched_tokens > 0, *ns > 0) {
                    (true, true) => "admit-hit-namespaced",
                    (true, false) => "admit-hit",
                    (false, _) => "admit-miss",
                });
                self.reqs.push(Req {
                    ns: *ns,
                    prefix: m.matched_tokens,
                    node: m.node,
                    tree_pages: m.pages,
                    tokens,
                    own,
                });
            }
            Op::Chunk { req, pages } => {
                if self.reqs.is_empty() {
                    return;
                }
                let i = req % self.reqs.len();
                let r = &self.reqs[i];
                let aligned = r.tokens.len() / ps * ps;
                let upto = (r.prefix + pages * ps).min(aligned);
                if upto <= r.prefix {
                    return;
                }
                let (ns, tokens, prefix, old) = (r.ns, r.tokens.clone(), r.prefix, r.node);
                let rest = self.reqs[i].own.split_off((upto - prefix) / ps);
                let part = std::mem::replace(&mut self.reqs[i].own, rest);
                let part_pages = part.pages().to_vec();
                let (found, _) = self.model_match(ns, &tokens[..upto]);
                let tail = self.split_tail(ns, &tokens[..upto], found);
                let out = self
                    .cache
                    .insert_with_prefix(&self.namespaces[ns], &tokens[..upto], prefix, part, 0)
                    .unwrap();
                self.model_insert(ns, &tokens[..upto], found, &tail, prefix, &part_pages, 0);
                assert_eq!((out.already_cached, out.cached), (found, upto));
                let m = self.do_match(ns, &tokens[..upto]);
                assert_eq!(m.matched_tokens, upto);
                assert_eq!(m.node, out.node);
                self.cache.lock(m.node).unwrap();
                self.cache.unlock(old).unwrap();
                let r = &mut self.reqs[i];
                r.prefix = upto;
                r.node = m.node;
                r.tree_pages = m.pages;
                self.did("chunk");
            }
            Op::Finish { req, priority } => {
                if self.reqs.is_empty() {
                    return;
                }
                let r = self.reqs.swap_remove(req % self.reqs.len());
                let own_pages = r.own.pages().to_vec();
                let (found, _) = self.model_match(r.ns, &r.tokens);
                let tail = self.split_tail(r.ns, &r.tokens, found);
                let out = self
                    .cache
                    .insert_with_prefix(
                        &self.namespaces[r.ns],
                        &r.tokens,
                        r.prefix,
                        r.own,
                        *priority,
                    )
                    .unwrap();
                self.model_insert(
                    r.ns, &r.tokens, found, &tail, r.prefix, &own_pages, *priority,
                );
                assert_eq!(
                    (out.already_cached, out.cached),
                    (found, r.tokens.len() / ps * ps)
                );
                self.cache.unlock(r.node).unwrap();
                self.did(if out.already_cached > r.prefix {
                    "finish-dup"
                } else {
                    "finish"
                });
            }
            Op::Abort { req } => {
                if self.reqs.is_empty() {
                    return;
                }
                let r = self.reqs.swap_remove(req % self.reqs.len());
                self.cache.unlock(r.node).unwrap();
            }
            Op::Insert { ns, seq, priority } => {
                let tokens = self.tokens(seq);
                let Some(pages) = self.alloc(self.pool.pages_for(tokens.len())) else {
                    return;
                };
                let ids = pages.pages().to_vec();
                let (found, _) = self.model_match(*ns, &tokens);
                let tail = self.split_tail(*ns, &tokens, found);
                let out = self
                    .cache
                    .insert(&self.namespaces[*ns], &tokens, pages, *priority)
                    .unwrap();
                self.model_insert(*ns, &tokens, found, &tail, 0, &ids, *priority);
                assert_eq!(
                    (out.already_cached, out.cached),
                    (found, tokens.len() / ps * ps)
                );
            }
            Op::Match { ns, seq } => {
                let tokens = self.tokens(seq);
                self.do_match(*ns, &tokens);
            }
            Op::Evict { tokens } => {
                if self.evict(*tokens) > 0 {
                    self.did("evict");
                }
            }
            Op::Flush => {
                let locked: HashSet<u32> = self
                    .cache
                    .nodes()
                    .iter()
                    .filter(|v| v.parent.is_some() && v.lock_ref > 0)
                    .flat_map(|v| v.pages.to_vec())
                    .collect();
                self.cache.flush();
                self.model.retain(|_, e| locked.contains(&e.page));
                if !locked.is_empty() {
                    self.did("flush-locked");
                }
            }
        }
    }

    /// Compares the cache with the model and checks every invariant.
    pub fn check(&self) {
        let ps = self.ps;
        if let Err(e) = self.cache.check_invariants() {
            panic!("step {}: {e}\n{}", self.steps, self.cache.dump());
        }
        // The cache's content, rebuilt from its nodes.
        let views = self.cache.nodes();
        let by_id: HashMap<u32, _> = views.iter().map(|v| (v.id.0, v)).collect();
        let paths = self.paths();
        let mut content: HashMap<Key, u32> = HashMap::new();
        let mut cache_pages = HashSet::new();
        for v in &views {
            let (ns, path) = &paths[&v.id.0];
            let start = path.len() - v.tokens.len();
            for (j, &p) in v.pages.iter().enumerate() {
                let key = (*ns, path[..start + (j + 1) * ps].to_vec());
                // A node's metadata is that of each of its pages.
                if let Some(e) = self.model.get(&key) {
                    let want = self.model_meta(&key, v.tokens.len());
                    assert_eq!(
                        v.meta, want,
                        "step {}: metadata of #{} (page {j})",
                        self.steps, v.id.0
                    );
                    assert_eq!(e.page, p);
                }
                content.insert(key, p);
                assert!(cache_pages.insert(p), "page {p} twice");
            }
        }
        let model: HashMap<Key, u32> = self
            .model
            .iter()
            .map(|(k, e)| (k.clone(), e.page))
            .collect();
        if content != model {
            let mut extra: Vec<_> = content
                .iter()
                .filter(|(k, _)| !model.contains_key(*k))
                .collect();
            let mut missing: Vec<_> = model
                .iter()
                .filter(|(k, _)| !content.contains_key(*k))
                .collect();
            extra.truncate(5);
            missing.truncate(5);
            panic!(
                "step {}: content differs from the model\nextra {extra:?}\nmissing {missing:?}\n{}",
                self.steps,
                self.cache.dump()
            );
        }
        // Every page owned exactly once: by the cache, a request, or the pool.
        let mut held = 0;
        let mut protected_keys: HashSet<Key> = HashSet::new();
        for r in &self.reqs {
            for p in r.own.pages() {
                assert!(
                    !cache_pages.contains(p),
                    "page {p} held by a request and the cache"
                );
            }
            held += r.own.len();
            // Locked nodes are never evicted: the request's prefix is intact.
            // (A miss in a namespace with no root yet returns the global root.)
            let (ns, path) = &paths[&r.node.0];
            if r.prefix == 0 {
                assert!(by_id[&r.node.0].parent.is_none(), "a miss locks a root");
            } else {
                assert_eq!(
                    (*ns, &path[..]),
                    (r.ns, &r.tokens[..r.prefix]),
                    "locked node moved"
                );
            }
            assert!(by_id[&r.node.0].lock_ref > 0);
            let (len, pages) = self.model_match(r.ns, &r.tokens[..r.prefix]);
            assert_eq!(
                (len, &pages),
                (r.prefix, &r.tree_pages),
                "locked prefix changed"
            );
            for k in (ps..=r.prefix).step_by(ps) {
                protected_keys.insert((r.ns, r.tokens[..k].to_vec()));
            }
        }
        let all_held: HashSet<u32> = self
            .reqs
            .iter()
            .flat_map(|r| r.own.pages().to_vec())
            .collect();
        assert_eq!(all_held.len(), held, "a page held twice by requests");
        assert_eq!(
            cache_pages.len() + held + self.pool.free_pages(),
            self.pool.total_pages(),
            "page leak or double ownership"
        );
        // Counters.
        let s = self.cache.stats();
        let cached = self.model.len() * ps;
        let protected = protected_keys.len() * ps;
        assert_eq!(s.cached_tokens, cached);
        assert_eq!(s.protected_tokens, protected);
        assert_eq!(s.evictable_tokens, cached - protected);
        assert_eq!(s.nodes, views.iter().filter(|v| v.parent.is_some()).count());
        assert_eq!(
            (s.hit_tokens, s.queried_tokens, s.evicted_tokens),
            (self.hit, self.queried, self.evicted)
        );
    }

    /// Ends every request (finishing even ones, aborting odd ones), flushes,
    /// and checks that the pool is whole again.
    pub fn finish(mut self) {
        let mut i = 0;
        while !self.reqs.is_empty() {
            let op = if i % 2 == 0 {
                Op::Finish {
                    req: 0,
                    priority: 0,
                }
            } else {
                Op::Abort { req: 0 }
            };
            self.apply(&op);
            self.check();
            i += 1;
        }
        self.apply(&Op::Flush);
        self.check();
        let s = self.cache.stats();
        assert_eq!((s.cached_tokens, s.nodes), (0, 0), "{}", self.cache.dump());
        assert_eq!(self.cache.nodes().len(), 1, "only the global root is left");
        assert_eq!(
            self.pool.free_pages(),
            self.pool.total_pages(),
            "pool not whole after flush"
        );
    }
}
