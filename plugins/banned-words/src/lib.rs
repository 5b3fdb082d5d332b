//! Example plugin: the `banned_words` logits processor.
//!
//! Config (JSON, from `[[plugins]] config = {...}` in arbor.toml):
//! `{"token_ids": [1234, 5678]}` — these tokens get a logit of −∞, so they are
//! never sampled. (Find a word's ids with the model's tokenizer; a word may
//! need every token that can start it.) `"panic_on_prompt_token": ID` makes the
//! processor panic on requests whose prompt contains that id: a test hook
//! showing that the host fails only that request.
#![allow(unsafe_code)]

use arbor_plugin_api::sdk::LogitsProcessor;

/// The processor's state.
pub struct BannedWords {
    banned: Vec<u32>,
    panic_on: Option<u32>,
}

/// Reads the unsigned integers of a JSON array under `key` (a tiny parser, so
/// the plugin needs no JSON dependency).
fn ids_after(config: &str, key: &str) -> Result<Vec<u32>, String> {
    let Some(start) = config.find(&format!("\"{key}\"")) else {
        return Ok(Vec::new());
    };
    let rest = &config[start..];
    let open = rest
        .find('[')
        .ok_or_else(|| format!("'{key}' must be an array"))?;
    let close = rest
        .find(']')
        .ok_or_else(|| format!("'{key}' array is not closed"))?;
    rest[open + 1..close]
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<u32>()
                .map_err(|_| format!("'{key}' holds '{s}', not a token id"))
        })
        .collect()
}

fn number_after(config: &str, key: &str) -> Result<Option<u32>, String> {
    let Some(start) = config.find(&format!("\"{key}\"")) else {
        return Ok(None);
    };
    let rest = &config[start + key.len() + 2..];
    let digits: String = rest
        .trim_start_matches([':', ' '])
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits
        .parse()
        .map(Some)
        .map_err(|_| format!("'{key}' must be a token id"))
}

impl LogitsProcessor for BannedWords {
    fn new(config: &str) -> Result<Self, String> {
        Ok(Self {
            banned: ids_after(config, "token_ids")?,
            panic_on: number_after(config, "panic_on_prompt_token")?,
        })
    }

    fn process(&self, logits: &mut [f32], prompt: &[u32], _output: &[u32]) -> Result<(), String> {
        if let Some(p) = self.panic_on
            && prompt.contains(&p)
        {
            panic!("banned_words was told to panic on token {p}");
        }
        for &t in &self.banned {
            if let Some(l) = logits.get_mut(t as usize) {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }
}

arbor_plugin_api::export_plugin! {
    name: "banned-words",
    version: "0.1.0",
    eviction_policies: [],
    logits_processors: [("banned_words", "never samples the token ids listed in its config", BannedWords)],
    samplers: [],
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_config_and_bans() {
        let p = BannedWords::new(r#"{"token_ids": [1, 3], "panic_on_prompt_token": 7}"#).unwrap();
        let mut l = vec![0.0; 5];
        p.process(&mut l, &[2], &[]).unwrap();
        assert_eq!(l[1], f32::NEG_INFINITY);
        assert_eq!(l[3], f32::NEG_INFINITY);
        assert_eq!(l[0], 0.0);
        assert!(BannedWords::new(r#"{"token_ids": [1, "x"]}"#).is_err());
        assert!(
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| p.process(
                &mut l,
                &[7],
                &[]
            )))
            .is_err()
        );
    }
}
