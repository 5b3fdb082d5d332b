//! Prometheus metrics in the text exposition format, with SGLang's names.
//!
//! Gauges and counters are read from the engine's [`EngineStats`] at scrape
//! time; the four latency histograms (`time_to_first_token_seconds`,
//! `inter_token_latency_seconds`, `e2e_request_latency_seconds`,
//! `queue_time_seconds`) are observed here from the timings the engine puts
//! in every output chunk. Every name is `<prefix>:<name>` (`arbor:` by
//! default; `sglang:` makes SGLang dashboards work) with a `model_name`
//! label. Histogram buckets are SGLang's.

use arbor_engine_core::engine::transfer::TransferReport;
use arbor_engine_core::engine::{EngineStats, OutputChunk};
use arbor_engine_core::grammar::GrammarCacheStats;
use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    15.0, 20.0, 25.0, 30.0, 40.0, 60.0, 120.0,
];
const ITL_BUCKETS: &[f64] = &[
    0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06, 0.08, 0.1, 0.15,
    0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.0,
];
const E2E_BUCKETS: &[f64] = &[
    0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0, 150.0, 200.0, 300.0, 400.0,
    600.0, 1200.0, 1800.0, 2400.0,
];
const QUEUE_BUCKETS: &[f64] = &[
    0.0, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0,
    300.0, 600.0,
];

#[derive(Debug)]
struct Histogram {
    name: &'static str,
    help: &'static str,
    buckets: &'static [f64],
    inner: Mutex<HistData>,
}

#[derive(Debug, Default)]
struct HistData {
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(name: &'static str, help: &'static str, buckets: &'static [f64]) -> Self {
        Self {
            name,
            help,
            buckets,
            inner: Mutex::new(HistData {
                counts: vec![0; buckets.len()],
                ..Default::default()
            }),
        }
    }

    fn observe_n(&self, v: f64, times: u64) {
        if !v.is_finite() || times == 0 {
            return;
        }
        let mut d = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = self.buckets.iter().position(|&b| v <= b) {
            d.counts[i] += times;
        }
        d.sum += v * times as f64;
        d.count += times;
    }

    fn count(&self) -> u64 {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).count
    }

    fn render(&self, out: &mut String, prefix: &str, labels: &str) {
        let d = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let n = format!("{prefix}:{}", self.name);
        let _ = writeln!(out, "# HELP {n} {}\n# TYPE {n} histogram", self.help);
        let mut acc = 0;
        for (b, c) in self.buckets.iter().zip(&d.counts) {
            acc += c;
            let _ = writeln!(out, "{n}_bucket{{{labels},le=\"{b}\"}} {acc}");
        }
        let _ = writeln!(out, "{n}_bucket{{{labels},le=\"+Inf\"}} {}", d.count);
        let _ = writeln!(out, "{n}_sum{{{labels}}} {}", d.sum);
        let _ = writeln!(out, "{n}_count{{{labels}}} {}", d.count);
    }
}

/// Per-sample timing state for the histograms.
#[derive(Clone, Debug, Default)]
pub(crate) struct SampleTiming {
    saw_first: bool,
    last_token_at: Option<f64>,
}

/// The server's metrics.
#[derive(Debug)]
pub struct Metrics {
    prefix: String,
    labels: String,
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
    queue: Histogram,
    /// Prefill/decode disaggregation: KV moved (a prefill worker's sent or
    /// deposited in bootstrap rooms; a decode worker's pulled from rooms).
    kv_sent_tokens: AtomicU64,
    kv_sent_bytes: AtomicU64,
    kv_sent_micros: AtomicU64,
    kv_send_failures: AtomicU64,
}

/// Checks a metric prefix (a Prometheus name without colons).
pub fn valid_prefix(p: &str) -> bool {
    let mut chars = p.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

impl Metrics {
    /// Metrics named `<prefix>:...` labelled with `model_name`.
    pub fn new(prefix: &str, model_name: &str) -> Self {
        Self {
            prefix: prefix.to_string(),
            labels: format!("model_name=\"{}\"", escape_label(model_name)),
            ttft: Histogram::new(
                "time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                TTFT_BUCKETS,
            ),
            itl: Histogram::new(
                "inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
                ITL_BUCKETS,
            ),
            e2e: Histogram::new(
                "e2e_request_latency_seconds",
                "Histogram of end-to-end request latency in seconds.",
                E2E_BUCKETS,
            ),
            queue: Histogram::new(
                "queue_time_seconds",
                "Histogram of time spent waiting in the queue in seconds.",
                QUEUE_BUCKETS,
            ),
            kv_sent_tokens: AtomicU64::new(0),
            kv_sent_bytes: AtomicU64::new(0),
            kv_sent_micros: AtomicU64::new(0),
            kv_send_failures: AtomicU64::new(0),
        }
    }

    /// Counts one KV transfer to a decode worker.
    pub(crate) fn kv_transferred(&self, t: &TransferReport) {
        self.kv_sent_tokens
            .fetch_add(t.tokens as u64, Ordering::Relaxed);
        self.kv_sent_bytes
            .fetch_add(t.bytes as u64, Ordering::Relaxed);
        self.kv_sent_micros
            .fetch_add((t.seconds * 1e6) as u64, Ordering::Relaxed);
    }

    /// Counts one failed KV transfer.
    pub(crate) fn kv_transfer_failed(&self) {
        self.kv_send_failures.fetch_add(1, Ordering::Relaxed);
    }

    /// Records the timings a chunk carries for one sample.
    pub(crate) fn observe(&self, t: &mut SampleTiming, c: &OutputChunk) {
        let m = &c.meta;
        let k = c.token_ids.len() as u64;
        if k > 0 {
            if !t.saw_first {
                t.saw_first = true;
                if let Some(ttft) = m.ttft {
                    self.ttft.observe_n(ttft, 1);
                }
                // Tokens beyond the first in the same chunk arrived together.
                if k > 1 {
                    self.itl.observe_n(0.0, k - 1);
                }
            } else if let Some(prev) = t.last_token_at {
                self.itl
                    .observe_n(((m.elapsed - prev) / k as f64).max(0.0), k);
            }
            t.last_token_at = Some(m.elapsed);
        }
        if c.finish.is_some() {
            self.e2e.observe_n(m.elapsed, 1);
            self.queue.observe_n(m.queue_time, 1);
        }
    }

    /// Finished samples observed so far.
    pub fn finished_samples(&self) -> u64 {
        self.e2e.count()
    }

    /// The exposition text for `stats`, with the grammar queue length and,
    /// when structured output is on, the grammar cache's counters.
    pub fn render(
        &self,
        s: &EngineStats,
        grammar_queue: usize,
        grammar_cache: Option<GrammarCacheStats>,
    ) -> String {
        let mut out = String::with_capacity(8192);
        let p = &self.prefix;
        let l = &self.labels;
        let mut one = |name: &str, kind: &str, help: &str, v: f64| {
            let _ = writeln!(
                out,
                "# HELP {p}:{name} {help}\n# TYPE {p}:{name} {kind}\n{p}:{name}{{{l}}} {v}"
            );
        };
        one(
            "num_running_reqs",
            "gauge",
            "The number of running requests.",
            s.num_running_reqs as f64,
        );
        one(
            "num_queue_reqs",
            "gauge",
            "The number of requests in the waiting queue.",
            s.num_queue_reqs as f64,
        );
        one(
            "num_grammar_queue_reqs",
            "gauge",
            "The number of requests waiting for their grammar to compile.",
            grammar_queue as f64,
        );
        if let Some(g) = grammar_cache {
            one(
                "grammar_cache_hits_total",
                "counter",
                "Grammar lookups answered by a compiled (or compiling) cache entry.",
                g.hits as f64,
            );
            one(
                "grammar_cache_misses_total",
                "counter",
                "Grammar lookups that started a compilation.",
                g.misses as f64,
            );
            one(
                "grammar_compile_errors_total",
                "counter",
                "Grammar compilations that failed.",
                g.compile_errors as f64,
            );
        }
        one(
            "jump_forward_tokens_total",
            "counter",
            "Number of tokens a grammar forced without a forward pass of their own.",
            s.jump_forward_tokens_total as f64,
        );
        one(
            "given_first_tokens_total",
            "counter",
            "Requests that started from a first token a disaggregated prefill worker sampled.",
            s.given_first_tokens_total as f64,
        );
        one(
            "spec_accept_length",
            "gauge",
            "The average number of tokens per verify step of speculative decoding (accepted drafts + 1).",
            s.spec_accept_length,
        );
        let rate = if s.spec_draft_tokens_total > 0 {
            s.spec_accepted_tokens_total as f64 / s.spec_draft_tokens_total as f64
        } else {
            0.0
        };
        one(
            "spec_accept_rate",
            "gauge",
            "The share of draft tokens the target accepted, since start.",
            rate,
        );
        one(
            "spec_verify_ct_total",
            "counter",
            "Decode steps of requests under speculative decoding.",
            s.spec_verify_ct_total as f64,
        );
        one(
            "spec_draft_tokens_total",
            "counter",
            "Draft tokens proposed and verified.",
            s.spec_draft_tokens_total as f64,
        );
        one(
            "spec_accepted_tokens_total",
            "counter",
            "Draft tokens accepted.",
            s.spec_accepted_tokens_total as f64,
        );
        one(
            "spec_draft_tokens_skipped_total",
            "counter",
            "Draft tokens the adaptive controller did not verify because they would not pay.",
            s.spec_draft_tokens_skipped_total as f64,
        );
        one(
            "spec_draft_budget",
            "gauge",
            "Draft tokens per decoding request in the last step (after the adaptive controller).",
            s.spec_draft_budget,
        );
        for (name, kind, help, v) in hicache_lines(s) {
            one(name, kind, help, v);
        }
        one(
            "num_used_tokens",
            "gauge",
            "The number of KV cache tokens that requests hold (evictable cached tokens excluded).",
            s.num_used_tokens as f64,
        );
        one(
            "evictable_tokens",
            "gauge",
            "The number of KV cache tokens the prefix cache keeps for reuse that no request holds (freed on demand).",
            s.evictable_tokens as f64,
        );
        one(
            "cache_tokens",
            "gauge",
            "The number of KV cache tokens the prefix cache holds (evictable and locked by requests).",
            s.cache_tokens as f64,
        );
        one(
            "max_total_num_tokens",
            "gauge",
            "The KV cache capacity in tokens.",
            s.max_total_tokens as f64,
        );
        one(
            "token_usage",
            "gauge",
            "The fraction of KV cache tokens that requests hold (num_used_tokens / max_total_num_tokens).",
            s.token_usage,
        );
        one(
            "cache_hit_rate",
            "gauge",
            "The prefix cache hit rate over recent prefills.",
            s.cache_hit_rate,
        );
        one(
            "gen_throughput",
            "gauge",
            "The generation throughput (token/s).",
            s.gen_throughput,
        );
        one(
            "num_retracted_reqs",
            "gauge",
            "The number of retractions since start.",
            s.num_retracted_reqs_total as f64,
        );
        one(
            "prompt_tokens_total",
            "counter",
            "Number of prefill tokens processed.",
            s.prompt_tokens_total as f64,
        );
        one(
            "generation_tokens_total",
            "counter",
            "Number of generation tokens processed.",
            s.generation_tokens_total as f64,
        );
        one(
            "cached_tokens_total",
            "counter",
            "Number of prompt tokens served from the prefix cache.",
            s.cached_tokens_total as f64,
        );
        one(
            "num_requests_total",
            "counter",
            "Number of requests processed.",
            s.num_requests_total as f64,
        );
        one(
            "num_aborted_requests_total",
            "counter",
            "Number of requests aborted.",
            s.num_aborted_requests_total as f64,
        );
        for (name, help, v) in [
            (
                "kv_transfer_tokens_total",
                "Prompt tokens of KV moved between prefill and decode workers (prefill: sent or deposited in bootstrap rooms; decode: pulled and imported).",
                self.kv_sent_tokens.load(Ordering::Relaxed) as f64,
            ),
            (
                "kv_transfer_bytes_total",
                "Bytes of KV moved between prefill and decode workers.",
                self.kv_sent_bytes.load(Ordering::Relaxed) as f64,
            ),
            (
                "kv_transfer_seconds_total",
                "Seconds spent moving KV between prefill and decode workers.",
                self.kv_sent_micros.load(Ordering::Relaxed) as f64 / 1e6,
            ),
            (
                "kv_transfer_failures_total",
                "KV transfers between prefill and decode workers that failed (the decode worker computed the prompt).",
                self.kv_send_failures.load(Ordering::Relaxed) as f64,
            ),
        ] {
            one(name, "counter", help, v);
        }
        if !s.expert_load.is_empty() {
            let name = format!("{p}:moe_expert_tokens_total");
            let _ = writeln!(
                out,
                "# HELP {name} Tokens routed to each expert of each MoE layer (the input of expert load balancing).\n# TYPE {name} counter"
            );
            for e in &s.expert_load {
                for (expert, n) in e.tokens.iter().enumerate() {
                    let _ = writeln!(
                        out,
                        "{name}{{{l},layer=\"{}\",expert=\"{expert}\"}} {n}",
                        e.layer
                    );
                }
            }
        }
        for h in [&self.ttft, &self.itl, &self.e2e, &self.queue] {
            h.render(&mut out, p, l);
        }
        out
    }
}

/// The HiCache series (none when the tiers are off): name, type, help, value.
fn hicache_lines(s: &EngineStats) -> Vec<(&'static str, &'static str, &'static str, f64)> {
    let t = &s.tiers;
    if t.host_capacity_tokens == 0 {
        return Vec::new();
    }
    let c = &s.kv_copy;
    vec![
        (
            "hicache_host_tokens",
            "gauge",
            "Tokens whose KV the host tier holds.",
            t.host_tokens as f64,
        ),
        (
            "hicache_host_capacity_tokens",
            "gauge",
            "Token capacity of the host tier.",
            t.host_capacity_tokens as f64,
        ),
        (
            "hicache_host_hit_tokens_total",
            "counter",
            "Prompt tokens loaded back from the host tier instead of recomputed.",
            t.host_hit_tokens as f64,
        ),
        (
            "hicache_storage_hit_tokens_total",
            "counter",
            "Of those, tokens that had come from the storage tier.",
            t.storage_hit_tokens as f64,
        ),
        (
            "hicache_demoted_tokens_total",
            "counter",
            "Tokens moved from the device to the host tier on eviction.",
            t.demoted_tokens as f64,
        ),
        (
            "hicache_pages_to_host_total",
            "counter",
            "KV pages copied from the device to the host.",
            c.pages_to_host as f64,
        ),
        (
            "hicache_pages_to_device_total",
            "counter",
            "KV pages copied from the host to the device.",
            c.pages_to_device as f64,
        ),
        (
            "hicache_copy_bytes_total",
            "counter",
            "Bytes copied between the device and the host.",
            c.bytes as f64,
        ),
        (
            "hicache_copy_seconds_total",
            "counter",
            "Seconds spent copying KV between the device and the host.",
            c.seconds,
        ),
        (
            "hicache_storage_read_pages_total",
            "counter",
            "KV pages read from the storage tier.",
            t.storage_read_pages as f64,
        ),
        (
            "hicache_storage_read_bytes_total",
            "counter",
            "Bytes read from the storage tier.",
            t.storage_read_bytes as f64,
        ),
        (
            "hicache_storage_read_seconds_total",
            "counter",
            "Seconds spent reading the storage tier (off the scheduler thread).",
            t.storage_read_seconds,
        ),
        (
            "hicache_storage_write_pages_total",
            "counter",
            "KV pages written to the storage tier.",
            t.storage_write_pages as f64,
        ),
        (
            "hicache_storage_write_bytes_total",
            "counter",
            "Bytes written to the storage tier.",
            t.storage_write_bytes as f64,
        ),
        (
            "hicache_storage_write_seconds_total",
            "counter",
            "Seconds spent writing the storage tier (off the scheduler thread).",
            t.storage_write_seconds,
        ),
        (
            "hicache_storage_errors_total",
            "counter",
            "Storage operations that failed (the requests recomputed).",
            t.storage_errors as f64,
        ),
        (
            "hicache_storage_corrupt_total",
            "counter",
            "Stored entries found corrupt, skipped and removed.",
            t.storage_corrupt as f64,
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use arbor_engine_core::engine::{Finish, FinishKind, OutputMeta};

    #[test]
    fn renders_names_with_prefix_and_histograms() {
        let m = Metrics::new("sglang", "m\"x");
        let mut t = SampleTiming::default();
        let chunk = |n: usize, elapsed: f64, fin: bool| OutputChunk {
            index: 0,
            token_ids: vec![1; n],
            text: String::new(),
            logprobs: vec![],
            finish: fin.then_some(Finish {
                kind: FinishKind::Length,
                matched: None,
                message: None,
            }),
            meta: OutputMeta {
                ttft: Some(0.05),
                elapsed,
                queue_time: 0.01,
                ..Default::default()
            },
        };
        m.observe(&mut t, &chunk(1, 0.05, false));
        m.observe(&mut t, &chunk(2, 0.07, true));
        let s = m.render(&EngineStats::default(), 0, None);
        assert!(s.contains("sglang:num_running_reqs{model_name=\"m\\\"x\"} 0"));
        assert!(s.contains("sglang:time_to_first_token_seconds_count{model_name=\"m\\\"x\"} 1"));
        assert!(s.contains("sglang:inter_token_latency_seconds_count{model_name=\"m\\\"x\"} 2"));
        assert!(s.contains("# TYPE sglang:prompt_tokens_total counter"));
        assert_eq!(m.finished_samples(), 1);
        assert!(
            valid_prefix("arbor")
                && !valid_prefix("a:b")
                && !valid_prefix("")
                && !valid_prefix("1a")
        );
    }
}
