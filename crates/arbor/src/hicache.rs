//! `[hicache]` and SGLang's `--enable-hierarchical-cache` / `--hicache-*`
//! flags (one struct: [`HiCacheSection`]) and the checked
//! [`HiCacheSettings`] the engine set-up builds the cache from.
//!
//! Off by default. Every error names the flag; a HiCache setting in a binary
//! built without the `kv-hicache` cargo feature is refused with a message
//! naming the feature.

use crate::settings::Section;
use anyhow::{Result, bail};
use clap::Args;
use serde::{Deserialize, Serialize};

/// `[hicache]` and the HiCache flags (SGLang's names): host-memory and
/// storage KV tiers (crates/kv-hicache). One declaration per setting
/// ([`crate::settings`]).
#[derive(Args, Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct HiCacheSection {
    /// Keep KV evicted from the device in host memory, and in storage when a backend is set.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", help_heading = "HiCache")]
    pub enable_hierarchical_cache: Option<bool>,
    /// Host pool size as a multiple of the device pool.
    #[arg(long, help_heading = "HiCache")]
    pub hicache_ratio: Option<f64>,
    /// Host pool size in GB; overrides --hicache-ratio when > 0.
    #[arg(long, help_heading = "HiCache")]
    pub hicache_size: Option<f64>,
    /// When device KV is copied to the host: write_through, write_through_selective or write_back.
    #[arg(long, help_heading = "HiCache")]
    pub hicache_write_policy: Option<String>,
    /// Storage tier under the host: file or redis [default: none].
    #[arg(long, help_heading = "HiCache")]
    pub hicache_storage_backend: Option<String>,
    /// JSON settings of the storage tier: '{"dir": "..."}' (file) or '{"url": "redis://host:port"}' (redis).
    #[arg(long, help_heading = "HiCache")]
    pub hicache_storage_backend_extra_config: Option<String>,
    /// When a request whose prefix is read from storage is admitted: best_effort, wait_complete or timeout.
    #[arg(long, help_heading = "HiCache")]
    pub hicache_storage_prefetch_policy: Option<String>,
}

impl Section for HiCacheSection {
    fn defaults() -> Self {
        Self {
            enable_hierarchical_cache: Some(false),
            hicache_ratio: Some(2.0),
            hicache_size: Some(0.0),
            hicache_write_policy: Some("write_through".into()),
            hicache_storage_backend: None,
            hicache_storage_backend_extra_config: None,
            hicache_storage_prefetch_policy: Some("best_effort".into()),
        }
    }
}

/// Checked HiCache settings.
#[derive(Clone, Debug, PartialEq)]
pub struct HiCacheSettings {
    /// Host pool size as a multiple of the device pool.
    pub ratio: f64,
    /// Host pool size in GB (0: use the ratio).
    pub size_gb: f64,
    /// A write policy name (checked).
    pub write_policy: String,
    /// A prefetch policy name (checked).
    pub prefetch_policy: String,
    /// The storage backend and its JSON settings.
    pub storage: Option<(String, Option<String>)>,
}

const WRITE_POLICIES: [&str; 3] = ["write_through", "write_through_selective", "write_back"];
const PREFETCH_POLICIES: [&str; 3] = ["best_effort", "wait_complete", "timeout"];
const BACKENDS: [&str; 2] = ["file", "redis"];

impl HiCacheSection {
    /// The storage backend given while HiCache is off: as in SGLang it then
    /// has no effect, and the start-up summary says so.
    pub fn storage_without_enable(&self) -> Option<&str> {
        if self.enable_hierarchical_cache.unwrap_or(false) {
            return None;
        }
        self.hicache_storage_backend
            .as_deref()
            .filter(|b| *b != "none")
    }

    /// The checked settings (`None` when off); errors name the flag.
    pub fn to_settings(&self, radix_disabled: bool) -> Result<Option<HiCacheSettings>> {
        if !self.enable_hierarchical_cache.unwrap_or(false) {
            return Ok(None);
        }
        if !cfg!(feature = "kv-hicache") {
            bail!(
                "--enable-hierarchical-cache: this binary was built without HiCache; rebuild \
                 arbor with the `kv-hicache` cargo feature"
            );
        }
        if radix_disabled {
            bail!("--enable-hierarchical-cache needs the radix cache: drop --disable-radix-cache");
        }
        let ratio = self.hicache_ratio.unwrap_or(2.0);
        if !(ratio.is_finite() && ratio > 0.0) {
            bail!("[hicache] hicache_ratio / --hicache-ratio must be positive, got {ratio}");
        }
        let size_gb = self.hicache_size.unwrap_or(0.0);
        if !(size_gb.is_finite() && size_gb >= 0.0) {
            bail!("[hicache] hicache_size / --hicache-size must be >= 0 GB, got {size_gb}");
        }
        let write_policy = self
            .hicache_write_policy
            .clone()
            .unwrap_or_else(|| "write_through".into());
        if !WRITE_POLICIES.contains(&write_policy.as_str()) {
            bail!(
                "[hicache] hicache_write_policy / --hicache-write-policy '{write_policy}' is not \
                 one of {}",
                WRITE_POLICIES.join(", ")
            );
        }
        let prefetch_policy = self
            .hicache_storage_prefetch_policy
            .clone()
            .unwrap_or_else(|| "best_effort".into());
        if !PREFETCH_POLICIES.contains(&prefetch_policy.as_str()) {
            bail!(
                "[hicache] hicache_storage_prefetch_policy / --hicache-storage-prefetch-policy \
                 '{prefetch_policy}' is not one of {}",
                PREFETCH_POLICIES.join(", ")
            );
        }
        let storage = match self.hicache_storage_backend.as_deref() {
            None | Some("none") => None,
            Some(b) if BACKENDS.contains(&b) => Some((
                b.to_string(),
                self.hicache_storage_backend_extra_config.clone(),
            )),
            Some(b) => bail!(
                "[hicache] hicache_storage_backend / --hicache-storage-backend '{b}' is not one \
                 of {}",
                BACKENDS.join(", ")
            ),
        };
        if storage.is_none() && self.hicache_storage_backend_extra_config.is_some() {
            bail!(
                "--hicache-storage-backend-extra-config needs --hicache-storage-backend file|redis"
            );
        }
        Ok(Some(HiCacheSettings {
            ratio,
            size_gb,
            write_policy,
            prefetch_policy,
            storage,
        }))
    }
}

#[cfg(feature = "kv-hicache")]
/// The model's identity for stored KV: its folder or file name, its
/// configuration, and a digest of the size, head and tail of each weight
/// file (two checkpoints of one architecture never share pages).
fn model_identity(model: &arbor_models::LoadedModel) -> String {
    use sha2::{Digest, Sha256};
    use std::io::{Read, Seek, SeekFrom};
    const SAMPLE: u64 = 1 << 20;
    let mut h = Sha256::new();
    h.update(model.config.to_string().as_bytes());
    let mut files: Vec<std::path::PathBuf> = if model.path.is_dir() {
        std::fs::read_dir(&model.path)
            .map(|d| {
                d.flatten()
                    .map(|e| e.path())
                    .filter(|p| {
                        p.extension()
                            .is_some_and(|x| x == "safetensors" || x == "gguf" || x == "bin")
                    })
                    .collect()
            })
            .unwrap_or_default()
    } else {
        vec![model.path.clone()]
    };
    files.sort();
    for f in files {
        let Ok(mut file) = std::fs::File::open(&f) else {
            continue;
        };
        let len = file.metadata().map(|m| m.len()).unwrap_or(0);
        h.update(len.to_le_bytes());
        let mut buf = Vec::new();
        let _ = (&mut file).take(SAMPLE).read_to_end(&mut buf);
        if len > 2 * SAMPLE && file.seek(SeekFrom::Start(len - SAMPLE)).is_ok() {
            let _ = file.take(SAMPLE).read_to_end(&mut buf);
        }
        h.update(&buf);
    }
    let name = model
        .path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let digest: [u8; 32] = h.finalize().into();
    let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    format!("{name}@{hex}")
}

/// Builds the HiCache prefix cache for a device pool of `kv`.
#[cfg(feature = "kv-hicache")]
pub fn build(
    s: &HiCacheSettings,
    kv: &arbor_engine_core::KvSpec,
    policy: std::sync::Arc<dyn arbor_engine_core::EvictionPolicy>,
    model: &arbor_models::LoadedModel,
    host_memory: Option<std::sync::Arc<dyn arbor_engine_core::HostMemory>>,
) -> Result<Box<dyn arbor_engine_core::PrefixCache>> {
    use anyhow::Context;
    use arbor_kv_hicache::{HiCache, HiCacheConfig, HiCacheOptions, PrefetchPolicy, WritePolicy};
    let defaults = HiCacheConfig::default();
    let config = HiCacheConfig {
        ratio: s.ratio,
        size_gb: s.size_gb,
        write_policy: WritePolicy::parse(&s.write_policy).context("--hicache-write-policy")?,
        prefetch_policy: PrefetchPolicy::parse(&s.prefetch_policy)
            .context("--hicache-storage-prefetch-policy")?,
        ..defaults
    };
    let identity = model_identity(model);
    let mut config = config;
    let storage = match &s.storage {
        None => None,
        Some((backend, extra)) => {
            use arbor_kv_hicache::storage::{StorageConfig, Store};
            let sc = StorageConfig::parse(backend, extra.as_deref())
                .context("--hicache-storage-backend-extra-config")?;
            config.prefetch_timeout_base =
                std::time::Duration::from_secs_f64(sc.prefetch_timeout_base);
            config.prefetch_timeout_per_ki_token =
                std::time::Duration::from_secs_f64(sc.prefetch_timeout_per_ki_token);
            config.prefetch_threshold = sc.prefetch_threshold;
            let tier = arbor_engine_core::TierIdentity::new(identity.clone(), kv);
            let store = Store::open(&sc, &tier)
                .with_context(|| format!("--hicache-storage-backend {backend}"))?;
            if let Store::File(f) = &store {
                // Temp files of a crashed write are never entries; sweep old ones.
                let _ = f.remove_stale_temps(std::time::Duration::from_secs(600));
            }
            let store: std::sync::Arc<dyn arbor_engine_core::KvTier> = std::sync::Arc::new(store);
            Some(store)
        }
    };
    let cache = HiCache::new(HiCacheOptions {
        kv: *kv,
        policy,
        model: identity,
        config,
        storage,
        host_memory,
    })
    .map_err(|e| match e {
        arbor_kv_hicache::HiCacheError::InvalidSetting { key, reason } => {
            let e = arbor_engine_core::CoreError::InvalidSetting { key, reason };
            crate::settings::named_setting(e, "hicache")
        }
        e => e.into(),
    })?;
    Ok(Box::new(cache))
}

/// Without the `kv-hicache` feature settings are refused before this is reached.
#[cfg(not(feature = "kv-hicache"))]
pub fn build(
    _s: &HiCacheSettings,
    _kv: &arbor_engine_core::KvSpec,
    _policy: std::sync::Arc<dyn arbor_engine_core::EvictionPolicy>,
    _model: &arbor_models::LoadedModel,
    _host_memory: Option<std::sync::Arc<dyn arbor_engine_core::HostMemory>>,
) -> Result<Box<dyn arbor_engine_core::PrefixCache>> {
    bail!("--enable-hierarchical-cache: rebuild arbor with the `kv-hicache` cargo feature")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_by_default_flags_override_and_errors_name_the_flag() {
        let off = crate::settings::layered(HiCacheSection::default(), &HiCacheSection::default());
        assert!(off.to_settings(false).expect("off").is_none());
        assert_eq!(off.storage_without_enable(), None);
        let storage_only = HiCacheSection {
            hicache_storage_backend: Some("redis".into()),
            ..Default::default()
        };
        let ignored = crate::settings::layered(HiCacheSection::default(), &storage_only);
        assert!(ignored.to_settings(false).expect("off").is_none());
        assert_eq!(ignored.storage_without_enable(), Some("redis"));
        let file = HiCacheSection {
            enable_hierarchical_cache: Some(true),
            hicache_ratio: Some(3.0),
            hicache_storage_backend: Some("file".into()),
            ..Default::default()
        };
        let a = HiCacheSection {
            hicache_ratio: Some(1.5),
            hicache_write_policy: Some("write_back".into()),
            ..Default::default()
        };
        let s = crate::settings::layered(file.clone(), &a);
        if cfg!(feature = "kv-hicache") {
            let h = s.to_settings(false).expect("valid").expect("on");
            assert_eq!(h.ratio, 1.5);
            assert_eq!(h.write_policy, "write_back");
            assert_eq!(h.storage, Some(("file".into(), None)));
            assert_eq!(s.storage_without_enable(), None);
            let e = s.to_settings(true).expect_err("needs the radix cache");
            assert!(e.to_string().contains("--disable-radix-cache"), "{e}");
        }
        for (a, flag) in [
            (
                HiCacheSection {
                    hicache_write_policy: Some("sometimes".into()),
                    ..Default::default()
                },
                "--hicache-write-policy",
            ),
            (
                HiCacheSection {
                    hicache_storage_backend: Some("s3".into()),
                    ..Default::default()
                },
                "--hicache-storage-backend",
            ),
            (
                HiCacheSection {
                    hicache_ratio: Some(0.0),
                    ..Default::default()
                },
                "--hicache-ratio",
            ),
            (
                HiCacheSection {
                    hicache_storage_prefetch_policy: Some("eager".into()),
                    ..Default::default()
                },
                "--hicache-storage-prefetch-policy",
            ),
        ] {
            let e = crate::settings::layered(file.clone(), &a)
                .to_settings(false)
                .expect_err("refused");
            let flag_or_feature = if cfg!(feature = "kv-hicache") {
                flag
            } else {
                "kv-hicache"
            };
            assert!(e.to_string().contains(flag_or_feature), "{e}");
        }
    }
}
