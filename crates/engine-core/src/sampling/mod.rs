//! Sampling parameters, the sampler and logits-processor traits, and the
//! built-in implementations.
//!
//! Per step and per request the engine applies, in order: the request's
//! logits processors (penalties, logit bias, plugins), then the sampler
//! (greedy when `temperature == 0` or `top_k == 1`; otherwise temperature,
//! then top-k, top-p and min-p filtering, then a draw from the request's own
//! RNG). The RNG is seeded from `seed` when given, so the same seed and the
//! same logits give the same tokens.
//!
//! Penalties follow vLLM and HF: the repetition penalty covers prompt and
//! output tokens, frequency and presence penalties cover output tokens only.
//!
//! The `sampling` room also holds [`logit_edits`]: the per-row edits
//! (penalties, bias, grammar masks) any device applies before sampling.

pub mod logit_edits;
use crate::error::{CoreError, Param, Result};
use crate::sampling::logit_edits::{LogitEdits, RowEdits};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};

/// The most stop strings a request may give.
pub const MAX_STOP_STRINGS: usize = 64;

/// Per-request sampling parameters (SGLang's names).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SamplingParams {
    /// Most tokens to generate.
    pub max_new_tokens: usize,
    /// Fewest tokens to generate before EOS or stop ids may end the request.
    pub min_new_tokens: usize,
    /// Softmax temperature; 0 means greedy.
    pub temperature: f32,
    /// Nucleus mass in (0, 1].
    pub top_p: f32,
    /// Keep the k most likely tokens; -1 (or 0) keeps all.
    pub top_k: i32,
    /// Drop tokens whose probability is below `min_p` × the top probability.
    pub min_p: f32,
    /// Divides positive (multiplies negative) logits of seen tokens; 1 is off.
    pub repetition_penalty: f32,
    /// Subtracted once per occurrence in the output.
    pub frequency_penalty: f32,
    /// Subtracted once if the token occurs in the output.
    pub presence_penalty: f32,
    /// Added to the logits of the given token ids.
    pub logit_bias: BTreeMap<u32, f32>,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Stop when the output text matches one of these regular expressions
    /// (SGLang's `stop_regex`; the text is kept whole, and the finish names
    /// the pattern).
    pub stop_regex: Vec<String>,
    /// Stop token ids (besides the model's EOS ids).
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past EOS.
    pub ignore_eos: bool,
    /// Leave special tokens out of the text.
    pub skip_special_tokens: bool,
    /// Keep the matched stop string in the text.
    pub no_stop_trim: bool,
    /// Seed of the request's RNG.
    pub seed: Option<u64>,
    /// Parallel samples of the prompt.
    pub n: usize,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            max_new_tokens: 128,
            min_new_tokens: 0,
            temperature: 1.0,
            top_p: 1.0,
            top_k: -1,
            min_p: 0.0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            logit_bias: BTreeMap::new(),
            stop: Vec::new(),
            stop_regex: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            skip_special_tokens: true,
            no_stop_trim: false,
            seed: None,
            n: 1,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding of up to `max_new_tokens`.
    pub fn greedy(max_new_tokens: usize) -> Self {
        Self {
            max_new_tokens,
            temperature: 0.0,
            ..Default::default()
        }
    }

    /// The compiled `stop_regex` patterns; the error says which one fails and why.
    pub fn stop_regexes(&self) -> std::result::Result<Vec<regex::Regex>, String> {
        self.stop_regex
            .iter()
            .map(|p| {
                regex::RegexBuilder::new(p)
                    .size_limit(1 << 20)
                    .build()
                    .map_err(|e| format!("has an invalid pattern {p:?}: {e}"))
            })
            .collect()
    }

    /// True when sampling reduces to argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature < 1e-6 || self.top_k == 1
    }

    /// Checks ranges; the message names the parameter.
    pub fn validate(&self, vocab_size: usize) -> Result<()> {
        let bad = |param: Param, reason: String| Err(CoreError::param(param, reason));
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return bad(
                Param::Temperature,
                format!("must be >= 0, got {}", self.temperature),
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(
                Param::TopP,
                format!("must be in (0, 1], got {}", self.top_p),
            );
        }
        if self.top_k < -1 {
            return bad(
                Param::TopK,
                format!("must be -1 or >= 1, got {}", self.top_k),
            );
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad(
                Param::MinP,
                format!("must be in [0, 1], got {}", self.min_p),
            );
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty <= 2.0) {
            return bad(
                Param::RepetitionPenalty,
                format!("must be in (0, 2], got {}", self.repetition_penalty),
            );
        }
        if !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return bad(
                Param::FrequencyPenalty,
                format!("must be in [-2, 2], got {}", self.frequency_penalty),
            );
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) {
            return bad(
                Param::PresencePenalty,
                format!("must be in [-2, 2], got {}", self.presence_penalty),
            );
        }
        if self.min_new_tokens > self.max_new_tokens {
            return bad(
                Param::MinNewTokens,
                format!(
                    "({}) exceeds max_new_tokens ({})",
                    self.min_new_tokens, self.max_new_tokens
                ),
            );
        }
        if self.n == 0 || self.n > 128 {
            return bad(Param::N, format!("must be in [1, 128], got {}", self.n));
        }
        let outside = |t: &&u32| **t as usize >= vocab_size;
        if let Some(t) = self.stop_token_ids.iter().find(outside) {
            return bad(
                Param::StopTokenIds,
                format!("has token id {t}, outside the vocabulary of {vocab_size}"),
            );
        }
        if let Some(t) = self.logit_bias.keys().find(outside) {
            return bad(
                Param::LogitBias,
                format!("has token id {t}, outside the vocabulary of {vocab_size}"),
            );
        }
        if self.stop.iter().any(|s| s.is_empty()) {
            return bad(Param::Stop, "must not hold empty strings".into());
        }
        if self.stop.len() > MAX_STOP_STRINGS {
            return bad(
                Param::Stop,
                format!(
                    "holds {} strings; at most {MAX_STOP_STRINGS}",
                    self.stop.len()
                ),
            );
        }
        if self.stop_regex.len() > MAX_STOP_STRINGS {
            return bad(
                Param::StopRegex,
                format!(
                    "holds {} patterns; at most {MAX_STOP_STRINGS}",
                    self.stop_regex.len()
                ),
            );
        }
        if let Err(e) = self.stop_regexes() {
            return bad(Param::StopRegex, e);
        }
        if self.logit_bias.values().any(|v| !v.is_finite()) {
            return bad(Param::LogitBias, "values must be finite".into());
        }
        Ok(())
    }
}

/// A small, fast, seedable RNG (xoshiro256**), one per request.
#[derive(Clone, Debug)]
pub struct SeqRng {
    s: [u64; 4],
}

fn splitmix64(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl SeqRng {
    /// An RNG seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        let mut x = seed;
        let s = [
            splitmix64(&mut x),
            splitmix64(&mut x),
            splitmix64(&mut x),
            splitmix64(&mut x),
        ];
        Self { s }
    }

    /// An RNG seeded from the clock and a process-wide counter.
    pub fn from_entropy() -> Self {
        use std::sync::atomic::{AtomicU64, Ordering};
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        Self::new(t ^ COUNTER.fetch_add(0x1234_5678_9ABC_DEF1, Ordering::Relaxed))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let result = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        result
    }

    /// A uniform float in [0, 1).
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// What a logits processor may look at.
#[derive(Clone, Copy, Debug)]
pub struct LogitsContext<'a> {
    /// The prompt's token ids.
    pub prompt: &'a [u32],
    /// Tokens generated so far.
    pub output: &'a [u32],
    /// The request's parameters.
    pub params: &'a SamplingParams,
}

/// Changes logits in place before sampling.
pub trait LogitsProcessor: Send + Sync {
    /// Registered name.
    fn name(&self) -> &str;
    /// Modifies `logits` (one row over the vocabulary).
    fn process(&self, logits: &mut [f32], ctx: &LogitsContext<'_>) -> Result<()>;
    /// Whether `process` can change anything for a request with `params`
    /// (when not, its history need not be gathered and sampling may stay on
    /// the device).
    fn is_active(&self, params: &SamplingParams) -> bool {
        let _ = params;
        true
    }
    /// Writes what `process` would do to a row as token edits, so the row
    /// can be edited and sampled where the logits are
    /// ([`crate::sampling::logit_edits`]); gives the row up (the default) when that
    /// cannot express it, and the row is then processed on the host.
    fn edit(&self, ctx: &LogitsContext<'_>, row: &mut RowEdits) {
        let _ = ctx;
        row.give_up();
    }
}

/// Chooses the next token from processed logits.
pub trait Sampler: Send + Sync {
    /// Registered name.
    fn name(&self) -> &str;
    /// Picks a token id; may modify `logits` as scratch space.
    fn sample(&self, logits: &mut [f32], params: &SamplingParams, rng: &mut SeqRng) -> Result<u32>;
}

/// Index of the largest value; the lowest index wins ties (as `torch.argmax`).
/// NaN is never the largest; 0 when nothing exceeds `-inf`.
pub fn argmax(values: &[f32]) -> u32 {
    // Two passes over fixed-size chunks, both of which vectorize: the
    // largest value in 16 independent lanes (only a strictly larger value
    // replaces a lane's, so NaN never does), then the first chunk holding
    // it and its first index there.
    const LANES: usize = 16;
    let (chunks, rest) = values.as_chunks::<LANES>();
    let mut lanes = [f32::NEG_INFINITY; LANES];
    for chunk in chunks {
        for (l, &v) in lanes.iter_mut().zip(chunk) {
            *l = if v > *l { v } else { *l };
        }
    }
    // Lanes never hold NaN, so halving them pairwise (which vectorizes)
    // finds the same largest value as a scan.
    for width in [8, 4, 2, 1] {
        let (lo, hi) = lanes.split_at_mut(width);
        for (l, &h) in lo.iter_mut().zip(hi.iter()) {
            *l = if h > *l { h } else { *l };
        }
    }
    let mut best = lanes[0];
    for &v in rest {
        if v > best {
            best = v;
        }
    }
    if best == f32::NEG_INFINITY {
        return 0;
    }
    let first = |c: &[f32]| c.iter().position(|&v| v == best);
    for (c, chunk) in chunks.iter().enumerate() {
        if chunk.iter().fold(false, |hit, &v| hit | (v == best)) {
            return (c * LANES + first(chunk).unwrap_or(0)) as u32;
        }
    }
    (chunks.len() * LANES + first(rest).unwrap_or(0)) as u32
}

/// Greedy, or temperature with top-k, top-p and min-p filtering.
#[derive(Debug, Default, Clone, Copy)]
pub struct StandardSampler;

impl Sampler for StandardSampler {
    fn name(&self) -> &str {
        "standard"
    }

    fn sample(&self, logits: &mut [f32], params: &SamplingParams, rng: &mut SeqRng) -> Result<u32> {
        if logits.is_empty() {
            return Err(CoreError::invalid("sampling from empty logits"));
        }
        if params.is_greedy() {
            return Ok(argmax(logits));
        }
        let Some(cand) = filtered_candidates(logits, params) else {
            return Ok(argmax(logits));
        };
        let total: f32 = cand.iter().map(|c| c.0).sum();
        let mut r = rng.next_f32() * total;
        for c in &cand {
            r -= c.0;
            if r < 0.0 {
                return Ok(c.1);
            }
        }
        Ok(cand[cand.len() - 1].1)
    }
}

/// The candidates a temperature draw chooses from: `(weight, id)` after
/// temperature, top-k, top-p and min-p (weights unnormalized, positive);
/// `None` when nothing finite is left (the caller falls back to argmax).
/// Rejection sampling in speculative verification reads the same distribution
/// that [`StandardSampler`] draws from.
pub fn filtered_candidates(logits: &[f32], params: &SamplingParams) -> Option<Vec<(f32, u32)>> {
    let inv_t = 1.0 / params.temperature;
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        // Every token masked out (or NaN logits): fall back to argmax.
        return None;
    }
    // Candidates as (prob-unnormalized, id), restricted early where possible.
    let mut cand: Vec<(f32, u32)> = logits
        .iter()
        .enumerate()
        .filter(|(_, v)| v.is_finite())
        .map(|(i, &v)| (((v - max) * inv_t).exp(), i as u32))
        .collect();
    let desc = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
    let k = if params.top_k > 0 {
        (params.top_k as usize).min(cand.len())
    } else {
        cand.len()
    };
    if k < cand.len() {
        cand.select_nth_unstable_by(k - 1, desc);
        cand.truncate(k);
    }
    let total: f32 = cand.iter().map(|c| c.0).sum();
    if params.top_p < 1.0 {
        // Sort only a head large enough to hold top_p of the mass when possible.
        let mut head = cand.len().min(1024);
        loop {
            if head < cand.len() {
                cand.select_nth_unstable_by(head - 1, desc);
            }
            cand[..head].sort_unstable_by(desc);
            let mass: f32 = cand[..head].iter().map(|c| c.0).sum();
            if mass >= params.top_p * total || head == cand.len() {
                break;
            }
            head = (head * 4).min(cand.len());
        }
        let mut acc = 0.0;
        let mut keep = cand.len();
        for (i, c) in cand.iter().enumerate() {
            acc += c.0;
            if acc >= params.top_p * total {
                keep = i + 1;
                break;
            }
        }
        cand.truncate(keep.max(1));
    }
    if params.min_p > 0.0 {
        // The top unnormalized probability is exp(0) = 1.
        let floor = params.min_p;
        cand.retain(|c| c.0 >= floor);
    }
    let total: f32 = cand.iter().map(|c| c.0).sum();
    if cand.is_empty() || total <= 0.0 {
        return None;
    }
    Some(cand)
}

/// `ln(sum(exp(v)))`, computed from the largest value; that value when it
/// is not finite.
pub fn log_sum_exp(v: &[f32]) -> f32 {
    let m = v.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !m.is_finite() {
        return m;
    }
    m + v.iter().map(|x| (x - m).exp()).sum::<f32>().ln()
}

/// The `n` largest values of `v` with their indices: largest first, the
/// lower index first among equal values.
pub fn top_logits(v: &[f32], n: usize) -> Vec<(u32, f32)> {
    if n == 0 {
        return Vec::new();
    }
    let mut idx: Vec<(u32, f32)> = v.iter().enumerate().map(|(i, &x)| (i as u32, x)).collect();
    let k = n.min(idx.len());
    idx.select_nth_unstable_by(k - 1, |a, b| b.1.total_cmp(&a.1));
    idx.truncate(k);
    idx.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    idx
}

/// Repetition, frequency and presence penalties.
#[derive(Debug, Default, Clone, Copy)]
pub struct PenaltyProcessor;

impl LogitsProcessor for PenaltyProcessor {
    fn name(&self) -> &str {
        "penalties"
    }

    fn is_active(&self, p: &SamplingParams) -> bool {
        p.repetition_penalty != 1.0 || p.frequency_penalty != 0.0 || p.presence_penalty != 0.0
    }

    fn process(&self, logits: &mut [f32], ctx: &LogitsContext<'_>) -> Result<()> {
        let mut row = RowEdits::new(0, logits.len());
        self.edit(ctx, &mut row);
        let mut edits = LogitEdits::new(logits.len());
        row.finish(&mut edits)?;
        edits.apply(logits, logits.len())
    }

    /// Repetition over the prompt and the output (a positive logit times
    /// `1 / r`, another times `r`), then `frequency * count + presence`
    /// subtracted for each output token.
    fn edit(&self, ctx: &LogitsContext<'_>, row: &mut RowEdits) {
        let p = ctx.params;
        if p.repetition_penalty != 1.0 {
            let mut seen = std::collections::HashSet::new();
            for &t in ctx.prompt.iter().chain(ctx.output) {
                if seen.insert(t) {
                    row.repeat(t, p.repetition_penalty);
                }
            }
        }
        if p.frequency_penalty != 0.0 || p.presence_penalty != 0.0 {
            let mut counts: HashMap<u32, u32> = HashMap::new();
            for &t in ctx.output {
                *counts.entry(t).or_default() += 1;
            }
            for (t, c) in counts {
                row.penalize(t, p.frequency_penalty * c as f32 + p.presence_penalty);
            }
        }
    }
}

/// Adds `logit_bias` to the given tokens.
#[derive(Debug, Default, Clone, Copy)]
pub struct LogitBiasProcessor;

impl LogitsProcessor for LogitBiasProcessor {
    fn name(&self) -> &str {
        "logit_bias"
    }

    fn is_active(&self, p: &SamplingParams) -> bool {
        !p.logit_bias.is_empty()
    }

    fn process(&self, logits: &mut [f32], ctx: &LogitsContext<'_>) -> Result<()> {
        for (&t, &b) in &ctx.params.logit_bias {
            if let Some(l) = logits.get_mut(t as usize) {
                *l += b;
            }
        }
        Ok(())
    }

    fn edit(&self, ctx: &LogitsContext<'_>, row: &mut RowEdits) {
        for (&t, &b) in &ctx.params.logit_bias {
            row.bias(t, b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_and_ties() {
        let mut l = vec![1.0, 3.0, 3.0, -1.0];
        let mut rng = SeqRng::new(1);
        let t = StandardSampler
            .sample(&mut l, &SamplingParams::greedy(1), &mut rng)
            .unwrap();
        assert_eq!(t, 1);
    }

    /// The definition: the first index of the largest non-NaN value; 0
    /// when nothing exceeds `-inf`.
    fn argmax_reference(v: &[f32]) -> u32 {
        let mut best: Option<(usize, f32)> = None;
        for (i, &x) in v.iter().enumerate() {
            if x > best.map_or(f32::NEG_INFINITY, |b| b.1) {
                best = Some((i, x));
            }
        }
        best.map_or(0, |b| b.0 as u32)
    }

    #[test]
    fn argmax_matches_its_definition() {
        let mut rng = SeqRng::new(7);
        for len in 0..80 {
            for _ in 0..50 {
                // Few distinct values (many ties), some NaN and infinities.
                let v: Vec<f32> = (0..len)
                    .map(|_| match rng.next_u64() % 12 {
                        0 => f32::NAN,
                        1 => f32::NEG_INFINITY,
                        2 if len > 40 => f32::INFINITY,
                        r => (r % 5) as f32 - 2.0,
                    })
                    .collect();
                assert_eq!(argmax(&v), argmax_reference(&v), "{v:?}");
            }
        }
        assert_eq!(argmax(&[f32::NAN; 9]), 0);
        assert_eq!(argmax(&[f32::NEG_INFINITY; 17]), 0);
        let mut big = vec![0.5f32; 49_152];
        big[49_151] = 0.75;
        big[20_001] = 0.75;
        assert_eq!(argmax(&big), 20_001);
    }

    #[test]
    fn seeded_sampling_repeats_and_respects_top_k() {
        let logits: Vec<f32> = (0..1000).map(|i| ((i * 37) % 101) as f32 / 10.0).collect();
        let params = SamplingParams {
            temperature: 0.8,
            top_k: 5,
            ..Default::default()
        };
        let mut top5: Vec<(f32, u32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &v)| (v, i as u32))
            .collect();
        top5.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        let allowed: Vec<u32> = top5[..5].iter().map(|x| x.1).collect();
        let run = |seed| {
            let mut rng = SeqRng::new(seed);
            (0..50)
                .map(|_| {
                    StandardSampler
                        .sample(&mut logits.clone(), &params, &mut rng)
                        .unwrap()
                })
                .collect::<Vec<_>>()
        };
        let a = run(7);
        assert_eq!(a, run(7));
        assert!(a.iter().all(|t| allowed.contains(t)));
        assert_ne!(a, run(8));
    }

    #[test]
    fn top_p_keeps_nucleus() {
        // Probabilities ~ 0.6, 0.3, 0.1 (+ tiny): top_p 0.5 keeps only the first.
        let mut logits = vec![0.6f32.ln(), 0.3f32.ln(), 0.1f32.ln(), -30.0];
        let params = SamplingParams {
            top_p: 0.5,
            ..Default::default()
        };
        let mut rng = SeqRng::new(3);
        for _ in 0..20 {
            assert_eq!(
                StandardSampler
                    .sample(&mut logits, &params, &mut rng)
                    .unwrap(),
                0
            );
        }
        let params = SamplingParams {
            top_p: 0.85,
            ..Default::default()
        };
        let mut seen = [0; 4];
        for _ in 0..400 {
            seen[StandardSampler
                .sample(&mut logits, &params, &mut rng)
                .unwrap() as usize] += 1;
        }
        assert!(seen[0] > 0 && seen[1] > 0 && seen[2] == 0 && seen[3] == 0);
    }

    #[test]
    fn min_p_filters() {
        let mut logits = vec![0.0, -0.1, -5.0];
        let params = SamplingParams {
            min_p: 0.5,
            ..Default::default()
        };
        let mut rng = SeqRng::new(9);
        for _ in 0..100 {
            let t = StandardSampler
                .sample(&mut logits, &params, &mut rng)
                .unwrap();
            assert!(t < 2);
        }
    }

    #[test]
    fn penalties() {
        let params = SamplingParams {
            repetition_penalty: 2.0,
            frequency_penalty: 0.5,
            presence_penalty: 0.25,
            ..Default::default()
        };
        let mut logits = vec![2.0, -2.0, 1.0, 1.0];
        let ctx = LogitsContext {
            prompt: &[0],
            output: &[1, 1],
            params: &params,
        };
        PenaltyProcessor.process(&mut logits, &ctx).unwrap();
        assert_eq!(logits, vec![1.0, -4.0 - 1.0 - 0.25, 1.0, 1.0]);
    }

    #[test]
    fn validation_names_the_field() {
        let p = SamplingParams {
            top_p: 1.5,
            ..Default::default()
        };
        assert!(p.validate(10).unwrap_err().to_string().contains("top_p"));
        let p = SamplingParams {
            stop_token_ids: vec![10],
            ..Default::default()
        };
        assert!(p.validate(10).is_err());
        let p: SamplingParams =
            serde_json::from_str(r#"{"temperature":0,"logit_bias":{"3":1.5}}"#).unwrap();
        assert_eq!(p.logit_bias.get(&3), Some(&1.5));
        assert!(serde_json::from_str::<SamplingParams>(r#"{"temprature":0}"#).is_err());
    }
}
