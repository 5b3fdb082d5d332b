//! kv-radix against SGLang's own RadixCache on the Mooncake conversation trace.
//!
//! Every request, in trace order: `match_prefix` of its tokens, `insert` of
//! its tokens (pages for all of them; the cache frees the duplicates), then
//! LRU eviction down to the run's bound (`evict(cached - bound)` when over).
//! Hash id `h` stands for the 512-token block `h*512 .. h*512+511`, the last
//! block cut at `input_length`. The totals must equal those SGLang 0.5.23
//! gave for the same runs, recorded by `tools/reference/radix_replay.py` in
//! `tests/fixtures/sglang_radix_mooncake.json`.
//!
//! The trace is read from `../shared/data` next to the workspace (or
//! `$ARBOR_DATA_DIR`); without it the test passes with a printed reason. The
//! fixture holds the first 2,000 requests (bounds 200,000 and 1,000,000
//! tokens) and the whole trace (12,031 requests, bound 1,000,000), each with
//! page sizes 1 and 16: about two seconds in all.

// A test: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use arbor_engine_core::{CacheNamespace, PagePool, PrefixCache};
use arbor_kv_radix::RadixCache;
use flate2::read::GzDecoder;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

const BLOCK: u64 = 512;
const FIXTURE: &str = include_str!("fixtures/sglang_radix_mooncake.json");

fn trace_path() -> Option<PathBuf> {
    let dir = std::env::var_os("ARBOR_DATA_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data"));
    let path = dir.join("traces/mooncake/conversation_trace.jsonl.gz");
    path.is_file().then_some(path)
}

/// Calls `f` with the token list of each of the first `n` requests of the
/// trace (every request for `n == 0`), in order.
fn for_each_request(path: &Path, n: usize, mut f: impl FnMut(&[u32])) {
    let file = std::fs::File::open(path).unwrap();
    let mut toks = Vec::new();
    for (i, line) in BufReader::new(GzDecoder::new(file)).lines().enumerate() {
        if n > 0 && i == n {
            break;
        }
        let v: serde_json::Value = serde_json::from_str(&line.unwrap()).unwrap();
        let len = v["input_length"].as_u64().unwrap() as usize;
        toks.clear();
        for h in v["hash_ids"].as_array().unwrap() {
            let h = h.as_u64().unwrap();
            toks.extend((h * BLOCK..(h + 1) * BLOCK).map(|t| u32::try_from(t).unwrap()));
        }
        toks.truncate(len);
        f(&toks);
    }
}

#[derive(Debug, PartialEq)]
struct Totals {
    requests: u64,
    queried: u64,
    matched: u64,
    evicted: u64,
    evict_calls: u64,
    cached: u64,
}

fn replay(path: &Path, n: usize, page_size: usize, bound: usize) -> Totals {
    let ns = CacheNamespace::default();
    // Enough for the bound and the largest request (under 200k tokens) twice.
    let pool = PagePool::new((bound + 400_000) / page_size + 16, page_size);
    let mut cache = RadixCache::lru(page_size).unwrap();
    let mut t = Totals {
        requests: 0,
        queried: 0,
        matched: 0,
        evicted: 0,
        evict_calls: 0,
        cached: 0,
    };
    for_each_request(path, n, |toks| {
        t.requests += 1;
        t.queried += toks.len() as u64;
        t.matched += cache.match_prefix(&ns, toks).matched_tokens as u64;
        let pages = pool.alloc(toks.len().div_ceil(page_size)).unwrap();
        cache.insert(&ns, toks, pages, 0).unwrap();
        let cached = cache.stats().cached_tokens;
        if cached > bound {
            t.evicted += cache.evict(cached - bound) as u64;
            t.evict_calls += 1;
        }
    });
    t.cached = cache.stats().cached_tokens as u64;
    t
}

#[test]
fn totals_equal_sglang() {
    let Some(path) = trace_path() else {
        println!(
            "sglang replay skipped: no mooncake trace under ../shared/data/traces \
             (or $ARBOR_DATA_DIR/traces)"
        );
        return;
    };
    let doc: serde_json::Value = serde_json::from_str(FIXTURE).unwrap();
    let runs = doc["runs"].as_array().unwrap();
    assert!(!runs.is_empty(), "no runs in the fixture");
    let mut failed = Vec::new();
    for r in runs {
        let get = |k: &str| r[k].as_u64().unwrap();
        let (n, ps, bound) = (get("requests"), get("page_size"), get("bound"));
        let want = Totals {
            requests: n,
            queried: get("queried_tokens"),
            matched: get("matched_tokens"),
            evicted: get("evicted_tokens"),
            evict_calls: get("evict_calls"),
            cached: get("cached_tokens"),
        };
        let got = replay(&path, n as usize, ps as usize, bound as usize);
        println!("page size {ps}, bound {bound}:\n  kv-radix {got:?}\n  sglang   {want:?}");
        if got != want {
            failed.push(format!("{n} requests, page size {ps}, bound {bound}"));
        }
    }
    assert!(failed.is_empty(), "totals differ from SGLang's: {failed:?}");
}
