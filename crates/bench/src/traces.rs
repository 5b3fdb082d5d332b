//! Public serving traces: Mooncake (`{"timestamp" (ms), "input_length",
//! "output_length", "hash_ids"}` per line) and Azure LLM inference
//! (`TIMESTAMP,ContextTokens,GeneratedTokens` CSV), and the synthesis of
//! prompts that honour a trace's prefix structure.
//!
//! Invariants of [`synthesize_ids`]: each Mooncake hash id stands for one
//! block of [`BLOCK`] tokens; equal hash ids give identical blocks and
//! different hash ids give independently drawn blocks (so two requests share
//! exactly the blocks their `hash_ids` share), the prompt has exactly
//! `input_length` tokens, and tokens beyond the listed blocks (and whole
//! Azure prompts, which have no hash ids) are unique to their request.

use crate::error::{BenchError, Result};
use crate::rng::Rng;
use std::path::Path;

/// Tokens per Mooncake hash block.
pub const BLOCK: usize = 512;

/// One request of a trace.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceRecord {
    /// Arrival time in seconds (absolute or relative: only differences matter).
    pub timestamp_s: Option<f64>,
    /// Prompt tokens.
    pub input_len: usize,
    /// Generated tokens.
    pub output_len: usize,
    /// Mooncake block hashes (empty for Azure).
    pub hash_ids: Vec<u64>,
}

/// Parses a Mooncake trace (JSONL, possibly gzipped); keeps the first `limit` records.
pub fn load_mooncake(path: &Path, limit: Option<usize>) -> Result<Vec<TraceRecord>> {
    let text = crate::files::read_text(path)?;
    parse_mooncake(&text, limit).map_err(|m| BenchError::data(path, m))
}

/// [`load_mooncake`] on text; errors name the line.
pub fn parse_mooncake(
    text: &str,
    limit: Option<usize>,
) -> std::result::Result<Vec<TraceRecord>, String> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if limit.is_some_and(|l| out.len() >= l) {
            break;
        }
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| format!("line {}: invalid JSON: {e}", i + 1))?;
        let num = |k: &str| {
            v.get(k)
                .and_then(serde_json::Value::as_u64)
                .ok_or_else(|| format!("line {}: '{k}' is missing or not a count", i + 1))
        };
        let hash_ids = v
            .get("hash_ids")
            .and_then(serde_json::Value::as_array)
            .map(|a| a.iter().filter_map(serde_json::Value::as_u64).collect())
            .unwrap_or_default();
        out.push(TraceRecord {
            timestamp_s: v
                .get("timestamp")
                .and_then(serde_json::Value::as_f64)
                .map(|ms| ms / 1000.0),
            input_len: num("input_length")? as usize,
            output_len: num("output_length")? as usize,
            hash_ids,
        });
    }
    Ok(out)
}

/// Parses an Azure LLM inference trace (CSV, possibly gzipped); keeps the first `limit` records.
pub fn load_azure(path: &Path, limit: Option<usize>) -> Result<Vec<TraceRecord>> {
    let text = crate::files::read_text(path)?;
    parse_azure(&text, limit).map_err(|m| BenchError::data(path, m))
}

/// [`load_azure`] on text; errors name the line.
pub fn parse_azure(
    text: &str,
    limit: Option<usize>,
) -> std::result::Result<Vec<TraceRecord>, String> {
    let mut lines = text.lines().enumerate();
    let header = lines.next().map(|(_, h)| h).unwrap_or_default();
    let cols: Vec<&str> = header.split(',').map(str::trim).collect();
    let col = |name: &str| {
        cols.iter()
            .position(|c| c.eq_ignore_ascii_case(name))
            .ok_or_else(|| format!("line 1: no '{name}' column (found: {header})"))
    };
    let (ts, ctx, generated) = (
        col("TIMESTAMP")?,
        col("ContextTokens")?,
        col("GeneratedTokens")?,
    );
    let mut out = Vec::new();
    for (i, line) in lines {
        if limit.is_some_and(|l| out.len() >= l) {
            break;
        }
        if line.trim().is_empty() {
            continue;
        }
        let f: Vec<&str> = line.split(',').map(str::trim).collect();
        let get = |c: usize| f.get(c).copied().unwrap_or_default();
        let count = |c: usize, name: &str| {
            get(c)
                .parse::<usize>()
                .map_err(|_| format!("line {}: {name} '{}' is not a count", i + 1, get(c)))
        };
        out.push(TraceRecord {
            timestamp_s: Some(parse_datetime(get(ts)).ok_or_else(|| {
                format!(
                    "line {}: timestamp '{}' is not a date and time",
                    i + 1,
                    get(ts)
                )
            })?),
            input_len: count(ctx, "ContextTokens")?,
            output_len: count(generated, "GeneratedTokens")?,
            hash_ids: Vec::new(),
        });
    }
    Ok(out)
}

/// Days from 1970-01-01 to a civil date (proleptic Gregorian).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Seconds since the Unix epoch of `YYYY-MM-DD[ T]HH:MM:SS[.fraction][Z]`
/// (a time zone offset other than `Z` is not accepted).
pub fn parse_datetime(s: &str) -> Option<f64> {
    let s = s.trim().trim_end_matches('Z');
    let (date, time) = s.split_once([' ', 'T'])?;
    let mut d = date.split('-').map(|x| x.parse::<i64>().ok());
    let (y, mo, da) = (d.next()??, d.next()??, d.next()??);
    let mut t = time.split(':');
    let h: i64 = t.next()?.parse().ok()?;
    let mi: i64 = t.next()?.parse().ok()?;
    let sec: f64 = t.next()?.parse().ok()?;
    if !(1..=12).contains(&mo)
        || !(1..=31).contains(&da)
        || h > 23
        || mi > 59
        || !(0.0..61.0).contains(&sec)
    {
        return None;
    }
    Some((days_from_civil(y, mo, da) * 86_400 + h * 3600 + mi * 60) as f64 + sec)
}

const UNIQUE_STREAM: u64 = 0x005E_ED0F_u64 << 40;

/// Token ids of one synthesized prompt for `rec` (the `index`-th request),
/// drawn from `vocab`, split into the blocks that make it up: one per hash id
/// that contributes tokens, then the request's own tail.
pub fn synthesize_blocks(
    rec: &TraceRecord,
    index: usize,
    vocab: &[u32],
    seed: u64,
) -> Vec<Vec<u32>> {
    synthesize_scaled(rec, index, vocab, seed, BLOCK)
}

/// A trace scaled down for small machines: each hash block stands for
/// `block` tokens instead of [`BLOCK`], input lengths shrink in proportion
/// (at least one token), and output lengths become `output_len` when given.
/// The prefix structure (which requests share which blocks) is unchanged.
pub fn scale(records: &[TraceRecord], block: usize, output_len: Option<usize>) -> Vec<TraceRecord> {
    records
        .iter()
        .map(|r| TraceRecord {
            input_len: (r.input_len * block).div_ceil(BLOCK).max(1),
            output_len: output_len.unwrap_or(r.output_len),
            ..r.clone()
        })
        .collect()
}

/// [`synthesize_blocks`] with `block` tokens per hash block (see [`scale`]).
pub fn synthesize_scaled(
    rec: &TraceRecord,
    index: usize,
    vocab: &[u32],
    seed: u64,
    block: usize,
) -> Vec<Vec<u32>> {
    let mut blocks = Vec::new();
    let mut left = rec.input_len;
    let draw = |rng: &mut Rng, n: usize| -> Vec<u32> {
        (0..n)
            .map(|_| {
                vocab
                    .get(rng.below(vocab.len() as u64) as usize)
                    .copied()
                    .unwrap_or(0)
            })
            .collect()
    };
    for &h in &rec.hash_ids {
        if left == 0 {
            break;
        }
        let mut rng = Rng::derived(seed, h);
        let n = left.min(block);
        // Draw the whole block so a truncated block is a prefix of the full one.
        let mut b = draw(&mut rng, block);
        b.truncate(n);
        blocks.push(b);
        left -= n;
    }
    if left > 0 {
        let mut rng = Rng::derived(seed ^ UNIQUE_STREAM, index as u64);
        blocks.push(draw(&mut rng, left));
    }
    blocks
}

/// [`synthesize_blocks`], concatenated.
pub fn synthesize_ids(rec: &TraceRecord, index: usize, vocab: &[u32], seed: u64) -> Vec<u32> {
    synthesize_blocks(rec, index, vocab, seed).concat()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scaled_traces_keep_their_sharing() {
        let a = TraceRecord {
            timestamp_s: None,
            input_len: 1100,
            output_len: 7,
            hash_ids: vec![1, 2, 3],
        };
        let b = TraceRecord {
            hash_ids: vec![1, 2, 9],
            ..a.clone()
        };
        let s = scale(&[a, b], 16, Some(3));
        assert_eq!((s[0].input_len, s[0].output_len), (35, 3));
        let vocab: Vec<u32> = (0..100).collect();
        let x = synthesize_scaled(&s[0], 0, &vocab, 1, 16).concat();
        let y = synthesize_scaled(&s[1], 1, &vocab, 1, 16).concat();
        assert_eq!(x.len(), 35);
        assert_eq!(x[..32], y[..32]);
        assert_ne!(x[32..], y[32..]);
    }

    #[test]
    fn parses_mooncake_lines() {
        let t = "{\"timestamp\": 1500, \"input_length\": 600, \"output_length\": 5, \"hash_ids\": [0, 1]}\n\n\
                 {\"timestamp\": 2500, \"input_length\": 10, \"output_length\": 2, \"hash_ids\": [0]}\n";
        let r = parse_mooncake(t, None).unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!(r[0].timestamp_s, Some(1.5));
        assert_eq!(r[0].hash_ids, vec![0, 1]);
        assert_eq!(parse_mooncake(t, Some(1)).unwrap().len(), 1);
        let e = parse_mooncake("{\"timestamp\": 1}", None).unwrap_err();
        assert!(e.contains("line 1") && e.contains("input_length"), "{e}");
    }

    #[test]
    fn parses_azure_csv_and_timestamps() {
        let t = "TIMESTAMP,ContextTokens,GeneratedTokens\n\
                 2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109\n";
        let r = parse_azure(t, None).unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!((r[0].input_len, r[0].output_len), (374, 44));
        let dt = r[1].timestamp_s.unwrap() - r[0].timestamp_s.unwrap();
        assert!((dt - 4.314579).abs() < 1e-6, "{dt}");
        assert!(parse_azure("A,B\n1,2\n", None).is_err());
        assert!(
            parse_azure(
                "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,2\n",
                None
            )
            .is_err()
        );
        // 2000-03-01T00:00:00Z is 951868800.
        assert_eq!(parse_datetime("2000-03-01T00:00:00Z"), Some(951_868_800.0));
        assert_eq!(parse_datetime("1970-01-01 00:01:02.5"), Some(62.5));
        assert_eq!(parse_datetime("2023-13-01 00:00:00"), None);
    }

    #[test]
    fn equal_hash_ids_give_equal_blocks() {
        let vocab: Vec<u32> = (0..1000).collect();
        let a = TraceRecord {
            timestamp_s: None,
            input_len: 1100,
            output_len: 1,
            hash_ids: vec![7, 8, 9],
        };
        let b = TraceRecord {
            timestamp_s: None,
            input_len: 1300,
            output_len: 1,
            hash_ids: vec![7, 8, 10],
        };
        let c = TraceRecord {
            timestamp_s: None,
            input_len: 1300,
            output_len: 1,
            hash_ids: vec![1, 8, 10],
        };
        let (ia, ib, ic) = (
            synthesize_ids(&a, 0, &vocab, 1),
            synthesize_ids(&b, 1, &vocab, 1),
            synthesize_ids(&c, 2, &vocab, 1),
        );
        assert_eq!((ia.len(), ib.len()), (1100, 1300));
        assert_eq!(ia[..1024], ib[..1024]);
        // The third blocks differ (hash 9 vs 10) from their first token on, almost surely.
        let common = ia.iter().zip(&ib).take_while(|(x, y)| x == y).count();
        assert!(common < 1030, "{common}");
        // A different first block, then the same hash 8: blocks are equal wherever they sit.
        assert_ne!(ic[..512], ib[..512]);
        assert_eq!(ic[512..1024], ib[512..1024]);
        // Past the listed blocks, tokens are the request's own.
        let d = TraceRecord {
            timestamp_s: None,
            input_len: 600,
            output_len: 1,
            hash_ids: vec![7],
        };
        let (d0, d1) = (
            synthesize_ids(&d, 0, &vocab, 1),
            synthesize_ids(&d, 1, &vocab, 1),
        );
        assert_eq!(d0[..512], d1[..512]);
        assert_ne!(d0[512..], d1[512..]);
        // Deterministic.
        assert_eq!(synthesize_ids(&a, 0, &vocab, 1), ia);
    }
}
