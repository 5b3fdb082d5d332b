//! `arbor profile-workload`: the workload profile the seeds ask for before
//! any tuning (casebook, "Common Tools"): input and output length median and
//! p95, the prefix sharing rate, peak concurrency, and the seeds' reading of
//! the sharing rate.
//!
//! Definitions (the seeds' `profile_workload.py`): the median is
//! `statistics.median`; p95 is `sorted(x)[int(n * 0.95)]`; the prefix sharing
//! rate sorts the prompts' token sequences, sums the common prefix lengths of
//! neighbours and divides by all prompt tokens. For a Mooncake trace the
//! sequences are the hash-id lists, a common block counting 512 tokens (the
//! last, partial block as many as both prompts have). Peak concurrency is the
//! largest number of requests in flight at once: exact when the log has end
//! times or latencies, otherwise estimated from arrivals with an assumed
//! service time of `TTFT + output_len * TPOT` (printed with the figure).
//! Invariant: the rate is in `[0, 1)`; a log without prompt content (Azure)
//! has no rate.

use crate::dataset::{LogEntry, load_log};
use crate::error::{BenchError, Result};
use crate::stats::{median_usize, nearest_rank};
use crate::tokenizer::PromptTokenizer;
use crate::traces::{BLOCK, TraceRecord, load_azure, load_mooncake};
use clap::Args;
use serde::Serialize;
use std::path::PathBuf;

/// Options of `arbor profile-workload`.
#[derive(Args, Debug, Clone)]
pub struct ProfileArgs {
    /// The log: JSONL of `{"prompt", "completion"}` (optional `timestamp`,
    /// `end_time` or `latency`), a Mooncake trace (JSONL with `hash_ids`) or an
    /// Azure trace (CSV); `.gz` is read transparently.
    pub log: PathBuf,
    /// Model folder (or tokenizer.json) whose tokenizer counts tokens of a
    /// JSONL log. Without it words stand in for tokens. Traces need none.
    #[arg(long = "model-path", alias = "tokenizer")]
    pub model_path: Option<PathBuf>,
    /// Read only the first N entries.
    #[arg(long)]
    pub limit: Option<usize>,
    /// Assumed time to first token (ms) for estimating concurrency from arrivals only.
    #[arg(long = "assume-ttft-ms", default_value_t = 500.0)]
    pub assume_ttft_ms: f64,
    /// Assumed time per output token (ms) for estimating concurrency from arrivals only.
    #[arg(long = "assume-tpot-ms", default_value_t = 30.0)]
    pub assume_tpot_ms: f64,
    /// Print the profile as one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// How peak concurrency was obtained.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ConcurrencySource {
    /// From logged start and end times.
    Logged,
    /// From arrivals and an assumed service time.
    Estimated,
}

/// A workload profile.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct WorkloadProfile {
    pub requests: usize,
    pub input_median: f64,
    pub input_p95: usize,
    pub output_median: Option<f64>,
    pub output_p95: Option<usize>,
    pub total_input_tokens: usize,
    pub prefix_sharing_rate: Option<f64>,
    pub peak_concurrency: Option<usize>,
    pub concurrency_source: Option<ConcurrencySource>,
    pub peak_arrivals_per_s: Option<usize>,
    pub tokens_exact: bool,
    pub reading: Option<String>,
}

fn common_prefix<T: PartialEq>(a: &[T], b: &[T]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// The seeds' prefix sharing rate of token sequences (sorts `seqs` in place).
pub fn prefix_sharing_rate<S: AsRef<[u32]> + Ord>(seqs: &mut [S]) -> f64 {
    let total: usize = seqs.iter().map(|s| s.as_ref().len()).sum();
    if total == 0 {
        return 0.0;
    }
    seqs.sort_unstable();
    let shared: usize = seqs
        .windows(2)
        .map(|w| common_prefix(w[0].as_ref(), w[1].as_ref()))
        .sum();
    shared as f64 / total as f64
}

/// The sharing rate of Mooncake records: common hash blocks count
/// [`BLOCK`] tokens each, capped by the shorter prompt.
pub fn block_sharing_rate(records: &[TraceRecord]) -> f64 {
    let total: usize = records.iter().map(|r| r.input_len).sum();
    if total == 0 {
        return 0.0;
    }
    let mut order: Vec<&TraceRecord> = records.iter().collect();
    order.sort_by(|a, b| {
        a.hash_ids
            .cmp(&b.hash_ids)
            .then(a.input_len.cmp(&b.input_len))
    });
    let shared: usize = order
        .windows(2)
        .map(|w| {
            (common_prefix(&w[0].hash_ids, &w[1].hash_ids) * BLOCK)
                .min(w[0].input_len)
                .min(w[1].input_len)
        })
        .sum();
    shared as f64 / total as f64
}

/// Largest number of `[start, end)` intervals open at once (an end at the
/// same instant as a start closes first).
pub fn peak_concurrency(intervals: &[(f64, f64)]) -> usize {
    let mut ev: Vec<(f64, i32)> = intervals
        .iter()
        .flat_map(|&(s, e)| [(s, 1), (e.max(s), -1)])
        .collect();
    ev.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let (mut cur, mut peak) = (0i64, 0i64);
    for (_, d) in ev {
        cur += i64::from(d);
        peak = peak.max(cur);
    }
    peak as usize
}

/// Most arrivals within any one-second window starting at an arrival.
pub fn peak_arrivals_per_s(starts: &[f64]) -> usize {
    let mut s = starts.to_vec();
    s.sort_by(f64::total_cmp);
    let mut best = 0;
    let mut j = 0;
    for i in 0..s.len() {
        while j < s.len() && s[j] < s[i] + 1.0 {
            j += 1;
        }
        best = best.max(j - i);
    }
    best
}

/// The seeds' reading of a sharing rate.
pub fn reading(rate: f64) -> &'static str {
    if rate < 0.2 {
        "below 0.2: little to gain from prefix reuse (RadixAttention gives almost no benefit)"
    } else if rate <= 0.6 {
        "0.2 to 0.6: worth benchmarking with and without the radix cache"
    } else {
        "above 0.6: a lot to gain from prefix reuse (expect a 75-95% cache hit rate); routing and prompt structure decide the rest"
    }
}

struct Lengths {
    ins: Vec<usize>,
    outs: Vec<usize>,
    starts: Vec<f64>,
    intervals: Vec<(f64, f64)>,
    rate: Option<f64>,
}

fn finish(l: Lengths, exact: bool, args: &ProfileArgs) -> WorkloadProfile {
    let (concurrency, source) = if !l.intervals.is_empty() {
        (
            Some(peak_concurrency(&l.intervals)),
            Some(ConcurrencySource::Logged),
        )
    } else if !l.starts.is_empty() {
        let iv: Vec<(f64, f64)> = l
            .starts
            .iter()
            .zip(&l.outs)
            .map(|(&s, &o)| {
                (
                    s,
                    s + (args.assume_ttft_ms + o as f64 * args.assume_tpot_ms) / 1000.0,
                )
            })
            .collect();
        (
            Some(peak_concurrency(&iv)),
            Some(ConcurrencySource::Estimated),
        )
    } else {
        (None, None)
    };
    WorkloadProfile {
        requests: l.ins.len(),
        input_median: median_usize(&l.ins).unwrap_or(0.0),
        input_p95: nearest_rank(&l.ins, 0.95).unwrap_or(0),
        output_median: median_usize(&l.outs),
        output_p95: nearest_rank(&l.outs, 0.95),
        total_input_tokens: l.ins.iter().sum(),
        prefix_sharing_rate: l.rate,
        peak_concurrency: concurrency,
        concurrency_source: source,
        peak_arrivals_per_s: (!l.starts.is_empty()).then(|| peak_arrivals_per_s(&l.starts)),
        tokens_exact: exact,
        reading: l.rate.map(|r| reading(r).to_string()),
    }
}

/// Profile of a JSONL log with `tok`.
pub fn profile_log(
    entries: &[LogEntry],
    tok: &PromptTokenizer,
    args: &ProfileArgs,
) -> Result<WorkloadProfile> {
    let mut seqs = Vec::with_capacity(entries.len());
    let mut outs = Vec::new();
    for e in entries {
        seqs.push(tok.encode(&e.prompt, true)?);
        match (&e.completion, e.output_len) {
            (Some(c), _) => outs.push(tok.count(c, false)?),
            (None, Some(n)) => outs.push(n),
            (None, None) => {}
        }
    }
    let ins: Vec<usize> = seqs.iter().map(Vec::len).collect();
    let rate = Some(prefix_sharing_rate(&mut seqs));
    let starts: Vec<f64> = entries.iter().filter_map(|e| e.start_s).collect();
    let intervals: Vec<(f64, f64)> = entries
        .iter()
        .filter_map(|e| Some((e.start_s?, e.end_s?)))
        .collect();
    let outs = if outs.len() == entries.len() {
        outs
    } else {
        Vec::new()
    };
    let starts = if starts.len() == entries.len() {
        starts
    } else {
        Vec::new()
    };
    let intervals = if intervals.len() == entries.len() {
        intervals
    } else {
        Vec::new()
    };
    Ok(finish(
        Lengths {
            ins,
            outs,
            starts,
            intervals,
            rate,
        },
        tok.is_exact(),
        args,
    ))
}

/// Profile of trace records (Mooncake with hash ids, or Azure without).
pub fn profile_trace(records: &[TraceRecord], args: &ProfileArgs) -> WorkloadProfile {
    let has_hashes = records.iter().any(|r| !r.hash_ids.is_empty());
    let starts: Vec<f64> = records.iter().filter_map(|r| r.timestamp_s).collect();
    let l = Lengths {
        ins: records.iter().map(|r| r.input_len).collect(),
        outs: records.iter().map(|r| r.output_len).collect(),
        starts: if starts.len() == records.len() {
            starts
        } else {
            Vec::new()
        },
        intervals: Vec::new(),
        rate: has_hashes.then(|| block_sharing_rate(records)),
    };
    finish(l, true, args)
}

/// Text of a profile, one `name: value` line each.
pub fn render(p: &WorkloadProfile) -> String {
    let approx = if p.tokens_exact {
        ""
    } else {
        " (words, approximate)"
    };
    let opt = |v: Option<String>| v.unwrap_or_else(|| "n/a".into());
    let mut l = vec![
        format!("{:<24}{}", "requests:", p.requests),
        format!("{:<24}{}{approx}", "input median:", p.input_median),
        format!("{:<24}{}{approx}", "input p95:", p.input_p95),
        format!(
            "{:<24}{}",
            "output median:",
            opt(p.output_median.map(|x| x.to_string()))
        ),
        format!(
            "{:<24}{}",
            "output p95:",
            opt(p.output_p95.map(|x| x.to_string()))
        ),
        format!(
            "{:<24}{}",
            "prefix sharing rate:",
            opt(p.prefix_sharing_rate.map(|r| format!("{r:.3}")))
                .replace("n/a", "n/a (the log has no prompt content)")
        ),
    ];
    let conc = match (p.peak_concurrency, p.concurrency_source) {
        (Some(c), Some(ConcurrencySource::Logged)) => c.to_string(),
        (Some(c), _) => format!("{c} (estimated from arrivals with the assumed TTFT and TPOT)"),
        _ => "n/a (no timestamps)".into(),
    };
    l.push(format!("{:<24}{conc}", "peak concurrency:"));
    if let Some(a) = p.peak_arrivals_per_s {
        l.push(format!("{:<24}{a}", "peak arrivals in 1 s:"));
    }
    if let Some(r) = &p.reading {
        l.push(format!("{:<24}{r}", "reading:"));
    }
    l.join("\n")
}

/// Runs `arbor profile-workload`: prints and returns the profile.
pub fn run_profile_workload(args: ProfileArgs) -> Result<WorkloadProfile> {
    let text_head = crate::files::read_text(&args.log)?;
    let first = text_head
        .lines()
        .find(|l| !l.trim().is_empty())
        .unwrap_or_default()
        .to_string();
    drop(text_head);
    let profile = if first.to_ascii_uppercase().starts_with("TIMESTAMP,") {
        profile_trace(&load_azure(&args.log, args.limit)?, &args)
    } else if first.contains("\"hash_ids\"") || first.contains("\"input_length\"") {
        profile_trace(&load_mooncake(&args.log, args.limit)?, &args)
    } else if first.starts_with('{') {
        let tok = match &args.model_path {
            Some(p) => PromptTokenizer::load(p)?,
            None => {
                eprintln!(
                    "note: no --model-path; words stand in for tokens, so lengths are approximate"
                );
                PromptTokenizer::Words
            }
        };
        let entries = load_log(&args.log, args.limit)?;
        if entries.is_empty() {
            return Err(BenchError::data(&args.log, "no entries"));
        }
        profile_log(&entries, &tok, &args)?
    } else {
        return Err(BenchError::data(
            &args.log,
            "unknown format: expected JSONL of {\"prompt\", \"completion\"}, a Mooncake trace or an Azure CSV",
        ));
    };
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&profile).unwrap_or_default()
        );
    } else {
        println!("{}", render(&profile));
    }
    Ok(profile)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args() -> ProfileArgs {
        ProfileArgs {
            log: PathBuf::new(),
            model_path: None,
            limit: None,
            assume_ttft_ms: 500.0,
            assume_tpot_ms: 30.0,
            json: false,
        }
    }

    #[test]
    fn sharing_rate_matches_the_seeds_script() {
        // sorted: [1,2,3,4], [1,2,3,9], [1,2,7], [5]: common prefixes 3 + 2 + 0 = 5 of 12 tokens.
        let mut s = vec![vec![1, 2, 3, 9], vec![5], vec![1, 2, 7], vec![1, 2, 3, 4]];
        assert!((prefix_sharing_rate(&mut s) - 5.0 / 12.0).abs() < 1e-12);
        assert_eq!(prefix_sharing_rate(&mut Vec::<Vec<u32>>::new()), 0.0);
        let mut same = vec![vec![1, 2]; 3];
        assert!((prefix_sharing_rate(&mut same) - 4.0 / 6.0).abs() < 1e-12);
    }

    #[test]
    fn block_rate_caps_partial_blocks() {
        let r = |ids: Vec<u64>, len| TraceRecord {
            timestamp_s: None,
            input_len: len,
            output_len: 1,
            hash_ids: ids,
        };
        // [0,1] (600 tokens) and [0,1,2] (1100): two common blocks, capped at 600.
        let recs = vec![r(vec![0, 1, 2], 1100), r(vec![0, 1], 600), r(vec![5], 100)];
        assert!((block_sharing_rate(&recs) - 600.0 / 1800.0).abs() < 1e-12);
    }

    #[test]
    fn concurrency_and_arrivals() {
        assert_eq!(
            peak_concurrency(&[(0.0, 2.0), (1.0, 3.0), (2.0, 4.0), (2.5, 2.6)]),
            3
        );
        assert_eq!(peak_concurrency(&[(0.0, 1.0), (1.0, 2.0)]), 1);
        assert_eq!(peak_concurrency(&[]), 0);
        assert_eq!(peak_arrivals_per_s(&[0.0, 0.2, 0.9, 1.0, 5.0]), 3);
    }

    #[test]
    fn profile_of_a_hand_made_log() {
        let e = |p: &str, c: &str, s: f64, d: f64| LogEntry {
            prompt: p.into(),
            completion: Some(c.into()),
            output_len: None,
            start_s: Some(s),
            end_s: Some(s + d),
        };
        let entries = vec![
            e("you are a helpful bot answer this one", "yes", 0.0, 2.0),
            e("you are a helpful bot answer that two", "no way", 0.5, 2.0),
            e("you are a helpful bot say hi", "hi there you", 1.0, 0.5),
            e("completely different", "ok ok ok ok", 3.0, 1.0),
        ];
        let p = profile_log(&entries, &PromptTokenizer::Words, &args()).unwrap();
        // Inputs 8, 8, 7, 2 words; outputs 1, 2, 3, 4.
        assert_eq!((p.requests, p.total_input_tokens), (4, 25));
        assert_eq!((p.input_median, p.input_p95), (7.5, 8));
        assert_eq!((p.output_median, p.output_p95), (Some(2.5), Some(4)));
        // Sorted: "completely..", "you..answer that two", "you..answer this one", "you..say hi":
        // neighbours share 0, 6 and 5 words: 11 / 25.
        assert!((p.prefix_sharing_rate.unwrap() - 11.0 / 25.0).abs() < 1e-12);
        assert_eq!(
            (p.peak_concurrency, p.concurrency_source),
            (Some(3), Some(ConcurrencySource::Logged))
        );
        assert_eq!(p.peak_arrivals_per_s, Some(2));
        assert!(p.reading.as_deref().unwrap().starts_with("0.2 to 0.6"));
        let text = render(&p);
        assert!(text.contains("prefix sharing rate:    0.440"), "{text}");
        assert!(text.contains("(words, approximate)"));
    }

    #[test]
    fn profile_of_traces() {
        let r = |ts: f64, ids: Vec<u64>, len, out| TraceRecord {
            timestamp_s: Some(ts),
            input_len: len,
            output_len: out,
            hash_ids: ids,
        };
        let recs = vec![
            r(0.0, vec![0, 1], 1024, 100),
            r(0.1, vec![0, 2], 1024, 10),
            r(10.0, vec![3], 512, 10),
        ];
        let p = profile_trace(&recs, &args());
        assert!((p.prefix_sharing_rate.unwrap() - 512.0 / 2560.0).abs() < 1e-12);
        // Service times 0.5 + 3.0 s and 0.5 + 0.3 s overlap; the third is alone.
        assert_eq!(
            (p.peak_concurrency, p.concurrency_source),
            (Some(2), Some(ConcurrencySource::Estimated))
        );
        let azure: Vec<TraceRecord> = recs
            .iter()
            .map(|x| TraceRecord {
                hash_ids: vec![],
                ..x.clone()
            })
            .collect();
        let p = profile_trace(&azure, &args());
        assert_eq!(p.prefix_sharing_rate, None);
        assert!(render(&p).contains("n/a (the log has no prompt content)"));
        assert_eq!(reading(0.1).split(':').next(), Some("below 0.2"));
        assert!(reading(0.81).starts_with("above 0.6"));
    }
}
