//! Unit tests of the radix cache's operations on small hand-built trees.

use super::*;
use crate::policy::builtin_policy;
use arbor_engine_core::PagePool;

fn ns() -> CacheNamespace {
    CacheNamespace::default()
}

fn cache(ps: usize, policy: &str) -> RadixCache {
    RadixCache::with_policy(ps, builtin_policy(policy).unwrap()).unwrap()
}

/// Inserts `tokens` with freshly allocated pages covering all of them.
fn put(c: &mut RadixCache, pool: &PagePool, tokens: &[u32], prio: i64) -> InsertOutcome {
    let pages = pool.alloc(pool.pages_for(tokens.len())).unwrap();
    let out = c.insert(&ns(), tokens, pages, prio).unwrap();
    c.check_invariants().unwrap();
    out
}

fn ok(c: &RadixCache) {
    if let Err(e) = c.check_invariants() {
        panic!("{e}\n{}", c.dump());
    }
}

#[test]
fn insert_match_and_split() {
    let pool = PagePool::new(64, 1);
    let mut c = cache(1, "lru");
    let out = put(&mut c, &pool, &[1, 2, 3, 4], 0);
    assert_eq!((out.already_cached, out.cached), (0, 4));
    let pages: Vec<u32> = c.node_view(out.node).unwrap().pages.to_vec();
    let m = c.match_prefix(&ns(), &[1, 2, 3, 9]);
    assert_eq!(m.matched_tokens, 3);
    assert_eq!(m.pages, pages[..3]);
    ok(&c);
    // The split keeps the leaf's id on the lower part.
    let leaf = c.node_view(out.node).unwrap();
    assert_eq!(leaf.tokens, [4]);
    assert_eq!(leaf.parent, Some(m.node));
    assert_eq!(c.stats().nodes, 2);
    // A branch off the split point.
    let out2 = put(&mut c, &pool, &[1, 2, 3, 7, 8], 0);
    assert_eq!((out2.already_cached, out2.cached), (3, 5));
    assert_eq!(
        pool.free_pages(),
        64 - 6,
        "three duplicate pages were freed"
    );
    let s = c.stats();
    assert_eq!(
        (s.cached_tokens, s.nodes, s.hit_tokens, s.queried_tokens),
        (6, 3, 3, 4)
    );
    assert_eq!(c.peek_prefix(&ns(), &[1, 2, 3, 7, 8, 9]), 5);
    assert_eq!(c.peek_prefix(&ns(), &[2]), 0);
    c.flush();
    ok(&c);
    assert_eq!(pool.free_pages(), 64);
    assert_eq!(c.stats().nodes, 0);
}

#[test]
fn page_alignment() {
    let pool = PagePool::new(16, 4);
    let mut c = cache(4, "lru");
    let toks: Vec<u32> = (0..10).collect();
    let out = put(&mut c, &pool, &toks, 0);
    assert_eq!((out.already_cached, out.cached), (0, 8));
    assert_eq!(pool.free_pages(), 14, "the unaligned tail page is freed");
    // Matches stop at page boundaries, also inside a node.
    let m = c.match_prefix(&ns(), &[0, 1, 2, 3, 4, 5, 99, 7, 8]);
    assert_eq!(m.matched_tokens, 4);
    assert_eq!(m.pages.len(), 1);
    ok(&c);
    assert_eq!(c.match_prefix(&ns(), &[0, 1, 2]).matched_tokens, 0);
    // Same first page, different second page: shares one page.
    let out = put(&mut c, &pool, &[0, 1, 2, 3, 9, 9, 9, 9], 0);
    assert_eq!((out.already_cached, out.cached), (4, 8));
    assert_eq!(c.stats().cached_tokens, 12);
    // Too short to hold a page: nothing cached, everything freed.
    let out = put(&mut c, &pool, &[5, 5], 0);
    assert_eq!(
        (out.already_cached, out.cached, out.node),
        (0, 0, NodeId(0))
    );
    c.flush();
    assert_eq!(pool.free_pages(), 16);
}

#[test]
fn lock_protects_and_counts() {
    let pool = PagePool::new(64, 1);
    let mut c = cache(1, "lru");
    put(&mut c, &pool, &[1, 2, 3, 4], 0);
    put(&mut c, &pool, &[1, 2, 5, 6], 0);
    let m = c.match_prefix(&ns(), &[1, 2, 3, 4]);
    c.lock(m.node).unwrap();
    ok(&c);
    let s = c.stats();
    assert_eq!((s.protected_tokens, s.evictable_tokens), (4, 2));
    // Only the unlocked branch goes.
    assert_eq!(c.evict(100), 2);
    ok(&c);
    assert_eq!(c.stats().cached_tokens, 4);
    c.flush();
    assert_eq!(c.stats().cached_tokens, 4, "flush keeps locked nodes");
    c.lock(m.node).unwrap();
    c.unlock(m.node).unwrap();
    assert_eq!(c.stats().protected_tokens, 4);
    c.unlock(m.node).unwrap();
    let s = c.stats();
    assert_eq!((s.protected_tokens, s.evictable_tokens), (0, 4));
    assert!(c.unlock(m.node).is_err(), "unlock without lock");
    // Parents become candidates as their children go.
    assert_eq!(c.evict(1), 2, "a whole leaf goes");
    assert_eq!(c.evict(1), 2, "then its parent");
    assert_eq!(c.stats().evicted_tokens, 6);
    assert!(c.lock(m.node).is_err(), "evicted node");
    assert!(c.lock(NodeId(999)).is_err());
    assert_eq!(pool.free_pages(), 64);
}

#[test]
fn lock_of_root_and_split_locked_node() {
    let pool = PagePool::new(64, 2);
    let mut c = cache(2, "lru");
    let out = put(&mut c, &pool, &[1, 2, 3, 4, 5, 6], 0);
    c.lock(out.node).unwrap();
    // Splitting a locked node copies its lock count to the upper part.
    let m = c.match_prefix(&ns(), &[1, 2, 3, 4, 0, 0]);
    assert_eq!(m.matched_tokens, 4);
    ok(&c);
    assert_eq!(c.node_view(m.node).unwrap().lock_ref, 1);
    assert_eq!(c.stats().protected_tokens, 6);
    c.unlock(out.node).unwrap();
    ok(&c);
    assert_eq!(c.stats().evictable_tokens, 6);
    let miss = c.match_prefix(&ns(), &[9, 9]);
    assert_eq!(miss.node, NodeId(0));
    c.lock(miss.node).unwrap();
    c.unlock(miss.node).unwrap();
    ok(&c);
    c.flush();
    assert_eq!(pool.free_pages(), 64);
}

#[test]
fn reused_prefix_and_chunked_prefill() {
    let pool = PagePool::new(64, 2);
    let mut c = cache(2, "lru");
    let sys: Vec<u32> = vec![7, 7, 8, 8];
    put(&mut c, &pool, &sys, 0);
    // A request reuses the system prompt, computes 7 more tokens in chunks of 4.
    let req: Vec<u32> = [sys.clone(), vec![1, 2, 3, 4, 5, 6, 7]].concat();
    let m = c.match_prefix(&ns(), &req);
    assert_eq!(m.matched_tokens, 4);
    c.lock(m.node).unwrap();
    let mut node = m.node;
    let mut protected_len = m.matched_tokens;
    let mut own = pool
        .alloc(pool.pages_for(req.len() - protected_len))
        .unwrap();
    // Chunk 1 computed up to 8 tokens: cache the computed part (cache_unfinished_req).
    let rest = own.split_off(2);
    let out = c
        .insert_with_prefix(&ns(), &req[..8], protected_len, own, 0)
        .unwrap();
    own = rest;
    assert_eq!((out.already_cached, out.cached), (4, 8));
    let m2 = c.match_prefix(&ns(), &req[..8]);
    assert_eq!(m2.matched_tokens, 8);
    assert_eq!(m2.node, out.node);
    c.lock(m2.node).unwrap();
    c.unlock(node).unwrap();
    node = m2.node;
    protected_len = 8;
    ok(&c);
    assert_eq!(c.stats().protected_tokens, 8);
    // Finish: the rest (3 tokens: one whole page and a tail).
    let out = c
        .insert_with_prefix(&ns(), &req, protected_len, own, 0)
        .unwrap();
    assert_eq!((out.already_cached, out.cached), (8, 10));
    c.unlock(node).unwrap();
    ok(&c);
    assert_eq!(c.stats().cached_tokens, 10);
    assert_eq!(pool.used_pages(), 5);
    c.flush();
    assert_eq!(pool.free_pages(), 64);
}

#[test]
fn insert_errors_free_pages() {
    let pool = PagePool::new(16, 2);
    let mut c = cache(2, "lru");
    let e = c
        .insert(&ns(), &[1, 2, 3], pool.alloc(1).unwrap(), 0)
        .unwrap_err();
    assert!(e.to_string().contains("expected 2"), "{e}");
    let e = c
        .insert_with_prefix(&ns(), &[1, 2, 3], 1, pool.alloc(1).unwrap(), 0)
        .unwrap_err();
    assert!(e.to_string().contains("whole number of pages"), "{e}");
    let e = c
        .insert_with_prefix(&ns(), &[1, 2, 3, 4], 2, pool.alloc(1).unwrap(), 0)
        .unwrap_err();
    assert!(e.to_string().contains("should be cached"), "{e}");
    let other = CacheNamespace::new(Some("lora"), None);
    let e = c
        .insert_with_prefix(&other, &[1, 2, 3, 4], 2, pool.alloc(1).unwrap(), 0)
        .unwrap_err();
    assert!(e.to_string().contains("should be cached"), "{e}");
    ok(&c);
    assert_eq!(pool.free_pages(), 16);
    assert!(RadixCache::lru(0).is_err());
}

#[test]
fn namespaces_never_share() {
    let pool = PagePool::new(64, 1);
    let mut c = cache(1, "lru");
    let a = CacheNamespace::new(Some("adapter-a"), None);
    let b = CacheNamespace::new(None, Some("salt"));
    put(&mut c, &pool, &[1, 2, 3], 0);
    let out = c.insert(&a, &[1, 2, 3], pool.alloc(3).unwrap(), 0).unwrap();
    assert_eq!(
        out.already_cached, 0,
        "another namespace's copy is not shared"
    );
    ok(&c);
    assert_eq!(c.match_prefix(&b, &[1, 2, 3]).matched_tokens, 0);
    let m = c.match_prefix(&a, &[1, 2, 3]);
    assert_eq!(m.matched_tokens, 3);
    assert_eq!(c.stats().cached_tokens, 6);
    assert!(c.dump().contains("adapter-a"), "{}", c.dump());
    // Evicting everything drops the namespace root too.
    c.lock(m.node).unwrap();
    c.flush();
    ok(&c);
    c.unlock(m.node).unwrap();
    c.flush();
    ok(&c);
    assert!(c.namespaces.is_empty());
    assert_eq!(c.nodes().len(), 1);
    assert_eq!(pool.free_pages(), 64);
}

#[test]
fn priority_is_max_along_the_path() {
    let pool = PagePool::new(64, 1);
    let mut c = cache(1, "priority");
    let low = put(&mut c, &pool, &[1, 2, 3], -5);
    let high = put(&mut c, &pool, &[1, 2, 4], 9);
    let shared = c.node_view(high.node).unwrap().parent.unwrap();
    assert_eq!(c.node_view(shared).unwrap().meta.priority, 9);
    assert_eq!(c.node_view(low.node).unwrap().meta.priority, -5);
    assert_eq!(c.evict(1), 1);
    assert!(
        c.node_view(low.node).is_none(),
        "the low-priority leaf goes first"
    );
    c.flush();
    assert_eq!(pool.free_pages(), 64);
}

/// As SGLang (checked against its `RadixCache`, 0.5.23): a match that splits
/// a node refreshes the part below the split too, so that part outlives an
/// older leaf under LRU.
#[test]
fn split_by_a_match_refreshes_the_lower_part() {
    let pool = PagePool::new(64, 1);
    let mut c = cache(1, "lru");
    let a = put(&mut c, &pool, &[1, 2, 3, 4], 0);
    put(&mut c, &pool, &[7, 7], 0);
    c.match_prefix(&ns(), &[1, 2]);
    ok(&c);
    assert_eq!(c.evict(1), 2);
    assert_eq!(
        c.peek_prefix(&ns(), &[7, 7]),
        0,
        "the older leaf goes first"
    );
    assert_eq!(c.node_view(a.node).unwrap().tokens, [3, 4]);
    c.flush();
}

/// As SGLang: an insert that splits a leaf stamps the lower part with the
/// insert's time and its new leaf later, so the lower part goes first even
/// when the new leaf has the smaller node id.
#[test]
fn split_by_an_insert_stamps_the_new_leaf_later() {
    let pool = PagePool::new(64, 1);
    let mut c = cache(1, "lru");
    put(&mut c, &pool, &[9], 0);
    put(&mut c, &pool, &[8], 0);
    let a = put(&mut c, &pool, &[1, 2, 3, 4], 0);
    assert_eq!(
        c.evict(2),
        2,
        "frees two low ids for the split and the leaf"
    );
    let b = put(&mut c, &pool, &[1, 2, 5, 6], 0);
    assert!(b.node.0 < a.node.0);
    let (la, lb) = (
        c.node_view(a.node).unwrap().meta.last_access,
        c.node_view(b.node).unwrap().meta.last_access,
    );
    assert_eq!(lb, la + 1);
    assert_eq!(c.evict(1), 2);
    assert_eq!(c.peek_prefix(&ns(), &[1, 2, 3, 4]), 2);
    assert_eq!(c.peek_prefix(&ns(), &[1, 2, 5, 6]), 4);
    c.flush();
}

/// Four leaves A, B, C, D created at ticks 1..=4, then matched C, A, A, B
/// (ticks 5..=8) with priorities A 0, B 5, C -1, D 2.
fn order_for(policy: &str) -> Vec<char> {
    let pool = PagePool::new(64, 1);
    let mut c = cache(1, policy);
    let names = ['A', 'B', 'C', 'D'];
    let prios = [0, 5, -1, 2];
    let mut ids = Vec::new();
    for (i, p) in prios.iter().enumerate() {
        ids.push(put(&mut c, &pool, &[i as u32 + 10, 1], *p).node);
    }
    for i in [2u32, 0, 0, 1] {
        c.match_prefix(&ns(), &[i + 10, 1]);
    }
    let mut order = Vec::new();
    while c.evict(1) > 0 {
        ok(&c);
        for (i, &id) in ids.iter().enumerate() {
            if c.node_view(id).is_none() && !order.contains(&names[i]) {
                order.push(names[i]);
            }
        }
    }
    assert_eq!(pool.free_pages(), 64);
    order
}

#[test]
fn eviction_order_of_each_policy() {
    assert_eq!(order_for("lru"), ['D', 'C', 'A', 'B']);
    assert_eq!(order_for("lfu"), ['D', 'C', 'B', 'A']);
    assert_eq!(order_for("fifo"), ['A', 'B', 'C', 'D']);
    assert_eq!(order_for("mru"), ['B', 'A', 'C', 'D']);
    assert_eq!(order_for("filo"), ['D', 'C', 'B', 'A']);
    assert_eq!(order_for("priority"), ['C', 'A', 'D', 'B']);
    assert_eq!(order_for("slru"), ['D', 'C', 'B', 'A']);
}

#[test]
fn dump_and_memory() {
    let pool = PagePool::new(64, 1);
    let mut c = cache(1, "lru");
    put(&mut c, &pool, &[1, 2, 3, 4], 0);
    put(&mut c, &pool, &[1, 2, 5], 0);
    let d = c.dump();
    assert!(
        d.starts_with("radix cache: page size 1, policy lru, 3 nodes"),
        "{d}"
    );
    assert!(d.contains("  #"), "{d}");
    assert!(d.contains("tokens [3 4]"), "{d}");
    let m = c.memory_usage();
    assert_eq!(m.tokens, 5 * 4);
    assert_eq!(m.pages, 5 * 4);
    assert!(m.total() > m.tokens + m.pages);
    c.flush();
}

#[test]
fn registered_caches() {
    let r = arbor_engine_core::Registry::builtin().unwrap();
    let opts = PrefixCacheOptions {
        page_size: 4,
        policy: builtin_policy("lfu").unwrap(),
    };
    for name in ["radix", "none"] {
        let c = (r.prefix_caches.get(name).unwrap())(&opts).unwrap();
        assert_eq!(c.name(), name);
    }
    let bad = PrefixCacheOptions {
        page_size: 0,
        ..opts
    };
    assert!((r.prefix_caches.get("radix").unwrap())(&bad).is_err());
}

#[test]
fn dump_shows_the_tree() {
    let pool = PagePool::new(64, 2);
    let mut c = cache(2, "lru");
    put(
        &mut c,
        &pool,
        &[
            1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,
        ],
        0,
    );
    put(&mut c, &pool, &[1, 2, 3, 4, 9, 9], 3);
    let other = CacheNamespace::new(Some("lora-a"), Some("t1"));
    c.insert(&other, &[1, 2], pool.alloc(1).unwrap(), 0)
        .unwrap();
    let m = c.match_prefix(&ns(), &[1, 2, 3, 4, 5, 6]);
    c.lock(m.node).unwrap();
    let d = c.dump();
    // Each insert ticks for its path (1, 3, 5) and again for its new leaf
    // (2, 4, 6); the match (7) also stamps #1, the part it split off #6.
    let want = [
        "namespace default: root #0 lock=1",
        "  #2 4 tokens [1 2 3 4] pages [9 8] lock=1 hits=1 last=7 created=2 prio=3",
        "    #6 2 tokens [5 6] pages [7] lock=1 hits=1 last=7 created=2 prio=0",
        "      #1 14 tokens [7 8 9 10 11 12 13 14 …] pages [6 5 4 3 …] lock=0 hits=0 last=7",
        "    #3 2 tokens [9 9] pages [10] lock=0 hits=0 last=4 created=4 prio=3",
        "namespace \"lora-a\\u{1f}t1\": root #4 lock=0",
        "  #5 2 tokens [1 2] pages [11] lock=0",
    ];
    for w in want {
        assert!(d.contains(w), "missing {w:?} in\n{d}");
    }
    assert!(d.starts_with("radix cache: page size 2, policy lru, 5 nodes, 24 cached tokens"));
    c.unlock(m.node).unwrap();
    c.flush();
}
