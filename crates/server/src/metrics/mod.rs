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

mod series;

/// One series of the exposition: name (after the prefix), Prometheus type,
/// help line and value.
type Series = (&'static str, &'static str, &'static str, f64);

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

    /// The PD transfer counters.
    fn kv_transfer_series(&self) -> Vec<Series> {
        vec![
            (
                "kv_transfer_tokens_total",
                "counter",
                "Prompt tokens of KV moved between prefill and decode workers (prefill: sent or deposited in bootstrap rooms; decode: pulled and imported).",
                self.kv_sent_tokens.load(Ordering::Relaxed) as f64,
            ),
            (
                "kv_transfer_bytes_total",
                "counter",
                "Bytes of KV moved between prefill and decode workers.",
                self.kv_sent_bytes.load(Ordering::Relaxed) as f64,
            ),
            (
                "kv_transfer_seconds_total",
                "counter",
                "Seconds spent moving KV between prefill and decode workers.",
                self.kv_sent_micros.load(Ordering::Relaxed) as f64 / 1e6,
            ),
            (
                "kv_transfer_failures_total",
                "counter",
                "KV transfers between prefill and decode workers that failed (the decode worker computed the prompt).",
                self.kv_send_failures.load(Ordering::Relaxed) as f64,
            ),
        ]
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
        let series = [
            series::queue(s, grammar_queue, grammar_cache),
            series::speculative(s),
            series::hicache(s),
            series::pool(s),
            self.kv_transfer_series(),
        ];
        for (name, kind, help, v) in series.into_iter().flatten() {
            let _ = writeln!(
                out,
                "# HELP {p}:{name} {help}\n# TYPE {p}:{name} {kind}\n{p}:{name}{{{l}}} {v}"
            );
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

/// One metric of the exposition: its name (under the prefix), Prometheus
/// type and help line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MetricInfo {
    pub name: String,
    pub kind: String,
    pub help: String,
}

/// Every metric `/metrics` can print, with every optional group on
/// (structured output, HiCache, MoE): read back from the exposition
/// itself, so the reference page `docs/src/reference/metrics.md` is
/// generated from what the server prints.
pub fn catalogue(prefix: &str) -> Vec<MetricInfo> {
    let mut stats = EngineStats::default();
    stats.tiers.host_capacity_tokens = 1;
    stats.expert_load = vec![arbor_engine_core::moe::ExpertLoad {
        layer: 0,
        tokens: vec![0],
    }];
    let text = Metrics::new(prefix, "m").render(&stats, 0, Some(GrammarCacheStats::default()));
    let mut out: Vec<MetricInfo> = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
            out.push(MetricInfo {
                name: name.to_string(),
                kind: String::new(),
                help: help.to_string(),
            });
        } else if let Some(rest) = line.strip_prefix("# TYPE ")
            && let Some((name, kind)) = rest.split_once(' ')
            && let Some(m) = out.iter_mut().rev().find(|m| m.name == name)
        {
            m.kind = kind.to_string();
        }
    }
    out
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
            prompt_logprobs: vec![],
            embedding: vec![],
            finish: fin.then_some(Finish {
                kind: FinishKind::Length,
                matched: None,
                message: None,
                cause: None,
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
