//! The host tier under seeded random request lifecycles, checked against a
//! simulated KV memory: every device page and host slot holds a stamp of
//! the prefix whose KV it contains; the test applies the cache's recorded
//! copies in order exactly as an executor does before a step's forward, and
//! every match must hand back pages whose stamps are the matched prefix's.
//! After every step: the tree's invariants, and the device and host pools'
//! accounting (every page owned by the cache, a running request, or free).

use arbor_engine_core::{
    CacheNamespace, CopyDirection, HostKvPool, KvTierOps, NodeId, PagePool, PageSet, PrefixCache,
    TierIdentity,
};
use arbor_kv_radix::{RadixCache, TierOptions, WritePolicy};
use std::collections::HashMap;
use std::sync::Arc;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Stamp of the KV of the page that ends at `end` in `tokens`.
fn stamp(tokens: &[u32], end: usize) -> u64 {
    tokens[..end]
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, &t| {
            (h ^ u64::from(t)).wrapping_mul(0x100_0000_01b3)
        })
}

struct Running {
    tokens: Vec<u32>,
    node: NodeId,
    matched: usize,
    own: PageSet,
}

struct Sim {
    cache: RadixCache,
    pool: PagePool,
    host: Arc<HostKvPool>,
    ps: usize,
    device: Vec<Option<u64>>,
    /// Each host slot's generation when written, and its stamp.
    host_mem: HashMap<u32, (u64, u64)>,
    running: Vec<Running>,
    ns: CacheNamespace,
    loaded_tokens: usize,
    demotions: usize,
}

impl Sim {
    fn new(policy: WritePolicy, ps: usize, device_pages: usize, host_pages: usize) -> Self {
        let pool = PagePool::new(device_pages, ps);
        let host = HostKvPool::new(8, host_pages);
        let mut cache = RadixCache::lru(ps).expect("page size");
        let spec = arbor_engine_core::KvSpec {
            num_layers: 1,
            num_kv_heads: 1,
            head_dim: 1,
            page_size: ps,
            num_pages: device_pages,
            dtype: arbor_engine_core::DType::F32,
            values_in_keys: false,
        };
        cache
            .enable_tiers(TierOptions {
                host: host.clone(),
                write_policy: policy,
                identity: Some(TierIdentity::new("sim", &spec)),
            })
            .expect("empty cache");
        cache.bind_pool(&pool).expect("bind");
        Self {
            cache,
            pool,
            host,
            ps,
            device: vec![None; device_pages],
            host_mem: HashMap::new(),
            running: Vec::new(),
            ns: CacheNamespace::default(),
            loaded_tokens: 0,
            demotions: 0,
        }
    }

    /// Runs the recorded copies as an executor does: a copy into or out of
    /// a host slot freed since it was recorded is an error there.
    fn run_copies(&mut self) {
        let KvTierOps { copies, .. } = self.cache.take_kv_ops();
        for c in copies {
            match c.direction {
                CopyDirection::ToHost => {
                    let v = self.device[c.device_page as usize].expect("backup of an empty page");
                    assert!(
                        self.host.write(c.host, |_| {}),
                        "backup into freed host slot {}",
                        c.host.slot
                    );
                    self.host_mem.insert(c.host.slot, (c.host.generation, v));
                    self.demotions += 1;
                }
                CopyDirection::ToDevice => {
                    let (generation, v) = *self
                        .host_mem
                        .get(&c.host.slot)
                        .expect("load of an empty slot");
                    assert_eq!(
                        generation, c.host.generation,
                        "load from a host slot written for another allocation"
                    );
                    self.device[c.device_page as usize] = Some(v);
                }
            }
        }
    }

    fn alloc(&mut self, n: usize) -> Option<PageSet> {
        let free = self.pool.free_pages();
        if free < n {
            self.cache.evict((n - free) * self.ps);
        }
        self.pool.alloc(n).ok()
    }

    fn start(&mut self, tokens: Vec<u32>) {
        let m = self.cache.match_prefix(&self.ns, &tokens);
        self.cache.lock(m.node).expect("lock");
        self.loaded_tokens += m.host_tokens;
        let rest = (tokens.len() - m.matched_tokens).div_ceil(self.ps);
        let own = self.alloc(rest);
        // The step: copies first, then the forward reads the prefix and writes the rest.
        self.run_copies();
        for (i, &p) in m.pages.iter().enumerate() {
            assert_eq!(
                self.device[p as usize],
                Some(stamp(&tokens, (i + 1) * self.ps)),
                "page {i} of a matched prefix holds other KV"
            );
        }
        let Some(own) = own else {
            self.cache.unlock(m.node).expect("unlock");
            return;
        };
        for (i, &p) in own.pages().iter().enumerate() {
            let end = (m.matched_tokens + (i + 1) * self.ps).min(tokens.len());
            self.device[p as usize] = Some(stamp(&tokens, end));
        }
        self.running.push(Running {
            tokens,
            node: m.node,
            matched: m.matched_tokens,
            own,
        });
    }

    fn finish(&mut self, i: usize) {
        let r = self.running.swap_remove(i);
        // The prefix stayed locked while the request ran: it must still be
        // on the device, in the same pages, holding the same KV.
        let m = self.cache.match_prefix(&self.ns, &r.tokens[..r.matched]);
        assert_eq!(m.matched_tokens, r.matched, "a locked prefix was evicted");
        assert_eq!(
            m.host_tokens, 0,
            "a locked prefix was demoted and loaded back"
        );
        for (i, &p) in m.pages.iter().enumerate() {
            assert_eq!(
                self.device[p as usize],
                Some(stamp(&r.tokens, (i + 1) * self.ps))
            );
        }
        self.cache
            .insert_with_prefix(&self.ns, &r.tokens, r.matched, r.own, 0)
            .expect("insert");
        self.cache.unlock(r.node).expect("unlock");
    }

    /// Pages fetched from "storage" into fresh host slots, as the storage worker does.
    fn fetched(&mut self, tokens: &[u32]) {
        let have = self.cache.peek_prefix(&self.ns, tokens);
        let pages = tokens.len() / self.ps - have / self.ps;
        let Some(h) = self.host.alloc(pages) else {
            return;
        };
        for (i, s) in h.slots().iter().enumerate() {
            self.host.write(*s, |_| {});
            self.host_mem.insert(
                s.slot,
                (s.generation, stamp(tokens, have + (i + 1) * self.ps)),
            );
        }
        self.cache.insert_host(&self.ns, tokens, have, h);
    }

    fn check(&self) {
        self.cache.check_invariants().expect("invariants");
        let st = self.cache.stats();
        let held: usize = self.running.iter().map(|r| r.own.len()).sum();
        assert_eq!(
            self.pool.used_pages(),
            st.cached_tokens / self.ps + held,
            "device pages: pool, cache and running requests disagree"
        );
        assert_eq!(
            self.host.total_pages() - self.host.free_pages(),
            st.tiers.host_tokens / self.ps,
            "host slots: pool and cache disagree"
        );
    }
}

fn random_tokens(rng: &mut Rng, ps: usize) -> Vec<u32> {
    // A few shared stems, then a random tail: prefixes recur.
    let stem = rng.below(4) as u32;
    let len = ps * (1 + rng.below(6)) + rng.below(ps + 1);
    (0..len)
        .map(|i| {
            if i < 2 * ps {
                stem * 10 + (i as u32 % 3)
            } else {
                rng.below(3) as u32
            }
        })
        .collect()
}

fn run(policy: WritePolicy, ps: usize, host_pages: usize, seed: u64) -> (usize, usize) {
    let mut sim = Sim::new(policy, ps, 24, host_pages);
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    for _ in 0..400 {
        match rng.below(10) {
            0..=4 => {
                let t = random_tokens(&mut rng, ps);
                sim.start(t);
            }
            5..=7 if !sim.running.is_empty() => {
                let i = rng.below(sim.running.len());
                sim.finish(i);
            }
            8 => {
                let t = random_tokens(&mut rng, ps);
                sim.fetched(&t);
            }
            _ => {
                let n = rng.below(8) * ps;
                sim.cache.evict(n);
            }
        }
        sim.check();
    }
    while !sim.running.is_empty() {
        sim.finish(0);
        sim.check();
    }
    sim.run_copies();
    let seen = (sim.loaded_tokens, sim.demotions);
    sim.cache.flush();
    sim.check();
    assert_eq!(sim.pool.used_pages(), 0, "device pages left after a flush");
    assert_eq!(
        sim.host.free_pages(),
        sim.host.total_pages(),
        "host slots left"
    );
    seen
}

#[test]
fn random_lifecycles_keep_kv_where_the_tree_says() {
    let (mut loaded, mut copied) = (0, 0);
    for policy in [
        WritePolicy::WriteThrough,
        WritePolicy::WriteThroughSelective,
        WritePolicy::WriteBack,
    ] {
        // A host tier larger than the device pool, and one smaller (host
        // eviction then takes leaves demoted in the same step).
        for host_pages in [40, 8] {
            for ps in [1, 2, 4] {
                for seed in 0..5 {
                    let (l, c) = run(policy, ps, host_pages, seed);
                    loaded += l;
                    copied += c;
                }
            }
        }
    }
    println!("{loaded} tokens loaded back from the host, {copied} pages copied to it");
    assert!(
        loaded > 100,
        "few loads from the host tier: {loaded} tokens"
    );
    assert!(copied > 100, "few copies to the host tier: {copied}");
}

#[test]
fn evicted_prefix_comes_back_from_host() {
    let ps = 2;
    let mut sim = Sim::new(WritePolicy::WriteBack, ps, 8, 16);
    let a: Vec<u32> = (0..8).collect();
    sim.start(a.clone());
    sim.finish(0);
    sim.check();
    // Fill the device with other KV: `a` is demoted, not dropped.
    let b: Vec<u32> = (100..116).collect();
    sim.start(b);
    sim.check();
    assert_eq!(sim.cache.stats().tiers.host_tokens, 8);
    sim.finish(0);
    let m = sim.cache.match_prefix(&CacheNamespace::default(), &a);
    assert_eq!((m.matched_tokens, m.host_tokens), (8, 8));
    sim.run_copies();
    for (i, &p) in m.pages.iter().enumerate() {
        assert_eq!(sim.device[p as usize], Some(stamp(&a, (i + 1) * ps)));
    }
    sim.check();
}
