//! N-gram speculator benchmarks replaying real conversations.
//!
//! Data: ShareGPT V3 (the first 2,500 conversations) from
//! `../shared/data/traces/sharegpt/ShareGPT_V3_first2500.json.gz` (or
//! `$ARBOR_DATA_DIR/traces/...`). Text becomes token ids by splitting on
//! whitespace and hashing each word (FNV-1a, mixed, modulo 150,000); every
//! turn starts with a role token. Without the data the benchmarks are skipped
//! with a message.
//!
//! Replay: 256 conversations run at once, as a scheduler's batch. A human
//! turn is observed whole (a prompt); an assistant turn is decoded with
//! speculation: each step proposes up to 8 draft tokens per request, counts
//! how many leading draft tokens equal the real next tokens (for a tree, the
//! longest path that does), and observes those plus one more real token, as
//! verification would. A finished conversation is released and the next one
//! joins. Default options (SGLang's: windows 1..=12, breadth 1..=10, depth
//! 18, capacity 10M nodes).
//!
//! Printed first, per draft shape (chain, BFS tree, PROB tree): the accept
//! rate (accepted / drafted), accepted tokens per step, tokens per step, and
//! the mean time of `observe` per decode call, per prompt token, and of
//! `propose` per request. `$ARBOR_NGRAM_CONVS` limits the conversations of
//! that replay (default: all). Then criterion measures, on a trie warmed by
//! 1,000 conversations: `propose` of a 256-request batch per shape,
//! `observe` of one token for each of 256 requests, and prompt `observe`.

use arbor_engine_core::speculative::{NgramMatchType, NgramOptions};
use arbor_engine_core::{Draft, DraftRequest, Speculator};
use arbor_spec_decode::NgramSpeculator;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use flate2::read::GzDecoder;
use std::hint::black_box;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const BATCH: usize = 256;
const DRAFT: usize = 8;
const WARM_CONVS: usize = 1000;

fn data_dir() -> Option<PathBuf> {
    let dir = std::env::var_os("ARBOR_DATA_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data"));
    dir.join("traces/sharegpt").is_dir().then_some(dir)
}

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn word(w: &str) -> u32 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for b in w.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
    }
    (mix(h) % 150_000) as u32 + 16
}

/// One conversation: (is the assistant speaking, tokens) per turn.
type Conv = Vec<(bool, Vec<u32>)>;

fn load(dir: &Path) -> Result<Vec<Conv>, String> {
    let path = dir.join("traces/sharegpt/ShareGPT_V3_first2500.json.gz");
    let f = std::fs::File::open(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut text = String::new();
    GzDecoder::new(f)
        .read_to_string(&mut text)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let convs = v.as_array().ok_or("ShareGPT: not a JSON array")?;
    let mut out = Vec::new();
    for c in convs {
        let Some(turns) = c["conversations"].as_array() else {
            continue;
        };
        let mut conv = Vec::new();
        for t in turns {
            let gpt = t["from"].as_str() == Some("gpt");
            let Some(value) = t["value"].as_str() else {
                continue;
            };
            let mut toks = vec![if gpt { 1 } else { 2 }];
            toks.extend(value.split_whitespace().map(word));
            conv.push((gpt, toks));
        }
        if conv.iter().any(|(gpt, t)| *gpt && t.len() > 1) {
            out.push(conv);
        }
    }
    Ok(out)
}

fn options(match_type: NgramMatchType) -> NgramOptions {
    NgramOptions {
        match_type,
        ..NgramOptions::default()
    }
}

/// Leading draft tokens equal to `actual` (the longest such path of a tree).
fn accepted(d: &Draft, actual: &[u32]) -> usize {
    let Some(parents) = &d.parents else {
        return d
            .tokens
            .iter()
            .zip(actual)
            .take_while(|(a, b)| a == b)
            .count();
    };
    let mut cur = None;
    let mut n = 0;
    while n < actual.len() {
        let next = (0..d.tokens.len()).find(|&i| parents[i] == cur && d.tokens[i] == actual[n]);
        match next {
            Some(i) => {
                cur = Some(i as u32);
                n += 1;
            }
            None => break,
        }
    }
    n
}

struct Slot {
    key: u64,
    conv: usize,
    turn: usize,
    pos: usize,
    history: Vec<u32>,
}

#[derive(Default)]
struct Stats {
    steps: u64,
    drafted: u64,
    accepted: u64,
    decoded: u64,
    prompt_tokens: u64,
    observe_calls: u64,
    observe: Duration,
    prompt: Duration,
    propose: Duration,
}

/// 256 conversations in flight over one speculator.
struct Replay<'a> {
    convs: &'a [Conv],
    spec: NgramSpeculator,
    slots: Vec<Slot>,
    next_conv: usize,
    next_key: u64,
    tree: bool,
    stats: Stats,
}

impl<'a> Replay<'a> {
    fn new(convs: &'a [Conv], match_type: NgramMatchType, tree: bool) -> Self {
        let spec = NgramSpeculator::new(options(match_type)).expect("default options are valid");
        let mut r = Self {
            convs,
            spec,
            slots: Vec::new(),
            next_conv: 0,
            next_key: 0,
            tree,
            stats: Stats::default(),
        };
        while r.slots.len() < BATCH && r.admit_one() {}
        r
    }

    /// Starts the next conversation in a new slot; false when none is left.
    fn admit_one(&mut self) -> bool {
        if self.next_conv >= self.convs.len() {
            return false;
        }
        self.next_key += 1;
        let mut s = Slot {
            key: self.next_key,
            conv: self.next_conv,
            turn: 0,
            pos: 0,
            history: Vec::new(),
        };
        self.next_conv += 1;
        if self.prefill(&mut s) {
            self.slots.push(s);
        }
        true
    }

    /// Observes human turns whole until an assistant turn starts; false when the conversation ended.
    fn prefill(&mut self, s: &mut Slot) -> bool {
        let convs = self.convs;
        let conv = &convs[s.conv];
        loop {
            let Some((gpt, toks)) = conv.get(s.turn) else {
                self.spec.release(s.key);
                return false;
            };
            if *gpt && s.pos == 0 {
                // The role token is part of the prompt.
                self.observe_prompt(s.key, &toks[..1]);
                s.history.push(toks[0]);
                s.pos = 1;
            }
            if *gpt && s.pos < toks.len() {
                return true;
            }
            if !*gpt {
                self.observe_prompt(s.key, toks);
                s.history.extend(toks);
            }
            s.turn += 1;
            s.pos = 0;
        }
    }

    fn observe_prompt(&mut self, key: u64, toks: &[u32]) {
        let t = Instant::now();
        self.spec.observe(key, toks);
        self.stats.prompt += t.elapsed();
        self.stats.prompt_tokens += toks.len() as u64;
    }

    /// One decode step of every slot; false when all conversations are done.
    fn step(&mut self, speculate: bool) -> bool {
        if self.slots.is_empty() {
            return false;
        }
        let drafts = if speculate {
            let reqs: Vec<DraftRequest<'_>> = self
                .slots
                .iter()
                .map(|s| DraftRequest {
                    key: s.key,
                    tokens: &s.history,
                    len: s.history.len(),
                    max_tokens: DRAFT,
                    allow_tree: self.tree,
                    pages: &[],
                    sampling: None,
                })
                .collect();
            let t = Instant::now();
            let d = self.spec.propose(&reqs);
            self.stats.propose += t.elapsed();
            d
        } else {
            vec![Draft::default(); self.slots.len()]
        };
        let convs = self.convs;
        let mut slots = std::mem::take(&mut self.slots);
        let mut kept = Vec::with_capacity(slots.len());
        for (mut s, d) in slots.drain(..).zip(drafts) {
            let toks = &convs[s.conv][s.turn].1;
            let rest = &toks[s.pos..];
            let a = accepted(&d, rest).min(rest.len() - 1);
            let emit = &rest[..a + 1];
            self.stats.steps += 1;
            self.stats.drafted += d.tokens.len() as u64;
            self.stats.accepted += a as u64;
            self.stats.decoded += emit.len() as u64;
            let t = Instant::now();
            self.spec.observe(s.key, emit);
            self.stats.observe += t.elapsed();
            self.stats.observe_calls += 1;
            s.history.extend(emit);
            s.pos += emit.len();
            if s.pos >= toks.len() {
                s.turn += 1;
                s.pos = 0;
                if !self.prefill(&mut s) {
                    continue;
                }
            }
            kept.push(s);
        }
        self.slots = kept;
        while self.slots.len() < BATCH && self.admit_one() {}
        true
    }

    fn requests(&self) -> Vec<(u64, Vec<u32>)> {
        self.slots
            .iter()
            .map(|s| (s.key, s.history.clone()))
            .collect()
    }
}

fn us(d: Duration, n: u64) -> f64 {
    d.as_secs_f64() * 1e6 / n.max(1) as f64
}

fn summary(convs: &[Conv]) {
    let limit = std::env::var("ARBOR_NGRAM_CONVS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(convs.len())
        .min(convs.len());
    let convs = &convs[..limit];
    let tokens: usize = convs.iter().flatten().map(|(_, t)| t.len()).sum();
    println!(
        "ngram replay: {} ShareGPT conversations, {tokens} tokens, batch {BATCH}, up to {DRAFT} drafts",
        convs.len()
    );
    for (name, mt, tree) in [
        ("chain", NgramMatchType::Bfs, false),
        ("bfs", NgramMatchType::Bfs, true),
        ("prob", NgramMatchType::Prob, true),
    ] {
        let mut r = Replay::new(convs, mt, tree);
        let t = Instant::now();
        while r.step(true) {}
        let wall = t.elapsed();
        let s = &r.stats;
        let st = r.spec.stats();
        println!(
            "  {name:5}: accept rate {:.3} ({} of {} drafted), {:.2} accepted/step, \
             {:.2} tokens/step; observe {:.2} us/call (decode), {:.2} us/prompt token; \
             propose {:.2} us/request; {} nodes ({} evicted, {:.0} MB); {:.1} s",
            s.accepted as f64 / s.drafted.max(1) as f64,
            s.accepted,
            s.drafted,
            s.accepted as f64 / s.steps.max(1) as f64,
            s.decoded as f64 / s.steps.max(1) as f64,
            us(s.observe, s.observe_calls),
            us(s.prompt, s.prompt_tokens),
            us(s.propose, s.steps),
            st.nodes,
            st.evicted,
            st.memory_bytes as f64 / 1e6,
            wall.as_secs_f64(),
        );
    }
}

fn warm(convs: &[Conv], mt: NgramMatchType, tree: bool) -> Replay<'_> {
    let mut r = Replay::new(convs, mt, tree);
    while r.next_conv < WARM_CONVS.min(convs.len() / 2) && r.step(true) {}
    r
}

fn benches(c: &mut Criterion) {
    let Some(dir) = data_dir() else {
        eprintln!(
            "ngram bench skipped: no ShareGPT data under ../shared/data (or $ARBOR_DATA_DIR)"
        );
        return;
    };
    let convs = match load(&dir) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("ngram bench skipped: {e}");
            return;
        }
    };
    summary(&convs);

    let mut g = c.benchmark_group("ngram");
    g.sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    for (name, mt, tree) in [
        ("chain", NgramMatchType::Bfs, false),
        ("bfs", NgramMatchType::Bfs, true),
        ("prob", NgramMatchType::Prob, true),
    ] {
        let mut r = warm(&convs, mt, tree);
        let owned = r.requests();
        let reqs: Vec<DraftRequest<'_>> = owned
            .iter()
            .map(|(key, t)| DraftRequest {
                key: *key,
                tokens: t,
                len: t.len(),
                max_tokens: DRAFT,
                allow_tree: tree,
                pages: &[],
                sampling: None,
            })
            .collect();
        g.throughput(Throughput::Elements(reqs.len() as u64));
        g.bench_function(format!("propose_{name}_batch{BATCH}"), |b| {
            b.iter(|| black_box(r.spec.propose(black_box(&reqs))))
        });
    }

    let mut r = warm(&convs, NgramMatchType::Bfs, false);
    g.throughput(Throughput::Elements(BATCH as u64));
    g.bench_function(format!("observe_decode_1token_batch{BATCH}"), |b| {
        b.iter_custom(|iters| {
            let before = r.stats.observe;
            for _ in 0..iters {
                if !r.step(false) {
                    r = warm(&convs, NgramMatchType::Bfs, false);
                }
            }
            r.stats.observe.saturating_sub(before)
        })
    });

    let mut r = warm(&convs, NgramMatchType::Bfs, false);
    let prompts: Vec<&Vec<u32>> = convs[WARM_CONVS.min(convs.len() / 2)..]
        .iter()
        .flatten()
        .filter(|(gpt, _)| !gpt)
        .map(|(_, t)| t)
        .collect();
    let per_iter = 16;
    let mean = prompts.iter().map(|p| p.len()).sum::<usize>() / prompts.len().max(1);
    g.throughput(Throughput::Elements((per_iter * mean) as u64));
    let mut next = 0usize;
    g.bench_function("observe_prompt_16prompts", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                for _ in 0..per_iter {
                    let p = prompts[next % prompts.len()];
                    next += 1;
                    let key = u64::MAX - next as u64;
                    let t = Instant::now();
                    r.spec.observe(key, p);
                    total += t.elapsed();
                    r.spec.release(key);
                }
            }
            total
        })
    });
    g.finish();
}

criterion_group!(ngram, benches);
criterion_main!(ngram);
