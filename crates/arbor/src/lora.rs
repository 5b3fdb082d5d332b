//! `[lora]` and SGLang's LoRA flags (`--enable-lora`, `--lora-paths`,
//! `--max-loras-per-batch`, `--max-lora-rank`, `--lora-target-modules`,
//! `--max-loaded-loras`): the TOML section, the flags, their merge
//! (defaults < TOML < flags), the checked [`LoraSettings`], and the
//! registry built from them with the start-up adapters loaded.
//!
//! Off by default; `--lora-paths` turns it on (as in SGLang). An adapter is
//! given as `name=path`, as a bare `path` (named after its folder), or as
//! SGLang's JSON `{"lora_name": ..., "lora_path": ..., "pinned": ...}`.
//! Errors name the flag (an adapter over a limit: the limit's key and flag).

use crate::settings::Section;
use anyhow::{Context, Result, bail};
use arbor_engine_core::{Backend, LoraTarget, ModelSpec};
use arbor_lora::{LoraError, LoraLimits, LoraRegistry};
use clap::Args;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::sync::Arc;

/// `[lora]` and the LoRA flags (SGLang's names): multi-LoRA serving
/// (crates/lora). One declaration per setting ([`crate::settings`]).
#[derive(Args, Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LoraSection {
    /// Serve LoRA adapters (requests name them in lora_path or as model "base:adapter"); on when lora_paths is set.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", help_heading = "LoRA")]
    pub enable_lora: Option<bool>,
    /// Adapters to load at start-up: name=path, path, or '{"lora_name":..,"lora_path":..}' (repeatable).
    #[arg(long, num_args = 1.., help_heading = "LoRA")]
    pub lora_paths: Option<Vec<String>>,
    /// Most distinct adapters in one step, the base model counting as one.
    #[arg(long, help_heading = "LoRA")]
    pub max_loras_per_batch: Option<usize>,
    /// Largest adapter rank accepted [default: the largest start-up adapter's; any when none].
    #[arg(long, help_heading = "LoRA")]
    pub max_lora_rank: Option<usize>,
    /// Modules adapters may target: all, or some of q_proj k_proj v_proj o_proj gate_proj up_proj down_proj.
    #[arg(long, num_args = 1.., help_heading = "LoRA")]
    pub lora_target_modules: Option<Vec<String>>,
    /// Most adapters loaded at once [default: no bound].
    #[arg(long, help_heading = "LoRA")]
    pub max_loaded_loras: Option<usize>,
}

impl Section for LoraSection {
    fn defaults() -> Self {
        Self {
            enable_lora: Some(false),
            max_loras_per_batch: Some(8),
            ..Default::default()
        }
    }

    fn settle(&mut self) {
        if self.lora_paths.as_ref().is_some_and(|p| !p.is_empty()) {
            self.enable_lora = Some(true);
        }
    }
}

/// Checked LoRA settings.
#[derive(Clone, Debug, PartialEq)]
pub struct LoraSettings {
    /// Start-up adapters (name, folder).
    pub adapters: Vec<(String, PathBuf)>,
    /// Most distinct adapters per step.
    pub max_loras_per_batch: usize,
    /// Largest rank (`None`: the largest start-up adapter's, else any).
    pub max_rank: Option<usize>,
    /// Allowed targets (`None`: all).
    pub targets: Option<Vec<LoraTarget>>,
    /// Most adapters loaded at once.
    pub max_loaded: Option<usize>,
}

impl LoraSection {
    /// The checked settings (`None` when off); errors name the flag.
    pub fn to_settings(&self) -> Result<Option<LoraSettings>> {
        let max_per_batch = self.max_loras_per_batch.unwrap_or(8);
        if max_per_batch == 0 {
            bail!("[lora] max_loras_per_batch / --max-loras-per-batch must be at least 1");
        }
        if !self.enable_lora.unwrap_or(false) {
            return Ok(None);
        }
        if self.max_lora_rank == Some(0) {
            bail!("[lora] max_lora_rank / --max-lora-rank must be at least 1");
        }
        if self.max_loaded_loras == Some(0) {
            bail!("[lora] max_loaded_loras / --max-loaded-loras must be at least 1");
        }
        let targets = match &self.lora_target_modules {
            None => None,
            Some(m) if m.iter().any(|x| x == "all" || x == "all-linear") => None,
            Some(m) => Some(
                m.iter()
                    .map(|x| {
                        LoraTarget::from_module(x).with_context(|| {
                            format!(
                                "[lora] lora_target_modules / --lora-target-modules: unknown module '{x}' \
                                 (all, q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)"
                            )
                        })
                    })
                    .collect::<Result<Vec<_>>>()?,
            ),
        };
        let mut adapters: Vec<(String, PathBuf)> = Vec::new();
        for spec in self.lora_paths.iter().flatten() {
            let (name, path) = parse_adapter(spec)?;
            if adapters.iter().any(|(n, _)| *n == name) {
                bail!("[lora] lora_paths / --lora-paths: the name '{name}' is given twice");
            }
            adapters.push((name, path));
        }
        Ok(Some(LoraSettings {
            adapters,
            max_loras_per_batch: max_per_batch,
            max_rank: self.max_lora_rank,
            targets,
            max_loaded: self.max_loaded_loras,
        }))
    }
}

/// One `--lora-paths` entry: `name=path`, `path`, or SGLang's JSON object.
fn parse_adapter(spec: &str) -> Result<(String, PathBuf)> {
    let spec = spec.trim();
    let flag = "[lora] lora_paths / --lora-paths";
    if spec.starts_with('{') {
        let v: serde_json::Value =
            serde_json::from_str(spec).with_context(|| format!("{flag}: '{spec}' is not JSON"))?;
        let field = |k: &str| {
            v.get(k)
                .and_then(serde_json::Value::as_str)
                .map(str::to_string)
                .with_context(|| format!("{flag}: '{spec}' has no string '{k}'"))
        };
        return Ok((field("lora_name")?, PathBuf::from(field("lora_path")?)));
    }
    let (name, path) = match spec.split_once('=') {
        Some((n, p)) => (n.to_string(), PathBuf::from(p)),
        None => {
            let p = PathBuf::from(spec);
            let n = p
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .with_context(|| format!("{flag}: cannot name the adapter at '{spec}'"))?;
            (n, p)
        }
    };
    if name.is_empty() || path.as_os_str().is_empty() {
        bail!("{flag}: '{spec}' must be name=path or a path");
    }
    Ok((name, path))
}

/// The registry with the start-up adapters loaded. Without `--max-lora-rank`
/// the largest start-up adapter's rank bounds adapters loaded later (as
/// SGLang sizes its pool); with no start-up adapter any rank is accepted.
///
/// With tensor parallelism `rank_backends` holds every rank's device and
/// `spec` is rank 0's shard: adapters are loaded as one shard per rank,
/// against the whole model's shape.
pub fn build(
    s: &LoraSettings,
    replicas: Vec<Vec<Arc<dyn Backend>>>,
    spec: &ModelSpec,
) -> Result<Arc<LoraRegistry>> {
    let limits = LoraLimits {
        max_rank: s.max_rank,
        targets: s.targets.clone(),
    };
    // `spec` is one rank's shard: the adapters are checked against the whole model.
    let world = replicas.first().map_or(1, Vec::len);
    let whole = spec.for_group(world, spec.weight_bytes * world as u64);
    let mut registry = LoraRegistry::replicated(replicas, whole, limits, s.max_loaded);
    let mut largest = 0;
    for (name, path) in &s.adapters {
        let adapter = registry.load(name, path).map_err(|e| match e {
            // A limit names its setting as the binary takes it.
            LoraError::Limit { setting, .. } => {
                anyhow::anyhow!("{}: {e}", crate::settings::setting_name("lora", setting))
            }
            e => anyhow::Error::from(e).context("--lora-paths"),
        })?;
        largest = largest.max(adapter.rank());
    }
    if s.max_rank.is_none() && !s.adapters.is_empty() {
        registry.set_max_rank(Some(largest));
    }
    Ok(Arc::new(registry))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_flags_and_errors() {
        assert_eq!(
            parse_adapter("a=/x/y").unwrap_or_default(),
            ("a".into(), "/x/y".into())
        );
        assert_eq!(
            parse_adapter("/x/sql-lora").unwrap_or_default(),
            ("sql-lora".into(), "/x/sql-lora".into())
        );
        assert_eq!(
            parse_adapter(r#"{"lora_name": "b", "lora_path": "/p", "pinned": true}"#)
                .unwrap_or_default(),
            ("b".into(), "/p".into())
        );
        let a = LoraSection {
            lora_paths: Some(vec!["a=/x".into()]),
            ..Default::default()
        };
        let s = crate::settings::layered(LoraSection::default(), &a);
        assert_eq!(s.enable_lora, Some(true), "--lora-paths turns LoRA on");
        let st = s.to_settings().ok().flatten();
        assert_eq!(st.map(|s| s.max_loras_per_batch), Some(8));
        let bad = LoraSection {
            enable_lora: Some(true),
            lora_target_modules: Some(vec!["lm_head".into()]),
            ..Default::default()
        };
        let e = bad
            .to_settings()
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            e.contains("--lora-target-modules") && e.contains("lm_head"),
            "{e}"
        );
        let twice = LoraSection {
            enable_lora: Some(true),
            lora_paths: Some(vec!["a=/x".into(), "a=/y".into()]),
            ..Default::default()
        };
        let e = twice
            .to_settings()
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("'a' is given twice"), "{e}");
    }
}
