//! Seeded random request lifecycles (admit, chunked prefill, finish, abort,
//! inserts, matches, evictions, flushes) checked against a naive model after
//! every step, for every built-in policy and several page sizes.

mod common;

use arbor_kv_radix::POLICY_NAMES;
use common::{Harness, Op, Rng};

use std::collections::HashMap;

/// Runs one seeded sequence; returns what it exercised.
fn run(
    policy: &str,
    ps: usize,
    seed: u64,
    steps: usize,
    pool_pages: usize,
    alphabet: u32,
) -> (HashMap<&'static str, usize>, usize) {
    let mut h = Harness::new(policy, ps, pool_pages, alphabet);
    let mut rng = Rng(seed.wrapping_mul(0x2545_F491_4F6C_DD1D) ^ ps as u64);
    for _ in 0..steps {
        let op = Op::random(&mut rng);
        h.apply(&op);
        h.check();
    }
    let seen = (h.done.clone(), h.max_nodes);
    h.finish();
    seen
}

fn assert_exercised(done: &HashMap<&'static str, usize>, kinds: &[&str]) {
    for k in kinds {
        assert!(
            done.get(k).copied().unwrap_or(0) > 0,
            "no '{k}' step ran: {done:?}"
        );
    }
}

#[test]
fn every_policy_and_page_size() {
    let mut done: HashMap<&'static str, usize> = HashMap::new();
    let mut max_nodes = 0;
    for policy in POLICY_NAMES {
        for ps in [1, 2, 4] {
            for seed in 0..6 {
                let (d, n) = run(policy, ps, seed, 300, 48, 3);
                for (k, v) in d {
                    *done.entry(k).or_default() += v;
                }
                max_nodes = max_nodes.max(n);
            }
        }
    }
    assert_exercised(
        &done,
        &[
            "admit-hit",
            "admit-hit-namespaced",
            "admit-miss",
            "chunk",
            "finish",
            "finish-dup",
            "evict",
            "flush-locked",
        ],
    );
    assert!(max_nodes >= 20, "trees stayed small: {max_nodes} nodes");
    println!("exercised {done:?}, up to {max_nodes} nodes");
}

#[test]
fn large_alphabet_long_run() {
    // Fewer shared prefixes, more pressure on the pool.
    for seed in 0..4 {
        run("lru", 1, 100 + seed, 1500, 40, 50);
        run("slru", 3, 200 + seed, 1500, 40, 2);
    }
}

#[test]
fn roomy_pool_rarely_evicts() {
    for seed in 0..4 {
        run("lfu", 2, 300 + seed, 800, 4096, 3);
    }
}
