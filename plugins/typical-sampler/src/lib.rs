//! Example plugin: the `typical` sampler, locally typical sampling (Meister
//! et al., "Locally Typical Sampling", 2022; `typical_p` in Hugging Face
//! transformers).
//!
//! At each step it keeps the tokens whose surprisal −log p is closest to the
//! distribution's entropy H, in that order, until their probability mass
//! reaches `typical_p`, and samples among them in proportion to p. Logits are
//! divided by the request's temperature first; temperature 0 is greedy
//! (argmax). The request's seeded 64 random bits drive the draw, so the same
//! seed gives the same tokens.
//!
//! Config (JSON, from `[[plugins]] config = {...}`): `{"typical_p": 0.9}`
//! (default 0.95, in [0, 1]; 0 keeps only the most typical token).
//!
//! Invariants: the returned id is always inside the vocabulary; logits that
//! are all −∞ or NaN are an error, never a panic.
#![allow(unsafe_code)]

use arbor_plugin_api::SamplingParamsV1;
use arbor_plugin_api::sdk::Sampler;

/// The sampler's configuration.
pub struct TypicalSampler {
    typical_p: f64,
}

/// Reads the number after `"key":` in a flat JSON object (a tiny parser, so
/// the plugin needs no JSON dependency).
fn number_after(config: &str, key: &str) -> Result<Option<f64>, String> {
    let Some(start) = config.find(&format!("\"{key}\"")) else {
        return Ok(None);
    };
    let rest = config[start + key.len() + 2..].trim_start_matches([':', ' ']);
    let text: String = rest
        .chars()
        .take_while(|c| c.is_ascii_digit() || matches!(c, '.' | 'e' | 'E' | '-' | '+'))
        .collect();
    text.parse()
        .map(Some)
        .map_err(|_| format!("'{key}' must be a number, got '{text}'"))
}

impl TypicalSampler {
    /// The ids kept for `probs` (normalized), most typical first.
    fn typical_set(&self, probs: &[f64]) -> Vec<usize> {
        let entropy: f64 = probs
            .iter()
            .filter(|&&p| p > 0.0)
            .map(|&p| -p * p.ln())
            .sum();
        let mut ids: Vec<usize> = (0..probs.len()).filter(|&i| probs[i] > 0.0).collect();
        let dist = |i: usize| (-probs[i].ln() - entropy).abs();
        ids.sort_by(|&a, &b| dist(a).total_cmp(&dist(b)).then(a.cmp(&b)));
        let mut mass = 0.0;
        let mut keep = 0;
        for &i in &ids {
            keep += 1;
            mass += probs[i];
            if mass >= self.typical_p {
                break;
            }
        }
        ids.truncate(keep.max(1));
        ids
    }
}

impl Sampler for TypicalSampler {
    fn new(config: &str) -> Result<Self, String> {
        let typical_p = number_after(config, "typical_p")?.unwrap_or(0.95);
        if !(0.0..=1.0).contains(&typical_p) {
            return Err(format!("typical_p must be in [0, 1], got {typical_p}"));
        }
        Ok(Self { typical_p })
    }

    fn sample(&self, logits: &mut [f32], params: &SamplingParamsV1) -> Result<u32, String> {
        let max = logits
            .iter()
            .copied()
            .filter(|l| !l.is_nan())
            .fold(f32::NEG_INFINITY, f32::max);
        if max == f32::NEG_INFINITY {
            return Err("every logit is -inf or NaN".into());
        }
        let argmax = logits.iter().position(|&l| l == max).unwrap_or(0);
        if params.temperature <= 0.0 {
            return Ok(argmax as u32);
        }
        let t = f64::from(params.temperature);
        let mut probs: Vec<f64> = logits
            .iter()
            .map(|&l| {
                if l.is_nan() {
                    0.0
                } else {
                    ((f64::from(l) - f64::from(max)) / t).exp()
                }
            })
            .collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
        let kept = self.typical_set(&probs);
        let mass: f64 = kept.iter().map(|&i| probs[i]).sum();
        // 53 of the 64 random bits make a uniform draw in [0, 1).
        let u = (params.random >> 11) as f64 / (1u64 << 53) as f64 * mass;
        let mut acc = 0.0;
        for &i in &kept {
            acc += probs[i];
            if u < acc {
                return Ok(i as u32);
            }
        }
        Ok(kept[kept.len() - 1] as u32)
    }
}

arbor_plugin_api::export_plugin! {
    name: "typical-sampler",
    version: "0.1.0",
    eviction_policies: [],
    logits_processors: [],
    samplers: [("typical", "locally typical sampling: keeps the tokens whose surprisal is nearest the entropy, up to typical_p of the mass", TypicalSampler)],
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn params(temperature: f32, random: u64) -> SamplingParamsV1 {
        SamplingParamsV1 {
            temperature,
            top_p: 1.0,
            top_k: -1,
            min_p: 0.0,
            random,
        }
    }

    /// p = [0.5, 0.25, 0.125, 0.125]: H = 1.75 ln 2 nats; surprisals are
    /// 1, 2, 3, 3 (× ln 2), so token 1 is the most typical, then token 0.
    fn logits() -> Vec<f32> {
        [0.5f32, 0.25, 0.125, 0.125]
            .iter()
            .map(|p| p.ln())
            .collect()
    }

    #[test]
    fn keeps_the_tokens_nearest_the_entropy() {
        let only = TypicalSampler::new(r#"{"typical_p": 0}"#).unwrap();
        for r in [0, u64::MAX / 3, u64::MAX] {
            assert_eq!(only.sample(&mut logits(), &params(1.0, r)).unwrap(), 1);
        }
        // Greedy at temperature 0 whatever the config.
        assert_eq!(only.sample(&mut logits(), &params(0.0, 7)).unwrap(), 0);
        let two = TypicalSampler::new(r#"{"typical_p": 0.75}"#).unwrap();
        let probs = [0.5, 0.25, 0.125, 0.125];
        assert_eq!(two.typical_set(&probs), vec![1, 0]);
        // u < 0.25 of 0.75 picks token 1, the rest token 0.
        assert_eq!(two.sample(&mut logits(), &params(1.0, 0)).unwrap(), 1);
        assert_eq!(
            two.sample(&mut logits(), &params(1.0, u64::MAX)).unwrap(),
            0
        );
        assert!(TypicalSampler::new(r#"{"typical_p": 2}"#).is_err());
        assert!(TypicalSampler::new(r#"{"typical_p": "x"}"#).is_err());
        let mut dead = vec![f32::NEG_INFINITY; 3];
        assert!(only.sample(&mut dead, &params(1.0, 0)).is_err());
    }
}
