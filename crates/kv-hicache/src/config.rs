//! HiCache settings (SGLang's `--hicache-*` flags) and their checks.
//!
//! Invariant: a [`HiCacheConfig`] that passed [`HiCacheConfig::validate`]
//! sizes a host pool of at least one page and names known policies; every
//! error names the flag it comes from.

use arbor_engine_core::{KvSpec, TierIdentity};
use arbor_kv_radix::WritePolicy;
use std::time::Duration;

/// When a request whose prefix is being fetched from storage is admitted
/// (`--hicache-storage-prefetch-policy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefetchPolicy {
    /// At once; pages that arrive later serve later requests.
    BestEffort,
    /// Once the fetch finished (or failed).
    WaitComplete,
    /// Once the fetch finished, or after its timeout.
    Timeout,
}

impl PrefetchPolicy {
    /// The flag values.
    pub const NAMES: [&'static str; 3] = ["best_effort", "wait_complete", "timeout"];

    /// Parses a flag value.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "best_effort" => Some(Self::BestEffort),
            "wait_complete" => Some(Self::WaitComplete),
            "timeout" => Some(Self::Timeout),
            _ => None,
        }
    }
}

/// Errors of the HiCache settings and set-up.
#[derive(Debug, thiserror::Error)]
pub enum HiCacheError {
    /// The tiers could not be set up; the message says why.
    #[error("{0}")]
    Config(String),
    /// A setting is out of range: `key` is its configuration name
    /// (`hicache_ratio`); the binary adds where it was given. `reason`
    /// completes a sentence that starts with it.
    #[error("{key} {reason}")]
    InvalidSetting { key: &'static str, reason: String },
    /// The radix cache refused the tiers.
    #[error("hicache: {0}")]
    Radix(#[from] arbor_kv_radix::RadixError),
    /// The storage tier could not be opened.
    #[error("hicache storage: {0}")]
    Storage(#[from] arbor_engine_core::TierError),
}

/// The HiCache's settings.
#[derive(Clone, Debug)]
pub struct HiCacheConfig {
    /// Host pool size as a multiple of the device pool (`--hicache-ratio`).
    pub ratio: f64,
    /// Host pool size in GB (`--hicache-size`); overrides the ratio when > 0.
    pub size_gb: f64,
    /// When device KV is copied to the host (`--hicache-write-policy`).
    pub write_policy: WritePolicy,
    /// When a request waiting on a storage fetch is admitted.
    pub prefetch_policy: PrefetchPolicy,
    /// `timeout` policy: base wait (SGLang's `prefetch_timeout_base`).
    pub prefetch_timeout_base: Duration,
    /// `timeout` policy: extra wait per 1,024 tokens fetched
    /// (`prefetch_timeout_per_ki_token`).
    pub prefetch_timeout_per_ki_token: Duration,
    /// Fewest tokens a storage hit must cover to be fetched (`prefetch_threshold`).
    pub prefetch_threshold: usize,
}

impl Default for HiCacheConfig {
    fn default() -> Self {
        Self {
            ratio: 2.0,
            size_gb: 0.0,
            write_policy: WritePolicy::WriteThrough,
            prefetch_policy: PrefetchPolicy::BestEffort,
            prefetch_timeout_base: Duration::from_secs(1),
            prefetch_timeout_per_ki_token: Duration::from_millis(250),
            prefetch_threshold: 256,
        }
    }
}

impl HiCacheConfig {
    /// Checks the values.
    pub fn validate(&self) -> Result<(), HiCacheError> {
        if !self.ratio.is_finite() || self.ratio <= 0.0 {
            return Err(HiCacheError::InvalidSetting {
                key: "hicache_ratio",
                reason: format!("must be positive (got {})", self.ratio),
            });
        }
        if !self.size_gb.is_finite() || self.size_gb < 0.0 {
            return Err(HiCacheError::InvalidSetting {
                key: "hicache_size",
                reason: format!(
                    "must be 0 (use the ratio) or a positive size in GB (got {})",
                    self.size_gb
                ),
            });
        }
        Ok(())
    }

    /// Host pages for a device pool of `kv`: `--hicache-size` GB, else ratio × device pages.
    pub fn host_pages(&self, kv: &KvSpec) -> Result<usize, HiCacheError> {
        self.validate()?;
        let page_bytes = TierIdentity::new("", kv).page_bytes().max(1);
        let pages = if self.size_gb > 0.0 {
            (self.size_gb * 1e9 / page_bytes as f64) as usize
        } else {
            (self.ratio * kv.num_pages as f64) as usize
        };
        if pages == 0 {
            return Err(HiCacheError::InvalidSetting {
                key: if self.size_gb > 0.0 {
                    "hicache_size"
                } else {
                    "hicache_ratio"
                },
                reason: format!("leaves the host tier no page of {page_bytes} bytes: raise it"),
            });
        }
        Ok(pages)
    }

    /// How long the `timeout` policy waits for a fetch of `tokens`.
    pub fn prefetch_timeout(&self, tokens: usize) -> Duration {
        self.prefetch_timeout_base
            + self
                .prefetch_timeout_per_ki_token
                .mul_f64(tokens as f64 / 1024.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arbor_engine_core::DType;

    #[test]
    fn sizes_and_errors_name_the_flag() {
        let kv = KvSpec {
            num_layers: 2,
            num_kv_heads: 2,
            head_dim: 8,
            page_size: 4,
            num_pages: 10,
            dtype: DType::F32,
            values_in_keys: false,
        };
        let c = HiCacheConfig::default();
        assert_eq!(c.host_pages(&kv).ok(), Some(20));
        let page = 2 * 2 * 4 * 2 * 8 * 4;
        let sized = HiCacheConfig {
            size_gb: 1e-9 * 3.0 * page as f64,
            ..HiCacheConfig::default()
        };
        assert_eq!(sized.host_pages(&kv).ok(), Some(3));
        let bad = HiCacheConfig {
            ratio: 0.0,
            ..HiCacheConfig::default()
        };
        let e = bad
            .host_pages(&kv)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("hicache_ratio must be positive"), "{e}");
        assert_eq!(
            PrefetchPolicy::parse("timeout"),
            Some(PrefetchPolicy::Timeout)
        );
        assert_eq!(PrefetchPolicy::parse("soon"), None);
        assert!(c.prefetch_timeout(2048) > c.prefetch_timeout(0));
    }
}
