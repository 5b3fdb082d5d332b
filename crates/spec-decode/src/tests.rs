//! Tests of the n-gram speculator: exact drafts on hand-written histories,
//! capacity and eviction, release, determinism, and a randomized comparison
//! of chains against a brute-force scan of every observed history.

use crate::NgramSpeculator;
use arbor_engine_core::speculative::{NgramMatchType, NgramOptions};
use arbor_engine_core::{Draft, DraftRequest, Registry, SpeculativeConfig, Speculator};
use std::collections::HashMap;

fn opts(max_w: usize, depth: usize) -> NgramOptions {
    NgramOptions {
        min_match_window_size: 1,
        max_match_window_size: max_w,
        min_bfs_breadth: 1,
        max_bfs_breadth: 3,
        match_type: NgramMatchType::Bfs,
        max_trie_depth: depth,
        capacity: 100_000,
    }
}

fn propose(s: &mut NgramSpeculator, key: u64, tokens: &[u32], max: usize, tree: bool) -> Draft {
    let d = s.propose_one(&DraftRequest {
        key,
        tokens,
        len: tokens.len(),
        max_tokens: max,
        allow_tree: tree,
        pages: &[],
        sampling: None,
    });
    d.validate().expect("draft invariant");
    assert!(d.tokens.len() <= max);
    d
}

fn tree(tokens: &[u32], parents: &[Option<u32>]) -> Draft {
    Draft {
        tokens: tokens.to_vec(),
        parents: Some(parents.to_vec()),
        probs: Vec::new(),
    }
}

#[test]
fn copies_a_repeated_phrase() {
    let mut s = NgramSpeculator::new(opts(3, 5)).unwrap();
    let toks = [1, 2, 3, 4, 5, 6, 7, 8, 9, 40, 41, 1, 2, 3];
    s.observe(1, &toks);
    assert_eq!(
        propose(&mut s, 1, &toks, 5, false),
        Draft::chain(vec![4, 5, 6, 7, 8])
    );
    // The trie depth bounds the draft.
    assert_eq!(propose(&mut s, 1, &toks, 10, false).tokens.len(), 5);
    // The same, observed in pieces as decoding does.
    let mut s = NgramSpeculator::new(opts(3, 5)).unwrap();
    s.observe(1, &toks[..6]);
    for t in &toks[6..] {
        s.observe(1, std::slice::from_ref(t));
    }
    assert_eq!(propose(&mut s, 1, &toks, 3, false).tokens, vec![4, 5, 6]);
    s.check().unwrap();
}

#[test]
fn the_longest_window_wins() {
    let mut s = NgramSpeculator::new(opts(3, 4)).unwrap();
    // "5" is followed by 9 three times, "1 2 5" by 7 once.
    s.observe(1, &[5, 9, 5, 9, 5, 9, 1, 2, 5, 7]);
    s.observe(2, &[3, 1, 2, 5]);
    assert_eq!(propose(&mut s, 2, &[3, 1, 2, 5], 1, false).tokens, vec![7]);
    s.observe(3, &[4, 5]);
    assert_eq!(propose(&mut s, 3, &[4, 5], 1, false).tokens, vec![9]);
    // Nothing matches: no draft.
    s.observe(4, &[77]);
    assert_eq!(propose(&mut s, 4, &[77], 4, false), Draft::default());
    // Windows shorter than the minimum do not count.
    let mut o = opts(3, 4);
    o.min_match_window_size = 2;
    let mut s = NgramSpeculator::new(o).unwrap();
    s.observe(1, &[5, 9, 5, 9, 1, 2, 5, 7]);
    s.observe(2, &[4, 5]);
    assert_eq!(propose(&mut s, 2, &[4, 5], 2, false), Draft::default());
    s.observe(3, &[1, 2, 5]);
    assert_eq!(propose(&mut s, 3, &[1, 2, 5], 2, false).tokens, vec![7]);
}

/// "7" is followed by "1 5 7" three times, then by "2 9" twice (most recent).
fn branching(match_type: NgramMatchType) -> NgramSpeculator {
    let mut o = opts(2, 3);
    o.match_type = match_type;
    let mut s = NgramSpeculator::new(o).unwrap();
    s.observe(1, &[7, 1, 5, 7, 1, 5, 7, 1, 5, 7, 2, 9, 7, 2, 9]);
    s.observe(2, &[8, 7]);
    s
}

#[test]
fn chain_and_tree_shapes() {
    let mut s = branching(NgramMatchType::Bfs);
    assert_eq!(
        propose(&mut s, 2, &[8, 7], 8, false),
        Draft::chain(vec![1, 5, 7])
    );
    // BFS: match length 1 of at most 2 gives breadth 2, then 1, 1; children by recency.
    let d = propose(&mut s, 2, &[8, 7], 8, true);
    assert_eq!(
        d,
        tree(
            &[2, 1, 9, 5, 7, 7],
            &[None, None, Some(0), Some(1), Some(2), Some(3)]
        )
    );
    assert_eq!(d.first_chain(), vec![2, 9, 7]);
    // The budget cuts breadth first.
    assert_eq!(
        propose(&mut s, 2, &[8, 7], 3, true),
        tree(&[2, 1, 9], &[None, None, Some(0)])
    );
    // A one-token draft is a chain.
    assert_eq!(propose(&mut s, 2, &[8, 7], 1, true), Draft::chain(vec![2]));
}

#[test]
fn prob_takes_the_most_probable_nodes_first() {
    let mut s = branching(NgramMatchType::Prob);
    // 1: 3/5, then its child 5: 3/5, then 7: 3/5, then 2: 2/5, 9: 2/5, 7: 2/5.
    let d = propose(&mut s, 2, &[8, 7], 8, true);
    assert_eq!(
        d,
        tree(
            &[1, 5, 7, 2, 9, 7],
            &[None, Some(0), Some(1), None, Some(3), Some(4)]
        )
    );
    assert_eq!(
        d.first_chain(),
        propose(&mut s, 2, &[8, 7], 8, false).tokens
    );
    // With a budget of 4, the third-level 7 (3/5) beats the sibling 2's child.
    assert_eq!(
        propose(&mut s, 2, &[8, 7], 4, true),
        tree(&[1, 5, 7, 2], &[None, Some(0), Some(1), None])
    );
    // A path is returned as a chain.
    assert_eq!(
        propose(&mut s, 2, &[8, 7], 3, true),
        Draft::chain(vec![1, 5, 7])
    );
}

#[test]
fn bfs_breadth_shrinks_with_depth() {
    // Windows 1..=4, breadth 1..=5: scale 1, a 1-token match keeps 4, 3, 2.
    let mut o = opts(4, 3);
    o.max_bfs_breadth = 5;
    let mut s = NgramSpeculator::new(o.clone()).unwrap();
    let mut h = Vec::new();
    for a in 0..5 {
        for b in 0..5 {
            for c in 0..5 {
                h.extend([7, 10 + a, 20 + b, 30 + c]);
            }
        }
    }
    s.observe(1, &h);
    s.observe(2, &[99, 7]);
    let d = propose(&mut s, 2, &[99, 7], 64, true);
    let parents = d.parents.clone().unwrap();
    let depth = |mut i: usize| {
        let mut n = 1;
        while let Some(p) = parents[i] {
            i = p as usize;
            n += 1;
        }
        n
    };
    let mut per_depth = [0; 3];
    for i in 0..d.tokens.len() {
        per_depth[depth(i) - 1] += 1;
    }
    assert_eq!(per_depth, [4, 12, 24]);
    // The most recent children: 14, 13, 12, 11 after "7".
    assert_eq!(&d.tokens[..4], &[14, 13, 12, 11]);
    // A match of the longest window ("13 24 34 7", once, before "14 20 30")
    // keeps min_bfs_breadth (1) at every level; shorter windows add branches.
    let q = [13, 24, 34, 7];
    let d = propose(&mut s, 3, &q, 64, true);
    assert_eq!(d.first_chain(), vec![14, 20, 30]);
    assert_eq!(
        d.parents.as_ref().map(|p| p[..3].to_vec()),
        Some(vec![None, Some(0), Some(1)])
    );
    assert!(d.tokens.len() > 3);
    // Budget equal to the depth: only the longest anchor's chain.
    assert_eq!(
        propose(&mut s, 3, &q, 3, true),
        Draft::chain(vec![14, 20, 30])
    );
}

#[test]
fn capacity_is_respected_and_recent_ngrams_survive() {
    let mut o = opts(3, 4);
    o.capacity = 300;
    let mut s = NgramSpeculator::new(o).unwrap();
    let mut rng = Rng(7);
    for step in 0..3000u64 {
        let key = step % 5;
        let n = 1 + rng.below(4) as usize;
        let toks: Vec<u32> = (0..n).map(|_| rng.below(50) as u32).collect();
        s.observe(key, &toks);
        assert!(s.stats().nodes <= 300);
        if step % 97 == 0 {
            s.check().unwrap();
        }
        if step % 401 == 0 {
            s.release(key);
        }
    }
    assert!(s.stats().evicted > 0);
    let phrase = [100, 101, 102, 103, 104, 105, 106, 107];
    s.observe(9, &phrase);
    s.observe(9, &[60, 61]);
    s.observe(9, &phrase[..3]);
    s.check().unwrap();
    let mut q = phrase.to_vec();
    q.extend([60, 61, 100, 101, 102]);
    assert_eq!(
        propose(&mut s, 9, &q, 4, false).tokens,
        vec![103, 104, 105, 106]
    );
    // Small tries, evicting ahead of each token or while inserting, in every mode.
    for (cap, mt) in [
        (5, NgramMatchType::Bfs),
        (12, NgramMatchType::Prob),
        (20, NgramMatchType::Prob),
        (60, NgramMatchType::Bfs),
    ] {
        let mut o = opts(3, 4);
        o.capacity = cap;
        o.match_type = mt;
        let mut s = NgramSpeculator::new(o).unwrap();
        let mut h: HashMap<u64, Vec<u32>> = HashMap::new();
        for step in 0..1500u64 {
            let key = rng.below(3);
            let toks: Vec<u32> = (0..1 + rng.below(3)).map(|_| rng.below(7) as u32).collect();
            s.observe(key, &toks);
            s.check()
                .unwrap_or_else(|e| panic!("capacity {cap} step {step}: {e}"));
            let hist = h.entry(key).or_default();
            hist.extend(&toks);
            let _ = propose(&mut s, key, hist, 6, step % 2 == 0);
        }
    }
    // A trie smaller than one path still works (paths are cut).
    let mut o = opts(3, 4);
    o.capacity = 2;
    let mut s = NgramSpeculator::new(o).unwrap();
    s.observe(1, &[1, 2, 3, 4, 5, 1, 2]);
    s.check().unwrap();
    assert!(s.stats().nodes <= 2);
    let _ = propose(&mut s, 1, &[1, 2, 3, 4, 5, 1, 2], 4, true);
}

#[test]
fn release_drops_state_but_keeps_ngrams() {
    let mut s = NgramSpeculator::new(opts(3, 4)).unwrap();
    s.observe(1, &[1, 2, 3, 4, 5]);
    s.observe(2, &[9]);
    assert_eq!(s.stats().requests, 2);
    s.release(1);
    s.release(1);
    assert_eq!(s.stats().requests, 1);
    // A request never observed (or released) is matched by walking the trie.
    assert_eq!(propose(&mut s, 1, &[0, 1, 2], 2, false).tokens, vec![3, 4]);
    assert_eq!(propose(&mut s, 3, &[8, 3], 5, false).tokens, vec![4, 5]);
    // Tokens that differ from those observed are matched by walking too.
    s.observe(5, &[1, 2]);
    assert_eq!(propose(&mut s, 5, &[1, 2, 3], 5, false).tokens, vec![4, 5]);
    // A key reused starts a new history.
    s.observe(1, &[3]);
    assert_eq!(propose(&mut s, 1, &[3], 1, false).tokens, vec![4]);
    assert_eq!(
        propose(&mut s, 1, &[], 1, false),
        Draft::default(),
        "no tokens, no draft"
    );
    s.check().unwrap();
}

#[test]
fn proposals_are_deterministic() {
    for mt in [NgramMatchType::Bfs, NgramMatchType::Prob] {
        let mut o = opts(4, 5);
        o.match_type = mt;
        o.capacity = 500;
        o.max_bfs_breadth = 4;
        let mut a = NgramSpeculator::new(o.clone()).unwrap();
        let mut b = NgramSpeculator::new(o).unwrap();
        let mut rng = Rng(11);
        let mut hist: HashMap<u64, Vec<u32>> = HashMap::new();
        for step in 0..2000u64 {
            let key = rng.below(6);
            let toks: Vec<u32> = (0..1 + rng.below(3))
                .map(|_| rng.below(12) as u32)
                .collect();
            a.observe(key, &toks);
            b.observe(key, &toks);
            let h = hist.entry(key).or_default();
            h.extend(&toks);
            for tree in [false, true] {
                let reqs = [DraftRequest {
                    key,
                    tokens: h,
                    len: h.len(),
                    max_tokens: 8,
                    allow_tree: tree,
                    pages: &[],
                    sampling: None,
                }];
                let da = a.propose(&reqs);
                assert_eq!(da, b.propose(&reqs));
                assert_eq!(da, a.propose(&reqs), "propose changes nothing");
                da[0].validate().unwrap();
            }
            if step % 100 == 0 {
                a.check().unwrap();
            }
            if step % 300 == 0 {
                a.release(key);
                b.release(key);
                hist.remove(&key);
            }
        }
        a.check().unwrap();
    }
}

/// Brute force: every observed history, scanned for the context.
#[derive(Default)]
struct Naive {
    live: HashMap<u64, usize>,
    hists: Vec<(Vec<u32>, Vec<u64>)>,
    clock: u64,
}

impl Naive {
    fn observe(&mut self, key: u64, toks: &[u32]) {
        let n = self.hists.len();
        let i = *self.live.entry(key).or_insert(n);
        if i == self.hists.len() {
            self.hists.push(Default::default());
        }
        for &t in toks {
            self.clock += 1;
            self.hists[i].0.push(t);
            self.hists[i].1.push(self.clock);
        }
    }

    /// The most frequent token after `ctx` (ties: the latest seen).
    fn next(&self, ctx: &[u32]) -> Option<u32> {
        let mut stats: HashMap<u32, (u32, u64)> = HashMap::new();
        for (h, ts) in &self.hists {
            for i in 0..h.len().saturating_sub(ctx.len()) {
                if &h[i..i + ctx.len()] == ctx {
                    let e = stats.entry(h[i + ctx.len()]).or_default();
                    e.0 += 1;
                    e.1 = e.1.max(ts[i + ctx.len()]);
                }
            }
        }
        stats.into_iter().max_by_key(|&(_, s)| s).map(|(t, _)| t)
    }

    fn chain(&self, tokens: &[u32], o: &NgramOptions, max: usize) -> Vec<u32> {
        let hi = o.max_match_window_size.min(tokens.len());
        for w in (o.min_match_window_size..=hi).rev() {
            let mut ctx = tokens[tokens.len() - w..].to_vec();
            let mut out = Vec::new();
            while out.len() < max.min(o.max_trie_depth) {
                let Some(t) = self.next(&ctx) else {
                    break;
                };
                out.push(t);
                ctx.push(t);
            }
            if !out.is_empty() {
                return out;
            }
        }
        Vec::new()
    }
}

#[test]
fn chains_match_a_brute_force_scan() {
    for (seed, alphabet, max_w, min_w, depth) in [
        (1, 3, 3, 1, 4),
        (2, 5, 4, 2, 3),
        (3, 8, 2, 1, 6),
        (4, 4, 5, 1, 2),
    ] {
        let mut o = opts(max_w, depth);
        o.min_match_window_size = min_w;
        let mut s = NgramSpeculator::new(o.clone()).unwrap();
        let mut naive = Naive::default();
        let mut hist: HashMap<u64, Vec<u32>> = HashMap::new();
        let mut rng = Rng(seed);
        let mut drafted = 0;
        for step in 0..600 {
            let key = rng.below(4);
            let toks: Vec<u32> = (0..1 + rng.below(3))
                .map(|_| rng.below(alphabet) as u32)
                .collect();
            s.observe(key, &toks);
            naive.observe(key, &toks);
            let h = hist.entry(key).or_default();
            h.extend(&toks);
            let max = 1 + rng.below(6) as usize;
            let got = propose(&mut s, key, h, max, false);
            assert_eq!(
                got.tokens,
                naive.chain(h, &o, max),
                "seed {seed} step {step} history {h:?}"
            );
            drafted += got.tokens.len();
            if rng.below(10) == 0 {
                s.release(key);
                naive.live.remove(&key);
                hist.remove(&key);
            }
        }
        assert!(drafted > 300, "the test drafts something ({drafted})");
        s.check().unwrap();
    }
}

#[test]
fn prob_first_chain_follows_the_greedy_chain() {
    let mut o = opts(3, 4);
    o.match_type = NgramMatchType::Prob;
    let mut s = NgramSpeculator::new(o).unwrap();
    let mut rng = Rng(5);
    let mut h = Vec::new();
    for step in 0..800 {
        let t = rng.below(if step < 400 { 4 } else { 9 }) as u32;
        s.observe(1, &[t]);
        h.push(t);
        let max = 1 + rng.below(10) as usize;
        let chain = propose(&mut s, 1, &h, max, false).tokens;
        let first = propose(&mut s, 1, &h, max, true).first_chain();
        // Shorter windows may carry the tree on where the longest one ends.
        let n = chain.len().min(first.len());
        assert_eq!(chain[..n], first[..n], "{chain:?} vs {first:?}");
        assert!(!first.is_empty() || chain.is_empty());
        if step % 50 == 0 {
            s.check().unwrap();
        }
    }
}

/// A runner over the tiny Llama fixture (what a model drafter runs on).
fn tiny_inputs(r: &Registry) -> arbor_engine_core::SpeculatorInputs {
    use arbor_engine_core::{Backend, DType, LoadOptions, runner::ModelRunner};
    let backend: std::sync::Arc<dyn Backend> =
        std::sync::Arc::new(arbor_backend_cpu::CpuBackend::new(1).unwrap());
    let opts = LoadOptions {
        backend: backend.clone(),
        quant: r.quant_methods.get("f32").unwrap()(&Default::default()).unwrap(),
        progress: None,
    };
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-llama");
    let m = arbor_models::load_model(&path, r, &opts).unwrap();
    let runner = ModelRunner::new(m.model, backend, None, 16, 8, DType::F32).unwrap();
    arbor_engine_core::SpeculatorInputs {
        target: std::sync::Arc::new(runner),
        target_group: None,
        draft_model: None,
        draft_path: None,
    }
}

#[test]
fn registered_and_validated() {
    let r = Registry::builtin().unwrap();
    let inputs = tiny_inputs(&r);
    let f = |c: &SpeculativeConfig| r.speculators.get("ngram").unwrap()(c, &inputs);
    let mut cfg = SpeculativeConfig::default();
    let s = f(&cfg).unwrap();
    assert_eq!(s.name(), "ngram");
    cfg.ngram.min_match_window_size = 0;
    let e = f(&cfg).err().unwrap().to_string();
    assert!(
        e.contains("ngram_min_match_window_size (0) must be at least 1"),
        "{e}"
    );
    cfg = SpeculativeConfig::default();
    cfg.num_draft_tokens = 0;
    assert!(f(&cfg).is_err());
    let o = NgramOptions {
        max_trie_depth: 2000,
        ..NgramOptions::default()
    };
    assert!(NgramSpeculator::new(o).is_err());
}

/// SplitMix64.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        (z ^ (z >> 31)) % n
    }
}
