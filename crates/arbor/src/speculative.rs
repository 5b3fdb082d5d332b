//! `[speculative]` and SGLang's `--speculative-*` flags: the TOML section,
//! the flags, their merge (defaults < TOML < flags) and the engine's
//! [`SpeculativeConfig`].
//!
//! `algorithm` is `none` (off, the default) or a registered speculator
//! (any case): `ngram` (SGLang's `NGRAM`), `standalone` (a separate draft
//! model at `draft_model_path`), `layerskip` (the target's first
//! `draft_layers` layers), `eagle` / `eagle3` (an EAGLE or EAGLE3 draft
//! head at `draft_model_path`) or `nextn` (MTP layers of the target's
//! checkpoint). Any algorithm is refused when this binary was built without
//! the `spec-decode` cargo feature; an unknown one by the registry, naming
//! the flag.

use anyhow::{Result, bail};
use arbor_engine_core::speculative::{NgramMatchType, NgramOptions, SpeculativeConfig};
use clap::Args;
use serde::{Deserialize, Serialize};

/// `[speculative]`: speculative decoding (crates/spec-decode).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SpeculativeSection {
    /// `none` or a registered speculator: `ngram`, `standalone`, `layerskip`, `eagle`, `eagle3`, `nextn` [default: none].
    pub algorithm: Option<String>,
    /// Most draft tokens per request and step, 1..=64 [default: 8].
    pub num_draft_tokens: Option<usize>,
    /// Draft tokens a model drafter (standalone, layerskip) proposes per step, 1..=64 [default: 4].
    pub num_steps: Option<usize>,
    /// The draft model (HF folder or GGUF) of `standalone`, sharing the target's tokenizer; the head's folder for `eagle` and `eagle3`; the checkpoint with the MTP layers for `nextn` (default: the target's).
    pub draft_model_path: Option<std::path::PathBuf>,
    /// Layers of the target that draft under `layerskip` (1..layers-1).
    pub draft_layers: Option<usize>,
    /// Draft heads (eagle, eagle3, nextn): children per tree level; 1 drafts chains [default: 1].
    pub eagle_topk: Option<usize>,
    /// Draft fewer tokens, or none, where acceptance and step cost say it does not pay [default: true].
    pub adaptive: Option<bool>,
    /// Shortest suffix matched against the n-gram table [default: 1].
    pub ngram_min_match_window_size: Option<usize>,
    /// Longest suffix matched [default: 12].
    pub ngram_max_match_window_size: Option<usize>,
    /// Fewest children per level of a BFS draft tree [default: 1].
    pub ngram_min_bfs_breadth: Option<usize>,
    /// Most children per level of a BFS draft tree [default: 10].
    pub ngram_max_bfs_breadth: Option<usize>,
    /// BFS or PROB [default: BFS].
    pub ngram_match_type: Option<String>,
    /// Deepest continuation stored after a suffix [default: 18].
    pub ngram_max_trie_depth: Option<usize>,
    /// Most n-gram trie nodes kept, least recently used dropped first [default: 10000000].
    pub ngram_capacity: Option<usize>,
}

/// The `--speculative-*` flags (SGLang's names).
#[derive(Args, Debug, Clone, Default)]
pub struct SpeculativeArgs {
    /// Speculative decoding: none, NGRAM, STANDALONE (a draft model), LAYERSKIP (the target's first layers), EAGLE or EAGLE3 (a draft head) or NEXTN (the target's MTP layers) [default: none].
    #[arg(long = "speculative-algorithm", help_heading = "Speculative decoding")]
    pub speculative_algorithm: Option<String>,
    /// Draft tokens a model drafter (STANDALONE, LAYERSKIP) proposes per step, 1..=64 [default: 4].
    #[arg(long = "speculative-num-steps", help_heading = "Speculative decoding")]
    pub speculative_num_steps: Option<usize>,
    /// The STANDALONE draft model (an HF folder or a GGUF file with the target's tokenizer), the EAGLE or EAGLE3 head's folder, or the checkpoint holding NEXTN's layers (default: the target's).
    #[arg(
        long = "speculative-draft-model-path",
        help_heading = "Speculative decoding"
    )]
    pub speculative_draft_model_path: Option<std::path::PathBuf>,
    /// LAYERSKIP: the target's first N layers (then its final norm and LM head) draft.
    #[arg(
        long = "speculative-draft-layers",
        help_heading = "Speculative decoding"
    )]
    pub speculative_draft_layers: Option<usize>,
    /// Draft heads (EAGLE, EAGLE3, NEXTN): children kept per step; above 1, trees of the --speculative-num-draft-tokens best nodes over --speculative-num-steps levels [default: 1].
    #[arg(long = "speculative-eagle-topk", help_heading = "Speculative decoding")]
    pub speculative_eagle_topk: Option<usize>,
    /// Most draft tokens per request and step, 1..=64 [default: 8].
    #[arg(
        long = "speculative-num-draft-tokens",
        help_heading = "Speculative decoding"
    )]
    pub speculative_num_draft_tokens: Option<usize>,
    /// Always draft in full instead of adapting to acceptance and step cost.
    #[arg(
        long = "disable-speculative-adaptive",
        help_heading = "Speculative decoding"
    )]
    pub disable_speculative_adaptive: bool,
    /// Shortest suffix matched against the n-gram table [default: 1].
    #[arg(
        long = "speculative-ngram-min-match-window-size",
        help_heading = "Speculative decoding"
    )]
    pub speculative_ngram_min_match_window_size: Option<usize>,
    /// Longest suffix matched [default: 12].
    #[arg(
        long = "speculative-ngram-max-match-window-size",
        help_heading = "Speculative decoding"
    )]
    pub speculative_ngram_max_match_window_size: Option<usize>,
    /// Fewest children per level of a BFS draft tree [default: 1].
    #[arg(
        long = "speculative-ngram-min-bfs-breadth",
        help_heading = "Speculative decoding"
    )]
    pub speculative_ngram_min_bfs_breadth: Option<usize>,
    /// Most children per level of a BFS draft tree [default: 10].
    #[arg(
        long = "speculative-ngram-max-bfs-breadth",
        help_heading = "Speculative decoding"
    )]
    pub speculative_ngram_max_bfs_breadth: Option<usize>,
    /// BFS or PROB [default: BFS].
    #[arg(
        long = "speculative-ngram-match-type",
        help_heading = "Speculative decoding"
    )]
    pub speculative_ngram_match_type: Option<String>,
    /// Deepest continuation stored after a suffix [default: 18].
    #[arg(
        long = "speculative-ngram-max-trie-depth",
        help_heading = "Speculative decoding"
    )]
    pub speculative_ngram_max_trie_depth: Option<usize>,
    /// Most n-gram trie nodes kept [default: 10000000].
    #[arg(
        long = "speculative-ngram-capacity",
        help_heading = "Speculative decoding"
    )]
    pub speculative_ngram_capacity: Option<usize>,
}

impl SpeculativeSection {
    /// Defaults < `file` < `a`, every key filled in.
    pub fn resolve(f: SpeculativeSection, a: &SpeculativeArgs) -> Self {
        let d = NgramOptions::default();
        let e = SpeculativeConfig::default();
        Self {
            algorithm: Some(
                a.speculative_algorithm
                    .clone()
                    .or(f.algorithm)
                    .unwrap_or_else(|| "none".into())
                    .to_ascii_lowercase(),
            ),
            num_draft_tokens: Some(
                a.speculative_num_draft_tokens
                    .or(f.num_draft_tokens)
                    .unwrap_or(e.num_draft_tokens),
            ),
            num_steps: Some(
                a.speculative_num_steps
                    .or(f.num_steps)
                    .unwrap_or(e.num_steps),
            ),
            draft_model_path: a
                .speculative_draft_model_path
                .clone()
                .or(f.draft_model_path),
            draft_layers: a.speculative_draft_layers.or(f.draft_layers),
            eagle_topk: Some(
                a.speculative_eagle_topk
                    .or(f.eagle_topk)
                    .unwrap_or(e.eagle_topk),
            ),
            adaptive: Some(!a.disable_speculative_adaptive && f.adaptive.unwrap_or(true)),
            ngram_min_match_window_size: Some(
                a.speculative_ngram_min_match_window_size
                    .or(f.ngram_min_match_window_size)
                    .unwrap_or(d.min_match_window_size),
            ),
            ngram_max_match_window_size: Some(
                a.speculative_ngram_max_match_window_size
                    .or(f.ngram_max_match_window_size)
                    .unwrap_or(d.max_match_window_size),
            ),
            ngram_min_bfs_breadth: Some(
                a.speculative_ngram_min_bfs_breadth
                    .or(f.ngram_min_bfs_breadth)
                    .unwrap_or(d.min_bfs_breadth),
            ),
            ngram_max_bfs_breadth: Some(
                a.speculative_ngram_max_bfs_breadth
                    .or(f.ngram_max_bfs_breadth)
                    .unwrap_or(d.max_bfs_breadth),
            ),
            ngram_match_type: Some(
                a.speculative_ngram_match_type
                    .clone()
                    .or(f.ngram_match_type)
                    .unwrap_or_else(|| "BFS".into()),
            ),
            ngram_max_trie_depth: Some(
                a.speculative_ngram_max_trie_depth
                    .or(f.ngram_max_trie_depth)
                    .unwrap_or(d.max_trie_depth),
            ),
            ngram_capacity: Some(
                a.speculative_ngram_capacity
                    .or(f.ngram_capacity)
                    .unwrap_or(d.capacity),
            ),
        }
    }

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
        c.validate()?;
        Ok(Some(c))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_override_file_and_bad_values_name_the_flag() {
        let file = SpeculativeSection {
            algorithm: Some("NGRAM".into()),
            num_draft_tokens: Some(4),
            ..Default::default()
        };
        let a = SpeculativeArgs {
            speculative_num_draft_tokens: Some(6),
            ..Default::default()
        };
        let s = SpeculativeSection::resolve(file.clone(), &a);
        assert_eq!(s.algorithm.as_deref(), Some("ngram"));
        assert_eq!(s.num_draft_tokens, Some(6));
        if cfg!(feature = "spec-decode") {
            let c = s.to_engine().expect("config").expect("on");
            assert_eq!(c.num_draft_tokens, 6);
            assert!(c.adaptive);
        }
        for bad in [0usize, 65] {
            let a = SpeculativeArgs {
                speculative_num_draft_tokens: Some(bad),
                ..Default::default()
            };
            let e = SpeculativeSection::resolve(file.clone(), &a)
                .to_engine()
                .expect_err("refused");
            assert!(e.to_string().contains("--speculative"), "{e}");
        }
        let a = SpeculativeArgs {
            speculative_algorithm: Some("EAGLE3".into()),
            ..Default::default()
        };
        let e = SpeculativeSection::resolve(file, &a)
            .to_engine()
            .expect_err("refused");
        assert!(e.to_string().contains("speculative"), "{e}");
        let off =
            SpeculativeSection::resolve(SpeculativeSection::default(), &SpeculativeArgs::default());
        assert!(off.to_engine().expect("off").is_none());
    }

    #[test]
    fn draft_paths_and_layers_go_with_their_algorithms() {
        let with = |algo: &str, path: bool, layers: Option<usize>| {
            let a = SpeculativeArgs {
                speculative_algorithm: Some(algo.into()),
                speculative_draft_model_path: path.then(|| "/models/draft".into()),
                speculative_draft_layers: layers,
                ..Default::default()
            };
            SpeculativeSection::resolve(SpeculativeSection::default(), &a).to_engine()
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
