//! The adapters a server has loaded, by name.
//!
//! One registry per served model. Loading checks the adapter against the
//! model and the limits before it becomes visible; a name is taken once.
//! Unloading removes the name at once (new requests naming it are refused)
//! while requests already running keep their `Arc` to the weights, which
//! are freed when the last of them ends.

use crate::error::{LoraError, Result};
use crate::load::{LoraLimits, load_adapter_on};
use arbor_engine_core::{Backend, LoraAdapter, ModelSpec};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

/// A loaded adapter and where it came from.
#[derive(Clone, Debug)]
pub struct LoadedLora {
    /// The weights.
    pub adapter: Arc<LoraAdapter>,
    /// Its folder.
    pub path: PathBuf,
}

/// Adapters by name (see the module doc).
pub struct LoraRegistry {
    /// Per data-parallel replica, one device per tensor-parallel rank (one
    /// replica of one device without parallelism).
    replicas: Vec<Vec<Arc<dyn Backend>>>,
    spec: ModelSpec,
    limits: LoraLimits,
    max_loaded: Option<usize>,
    adapters: RwLock<BTreeMap<String, LoadedLora>>,
}

impl LoraRegistry {
    /// An empty registry for a model of `spec` on `backend`; at most
    /// `max_loaded` adapters at once (`None`: no bound).
    pub fn new(
        backend: Arc<dyn Backend>,
        spec: ModelSpec,
        limits: LoraLimits,
        max_loaded: Option<usize>,
    ) -> Self {
        Self::replicated(vec![vec![backend]], spec, limits, max_loaded)
    }

    /// An empty registry for a model of `spec` (the whole model's shape)
    /// served by several data-parallel replicas, `replicas[d]` replica
    /// `d`'s devices (one per tensor-parallel rank): each adapter is loaded
    /// once per replica ([`LoraAdapter::replicated`]), sharded over its
    /// ranks as [`LoraRegistry::sharded`] does.
    pub fn replicated(
        replicas: Vec<Vec<Arc<dyn Backend>>>,
        spec: ModelSpec,
        limits: LoraLimits,
        max_loaded: Option<usize>,
    ) -> Self {
        Self {
            replicas,
            spec,
            limits,
            max_loaded,
            adapters: RwLock::new(BTreeMap::new()),
        }
    }

    /// An empty registry for a model of `spec` (the whole model's shape)
    /// split over tensor-parallel ranks, `backends[r]` rank `r`'s device:
    /// each adapter is loaded as one shard per rank.
    pub fn sharded(
        backends: Vec<Arc<dyn Backend>>,
        spec: ModelSpec,
        limits: LoraLimits,
        max_loaded: Option<usize>,
    ) -> Self {
        Self::replicated(vec![backends], spec, limits, max_loaded)
    }

    /// The limits adapters are checked against.
    pub fn limits(&self) -> &LoraLimits {
        &self.limits
    }

    /// Bounds the rank of adapters loaded from now on (before the registry
    /// is shared: the start-up adapters' largest rank bounds later loads).
    pub fn set_max_rank(&mut self, max_rank: Option<usize>) {
        self.limits.max_rank = max_rank;
    }

    /// Loads the adapter in `dir` as `name`.
    pub fn load(&self, name: &str, dir: &Path) -> Result<Arc<LoraAdapter>> {
        check_name(name)?;
        if self.read().contains_key(name) {
            return Err(LoraError::AlreadyLoaded(name.to_string()));
        }
        let mut copies = self
            .replicas
            .iter()
            .map(|devices| {
                let backends: Vec<&(dyn Backend + 'static)> =
                    devices.iter().map(|b| &**b).collect();
                load_adapter_on(name, dir, &self.spec, &backends, &self.limits)
            })
            .collect::<Result<Vec<_>>>()?;
        let adapter = Arc::new(if copies.len() == 1 {
            copies.remove(0)
        } else {
            let digest = copies[0].digest().to_string();
            LoraAdapter::replicated(name, &digest, copies).map_err(|e| LoraError::Device {
                name: name.to_string(),
                source: e,
            })?
        });
        let mut map = self.adapters.write().unwrap_or_else(|e| e.into_inner());
        if map.contains_key(name) {
            return Err(LoraError::AlreadyLoaded(name.to_string()));
        }
        if let Some(m) = self.max_loaded
            && map.len() >= m
        {
            return Err(LoraError::Limit {
                name: name.to_string(),
                setting: "max_loaded_loras",
                msg: format!("{m} adapters are loaded already (max_loaded_loras {m})"),
            });
        }
        tracing::info!(
            "LoRA adapter '{name}' loaded from {}: rank {}, {} on {:?}",
            dir.display(),
            adapter.rank(),
            adapter.bytes(),
            adapter
                .targets()
                .iter()
                .map(|t| t.module())
                .collect::<Vec<_>>()
        );
        map.insert(
            name.to_string(),
            LoadedLora {
                adapter: adapter.clone(),
                path: dir.to_path_buf(),
            },
        );
        Ok(adapter)
    }

    /// Removes `name`; running requests keep their weights until they end.
    pub fn unload(&self, name: &str) -> Result<()> {
        let mut map = self.adapters.write().unwrap_or_else(|e| e.into_inner());
        match map.remove(name) {
            Some(_) => Ok(()),
            None => Err(not_loaded(name, &map)),
        }
    }

    /// The adapter named `name`.
    pub fn get(&self, name: &str) -> Result<Arc<LoraAdapter>> {
        let map = self.read();
        map.get(name)
            .map(|l| l.adapter.clone())
            .ok_or_else(|| not_loaded(name, &map))
    }

    /// Every loaded adapter, by name.
    pub fn list(&self) -> Vec<(String, LoadedLora)> {
        self.read()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<String, LoadedLora>> {
        self.adapters.read().unwrap_or_else(|e| e.into_inner())
    }
}

fn not_loaded(name: &str, map: &BTreeMap<String, LoadedLora>) -> LoraError {
    let loaded = if map.is_empty() {
        "none".to_string()
    } else {
        map.keys().cloned().collect::<Vec<_>>().join(", ")
    };
    LoraError::NotLoaded {
        name: name.to_string(),
        loaded,
    }
}

/// Names are what requests and `model` fields carry: not empty, no spaces,
/// no `:` (the OpenAI `model` field splits `base:adapter` at it).
fn check_name(name: &str) -> Result<()> {
    if name.is_empty() || name.contains(':') || name.chars().any(char::is_whitespace) {
        return Err(LoraError::Invalid {
            name: name.to_string(),
            msg: "an adapter name must be non-empty, without spaces or ':'".into(),
        });
    }
    Ok(())
}
