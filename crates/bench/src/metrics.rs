//! Benchmark figures from the per-request measurements, and the printed
//! "Serving Benchmark Result" block.
//!
//! The computations follow SGLang's `calculate_metrics`: totals and
//! latency statistics over successful requests only; TPOT is
//! `(latency - ttft) / (output_len - 1)` for outputs longer than one token;
//! ITLs of all requests are pooled; "Concurrency" is the sum of latencies over
//! the duration; the peaks bucket token and request times by whole seconds
//! from the first request's start. The block prints SGLang's rows, in its
//! order and format (`{:<40} {:<10}`), with P90 and P95 rows added to each
//! latency section; the prefix-cache and goodput sections come after the ITL
//! section, so everything SGLang prints compares line by line.

use crate::client::RequestOutput;
use crate::stats;
use serde::Serialize;

/// Mean, median, spread and tail of one latency, in milliseconds.
#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq)]
pub struct Summary {
    pub mean: f64,
    pub median: f64,
    pub std: f64,
    pub p90: f64,
    pub p95: f64,
    pub p99: f64,
    pub max: f64,
}

impl Summary {
    /// Statistics of `secs` (seconds), reported in milliseconds.
    pub fn of_seconds(secs: &[f64]) -> Self {
        let mut v: Vec<f64> = secs.iter().map(|s| s * 1000.0).collect();
        v.sort_by(f64::total_cmp);
        Self {
            mean: stats::mean(&v),
            median: stats::percentile_sorted(&v, 50.0),
            std: stats::std_dev(&v),
            p90: stats::percentile_sorted(&v, 90.0),
            p95: stats::percentile_sorted(&v, 95.0),
            p99: stats::percentile_sorted(&v, 99.0),
            max: stats::max(&v),
        }
    }
}

/// Service-level objectives for goodput.
#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq)]
pub struct Slo {
    /// Largest acceptable TTFT (ms).
    pub ttft_ms: Option<f64>,
    /// Largest acceptable gap between two tokens of a request (ms).
    pub itl_ms: Option<f64>,
}

impl Slo {
    /// Whether any objective is set.
    pub fn is_set(&self) -> bool {
        self.ttft_ms.is_some() || self.itl_ms.is_some()
    }

    /// Whether a successful request met every set objective.
    pub fn met_by(&self, o: &RequestOutput) -> bool {
        let ttft_ok = self.ttft_ms.is_none_or(|t| o.ttft * 1000.0 <= t);
        let itl_ok = self.itl_ms.is_none_or(|t| stats::max(&o.itl) * 1000.0 <= t);
        o.success && ttft_ok && itl_ok
    }
}

/// Goodput: throughput of the requests that met the objectives.
#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq)]
pub struct Goodput {
    pub slo: Slo,
    pub good_requests: usize,
    pub request_goodput: f64,
    pub output_goodput: f64,
}

/// What the server said about its prefix cache.
#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq)]
pub struct CacheReport {
    /// Successful requests whose answer carried `cached_tokens`.
    pub reporting: usize,
    /// Sum of `cached_tokens`.
    pub cached_tokens: usize,
    /// Prompt tokens of the reporting requests (server's count, else client's).
    pub prompt_tokens: usize,
    /// `cached_tokens / prompt_tokens`.
    pub hit_rate: f64,
    /// The data set's prefix sharing rate (the seeds' definition), when its tokens are known.
    pub dataset_sharing_rate: Option<f64>,
}

/// Every figure of a run.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Metrics {
    pub completed: usize,
    pub failed: usize,
    pub total_input: usize,
    pub total_output: usize,
    pub total_output_retokenized: Option<usize>,
    pub request_throughput: f64,
    pub input_throughput: f64,
    pub output_throughput: f64,
    pub total_throughput: f64,
    pub max_output_tokens_per_s: f64,
    pub max_concurrent_requests: usize,
    pub concurrency: f64,
    pub e2e_ms: Summary,
    pub ttft_ms: Summary,
    pub tpot_ms: Summary,
    pub itl_ms: Summary,
    pub goodput: Option<Goodput>,
    pub cache: Option<CacheReport>,
}

/// Options of [`calculate`].
#[derive(Clone, Copy, Debug, Default)]
pub struct MetricOptions {
    /// Count input tokens with the server's `prompt_tokens` when every
    /// successful request reported them (used when the client's counts are approximate).
    pub prefer_server_prompt_tokens: bool,
    /// Goodput objectives.
    pub slo: Slo,
    /// Report the cache even if no request carried `cached_tokens`.
    pub force_cache_report: bool,
    /// The data set's prefix sharing rate, for the cache section.
    pub dataset_sharing_rate: Option<f64>,
}

/// Computes the figures of `outputs` over a run of `duration` seconds.
/// `retokenized[i]` is the client's token count of output `i`'s text, when known.
pub fn calculate(
    outputs: &[RequestOutput],
    duration: f64,
    retokenized: Option<&[usize]>,
    opt: MetricOptions,
) -> Metrics {
    let ok: Vec<&RequestOutput> = outputs.iter().filter(|o| o.success).collect();
    let dur = duration.max(1e-9);
    let server_counts = opt.prefer_server_prompt_tokens
        && !ok.is_empty()
        && ok.iter().all(|o| o.server_prompt_tokens.is_some());
    let input_of = |o: &RequestOutput| {
        if server_counts {
            o.server_prompt_tokens.unwrap_or(o.prompt_len)
        } else {
            o.prompt_len
        }
    };
    let total_input: usize = ok.iter().map(|o| input_of(o)).sum();
    let total_output: usize = ok.iter().map(|o| o.output_len).sum();
    let total_output_retokenized = retokenized.map(|r| {
        outputs
            .iter()
            .zip(r)
            .filter(|(o, _)| o.success)
            .map(|(_, n)| *n)
            .sum()
    });
    let tpots: Vec<f64> = ok
        .iter()
        .filter(|o| o.output_len > 1)
        .map(|o| (o.latency - o.ttft) / (o.output_len - 1) as f64)
        .collect();
    let itls: Vec<f64> = ok.iter().flat_map(|o| o.itl.iter().copied()).collect();
    let ttfts: Vec<f64> = ok.iter().map(|o| o.ttft).collect();
    let e2es: Vec<f64> = ok.iter().map(|o| o.latency).collect();
    let mut e2e_ms = Summary::of_seconds(&e2es);
    if e2es.is_empty() {
        // SGLang's np.mean([]) of E2E prints nan.
        e2e_ms = Summary {
            mean: f64::NAN,
            median: f64::NAN,
            std: f64::NAN,
            p90: f64::NAN,
            p95: f64::NAN,
            p99: f64::NAN,
            max: f64::NAN,
        };
    }
    let (max_output_tokens_per_s, max_concurrent_requests) = peaks(&ok);
    let goodput = opt.slo.is_set().then(|| {
        let good: Vec<&&RequestOutput> = ok.iter().filter(|o| opt.slo.met_by(o)).collect();
        Goodput {
            slo: opt.slo,
            good_requests: good.len(),
            request_goodput: good.len() as f64 / dur,
            output_goodput: good.iter().map(|o| o.output_len).sum::<usize>() as f64 / dur,
        }
    });
    let reporting: Vec<&&RequestOutput> = ok.iter().filter(|o| o.cached_tokens.is_some()).collect();
    let cache = (opt.force_cache_report || !reporting.is_empty()).then(|| {
        let cached: usize = reporting.iter().filter_map(|o| o.cached_tokens).sum();
        let prompt: usize = reporting
            .iter()
            .map(|o| o.server_prompt_tokens.unwrap_or(o.prompt_len))
            .sum();
        CacheReport {
            reporting: reporting.len(),
            cached_tokens: cached,
            prompt_tokens: prompt,
            hit_rate: if prompt > 0 {
                cached as f64 / prompt as f64
            } else {
                0.0
            },
            dataset_sharing_rate: opt.dataset_sharing_rate,
        }
    });
    Metrics {
        completed: ok.len(),
        failed: outputs.len() - ok.len(),
        total_input,
        total_output,
        total_output_retokenized,
        request_throughput: ok.len() as f64 / dur,
        input_throughput: total_input as f64 / dur,
        output_throughput: total_output as f64 / dur,
        total_throughput: (total_input + total_output) as f64 / dur,
        max_output_tokens_per_s,
        max_concurrent_requests,
        concurrency: e2es.iter().sum::<f64>() / dur,
        e2e_ms,
        ttft_ms: Summary::of_seconds(&ttfts),
        tpot_ms: Summary::of_seconds(&tpots),
        itl_ms: Summary::of_seconds(&itls),
        goodput,
        cache,
    }
}

/// SGLang's peak output tokens per second and peak concurrent requests, by
/// one-second buckets from the earliest start.
fn peaks(ok: &[&RequestOutput]) -> (f64, usize) {
    let Some(min_start) = ok.iter().map(|o| o.start_time).min_by(f64::total_cmp) else {
        return (0.0, 0);
    };
    let max_end = ok
        .iter()
        .map(|o| o.start_time + o.latency)
        .fold(min_start, f64::max);
    let n = (max_end - min_start).ceil() as usize + 1;
    let mut tokens = vec![0usize; n];
    let mut reqs = vec![0usize; n];
    for o in ok {
        let mut t = o.start_time + o.ttft;
        let mut times = vec![t];
        for d in &o.itl {
            t += d;
            times.push(t);
        }
        for tt in times {
            let b = (tt - min_start).max(0.0) as usize;
            if b < n {
                tokens[b] += 1;
            }
        }
        let s = (o.start_time - min_start).max(0.0) as usize;
        let e = (o.start_time + o.latency - min_start).max(0.0) as usize;
        for slot in reqs.iter_mut().take((e + 1).min(n)).skip(s) {
            *slot += 1;
        }
    }
    (
        tokens.iter().copied().max().unwrap_or(0) as f64,
        reqs.iter().copied().max().unwrap_or(0),
    )
}

/// Python's `str(float)`: `inf`, `4.0`, `2.5`.
pub fn py_float(x: f64) -> String {
    if x.is_infinite() {
        if x > 0.0 { "inf".into() } else { "-inf".into() }
    } else if x.is_nan() {
        "nan".into()
    } else if x.fract() == 0.0 && x.abs() < 1e16 {
        format!("{x:.1}")
    } else {
        format!("{x}")
    }
}

fn f2(x: f64) -> String {
    if x.is_nan() {
        "nan".into()
    } else {
        format!("{x:.2}")
    }
}

/// What the block's header rows show besides the metrics.
#[derive(Clone, Debug)]
pub struct BlockHeader {
    /// The backend's name.
    pub backend: String,
    /// `inf`, a rate, or `trace`.
    pub request_rate: String,
    /// `--max-concurrency`.
    pub max_concurrency: Option<usize>,
    /// Benchmark duration (s).
    pub duration: f64,
    /// Speculative decoding's mean accepted length, when the server reports it.
    pub accept_length: Option<f64>,
}

/// The printed result block (SGLang's rows, one per line, no trailing newline).
pub fn render_block(h: &BlockHeader, m: &Metrics) -> String {
    let mut l: Vec<String> = Vec::new();
    let mut row = |label: &str, value: String| l.push(format!("{label:<40} {value:<10}"));
    row("Backend:", h.backend.clone());
    row("Traffic request rate:", h.request_rate.clone());
    row(
        "Max request concurrency:",
        h.max_concurrency
            .map_or("not set".into(), |c| c.to_string()),
    );
    row("Successful requests:", m.completed.to_string());
    row("Benchmark duration (s):", f2(h.duration));
    row("Total input tokens:", m.total_input.to_string());
    row("Total input text tokens:", m.total_input.to_string());
    row("Total generated tokens:", m.total_output.to_string());
    row(
        "Total generated tokens (retokenized):",
        m.total_output_retokenized
            .map_or("n/a".into(), |n| n.to_string()),
    );
    row("Request throughput (req/s):", f2(m.request_throughput));
    row("Input token throughput (tok/s):", f2(m.input_throughput));
    row("Output token throughput (tok/s):", f2(m.output_throughput));
    row(
        "Peak output token throughput (tok/s):",
        f2(m.max_output_tokens_per_s),
    );
    row(
        "Peak concurrent requests:",
        m.max_concurrent_requests.to_string(),
    );
    row("Total token throughput (tok/s):", f2(m.total_throughput));
    row("Concurrency:", f2(m.concurrency));
    if let Some(a) = h.accept_length {
        row("Accept length:", f2(a));
    }
    let mut out = vec![format!("{:=^50}", " Serving Benchmark Result ")];
    out.append(&mut l);
    let mut section = |title: &str, name: &str, s: &Summary, with_max: bool| {
        out.push(format!("{title:-^50}"));
        for (label, v) in [
            ("Mean", s.mean),
            ("Median", s.median),
            ("P90", s.p90),
            ("P95", s.p95),
            ("P99", s.p99),
        ] {
            out.push(format!(
                "{:<40} {:<10}",
                format!("{label} {name} (ms):"),
                f2(v)
            ));
        }
        if with_max {
            out.push(format!(
                "{:<40} {:<10}",
                format!("Max {name} (ms):"),
                f2(s.max)
            ));
        }
    };
    section("End-to-End Latency", "E2E Latency", &m.e2e_ms, false);
    section("Time to First Token", "TTFT", &m.ttft_ms, false);
    section(
        "Time per Output Token (excl. 1st token)",
        "TPOT",
        &m.tpot_ms,
        false,
    );
    section("Inter-Token Latency", "ITL", &m.itl_ms, true);
    let row2 = |label: &str, value: String| format!("{label:<40} {value:<10}");
    if let Some(c) = &m.cache {
        out.push(format!("{:-^50}", "Prefix Cache"));
        out.push(row2(
            "Requests reporting cached tokens:",
            format!("{}/{}", c.reporting, m.completed),
        ));
        out.push(row2("Total cached tokens:", c.cached_tokens.to_string()));
        out.push(row2(
            "Cache hit rate:",
            if c.reporting > 0 {
                format!("{:.3}", c.hit_rate)
            } else {
                "n/a".into()
            },
        ));
        out.push(row2(
            "Dataset prefix sharing rate:",
            c.dataset_sharing_rate
                .map_or("n/a".into(), |r| format!("{r:.3}")),
        ));
    }
    if let Some(g) = &m.goodput {
        out.push(format!("{:-^50}", "Goodput"));
        out.push(row2(
            "SLO TTFT (ms):",
            g.slo.ttft_ms.map_or("not set".into(), f2),
        ));
        out.push(row2(
            "SLO ITL (ms):",
            g.slo.itl_ms.map_or("not set".into(), f2),
        ));
        out.push(row2(
            "Requests meeting SLOs:",
            format!("{}/{}", g.good_requests, m.completed),
        ));
        out.push(row2("Request goodput (req/s):", f2(g.request_goodput)));
        out.push(row2("Output token goodput (tok/s):", f2(g.output_goodput)));
    }
    out.push("=".repeat(50));
    out.join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(start: f64, ttft: f64, itl: Vec<f64>, prompt_len: usize) -> RequestOutput {
        let latency = ttft + itl.iter().sum::<f64>();
        RequestOutput {
            success: true,
            prompt_len,
            output_len: itl.len() + 1,
            start_time: start,
            ttft,
            latency,
            itl,
            ..Default::default()
        }
    }

    #[test]
    fn counts_and_percentiles_on_known_inputs() {
        let outs = vec![
            req(0.0, 0.1, vec![0.02; 9], 100), // 10 tokens, 0.28 s
            req(0.4, 0.3, vec![0.05; 4], 50),  // 5 tokens, 0.5 s
            RequestOutput {
                success: false,
                prompt_len: 70,
                error: "x".into(),
                ..Default::default()
            },
        ];
        let m = calculate(&outs, 2.0, Some(&[11, 5, 0]), MetricOptions::default());
        assert_eq!(
            (m.completed, m.failed, m.total_input, m.total_output),
            (2, 1, 150, 15)
        );
        assert_eq!(m.total_output_retokenized, Some(16));
        assert!((m.request_throughput - 1.0).abs() < 1e-12);
        assert!((m.output_throughput - 7.5).abs() < 1e-12);
        assert!((m.total_throughput - 82.5).abs() < 1e-12);
        assert!((m.concurrency - (0.28 + 0.5) / 2.0).abs() < 1e-9);
        // TTFT: [100, 300] ms.
        assert!((m.ttft_ms.mean - 200.0).abs() < 1e-9);
        assert!((m.ttft_ms.p90 - 280.0).abs() < 1e-9);
        assert!((m.ttft_ms.p99 - 298.0).abs() < 1e-9);
        // TPOT: (0.28-0.1)/9 = 20 ms and (0.5-0.3)/4 = 50 ms.
        assert!((m.tpot_ms.median - 35.0).abs() < 1e-9);
        // ITL pooled: nine of 20 ms and four of 50 ms.
        assert!((m.itl_ms.max - 50.0).abs() < 1e-9);
        assert!((m.itl_ms.median - 20.0).abs() < 1e-9);
        assert!((m.itl_ms.mean - (9.0 * 20.0 + 4.0 * 50.0) / 13.0).abs() < 1e-9);
        // Peaks: both requests run, and all 15 tokens come, within the first second.
        assert_eq!(m.max_concurrent_requests, 2);
        assert_eq!(m.max_output_tokens_per_s, 15.0);
        assert!(m.goodput.is_none() && m.cache.is_none());
    }

    #[test]
    fn goodput_counts_requests_meeting_both_slos() {
        let outs = vec![
            req(0.0, 0.1, vec![0.02; 9], 10),
            req(0.0, 0.3, vec![0.02; 4], 10),
            req(0.0, 0.1, vec![0.2; 4], 10),
        ];
        let opt = MetricOptions {
            slo: Slo {
                ttft_ms: Some(200.0),
                itl_ms: Some(100.0),
            },
            ..Default::default()
        };
        let g = calculate(&outs, 2.0, None, opt).goodput.unwrap();
        assert_eq!(g.good_requests, 1);
        assert!((g.request_goodput - 0.5).abs() < 1e-12);
        assert!((g.output_goodput - 5.0).abs() < 1e-12);
        let only_ttft = MetricOptions {
            slo: Slo {
                ttft_ms: Some(200.0),
                itl_ms: None,
            },
            ..Default::default()
        };
        assert_eq!(
            calculate(&outs, 2.0, None, only_ttft)
                .goodput
                .unwrap()
                .good_requests,
            2
        );
    }

    #[test]
    fn cache_report_and_server_prompt_counts() {
        let mut a = req(0.0, 0.1, vec![0.01], 10);
        a.server_prompt_tokens = Some(12);
        a.cached_tokens = Some(0);
        let mut b = req(0.0, 0.1, vec![0.01], 10);
        b.server_prompt_tokens = Some(12);
        b.cached_tokens = Some(9);
        let opt = MetricOptions {
            prefer_server_prompt_tokens: true,
            dataset_sharing_rate: Some(0.4),
            ..Default::default()
        };
        let m = calculate(&[a, b], 1.0, None, opt);
        assert_eq!(m.total_input, 24);
        let c = m.cache.unwrap();
        assert_eq!((c.reporting, c.cached_tokens, c.prompt_tokens), (2, 9, 24));
        assert!((c.hit_rate - 0.375).abs() < 1e-12);
    }

    #[test]
    fn block_rows_match_sglang_format() {
        let outs = vec![req(0.0, 0.1, vec![0.02; 9], 100)];
        let m = calculate(&outs, 1.0, None, MetricOptions::default());
        let h = BlockHeader {
            backend: "sglang".into(),
            request_rate: py_float(f64::INFINITY),
            max_concurrency: None,
            duration: 1.0,
            accept_length: None,
        };
        let b = render_block(&h, &m);
        let lines: Vec<&str> = b.lines().collect();
        assert_eq!(
            lines[0],
            "============ Serving Benchmark Result ============"
        );
        assert_eq!(lines[1], format!("{:<40} {:<10}", "Backend:", "sglang"));
        assert_eq!(
            lines[2].trim_end(),
            "Traffic request rate:                    inf"
        );
        assert_eq!(
            lines[3].trim_end(),
            "Max request concurrency:                 not set"
        );
        assert!(b.contains("----------------End-to-End Latency----------------"));
        assert!(b.contains("---------------Time to First Token----------------"));
        assert!(b.contains("-----Time per Output Token (excl. 1st token)------"));
        assert!(b.contains("---------------Inter-Token Latency----------------"));
        assert!(b.contains(&format!("{:<40} {:<10}", "Mean TTFT (ms):", "100.00")));
        assert_eq!(*lines.last().unwrap(), "=".repeat(50));
        assert!(!b.contains("Prefix Cache") && !b.contains("Goodput"));
        assert_eq!(
            (py_float(4.0), py_float(2.5)),
            ("4.0".to_string(), "2.5".to_string())
        );
        // No success at all: E2E is nan, like SGLang.
        let none = calculate(&[], 1.0, None, MetricOptions::default());
        assert!(render_block(&h, &none).contains("Mean E2E Latency (ms):                   nan"));
    }
}
