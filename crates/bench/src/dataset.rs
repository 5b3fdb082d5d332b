//! The request sets of `arbor bench serving`, with SGLang's `bench_serving`
//! semantics: `random` (ShareGPT text cut or repeated to sampled lengths),
//! `random-ids` (synthetic token ids), `sharegpt` (first two turns of real
//! conversations), `generated-shared-prefix` (groups of prompts sharing a
//! random system prompt), `mooncake` and `azure` (traces, see
//! [`crate::traces`]) and `custom` (a JSONL log of prompts).
//!
//! Invariants: every row has a non-empty prompt and `output_len >= 1`;
//! `prompt_len` counts tokens with the client tokenizer (special tokens
//! included, as Hugging Face's `encode` does) or, without one, words;
//! `tokens` holds the prompt's ids whenever they are known, for
//! `--tokenize-prompt` and the prefix sharing rate; the same seed gives the
//! same rows.

use crate::error::{BenchError, Result};
use crate::rng::Rng;
use crate::tokenizer::PromptTokenizer;
use crate::traces::{TraceRecord, synthesize_scaled};
use serde_json::Value;
use std::path::Path;

/// What is sent as the prompt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Prompt {
    /// Text (`text` on the native API, `prompt` or a user message on OpenAI's).
    Text(String),
    /// Token ids (`input_ids` on the native API, `prompt` as ids on `/v1/completions`).
    Ids(Vec<u32>),
}

/// One request of a benchmark.
#[derive(Clone, Debug)]
pub struct DatasetRow {
    /// The prompt.
    pub prompt: Prompt,
    /// Its length in client tokens.
    pub prompt_len: usize,
    /// Tokens to generate.
    pub output_len: usize,
    /// Arrival time in seconds from the trace, when the data set has one.
    pub timestamp_s: Option<f64>,
    /// The prompt's token ids, when known.
    pub tokens: Option<Vec<u32>>,
}

/// SGLang's `compute_random_lens`: `n` lengths uniform in `[max(int(full * ratio), 1), full]`.
pub fn random_lens(full: usize, ratio: f64, n: usize, rng: &mut Rng) -> Vec<usize> {
    let lo = ((full as f64 * ratio) as usize).max(1);
    (0..n)
        .map(|_| rng.range_inclusive(lo, full.max(lo)))
        .collect()
}

/// The first two turns (prompt, completion) of each ShareGPT conversation with at least two.
pub fn load_sharegpt_pairs(path: &Path) -> Result<Vec<(String, String)>> {
    let text = crate::files::read_text(path)?;
    let v: Value = serde_json::from_str(&text)
        .map_err(|e| BenchError::data(path, format!("invalid JSON: {e}")))?;
    let arr = v
        .as_array()
        .ok_or_else(|| BenchError::data(path, "expected a JSON array of conversations"))?;
    Ok(arr
        .iter()
        .filter_map(|c| {
            let turns = c
                .get("conversations")
                .or_else(|| c.get("conversation"))?
                .as_array()?;
            let text = |t: &Value| {
                t.get("value")
                    .or_else(|| t.get("content"))
                    .and_then(Value::as_str)
                    .map(str::to_string)
            };
            Some((text(turns.first()?)?, text(turns.get(1)?)?))
        })
        .collect())
}

/// Sizes of a `random` / `random-ids` data set.
#[derive(Clone, Copy, Debug)]
pub struct RandomSpec {
    /// Requests.
    pub num_prompts: usize,
    /// Largest input length.
    pub input_len: usize,
    /// Largest output length.
    pub output_len: usize,
    /// Lengths are uniform in `[ratio * len, len]`.
    pub range_ratio: f64,
}

/// SGLang's `random`: ShareGPT prompts (shuffled) tokenized, then cut or
/// repeated to the sampled input length and decoded back to text. (SGLang
/// tokenizes with special tokens, so repeats carry stray BOS tokens; here the
/// prompt is tokenized without them.)
pub fn sample_random(
    spec: RandomSpec,
    tok: &PromptTokenizer,
    pairs: &[(String, String)],
    rng: &mut Rng,
) -> Result<Vec<DatasetRow>> {
    let input_lens = random_lens(spec.input_len, spec.range_ratio, spec.num_prompts, rng);
    let output_lens = random_lens(spec.output_len, spec.range_ratio, spec.num_prompts, rng);
    let mut order: Vec<usize> = (0..pairs.len()).collect();
    rng.shuffle(&mut order);
    let mut rows = Vec::with_capacity(spec.num_prompts);
    for &k in &order {
        let i = rows.len();
        if i == spec.num_prompts {
            break;
        }
        let ids = tok.encode(&pairs[k].0, false)?;
        if ids.is_empty() {
            continue;
        }
        let want = input_lens[i];
        let ids: Vec<u32> = ids.iter().copied().cycle().take(want).collect();
        rows.push(DatasetRow {
            prompt: Prompt::Text(tok.decode(&ids)?),
            prompt_len: want,
            output_len: output_lens[i],
            timestamp_s: None,
            tokens: Some(ids),
        });
    }
    if rows.len() < spec.num_prompts {
        return Err(BenchError::invalid(format!(
            "the ShareGPT file gave only {} usable prompts of the {} asked",
            rows.len(),
            spec.num_prompts
        )));
    }
    Ok(rows)
}

/// SGLang's `random-ids`: prompt `i` is `input_len` consecutive vocabulary ids
/// from a random offset (`(offset + i + j) % vocab`).
pub fn sample_random_ids(
    spec: RandomSpec,
    tok: &PromptTokenizer,
    rng: &mut Rng,
) -> Result<Vec<DatasetRow>> {
    let input_lens = random_lens(spec.input_len, spec.range_ratio, spec.num_prompts, rng);
    let output_lens = random_lens(spec.output_len, spec.range_ratio, spec.num_prompts, rng);
    let vocab = tok.sample_ids();
    if vocab.is_empty() {
        return Err(BenchError::Tokenizer("the vocabulary is empty".into()));
    }
    let mut rows = Vec::with_capacity(spec.num_prompts);
    for i in 0..spec.num_prompts {
        let offset = rng.below(vocab.len() as u64) as usize;
        let ids: Vec<u32> = (0..input_lens[i])
            .map(|j| vocab[(offset + i + j) % vocab.len()])
            .collect();
        rows.push(DatasetRow {
            prompt: Prompt::Text(tok.decode(&ids)?),
            prompt_len: input_lens[i],
            output_len: output_lens[i],
            timestamp_s: None,
            tokens: Some(ids),
        });
    }
    Ok(rows)
}

/// SGLang's `sharegpt`: shuffled conversations, prompt = first turn, output
/// length = the second turn's token count (or `fixed_output_len`); prompts or
/// outputs under 2 tokens are skipped, and so are pairs longer than `context_len`.
pub fn sample_sharegpt(
    pairs: &[(String, String)],
    num_prompts: usize,
    tok: &PromptTokenizer,
    fixed_output_len: Option<usize>,
    context_len: Option<usize>,
    rng: &mut Rng,
) -> Result<Vec<DatasetRow>> {
    if fixed_output_len.is_some_and(|n| n < 4) {
        return Err(BenchError::invalid(
            "--sharegpt-output-len must be at least 4",
        ));
    }
    let mut order: Vec<usize> = (0..pairs.len()).collect();
    rng.shuffle(&mut order);
    let mut rows = Vec::new();
    for &k in &order {
        if rows.len() == num_prompts {
            break;
        }
        let (prompt, completion) = &pairs[k];
        let ids = tok.encode(prompt, true)?;
        let output_len = match fixed_output_len {
            Some(n) => n,
            None => tok.count(completion, true)?,
        };
        if ids.len() < 2
            || output_len < 2
            || context_len.is_some_and(|c| ids.len() + output_len > c)
        {
            continue;
        }
        rows.push(DatasetRow {
            prompt: Prompt::Text(prompt.clone()),
            prompt_len: ids.len(),
            output_len,
            timestamp_s: None,
            tokens: Some(ids),
        });
    }
    Ok(rows)
}

/// Sizes of a `generated-shared-prefix` data set.
#[derive(Clone, Copy, Debug)]
pub struct GspSpec {
    /// Groups (distinct system prompts).
    pub num_groups: usize,
    /// Prompts per group.
    pub prompts_per_group: usize,
    /// System prompt length in tokens.
    pub system_prompt_len: usize,
    /// Question length in tokens.
    pub question_len: usize,
    /// Output length.
    pub output_len: usize,
    /// Lengths are uniform in `[ratio * len, len]` (1.0: fixed, SGLang's default).
    pub range_ratio: f64,
    /// Share of all prompts that belong to the first group (0: every group
    /// has `prompts_per_group`); the rest are spread evenly over the others.
    pub hot_fraction: f64,
}

impl GspSpec {
    /// Prompts of each group (they sum to `num_groups * prompts_per_group`).
    pub fn group_sizes(&self) -> Vec<usize> {
        let g = self.num_groups;
        let n = g * self.prompts_per_group;
        if self.hot_fraction <= 0.0 || g < 2 {
            return vec![self.prompts_per_group; g];
        }
        let hot = ((self.hot_fraction.min(1.0) * n as f64).round() as usize).min(n);
        let rest = n - hot;
        let mut sizes = vec![hot];
        sizes.extend((0..g - 1).map(|i| rest / (g - 1) + usize::from(i < rest % (g - 1))));
        sizes
    }
}

/// SGLang's `generated-shared-prefix`: each group has a system prompt of
/// random tokens; each prompt is `"{system}\n\n{question}"` with its own
/// random question; rows are shuffled.
pub fn sample_gsp(spec: GspSpec, tok: &PromptTokenizer, rng: &mut Rng) -> Result<Vec<DatasetRow>> {
    let vocab = tok.sample_ids();
    if vocab.is_empty() {
        return Err(BenchError::Tokenizer("the vocabulary is empty".into()));
    }
    let sizes = spec.group_sizes();
    let n: usize = sizes.iter().sum();
    let sys_lens = random_lens(
        spec.system_prompt_len,
        spec.range_ratio,
        spec.num_groups,
        rng,
    );
    let q_lens = random_lens(spec.question_len, spec.range_ratio, n, rng);
    let out_lens = random_lens(spec.output_len, spec.range_ratio, n, rng);
    let random_text = |len: usize, rng: &mut Rng| -> Result<String> {
        let ids: Vec<u32> = (0..len)
            .map(|_| vocab[rng.below(vocab.len() as u64) as usize])
            .collect();
        tok.decode(&ids)
    };
    let systems: Vec<String> = sys_lens
        .iter()
        .map(|&l| random_text(l, rng))
        .collect::<Result<_>>()?;
    let mut rows = Vec::with_capacity(n);
    let mut flat = 0;
    for (g, system) in systems.iter().enumerate() {
        for _ in 0..sizes[g] {
            let question = random_text(q_lens[flat], rng)?;
            let full = format!("{system}\n\n{question}");
            let ids = tok.encode(&full, true)?;
            rows.push(DatasetRow {
                prompt: Prompt::Text(full),
                prompt_len: ids.len(),
                output_len: out_lens[flat],
                timestamp_s: None,
                tokens: Some(ids),
            });
            flat += 1;
        }
    }
    rng.shuffle(&mut rows);
    Ok(rows)
}

/// Rows for a trace: prompts synthesized by [`synthesize_scaled`], as ids
/// (`ids == true`) or as the text of each block, decoded and concatenated.
pub fn from_trace(
    records: &[TraceRecord],
    tok: &PromptTokenizer,
    seed: u64,
    ids: bool,
    block: usize,
) -> Result<Vec<DatasetRow>> {
    let vocab = tok.sample_ids();
    let mut rows = Vec::with_capacity(records.len());
    for (i, r) in records.iter().enumerate() {
        if r.input_len == 0 {
            continue;
        }
        let blocks = synthesize_scaled(r, i, &vocab, seed, block);
        let all: Vec<u32> = blocks.concat();
        let prompt = if ids {
            Prompt::Ids(all.clone())
        } else {
            let parts: Vec<String> = blocks
                .iter()
                .map(|b| tok.decode(b))
                .collect::<Result<_>>()?;
            Prompt::Text(parts.join(if tok.is_exact() { "" } else { " " }))
        };
        rows.push(DatasetRow {
            prompt,
            prompt_len: r.input_len,
            output_len: r.output_len.max(1),
            timestamp_s: r.timestamp_s,
            tokens: Some(all),
        });
    }
    Ok(rows)
}

/// One entry of a JSONL request log (`custom` data set, `profile-workload`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LogEntry {
    /// The prompt text.
    pub prompt: String,
    /// The completion text, when logged.
    pub completion: Option<String>,
    /// An explicit output length (`output_len`, `max_tokens` or `max_new_tokens`).
    pub output_len: Option<usize>,
    /// Arrival time in seconds.
    pub start_s: Option<f64>,
    /// Completion time in seconds.
    pub end_s: Option<f64>,
}

/// A timestamp value in seconds: a number (values above 1e11 are taken as
/// milliseconds) or a `YYYY-MM-DD HH:MM:SS[.f]` string.
fn time_value(v: &Value) -> Option<f64> {
    match v {
        Value::Number(n) => n.as_f64().map(|x| if x > 1e11 { x / 1000.0 } else { x }),
        Value::String(s) => crate::traces::parse_datetime(s).or_else(|| s.parse::<f64>().ok()),
        _ => None,
    }
}

/// Parses one log line. Accepted shapes: `{"prompt", "completion"?, ...}`,
/// `{"text", ...}`, or `{"conversations"|"messages": [first turn, second turn, ...]}`
/// (turns as `{"content"|"value"}`); optional `output_len`/`max_tokens`/`max_new_tokens`,
/// `timestamp`/`start_time`/`arrival_time`, `end_time`/`end_timestamp`/`finish_time`,
/// `latency`/`duration`/`e2e_latency` (seconds).
pub fn parse_log_line(v: &Value) -> Option<LogEntry> {
    let first = |keys: &[&str]| keys.iter().find_map(|k| v.get(*k));
    let turn_text = |t: &Value| {
        t.get("content")
            .or_else(|| t.get("value"))
            .and_then(Value::as_str)
            .map(str::to_string)
    };
    let (prompt, completion) = if let Some(p) = first(&["prompt", "text"]).and_then(Value::as_str) {
        let c = first(&["completion", "response", "output"])
            .and_then(Value::as_str)
            .map(str::to_string);
        (p.to_string(), c)
    } else {
        let turns = first(&["conversations", "messages", "conversation"])?.as_array()?;
        (turn_text(turns.first()?)?, turns.get(1).and_then(turn_text))
    };
    let start_s = first(&["timestamp", "start_time", "arrival_time"]).and_then(time_value);
    let end_s = first(&["end_time", "end_timestamp", "finish_time"])
        .and_then(time_value)
        .or_else(|| {
            let d = first(&["latency", "duration", "e2e_latency"]).and_then(Value::as_f64)?;
            Some(start_s? + d)
        });
    Some(LogEntry {
        prompt,
        completion,
        output_len: first(&["output_len", "max_tokens", "max_new_tokens"])
            .and_then(Value::as_u64)
            .map(|n| n as usize),
        start_s,
        end_s,
    })
}

/// Reads a JSONL log (possibly gzipped); keeps the first `limit` entries.
pub fn load_log(path: &Path, limit: Option<usize>) -> Result<Vec<LogEntry>> {
    let text = crate::files::read_text(path)?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if limit.is_some_and(|l| out.len() >= l) {
            break;
        }
        if line.trim().is_empty() {
            continue;
        }
        let v: Value = serde_json::from_str(line)
            .map_err(|e| BenchError::data(path, format!("line {}: invalid JSON: {e}", i + 1)))?;
        let e = parse_log_line(&v).ok_or_else(|| {
            BenchError::data(
                path,
                format!(
                    "line {}: no prompt (expected \"prompt\", \"text\" or \"conversations\")",
                    i + 1
                ),
            )
        })?;
        out.push(e);
    }
    Ok(out)
}

/// The `custom` data set: a JSONL log; output length from the entry, else the
/// completion's token count, else `default_output_len`.
pub fn from_log(
    entries: &[LogEntry],
    tok: &PromptTokenizer,
    default_output_len: usize,
) -> Result<Vec<DatasetRow>> {
    let mut rows = Vec::with_capacity(entries.len());
    for e in entries {
        let ids = tok.encode(&e.prompt, true)?;
        if ids.is_empty() {
            continue;
        }
        let output_len = match (e.output_len, &e.completion) {
            (Some(n), _) => n,
            (None, Some(c)) => tok.count(c, false)?,
            (None, None) => default_output_len,
        };
        rows.push(DatasetRow {
            prompt: Prompt::Text(e.prompt.clone()),
            prompt_len: ids.len(),
            output_len: output_len.max(1),
            timestamp_s: e.start_s,
            tokens: Some(ids),
        });
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::prefix_sharing_rate;

    fn pairs() -> Vec<(String, String)> {
        vec![
            ("the river of time".into(), "a b c d".into()),
            ("x".into(), "yes no".into()),
            ("one two three four five six".into(), "ok".into()),
        ]
    }

    #[test]
    fn random_lengths_respect_the_range() {
        let mut rng = Rng::new(1);
        let l = random_lens(100, 0.5, 1000, &mut rng);
        assert!(l.iter().all(|&x| (50..=100).contains(&x)));
        assert!(l.contains(&50) && l.contains(&100));
        assert!(
            random_lens(10, 0.0, 100, &mut rng)
                .iter()
                .all(|&x| (1..=10).contains(&x))
        );
        assert_eq!(random_lens(8, 1.0, 3, &mut rng), vec![8, 8, 8]);
    }

    #[test]
    fn random_rows_have_the_sampled_lengths() {
        let tok = PromptTokenizer::Words;
        let spec = RandomSpec {
            num_prompts: 3,
            input_len: 10,
            output_len: 5,
            range_ratio: 1.0,
        };
        let rows = sample_random(spec, &tok, &pairs(), &mut Rng::new(2)).unwrap();
        assert_eq!(rows.len(), 3);
        for r in &rows {
            assert_eq!(r.prompt_len, 10);
            assert_eq!(r.output_len, 5);
            let Prompt::Text(t) = &r.prompt else { panic!() };
            assert_eq!(tok.count(t, true).unwrap(), 10);
        }
        let too_many = RandomSpec {
            num_prompts: 4,
            ..spec
        };
        assert!(sample_random(too_many, &tok, &pairs(), &mut Rng::new(2)).is_err());
        let ids = sample_random_ids(spec, &tok, &mut Rng::new(2)).unwrap();
        assert!(
            ids.iter()
                .all(|r| r.tokens.as_ref().is_some_and(|t| t.len() == 10))
        );
    }

    #[test]
    fn sharegpt_filters_short_pairs() {
        let tok = PromptTokenizer::Words;
        let rows = sample_sharegpt(&pairs(), 10, &tok, None, None, &mut Rng::new(3)).unwrap();
        // "x" (1 token) and the 1-token completion "ok" are pruned.
        assert_eq!(rows.len(), 1);
        assert_eq!((rows[0].prompt_len, rows[0].output_len), (4, 4));
        let fixed =
            sample_sharegpt(&pairs(), 10, &tok, Some(16), Some(20), &mut Rng::new(3)).unwrap();
        assert_eq!(
            fixed.len(),
            1,
            "the 6-token prompt + 16 exceeds the context of 20"
        );
        assert!(sample_sharegpt(&pairs(), 1, &tok, Some(2), None, &mut Rng::new(3)).is_err());
    }

    #[test]
    fn generated_shared_prefix_really_shares_its_prefixes() {
        let tok = PromptTokenizer::Words;
        let spec = GspSpec {
            num_groups: 4,
            prompts_per_group: 8,
            system_prompt_len: 200,
            question_len: 20,
            output_len: 16,
            range_ratio: 1.0,
            hot_fraction: 0.0,
        };
        let rows = sample_gsp(spec, &tok, &mut Rng::new(4)).unwrap();
        assert_eq!(rows.len(), 32);
        // Group the prompts by their first 200 words: exactly 4 groups of 8.
        let mut groups = std::collections::HashMap::new();
        for r in &rows {
            let t = r.tokens.as_ref().unwrap();
            assert_eq!(t.len(), 220);
            *groups.entry(t[..200].to_vec()).or_insert(0) += 1;
        }
        assert_eq!(groups.len(), 4);
        assert!(groups.values().all(|&c| c == 8));
        // Sharing rate: 28 of 32 prompts share 200 of 220 tokens with a neighbour.
        let mut seqs: Vec<Vec<u32>> = rows.iter().map(|r| r.tokens.clone().unwrap()).collect();
        let rate = prefix_sharing_rate(&mut seqs);
        assert!(
            (rate - 28.0 * 200.0 / (32.0 * 220.0)).abs() < 0.01,
            "{rate}"
        );
        // Shuffled: the first rows do not all come from one group.
        let first: Vec<_> = rows[..8]
            .iter()
            .map(|r| r.tokens.as_ref().unwrap()[..200].to_vec())
            .collect();
        assert!(first.iter().any(|f| f != &first[0]));
    }

    #[test]
    fn a_hot_group_takes_its_share() {
        let spec = GspSpec {
            num_groups: 4,
            prompts_per_group: 8,
            system_prompt_len: 50,
            question_len: 5,
            output_len: 4,
            range_ratio: 1.0,
            hot_fraction: 0.5,
        };
        assert_eq!(spec.group_sizes(), vec![16, 6, 5, 5]);
        let rows = sample_gsp(spec, &PromptTokenizer::Words, &mut Rng::new(9)).unwrap();
        let mut groups = std::collections::HashMap::new();
        for r in &rows {
            *groups
                .entry(r.tokens.as_ref().unwrap()[..50].to_vec())
                .or_insert(0) += 1;
        }
        let mut sizes: Vec<usize> = groups.into_values().collect();
        sizes.sort_unstable();
        assert_eq!(sizes, vec![5, 5, 6, 16]);
        let all = GspSpec {
            hot_fraction: 1.0,
            ..spec
        };
        assert_eq!(all.group_sizes(), vec![32, 0, 0, 0]);
    }

    #[test]
    fn log_lines_in_all_shapes() {
        let v: Value = serde_json::json!({"prompt": "hi there", "completion": "yo", "timestamp": 10.0, "latency": 2.5});
        let e = parse_log_line(&v).unwrap();
        assert_eq!((e.start_s, e.end_s), (Some(10.0), Some(12.5)));
        let v: Value = serde_json::json!({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "timestamp": 1_700_000_000_000u64});
        let e = parse_log_line(&v).unwrap();
        assert_eq!(
            (e.prompt.as_str(), e.completion.as_deref(), e.start_s),
            ("q", Some("a"), Some(1_700_000_000.0))
        );
        let v: Value = serde_json::json!({"text": "t", "max_tokens": 7, "start_time": "2024-01-01 00:00:00", "end_time": "2024-01-01 00:00:03"});
        let e = parse_log_line(&v).unwrap();
        assert_eq!(e.output_len, Some(7));
        assert_eq!(e.end_s.unwrap() - e.start_s.unwrap(), 3.0);
        assert!(parse_log_line(&serde_json::json!({"foo": 1})).is_none());
        let rows = from_log(&[e], &PromptTokenizer::Words, 9).unwrap();
        assert_eq!(rows[0].output_len, 7);
    }
}
