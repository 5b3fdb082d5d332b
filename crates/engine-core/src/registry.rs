//! The registry of named implementations.
//!
//! Built-in implementations register next to their code with
//! `inventory::submit!` (one of the `*Entry` types here); dynamic plugins add
//! theirs at run time through [`Registry::add`]-style methods. A [`Registry`]
//! is built once at start-up; it refuses two implementations of one kind with
//! the same name, and lists everything for `arbor info`.
//!
//! A crate that only calls `submit!` must be referenced from the final binary
//! (`use arbor_kv_radix as _;`) or the linker drops its entries.

use crate::backend::{Backend, BackendOptions};
use crate::comm::DeviceGroup;
use crate::error::{CoreError, Result};
use crate::grammar::{GrammarBackend, GrammarBackendConfig};
use crate::kv::prefix_cache::{EvictionPolicy, PrefixCache, PrefixCacheOptions};
use crate::model::ModelArchitecture;
use crate::model::quant::{QuantInit, QuantMethod};
use crate::sampling::{LogitsProcessor, Sampler};
use crate::speculative::{SpeculativeConfig, Speculator, SpeculatorInputs};
use std::collections::BTreeMap;
use std::sync::Arc;

/// Where an implementation comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Origin {
    /// Compiled in and registered with `inventory`.
    Builtin,
    /// Loaded from a dynamic library at this path.
    Plugin(String),
}

/// One registered implementation.
pub struct Item<F> {
    /// One line describing it.
    pub about: String,
    /// Where it comes from.
    pub origin: Origin,
    /// Creates an instance.
    pub factory: F,
}

/// All implementations of one kind, by name.
pub struct Kind<F> {
    kind: &'static str,
    items: BTreeMap<String, Item<F>>,
}

impl<F> Kind<F> {
    fn new(kind: &'static str) -> Self {
        Self {
            kind,
            items: BTreeMap::new(),
        }
    }
    /// Adds an implementation; refuses a name already taken.
    pub fn add(&mut self, name: &str, about: &str, origin: Origin, factory: F) -> Result<()> {
        if self.items.contains_key(name) {
            return Err(CoreError::DuplicateRegistration {
                kind: self.kind,
                name: name.to_string(),
            });
        }
        self.items.insert(
            name.to_string(),
            Item {
                about: about.to_string(),
                origin,
                factory,
            },
        );
        Ok(())
    }
    /// The implementation named `name`, or an error listing the available ones.
    pub fn get(&self, name: &str) -> Result<&F> {
        self.items
            .get(name)
            .map(|i| &i.factory)
            .ok_or_else(|| CoreError::NotRegistered {
                kind: self.kind,
                name: name.to_string(),
                available: self.names().join(", "),
            })
    }
    /// Registered names, sorted.
    pub fn names(&self) -> Vec<String> {
        self.items.keys().cloned().collect()
    }
    /// (name, item) pairs, sorted by name.
    pub fn iter(&self) -> impl Iterator<Item = (&String, &Item<F>)> {
        self.items.iter()
    }
    /// The kind's name.
    pub fn kind(&self) -> &'static str {
        self.kind
    }
}

/// Creates a backend.
pub type BackendFactory = Arc<dyn Fn(&BackendOptions) -> Result<Arc<dyn Backend>> + Send + Sync>;
/// Opens one rank per options (each its device) of a backend whose devices
/// communicate directly, with their communicators (NCCL between CUDA devices).
pub type DeviceGroupFactory = Arc<dyn Fn(&[BackendOptions]) -> Result<DeviceGroup> + Send + Sync>;
/// Creates a model architecture.
pub type ArchitectureFactory = Arc<dyn Fn() -> Box<dyn ModelArchitecture> + Send + Sync>;
/// Creates a sampler.
pub type SamplerFactory = Arc<dyn Fn() -> Result<Arc<dyn Sampler>> + Send + Sync>;
/// Creates a logits processor from its options (a JSON value, `null` when none).
pub type LogitsProcessorFactory =
    Arc<dyn Fn(&serde_json::Value) -> Result<Arc<dyn LogitsProcessor>> + Send + Sync>;
/// Creates a quantization method.
pub type QuantMethodFactory = Arc<dyn Fn(&QuantInit) -> Result<Arc<dyn QuantMethod>> + Send + Sync>;
/// Creates an eviction policy.
pub type EvictionPolicyFactory = Arc<dyn Fn() -> Result<Arc<dyn EvictionPolicy>> + Send + Sync>;
/// Creates a prefix cache.
pub type PrefixCacheFactory =
    Arc<dyn Fn(&PrefixCacheOptions) -> Result<Box<dyn PrefixCache>> + Send + Sync>;
/// Creates a speculator (a fresh one per engine) over the target's runner
/// and, for a separate draft model, that model.
pub type SpeculatorFactory =
    Arc<dyn Fn(&SpeculativeConfig, &SpeculatorInputs) -> Result<Box<dyn Speculator>> + Send + Sync>;
/// Creates a grammar backend for one tokenizer.
pub type GrammarBackendFactory =
    Arc<dyn Fn(&GrammarBackendConfig) -> Result<Arc<dyn GrammarBackend>> + Send + Sync>;

macro_rules! entry {
    ($(#[$m:meta])* $entry:ident, $create:ty) => {
        $(#[$m])*
        pub struct $entry {
            /// Registered name.
            pub name: &'static str,
            /// One line describing it.
            pub about: &'static str,
            /// Creates an instance.
            pub create: $create,
        }
        inventory::collect!($entry);
    };
}

entry!(
    /// A built-in backend (`inventory::submit!`).
    BackendEntry,
    fn(&BackendOptions) -> Result<Arc<dyn Backend>>
);
entry!(
    /// A built-in device group, named after the backend whose devices it
    /// connects (`cuda`): how that backend's tensor-parallel ranks meet.
    DeviceGroupEntry,
    fn(&[BackendOptions]) -> Result<DeviceGroup>
);
entry!(
    /// A built-in model architecture, named as in HF `config.json` `architectures`.
    ArchitectureEntry,
    fn() -> Box<dyn ModelArchitecture>
);
entry!(
    /// A built-in sampler.
    SamplerEntry,
    fn() -> Result<Arc<dyn Sampler>>
);
entry!(
    /// A built-in logits processor.
    LogitsProcessorEntry,
    fn(&serde_json::Value) -> Result<Arc<dyn LogitsProcessor>>
);
entry!(
    /// A built-in quantization method.
    QuantMethodEntry,
    fn(&QuantInit) -> Result<Arc<dyn QuantMethod>>
);
entry!(
    /// A built-in eviction policy.
    EvictionPolicyEntry,
    fn() -> Result<Arc<dyn EvictionPolicy>>
);
entry!(
    /// A built-in prefix cache.
    PrefixCacheEntry,
    fn(&PrefixCacheOptions) -> Result<Box<dyn PrefixCache>>
);
entry!(
    /// A built-in grammar backend (constrained decoding), built once per tokenizer.
    GrammarBackendEntry,
    fn(&GrammarBackendConfig) -> Result<Arc<dyn GrammarBackend>>
);
entry!(
    /// A built-in speculator (draft proposer for speculative decoding).
    SpeculatorEntry,
    fn(&SpeculativeConfig, &SpeculatorInputs) -> Result<Box<dyn Speculator>>
);

/// Every implementation the process knows, by kind and name.
pub struct Registry {
    /// Compute devices.
    pub backends: Kind<BackendFactory>,
    /// Device groups by backend name: tensor-parallel ranks of that backend
    /// with a communicator of their own (others meet in the host-staged
    /// `comm::LocalGroup`).
    pub device_groups: Kind<DeviceGroupFactory>,
    /// Model architectures.
    pub architectures: Kind<ArchitectureFactory>,
    /// Samplers.
    pub samplers: Kind<SamplerFactory>,
    /// Logits processors.
    pub logits_processors: Kind<LogitsProcessorFactory>,
    /// Quantization methods.
    pub quant_methods: Kind<QuantMethodFactory>,
    /// Eviction policies of the prefix cache.
    pub eviction_policies: Kind<EvictionPolicyFactory>,
    /// Prefix caches.
    pub prefix_caches: Kind<PrefixCacheFactory>,
    /// Grammar backends (constrained decoding).
    pub grammar_backends: Kind<GrammarBackendFactory>,
    /// Speculators (speculative decoding).
    pub speculators: Kind<SpeculatorFactory>,
}

impl Registry {
    /// An empty registry.
    pub fn empty() -> Self {
        Self {
            backends: Kind::new("backend"),
            device_groups: Kind::new("device group"),
            architectures: Kind::new("model architecture"),
            samplers: Kind::new("sampler"),
            logits_processors: Kind::new("logits processor"),
            quant_methods: Kind::new("quantization method"),
            eviction_policies: Kind::new("eviction policy"),
            prefix_caches: Kind::new("prefix cache"),
            grammar_backends: Kind::new("grammar backend"),
            speculators: Kind::new("speculator"),
        }
    }

    /// Everything registered with `inventory` in this binary. Errors on duplicate names.
    pub fn builtin() -> Result<Self> {
        let mut r = Self::empty();
        let b = Origin::Builtin;
        for e in inventory::iter::<BackendEntry> {
            let f = e.create;
            r.backends.add(e.name, e.about, b.clone(), Arc::new(f))?;
        }
        for e in inventory::iter::<DeviceGroupEntry> {
            let f = e.create;
            r.device_groups
                .add(e.name, e.about, b.clone(), Arc::new(f))?;
        }
        for e in inventory::iter::<ArchitectureEntry> {
            let f = e.create;
            r.architectures
                .add(e.name, e.about, b.clone(), Arc::new(f))?;
        }
        for e in inventory::iter::<SamplerEntry> {
            let f = e.create;
            r.samplers.add(e.name, e.about, b.clone(), Arc::new(f))?;
        }
        for e in inventory::iter::<LogitsProcessorEntry> {
            let f = e.create;
            r.logits_processors
                .add(e.name, e.about, b.clone(), Arc::new(f))?;
        }
        for e in inventory::iter::<QuantMethodEntry> {
            let f = e.create;
            r.quant_methods
                .add(e.name, e.about, b.clone(), Arc::new(f))?;
        }
        for e in inventory::iter::<EvictionPolicyEntry> {
            let f = e.create;
            r.eviction_policies
                .add(e.name, e.about, b.clone(), Arc::new(f))?;
        }
        for e in inventory::iter::<PrefixCacheEntry> {
            let f = e.create;
            r.prefix_caches
                .add(e.name, e.about, b.clone(), Arc::new(f))?;
        }
        for e in inventory::iter::<GrammarBackendEntry> {
            let f = e.create;
            r.grammar_backends
                .add(e.name, e.about, b.clone(), Arc::new(f))?;
        }
        for e in inventory::iter::<SpeculatorEntry> {
            let f = e.create;
            r.speculators.add(e.name, e.about, b.clone(), Arc::new(f))?;
        }
        Ok(r)
    }

    /// (kind, name, about, origin) of every implementation, for listings.
    pub fn listing(&self) -> Vec<(&'static str, String, String, Origin)> {
        let mut out = Vec::new();
        macro_rules! list {
            ($k:expr) => {
                for (n, i) in $k.iter() {
                    out.push(($k.kind(), n.clone(), i.about.clone(), i.origin.clone()));
                }
            };
        }
        list!(self.backends);
        list!(self.device_groups);
        list!(self.architectures);
        list!(self.samplers);
        list!(self.logits_processors);
        list!(self.quant_methods);
        list!(self.eviction_policies);
        list!(self.prefix_caches);
        list!(self.grammar_backends);
        list!(self.speculators);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn duplicates_are_refused() {
        let mut k: Kind<u32> = Kind::new("thing");
        k.add("a", "first", Origin::Builtin, 1).unwrap();
        let e = k.add("a", "second", Origin::Builtin, 2).unwrap_err();
        assert!(e.to_string().contains("duplicate thing registration 'a'"));
        let e = k.get("b").err().unwrap();
        assert!(e.to_string().contains("available: a"), "{e}");
    }

    #[test]
    fn builtins_include_core_samplers() {
        let r = Registry::builtin().unwrap();
        assert!(r.samplers.get("standard").is_ok());
        assert!(r.logits_processors.get("penalties").is_ok());
    }
}
