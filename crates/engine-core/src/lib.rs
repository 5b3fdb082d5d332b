//! Arbor's minimal core.
//!
//! This crate owns the request and batch types, the paged KV pool, the
//! registry, and the traits every feature plugs into: compute backends
//! ([`Backend`]), attention ([`AttentionBackend`]), model architectures
//! ([`ModelArchitecture`]), quantization methods ([`QuantMethod`]), samplers and
//! logits processors ([`Sampler`], [`LogitsProcessor`]), and prefix caches with
//! their eviction policies ([`PrefixCache`], [`EvictionPolicy`]), and the KV tiers
//! below the device ([`KvTier`], [`HostKvPool`]). It depends on no feature crate.
//!
//! Modules are grouped in rooms by responsibility, with no import circle
//! between top-level modules (`python3 scripts/module-cycles.py
//! crates/engine-core`): `backend` (the device: the `Backend` trait and the
//! kernel interfaces it serves), `kv` (pages, state slots, the prefix cache
//! and its tiers), `model` (architectures, quantization, MoE, LoRA),
//! `sampling`, `parallel` (tensor- and data-parallel executors), `executor`
//! and `engine` (the scheduler). The old flat paths (`crate::state`,
//! `crate::tier`, ...) are re-exported.

pub mod backend;
pub use backend::{attention, columns};

pub mod comm;
pub mod detok;
pub mod dtype;
pub mod engine;
pub mod error;
pub mod executor;
pub mod grammar;
pub mod kv;
pub use kv::{namespace, no_prefix_cache, prefix_cache, state, tier};
mod logprobs;
pub mod model;
pub use model::{lora, moe, quant};
pub mod plugin;
pub mod registry;
pub mod runner;
pub mod sampling;
pub use sampling::logit_edits;
pub mod parallel;
pub mod speculative;
pub mod step;
pub use parallel::{dp_attention, tp};
pub mod tensor;

pub use attention::{
    AttentionBackend, AttentionBatch, AttentionCapabilities, AttentionParams, BatchLayout,
    KvScales, SeqLayout, TREE_MASK_TOKENS, TREE_MASK_WORDS,
};
pub use backend::{
    Backend, BackendCapabilities, BackendOptions, DeviceInfo, HostData, HostRows, LinearRef,
    LoraRows, QuantMatmul, RopeDims, RopeStyle,
};
pub use detok::{IncrementalDetokenizer, TokenDecoder};
pub use dp_attention::{DpAttentionGroup, DpAttentionRank};
pub use dtype::DType;
pub use error::{CoreError, Param, Result};
pub use executor::{Executor, ExecutorCapabilities, LocalExecutor, RankWeights};
pub use kv::{KvCache, KvDtypeChoice, KvLayer, KvSpec, PagePool, PageSet, ResolvedKvDtype};
pub use logit_edits::{LogitEdits, RowEdits, TokenEdit};
pub use lora::{LoraAdapter, LoraLayer, LoraPair, LoraSegment, LoraTarget};
pub use model::{
    AttentionSharding, ForwardBatch, ForwardContext, ForwardOutput, LoadOptions, Model,
    ModelArchitecture, ModelSpec, ShardSpec, WeightSource,
};
pub use no_prefix_cache::NoPrefixCache;
pub use prefix_cache::{
    CacheNamespace, EvictionKey, EvictionPolicy, InsertOutcome, NodeId, NodeMeta, PrefixCache,
    PrefixCacheOptions, PrefixCacheStats, PrefixMatch, TierStats,
};
pub use quant::{LinearSpec, QuantInit, QuantMethod};
pub use registry::Registry;
pub use sampling::{LogitsContext, LogitsProcessor, Sampler, SamplingParams, SeqRng};
pub use speculative::TpRunners;
pub use speculative::{
    ComputedStates, Draft, DraftDist, DraftRequest, DraftSampling, Drafting, SpeculativeConfig,
    Speculator, SpeculatorInputs,
};
pub use state::{StateCache, StatePool, StateSlot, StateSpec};
pub use step::{
    SampleRows, SampleSpec, SeqExtra, SeqOutput, SeqPlan, StateOps, StepOutput, StepPlan,
    StepTokens,
};
pub use tensor::{BufferId, BufferOwner, DeviceBuffer, HostTensor, Tensor};
pub use tier::{
    CopyDirection, HeldSlots, HostKvPool, HostMemory, HostPages, HostRegion, HostSlotRef,
    KvCopyStats, KvTier, KvTierOps, PageCopy, PageKey, TierError, TierIdentity, page_keys,
};
pub use tp::TpExecutor;

/// Re-exported so that implementation crates register with the same `inventory`.
pub use inventory;

mod builtins {
    use crate::kv::no_prefix_cache::NoPrefixCache;
    use crate::registry::{LogitsProcessorEntry, PrefixCacheEntry, SamplerEntry};
    use crate::sampling::{LogitBiasProcessor, PenaltyProcessor, StandardSampler};
    use std::sync::Arc;

    inventory::submit! {
        SamplerEntry {
            name: "standard",
            about: "greedy, or temperature with top-k, top-p and min-p",
            create: || Ok(Arc::new(StandardSampler)),
        }
    }
    inventory::submit! {
        PrefixCacheEntry {
            name: "none",
            about: "no prefix reuse (--disable-radix-cache): inserted pages are freed",
            create: |o| Ok(Box::new(NoPrefixCache::new(o)?)),
        }
    }
    inventory::submit! {
        LogitsProcessorEntry {
            name: "penalties",
            about: "repetition (prompt+output), frequency and presence (output) penalties",
            create: |_| Ok(Arc::new(PenaltyProcessor)),
        }
    }
    inventory::submit! {
        LogitsProcessorEntry {
            name: "logit_bias",
            about: "adds the request's logit_bias to the logits",
            create: |_| Ok(Arc::new(LogitBiasProcessor)),
        }
    }
}
