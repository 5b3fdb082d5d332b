//! Radix cache benchmarks on real serving traces, about 1M cached tokens each.
//!
//! Workloads (from `../shared/data/traces`, or `$ARBOR_DATA_DIR/traces`):
//! - `mooncake`: the conversation trace's multi-request conversations (requests
//!   sharing a second block), in trace order, until 1M distinct tokens; every
//!   hash id becomes one 512-token block of synthetic token ids, so equal ids
//!   give identical blocks and prefixes shared in the trace are shared here.
//! - `sharegpt`: multi-turn conversations behind a common 24-token system
//!   prompt; words (split on whitespace) become token ids by hashing, and each
//!   assistant turn ends one cached sequence (the history up to that turn), so
//!   turns of one conversation share their prefix.
//!
//! Measured per workload and page size (1 and 16): `match_prefix` of a cached
//! sequence (full hit) and of the next requests (partial hits), the insert of
//! every sequence into an empty cache (duplicate pages freed), evicting 10%
//! of the cached tokens, and metadata bytes per cached token. A summary with
//! per-op and per-token figures is printed first. Without the data folder the
//! benchmarks are skipped with a message.

use arbor_engine_core::{CacheNamespace, PagePool, PrefixCache};
use arbor_kv_radix::RadixCache;
use criterion::{Criterion, SamplingMode, Throughput, criterion_group, criterion_main};
use flate2::read::GzDecoder;
use std::collections::{HashMap, HashSet};
use std::hint::black_box;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const TARGET_TOKENS: usize = 1_000_000;
const HELD_OUT: usize = 64;
const BLOCK: usize = 512;

fn data_dir() -> Option<PathBuf> {
    let dir = std::env::var_os("ARBOR_DATA_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data"));
    dir.join("traces").is_dir().then_some(dir)
}

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn token(x: u64) -> u32 {
    (mix(x) % 150_000) as u32
}

fn open_gz(path: &Path) -> Result<GzDecoder<std::fs::File>, String> {
    let f = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(GzDecoder::new(f))
}

/// Cached sequences (in arrival order) and the next requests, held out for partial hits.
struct Workload {
    name: &'static str,
    seqs: Vec<Vec<u32>>,
    next: Vec<Vec<u32>>,
}

impl Workload {
    fn tokens(&self) -> usize {
        self.seqs.iter().map(Vec::len).sum()
    }
}

/// Distinct tokens of `seqs` (by whole 1-token prefixes, i.e. a trie count).
fn distinct(seqs: &[Vec<u32>]) -> usize {
    let mut c = RadixCache::lru(1).ok();
    let pool = PagePool::new(seqs.iter().map(Vec::len).sum::<usize>() + 1, 1);
    let mut n = 0;
    if let Some(c) = c.as_mut() {
        for s in seqs {
            if let Ok(p) = pool.alloc(s.len()) {
                let _ = c.insert(&CacheNamespace::default(), s, p, 0);
            }
        }
        n = c.stats().cached_tokens;
        c.flush();
    }
    n
}

fn mooncake(dir: &Path) -> Result<Workload, String> {
    let path = dir.join("traces/mooncake/conversation_trace.jsonl.gz");
    let mut reqs: Vec<(usize, Vec<u64>)> = Vec::new();
    for line in BufReader::new(open_gz(&path)?).lines() {
        let line = line.map_err(|e| format!("{}: {e}", path.display()))?;
        let v: serde_json::Value =
            serde_json::from_str(&line).map_err(|e| format!("{}: {e}", path.display()))?;
        let len = v["input_length"].as_u64().unwrap_or(0) as usize;
        let ids: Vec<u64> = v["hash_ids"]
            .as_array()
            .map(|a| a.iter().filter_map(|x| x.as_u64()).collect())
            .unwrap_or_default();
        if len > 0 && !ids.is_empty() {
            reqs.push((len, ids));
        }
    }
    // Conversations: requests sharing their second block, taken whole.
    let mut order: Vec<u64> = Vec::new();
    let mut groups: HashMap<u64, Vec<usize>> = HashMap::new();
    for (i, (_, ids)) in reqs.iter().enumerate() {
        if let Some(&k) = ids.get(1) {
            let g = groups.entry(k).or_default();
            if g.is_empty() {
                order.push(k);
            }
            g.push(i);
        }
    }
    let mut chosen = Vec::new();
    let mut blocks = HashSet::new();
    let mut rest = Vec::new();
    for k in order {
        let g = &groups[&k];
        if g.len() < 2 {
            continue;
        }
        if blocks.len() * BLOCK < TARGET_TOKENS {
            for &i in g {
                blocks.extend(reqs[i].1.iter().copied());
            }
            chosen.extend_from_slice(g);
        } else if rest.len() < HELD_OUT {
            rest.push(g[g.len() - 1]);
        }
    }
    chosen.sort_unstable();
    let seq = |i: usize| -> Vec<u32> {
        let (len, ids) = &reqs[i];
        let mut t = Vec::with_capacity(*len);
        'outer: for &h in ids {
            for j in 0..BLOCK as u64 {
                if t.len() == *len {
                    break 'outer;
                }
                t.push(token(h.wrapping_mul(1 << 20) ^ j));
            }
        }
        t
    };
    // Held-out requests: a cached conversation's prefix plus new blocks.
    let mut next: Vec<Vec<u32>> = Vec::new();
    for (n, &i) in chosen.iter().enumerate().take(HELD_OUT) {
        let mut t = seq(i);
        t.truncate(t.len() / 2);
        t.extend((0..2048u64).map(|j| token(0xABCD_0000 + (n as u64) * 4096 + j)));
        next.push(t);
    }
    next.extend(rest.into_iter().map(seq));
    Ok(Workload {
        name: "mooncake",
        seqs: chosen.into_iter().map(seq).collect(),
        next,
    })
}

fn sharegpt(dir: &Path) -> Result<Workload, String> {
    let path = dir.join("traces/sharegpt/ShareGPT_V3_first2500.json.gz");
    let mut text = String::new();
    open_gz(&path)?
        .read_to_string(&mut text)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let convs = v.as_array().ok_or("ShareGPT: not a JSON array")?;
    let word = |w: &str| -> u32 {
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        for b in w.bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
        token(h)
    };
    let system: Vec<u32> = (0..24).map(|i| token(0x5157 + i)).collect();
    let (mut seqs, mut next) = (Vec::new(), Vec::new());
    let mut cached = 0usize;
    for c in convs {
        let Some(turns) = c["conversations"].as_array() else {
            continue;
        };
        let mut history = system.clone();
        let mut conv_seqs = Vec::new();
        let mut added = 0;
        for t in turns {
            let role = t["from"].as_str().unwrap_or("");
            let Some(value) = t["value"].as_str() else {
                continue;
            };
            history.push(if role == "gpt" { 1 } else { 2 });
            let before = history.len();
            history.extend(value.split_whitespace().map(word));
            added += history.len() - before + 1;
            if role == "gpt" {
                conv_seqs.push(history.clone());
            }
        }
        if conv_seqs.is_empty() {
            continue;
        }
        if cached < TARGET_TOKENS {
            cached += added;
            seqs.extend(conv_seqs);
        } else if next.len() < HELD_OUT {
            // A new conversation: only the system prompt is shared.
            next.push(history);
        } else {
            break;
        }
    }
    // And new questions on cached conversations.
    let extra: Vec<Vec<u32>> = seqs
        .iter()
        .step_by((seqs.len() / HELD_OUT).max(1))
        .take(HELD_OUT)
        .enumerate()
        .map(|(n, s)| {
            let mut t = s.clone();
            t.extend((0..64u64).map(|j| token(0x7777_0000 + n as u64 * 100 + j)));
            t
        })
        .collect();
    next.extend(extra);
    Ok(Workload {
        name: "sharegpt",
        seqs,
        next,
    })
}

/// A cache holding every sequence of `w`, and the pool behind it.
fn build(w: &Workload, ps: usize) -> (RadixCache, PagePool, Duration) {
    let longest = w
        .seqs
        .iter()
        .chain(&w.next)
        .map(Vec::len)
        .max()
        .unwrap_or(0);
    let pool = PagePool::new((TARGET_TOKENS * 3 / 2 + 2 * longest) / ps + 64, ps);
    let mut cache = RadixCache::lru(ps).unwrap_or_else(|e| panic!("{e}"));
    let ns = CacheNamespace::default();
    let mut spent = Duration::ZERO;
    for s in &w.seqs {
        let pages = pool
            .alloc(pool.pages_for(s.len()))
            .unwrap_or_else(|e| panic!("pool too small: {e}"));
        let t = Instant::now();
        let out = cache.insert(&ns, s, pages, 0);
        spent += t.elapsed();
        black_box(out.ok());
    }
    (cache, pool, spent)
}

fn per(d: Duration, n: usize) -> f64 {
    d.as_secs_f64() * 1e9 / n.max(1) as f64
}

/// Average time of `f` over `reps` runs of all `queries`, in ns per query.
fn time_matches(cache: &mut RadixCache, queries: &[Vec<u32>], reps: usize) -> Duration {
    let ns = CacheNamespace::default();
    for q in queries {
        black_box(cache.match_prefix(&ns, q));
    }
    let t = Instant::now();
    for _ in 0..reps {
        for q in queries {
            black_box(cache.match_prefix(&ns, q));
        }
    }
    t.elapsed() / reps as u32
}

fn summary(w: &Workload, ps: usize) {
    let (mut cache, _pool, insert_time) = build(w, ps);
    let s = cache.stats();
    let total = w.tokens();
    let mem = cache.memory_usage();
    let hit = time_matches(&mut cache, &w.seqs, 3);
    let next_tokens: usize = w.next.iter().map(Vec::len).sum();
    let next_hit: usize = w
        .next
        .iter()
        .map(|q| cache.peek_prefix(&CacheNamespace::default(), q))
        .sum();
    let next = time_matches(&mut cache, &w.next, 5);
    let (cached, nodes) = (cache.stats().cached_tokens, cache.stats().nodes);
    let t = Instant::now();
    let freed = cache.evict(cached / 10);
    let evict = t.elapsed();
    println!(
        "summary {:>8} page {:>2}: {} seqs, {} tokens inserted, {} cached in {} nodes\n\
         \x20 insert: {:.2} us/op, {:.1} ns/token inserted\n\
         \x20 match (cached seqs, full hit): {:.2} us/op, {:.2} ns/token\n\
         \x20 match (next requests, {:.0}% hit): {:.2} us/op, {:.2} ns/token\n\
         \x20 evict 10% ({} tokens, {} nodes): {:.2} ms, {:.1} ns/token\n\
         \x20 metadata: {:.2} bytes/cached token ({} bytes: arena {}, tokens {}, pages {}, \
         edges {}, candidates {})",
        w.name,
        ps,
        w.seqs.len(),
        total,
        s.cached_tokens,
        s.nodes,
        per(insert_time, w.seqs.len()) / 1e3,
        per(insert_time, total),
        per(hit, w.seqs.len()) / 1e3,
        per(hit, total),
        100.0 * next_hit as f64 / next_tokens.max(1) as f64,
        per(next, w.next.len()) / 1e3,
        per(next, next_tokens),
        freed,
        nodes - cache.stats().nodes,
        evict.as_secs_f64() * 1e3,
        per(evict, freed),
        mem.total() as f64 / s.cached_tokens.max(1) as f64,
        mem.total(),
        mem.arena,
        mem.tokens,
        mem.pages,
        mem.edges,
        mem.candidates,
    );
    cache.flush();
}

fn workloads() -> Vec<Workload> {
    let Some(dir) = data_dir() else {
        println!(
            "skipping radix benchmarks: no traces under ../shared/data (set ARBOR_DATA_DIR to \
             the folder holding traces/)"
        );
        return Vec::new();
    };
    let mut out = Vec::new();
    for load in [mooncake, sharegpt] {
        match load(&dir) {
            Ok(w) => out.push(w),
            Err(e) => println!("skipping a workload: {e}"),
        }
    }
    out
}

fn benches(c: &mut Criterion) {
    for w in workloads() {
        println!(
            "workload {}: {} sequences, {} tokens ({} distinct), {} next requests",
            w.name,
            w.seqs.len(),
            w.tokens(),
            distinct(&w.seqs),
            w.next.len()
        );
        for ps in [1, 16] {
            summary(&w, ps);
        }
        for ps in [1, 16] {
            let mut g = c.benchmark_group(format!("{}/page{ps}", w.name));
            g.sample_size(10)
                .warm_up_time(Duration::from_millis(500))
                .measurement_time(Duration::from_secs(2));
            let ns = CacheNamespace::default();
            let (mut cache, _pool, _) = build(&w, ps);
            // One op per iteration, cycling through the queries.
            for (label, queries) in [("match_hit", &w.seqs), ("match_next", &w.next)] {
                let avg = queries.iter().map(Vec::len).sum::<usize>() / queries.len().max(1);
                g.throughput(Throughput::Elements(avg as u64));
                let mut i = 0;
                g.bench_function(label, |b| {
                    b.iter(|| {
                        i = (i + 1) % queries.len();
                        black_box(cache.match_prefix(&ns, &queries[i]))
                    })
                });
            }
            drop(cache);
            g.sampling_mode(SamplingMode::Flat);
            g.throughput(Throughput::Elements(w.tokens() as u64));
            g.bench_function("insert_all", |b| {
                b.iter_custom(|iters| (0..iters).map(|_| build(&w, ps).2).sum::<Duration>())
            });
            g.throughput(Throughput::Elements((TARGET_TOKENS / 10) as u64));
            g.bench_function("evict_10pct", |b| {
                b.iter_custom(|iters| {
                    let mut spent = Duration::ZERO;
                    for _ in 0..iters {
                        let (mut cache, _pool, _) = build(&w, ps);
                        let n = cache.stats().cached_tokens / 10;
                        let t = Instant::now();
                        black_box(cache.evict(n));
                        spent += t.elapsed();
                    }
                    spent
                })
            });
            g.finish();
        }
    }
}

criterion_group!(radix, benches);
criterion_main!(radix);
