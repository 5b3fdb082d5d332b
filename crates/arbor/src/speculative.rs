//! `[speculative]` and SGLang's `--speculative-*` flags (one struct:
//! [`SpeculativeSection`]) and the engine's [`SpeculativeConfig`].
//!
//! `algorithm` is `none` (off, the default) or a registered speculator
//! (any case): `ngram` (SGLang's `NGRAM`), `standalone` (a separate draft
//! model at `draft_model_path`), `layerskip` (the target's first
//! `draft_layers` layers), `eagle` / `eagle3` (an EAGLE or EAGLE3 draft
//! head at `draft_model_path`) or `nextn` (MTP layers of the target's
//! checkpoint). Any algorithm is refused when this binary was built without
//! the `spec-decode` cargo feature; an unknown one by the registry, naming
//! the flag.

use crate::settings::Section;
use anyhow::{Result, bail};
use arbor_engine_core::speculative::{NgramMatchType, NgramOptions, SpeculativeConfig};
use clap::Args;
use serde::{Deserialize, Serialize};

/// `[speculative]` and SGLang's `--speculative-*` flags: speculative
/// decoding (crates/spec-decode). A key is its flag without the
/// `speculative-` prefix. One declaration per setting ([`crate::settings`]).
#[derive(Args, Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SpeculativeSection {
    /// Speculative decoding: none, NGRAM, STANDALONE (a draft model), LAYERSKIP (the target's first layers), EAGLE or EAGLE3 (a draft head) or NEXTN (the target's MTP layers); any case.
    #[arg(long = "speculative-algorithm", help_heading = "Speculative decoding")]
    pub algorithm: Option<String>,
    /// Most draft tokens per request and step, 1..=64.
    #[arg(
        long = "speculative-num-draft-tokens",
        help_heading = "Speculative decoding"
    )]
    pub num_draft_tokens: Option<usize>,
    /// Draft tokens a model drafter (STANDALONE, LAYERSKIP) proposes per step, 1..=64.
    #[arg(long = "speculative-num-steps", help_heading = "Speculative decoding")]
    pub num_steps: Option<usize>,
    /// The STANDALONE draft model (an HF folder or a GGUF file with the target's tokenizer), the EAGLE or EAGLE3 head's folder, or the checkpoint holding NEXTN's layers [default: the target's].
    #[arg(
        long = "speculative-draft-model-path",
        help_heading = "Speculative decoding"
    )]
    pub draft_model_path: Option<std::path::PathBuf>,
    /// LAYERSKIP: the target's first N layers (then its final norm and LM head) draft.
    #[arg(
        long = "speculative-draft-layers",
        help_heading = "Speculative decoding"
    )]
    pub draft_layers: Option<usize>,
    /// Draft heads (EAGLE, EAGLE3, NEXTN): children kept per step; above 1, trees of the --speculative-num-draft-tokens best nodes over --speculative-num-steps levels.
    #[arg(long = "speculative-eagle-topk", help_heading = "Speculative decoding")]
    pub eagle_topk: Option<usize>,
    /// Draft fewer tokens, or none, where acceptance and step cost say it does not pay.
    #[arg(long = "speculative-adaptive", num_args = 0..=1, require_equals = true, default_missing_value = "true", help_heading = "Speculative decoding")]
    pub adaptive: Option<bool>,
    /// Always draft in full (the flag of `adaptive = false`).
    #[arg(
        long = "disable-speculative-adaptive",
        help_heading = "Speculative decoding"
    )]
    #[serde(skip)]
    pub disable_speculative_adaptive: bool,
    /// Shortest suffix matched against the n-gram table.
    #[arg(
        long = "speculative-ngram-min-match-window-size",
        help_heading = "Speculative decoding"
    )]
    pub ngram_min_match_window_size: Option<usize>,
    /// Longest suffix matched.
    #[arg(
        long = "speculative-ngram-max-match-window-size",
        help_heading = "Speculative decoding"
    )]
    pub ngram_max_match_window_size: Option<usize>,
    /// Fewest children per level of a BFS draft tree.
    #[arg(
        long = "speculative-ngram-min-bfs-breadth",
        help_heading = "Speculative decoding"
    )]
    pub ngram_min_bfs_breadth: Option<usize>,
    /// Most children per level of a BFS draft tree.
    #[arg(
        long = "speculative-ngram-max-bfs-breadth",
        help_heading = "Speculative decoding"
    )]
    pub ngram_max_bfs_breadth: Option<usize>,
    /// BFS or PROB.
    #[arg(
        long = "speculative-ngram-match-type",
        help_heading = "Speculative decoding"
    )]
    pub ngram_match_type: Option<String>,
    /// Deepest continuation stored after a suffix.
    #[arg(
        long = "speculative-ngram-max-trie-depth",
        help_heading = "Speculative decoding"
    )]
    pub ngram_max_trie_depth: Option<usize>,
    /// Most n-gram trie nodes kept, least recently used dropped first.
    #[arg(
        long = "speculative-ngram-capacity",
        help_heading = "Speculative decoding"
    )]
    pub ngram_capacity: Option<usize>,
}

impl Section for SpeculativeSection {
    fn defaults() -> Self {
        let d = NgramOptions::default();
        let e = SpeculativeConfig::default();
        Self {
            algorithm: Some("none".into()),
            num_draft_tokens: Some(e.num_draft_tokens),
            num_steps: Some(e.num_steps),
            draft_model_path: None,
            draft_layers: None,
            eagle_topk: Some(e.eagle_topk),
            adaptive: Some(true),
            disable_speculative_adaptive: false,
            ngram_min_match_window_size: Some(d.min_match_window_size),
            ngram_max_match_window_size: Some(d.max_match_window_size),
            ngram_min_bfs_breadth: Some(d.min_bfs_breadth),
            ngram_max_bfs_breadth: Some(d.max_bfs_breadth),
            ngram_match_type: Some("BFS".into()),
            ngram_max_trie_depth: Some(d.max_trie_depth),
            ngram_capacity: Some(d.capacity),
        }
    }

    fn fold_flags(&mut self) {
        if self.disable_speculative_adaptive {
            self.adaptive = Some(false);
        }
    }

    fn settle(&mut self) {
        if let Some(a) = self.algorithm.as_mut() {
            *a = a.to_ascii_lowercase();
        }
    }
}

impl SpeculativeSection {
    /// The engine's settings (`None` when off); errors name the flag.
    pub fn to_engine(&self) -> Result<Option<SpeculativeConfig>> {
        let algo = self.algorithm.clone().unwrap_or_else(|| "none".into());
        if algo == "none" {
            return Ok(None);
        }
        if !cfg!(feature = "spec-decode") {
            bail!(
                "--speculative-algorithm {algo} needs speculative decoding, which this binary was \
                 built without: rebuild with the `spec-decode` cargo feature of arbor"
            );
        }
        let upper = algo.to_ascii_uppercase();
        // NEXTN's layers are in the target's checkpoint unless a path is given.
        let needs_path = matches!(algo.as_str(), "standalone" | "eagle" | "eagle3");
        let takes_path = needs_path || algo == "nextn";
        match (needs_path, takes_path, self.draft_model_path.is_some()) {
            (true, _, false) => bail!(
                "--speculative-algorithm {upper} needs --speculative-draft-model-path \
                 (TOML: [speculative] draft_model_path)"
            ),
            (_, false, true) => bail!(
                "--speculative-draft-model-path is used by --speculative-algorithm STANDALONE, EAGLE, EAGLE3 and NEXTN only, not {upper}"
            ),
            _ => {}
        }
        match (algo == "layerskip", self.draft_layers.is_some()) {
            (true, false) => bail!(
                "--speculative-algorithm LAYERSKIP needs --speculative-draft-layers N \
                 (TOML: [speculative] draft_layers)"
            ),
            (false, true) => bail!(
                "--speculative-draft-layers is used by --speculative-algorithm LAYERSKIP only, not {upper}"
            ),
            _ => {}
        }
        let d = NgramOptions::default();
        let e = SpeculativeConfig::default();
        let c = SpeculativeConfig {
            algorithm: algo,
            num_draft_tokens: self.num_draft_tokens.unwrap_or(e.num_draft_tokens),
            num_steps: self.num_steps.unwrap_or(e.num_steps),
            draft_layers: self.draft_layers,
            eagle_topk: self.eagle_topk.unwrap_or(e.eagle_topk),
            adaptive: self.adaptive.unwrap_or(true),
            ngram: NgramOptions {
                min_match_window_size: self
                    .ngram_min_match_window_size
                    .unwrap_or(d.min_match_window_size),
                max_match_window_size: self
                    .ngram_max_match_window_size
                    .unwrap_or(d.max_match_window_size),
                min_bfs_breadth: self.ngram_min_bfs_breadth.unwrap_or(d.min_bfs_breadth),
                max_bfs_breadth: self.ngram_max_bfs_breadth.unwrap_or(d.max_bfs_breadth),
                match_type: NgramMatchType::parse(
                    self.ngram_match_type.as_deref().unwrap_or("BFS"),
                )
                .map_err(|e| anyhow::anyhow!("--speculative-ngram-match-type: {e}"))?,
                max_trie_depth: self.ngram_max_trie_depth.unwrap_or(d.max_trie_depth),
                capacity: self.ngram_capacity.unwrap_or(d.capacity),
            },
        };
        c.validate()
            .map_err(|e| crate::settings::named_setting(e, "speculative"))?;
        Ok(Some(c))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::layered;

    #[test]
    fn flags_override_file_and_bad_values_name_the_flag() {
        let file = SpeculativeSection {
            algorithm: Some("NGRAM".into()),
            num_draft_tokens: Some(4),
            ..Default::default()
        };
        let a = SpeculativeSection {
            num_draft_tokens: Some(6),
            ..Default::default()
        };
        let s = layered(file.clone(), &a);
        assert_eq!(s.algorithm.as_deref(), Some("ngram"));
        assert_eq!(s.num_draft_tokens, Some(6));
        if cfg!(feature = "spec-decode") {
            let c = s.to_engine().expect("config").expect("on");
            assert_eq!(c.num_draft_tokens, 6);
            assert!(c.adaptive);
        }
        for bad in [0usize, 65] {
            let a = SpeculativeSection {
                num_draft_tokens: Some(bad),
                ..Default::default()
            };
            let e = layered(file.clone(), &a).to_engine().expect_err("refused");
            assert!(
                e.to_string().starts_with(
                    "[speculative] num_draft_tokens / --speculative-num-draft-tokens: must be between 1 and 64"
                ),
                "{e}"
            );
        }
        let a = SpeculativeSection {
            algorithm: Some("EAGLE3".into()),
            ..Default::default()
        };
        let e = layered(file, &a).to_engine().expect_err("refused");
        assert!(e.to_string().contains("speculative"), "{e}");
        let off = layered(
            SpeculativeSection::default(),
            &SpeculativeSection::default(),
        );
        assert!(off.to_engine().expect("off").is_none());
    }

    #[test]
    fn draft_paths_and_layers_go_with_their_algorithms() {
        let with = |algo: &str, path: bool, layers: Option<usize>| {
            let a = SpeculativeSection {
                algorithm: Some(algo.into()),
                draft_model_path: path.then(|| "/models/draft".into()),
                draft_layers: layers,
                ..Default::default()
            };
            layered(SpeculativeSection::default(), &a).to_engine()
        };
        if !cfg!(feature = "spec-decode") {
            return;
        }
        let err = |r: Result<Option<SpeculativeConfig>>| r.expect_err("refused").to_string();
        assert!(err(with("STANDALONE", false, None)).contains("--speculative-draft-model-path"));
        assert!(err(with("EAGLE3", false, None)).contains("--speculative-draft-model-path"));
        assert!(
            err(with("NGRAM", true, None)).contains("STANDALONE, EAGLE, EAGLE3 and NEXTN only")
        );
        assert!(err(with("LAYERSKIP", false, None)).contains("--speculative-draft-layers"));
        assert!(err(with("NGRAM", false, Some(2))).contains("LAYERSKIP only"));
        let c = with("LAYERSKIP", false, Some(2)).expect("ok").expect("on");
        assert_eq!(
            (c.algorithm.as_str(), c.draft_layers),
            ("layerskip", Some(2))
        );
        assert_eq!(c.num_steps, 4);
        with("STANDALONE", true, None).expect("ok");
        with("NEXTN", false, None).expect("ok");
        with("NEXTN", true, None).expect("ok");
    }
}
