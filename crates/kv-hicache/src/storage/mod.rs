//! Storage backends of the HiCache's third tier (L3), below host memory.
//!
//! - [`entry`]: the stored form of a page (header with identity digest, key,
//!   length and checksum, then the page), the same for every backend.
//! - [`file`](mod@file): [`FileStore`], one file per page under a directory.
//! - [`redis`]: [`RedisStore`], pages as values in a redis server.
//! - [`StorageConfig`]: SGLang's `--hicache-storage-backend` and
//!   `--hicache-storage-backend-extra-config`, parsed; [`open_store`] opens
//!   the store they name.
//!
//! Invariants: every store implements engine-core's [`KvTier`]: it returns a
//! page only when its entry decodes for this store's identity and key, it
//! writes each entry whole or not at all, and it never panics on I/O.
//! Unknown backends and unknown extra-config keys are errors naming them.

pub mod entry;
pub mod file;
pub mod redis;

pub use entry::{EntryCodec, EntryError};
pub use file::FileStore;
pub use redis::RedisStore;

use arbor_engine_core::{KvTier, PageKey, TierError, TierIdentity};
use serde_json::{Map, Value};
use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// The backends `--hicache-storage-backend` accepts.
pub const BACKENDS: &[&str] = &["file", "redis"];

/// The redis URL used when the extra config names none.
pub const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379";

/// Which store, and its settings.
#[derive(Clone, Debug, PartialEq)]
pub enum StorageBackend {
    /// [`FileStore`] under `dir` (extra config `{"dir": "...", "fsync": false}`).
    File {
        /// The directory (identity folders are made under it).
        dir: PathBuf,
        /// fsync each entry before it counts as written.
        fsync: bool,
    },
    /// [`RedisStore`] at `url` (extra config `{"url": "redis://...", "timeout": 2.0}`).
    Redis {
        /// `redis://[user:password@]host:port[/db]`.
        url: String,
        /// Connect, read and write timeout.
        timeout: Duration,
    },
}

/// The L3 storage settings (see the module doc).
#[derive(Clone, Debug, PartialEq)]
pub struct StorageConfig {
    /// The store.
    pub backend: StorageBackend,
    /// SGLang's `prefetch_threshold`: tokens a storage hit must cover to be prefetched (256).
    pub prefetch_threshold: usize,
    /// SGLang's `prefetch_timeout_base`: seconds a prefetch may take before its per-token share (1).
    pub prefetch_timeout_base: f64,
    /// SGLang's `prefetch_timeout_per_ki_token`: seconds more per 1024 tokens prefetched (0.25).
    pub prefetch_timeout_per_ki_token: f64,
}

/// Keys every backend's extra config accepts.
const COMMON_KEYS: &[&str] = &[
    "prefetch_threshold",
    "prefetch_timeout_base",
    "prefetch_timeout_per_ki_token",
];

fn nonempty_env(name: &str) -> Option<PathBuf> {
    std::env::var_os(name)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// The file store's directory when the extra config names none:
/// `$ARBOR_HOME/hicache`, else `$XDG_CACHE_HOME/arbor/hicache`, else
/// `~/.cache/arbor/hicache`.
pub fn default_file_dir() -> Option<PathBuf> {
    if let Some(home) = nonempty_env("ARBOR_HOME") {
        return Some(home.join("hicache"));
    }
    if let Some(cache) = nonempty_env("XDG_CACHE_HOME") {
        return Some(cache.join("arbor").join("hicache"));
    }
    nonempty_env("HOME").map(|h| h.join(".cache").join("arbor").join("hicache"))
}

fn config_err(msg: impl fmt::Display) -> TierError {
    TierError::Config(format!("extra config: {msg}"))
}

fn seconds(key: &str, v: &Value) -> Result<f64, TierError> {
    match v.as_f64() {
        Some(s) if s.is_finite() && s >= 0.0 => Ok(s),
        _ => Err(config_err(format!(
            "`{key}` must be a non-negative number of seconds, got {v}"
        ))),
    }
}

fn string(key: &str, v: &Value) -> Result<String, TierError> {
    v.as_str()
        .map(str::to_owned)
        .ok_or_else(|| config_err(format!("`{key}` must be a string, got {v}")))
}

impl StorageConfig {
    /// Parses `--hicache-storage-backend` (`backend`) and
    /// `--hicache-storage-backend-extra-config` (`extra`: a JSON object, or
    /// `@path` of a file holding one; `None` or empty: defaults).
    pub fn parse(backend: &str, extra: Option<&str>) -> Result<Self, TierError> {
        let backend_keys: &[&str] = match backend {
            "file" => &["dir", "fsync"],
            "redis" => &["url", "timeout"],
            other => {
                return Err(TierError::Config(format!(
                    "storage backend {other:?} is not supported (valid: {})",
                    BACKENDS.join(", ")
                )));
            }
        };
        let obj = parse_object(extra)?;
        for key in obj.keys() {
            if !backend_keys.contains(&key.as_str()) && !COMMON_KEYS.contains(&key.as_str()) {
                let mut valid: Vec<&str> = backend_keys.to_vec();
                valid.extend_from_slice(COMMON_KEYS);
                return Err(config_err(format!(
                    "unknown key `{key}` for storage backend {backend} (valid: {})",
                    valid.join(", ")
                )));
            }
        }
        let mut cfg = StorageConfig {
            backend: match backend {
                "file" => {
                    let dir = match obj.get("dir") {
                        Some(v) => PathBuf::from(string("dir", v)?),
                        None => default_file_dir().ok_or_else(|| {
                            config_err(
                                "no `dir` given and no ARBOR_HOME, XDG_CACHE_HOME or HOME to default it",
                            )
                        })?,
                    };
                    let fsync = match obj.get("fsync") {
                        None => false,
                        Some(v) => v.as_bool().ok_or_else(|| {
                            config_err(format!("`fsync` must be true or false, got {v}"))
                        })?,
                    };
                    StorageBackend::File { dir, fsync }
                }
                _ => {
                    let url = match obj.get("url") {
                        Some(v) => string("url", v)?,
                        None => DEFAULT_REDIS_URL.to_owned(),
                    };
                    let timeout = match obj.get("timeout") {
                        None => RedisStore::DEFAULT_TIMEOUT,
                        Some(v) => {
                            let s = seconds("timeout", v)?;
                            if s == 0.0 {
                                return Err(config_err("`timeout` must be above zero"));
                            }
                            Duration::from_secs_f64(s)
                        }
                    };
                    StorageBackend::Redis { url, timeout }
                }
            },
            prefetch_threshold: 256,
            prefetch_timeout_base: 1.0,
            prefetch_timeout_per_ki_token: 0.25,
        };
        if let Some(v) = obj.get("prefetch_threshold") {
            cfg.prefetch_threshold = v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| {
                    config_err(format!(
                        "`prefetch_threshold` must be a non-negative integer, got {v}"
                    ))
                })?;
        }
        if let Some(v) = obj.get("prefetch_timeout_base") {
            cfg.prefetch_timeout_base = seconds("prefetch_timeout_base", v)?;
        }
        if let Some(v) = obj.get("prefetch_timeout_per_ki_token") {
            cfg.prefetch_timeout_per_ki_token = seconds("prefetch_timeout_per_ki_token", v)?;
        }
        Ok(cfg)
    }

    /// The registered name of the backend (`file`, `redis`).
    pub fn backend_name(&self) -> &'static str {
        match self.backend {
            StorageBackend::File { .. } => "file",
            StorageBackend::Redis { .. } => "redis",
        }
    }

    /// How long a prefetch of `tokens` tokens may take (SGLang's linear
    /// timeout: base + per_ki_token × tokens / 1024).
    pub fn prefetch_timeout(&self, tokens: usize) -> Duration {
        let s = self.prefetch_timeout_base
            + self.prefetch_timeout_per_ki_token * tokens as f64 / 1024.0;
        Duration::try_from_secs_f64(s).unwrap_or(Duration::MAX)
    }
}

fn parse_object(extra: Option<&str>) -> Result<Map<String, Value>, TierError> {
    let text = match extra.map(str::trim) {
        None | Some("") => return Ok(Map::new()),
        Some(t) => match t.strip_prefix('@') {
            Some(path) => std::fs::read_to_string(path)
                .map_err(|e| config_err(format!("cannot read {path}: {e}")))?,
            None => t.to_owned(),
        },
    };
    match serde_json::from_str::<Value>(&text) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(other) => Err(config_err(format!("expected a JSON object, got {other}"))),
        Err(e) => Err(config_err(format!("invalid JSON: {e}"))),
    }
}

/// An opened store of either backend; use it where the backend's counters
/// are wanted, else [`open_store`]'s `Arc<dyn KvTier>`.
#[derive(Debug)]
pub enum Store {
    /// A [`FileStore`].
    File(FileStore),
    /// A [`RedisStore`].
    Redis(Box<RedisStore>),
}

impl Store {
    /// Opens the store `config` names for `identity`'s pages.
    pub fn open(config: &StorageConfig, identity: &TierIdentity) -> Result<Self, TierError> {
        Ok(match &config.backend {
            StorageBackend::File { dir, fsync } => {
                Store::File(FileStore::open(dir, identity)?.with_fsync(*fsync))
            }
            StorageBackend::Redis { url, timeout } => Store::Redis(Box::new(
                RedisStore::connect_with_timeout(url, identity, *timeout)?,
            )),
        })
    }

    /// Damaged entries the store removed so far.
    pub fn corrupt_removed(&self) -> u64 {
        match self {
            Store::File(s) => s.corrupt_removed(),
            Store::Redis(s) => s.corrupt_removed(),
        }
    }

    fn tier(&self) -> &dyn KvTier {
        match self {
            Store::File(s) => s,
            Store::Redis(s) => s.as_ref(),
        }
    }
}

impl KvTier for Store {
    fn name(&self) -> &str {
        self.tier().name()
    }
    fn exists(&self, keys: &[PageKey]) -> Result<Vec<bool>, TierError> {
        self.tier().exists(keys)
    }
    fn get(&self, keys: &[PageKey]) -> Result<Vec<Option<Vec<u8>>>, TierError> {
        self.tier().get(keys)
    }
    fn set(&self, entries: &[(PageKey, &[u8])]) -> Result<(), TierError> {
        self.tier().set(entries)
    }
    fn clear(&self) -> Result<(), TierError> {
        self.tier().clear()
    }
    fn corrupt_removed(&self) -> u64 {
        Store::corrupt_removed(self)
    }
}

/// Opens the store `config` names for `identity`'s pages.
pub fn open_store(
    config: &StorageConfig,
    identity: &TierIdentity,
) -> Result<Arc<dyn KvTier>, TierError> {
    Ok(Arc::new(Store::open(config, identity)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sglang_flags() {
        let c = StorageConfig::parse(
            "file",
            Some(r#"{"dir": "/x/y", "prefetch_timeout_base": 0.5}"#),
        )
        .expect("valid");
        assert_eq!(
            c.backend,
            StorageBackend::File {
                dir: "/x/y".into(),
                fsync: false
            }
        );
        assert_eq!(c.prefetch_timeout_base, 0.5);
        assert_eq!(c.prefetch_timeout_per_ki_token, 0.25);
        assert_eq!(c.prefetch_threshold, 256);
        assert_eq!(c.prefetch_timeout(2048), Duration::from_secs(1));

        let c = StorageConfig::parse("redis", None).expect("defaults");
        assert_eq!(
            c.backend,
            StorageBackend::Redis {
                url: DEFAULT_REDIS_URL.into(),
                timeout: RedisStore::DEFAULT_TIMEOUT
            }
        );
        let c = StorageConfig::parse(
            "redis",
            Some(r#"{"url": "redis://h:1", "timeout": 0.25, "prefetch_threshold": 64, "prefetch_timeout_per_ki_token": 1}"#),
        )
        .expect("valid");
        assert_eq!(
            c.backend,
            StorageBackend::Redis {
                url: "redis://h:1".into(),
                timeout: Duration::from_millis(250)
            }
        );
        assert_eq!(c.prefetch_threshold, 64);
        assert_eq!(c.prefetch_timeout_per_ki_token, 1.0);
        assert_eq!(c.backend_name(), "redis");

        let err = |b: &str, x: Option<&str>| match StorageConfig::parse(b, x) {
            Err(TierError::Config(m)) => m,
            other => panic!("{b} {x:?}: {other:?}"),
        };
        let m = err("mooncake", None);
        assert!(
            m.contains("storage backend \"mooncake\"") && m.contains("file, redis"),
            "{m}"
        );
        let m = err("file", Some(r#"{"url": "redis://x"}"#));
        assert!(m.contains("`url`") && m.contains("dir"), "{m}");
        let m = err("redis", Some(r#"{"dirr": 1}"#));
        assert!(m.contains("`dirr`"), "{m}");
        let m = err("redis", Some("[1]"));
        assert!(m.contains("JSON object"), "{m}");
        let m = err("redis", Some("{"));
        assert!(m.contains("invalid JSON"), "{m}");
        let m = err("redis", Some(r#"{"timeout": -1}"#));
        assert!(m.contains("timeout"), "{m}");
        let m = err("file", Some(r#"{"prefetch_threshold": 1.5}"#));
        assert!(m.contains("prefetch_threshold"), "{m}");
    }
}
