//! Arbor's RadixAttention prefix cache (SGLang's radix cache) and its eviction policies.
//!
//! This crate owns:
//! - [`RadixCache`]: a radix tree in an arena whose edges are runs of whole KV
//!   pages; it implements engine-core's [`PrefixCache`](arbor_engine_core::PrefixCache)
//!   (match, insert, lock/unlock, evict, flush, stats, dump) with an exact
//!   candidate set of evictable leaves;
//! - a re-export of engine-core's [`NoPrefixCache`] (no reuse, `--disable-radix-cache`);
//! - the built-in eviction policies (`lru`, `lfu`, `fifo`, `mru`, `filo`,
//!   `priority`, `slru`) in [`policy`].
//!
//! Everything registers with `inventory`: the prefix cache `radix` (engine-core registers `none`),
//! and one eviction policy per name. A binary must reference the crate
//! (`use arbor_kv_radix as _;`) for the entries to be linked in.
//!
//! Invariant kept by every operation: each KV page handed to the cache is
//! either owned by exactly one node or back in the pool; after `flush` with no
//! locks held the cache owns no page.

mod error;
pub mod policy;
mod radix;

/// The no-reuse cache lives in engine-core (so an engine without this crate still serves).
pub use arbor_engine_core::NoPrefixCache;
pub use error::RadixError;
pub use policy::{POLICY_NAMES, builtin_policy};
pub use radix::{
    MemoryUsage, NodeView, RadixCache, SELECTIVE_HITS, StorageBackup, TierOptions, WritePolicy,
};

use arbor_engine_core::registry::PrefixCacheEntry;

arbor_engine_core::inventory::submit! {
    PrefixCacheEntry {
        name: "radix",
        about: "RadixAttention: a radix tree of KV pages shared across requests",
        create: |o| Ok(Box::new(RadixCache::new(o)?)),
    }
}
