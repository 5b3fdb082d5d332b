//! Arbor's HiCache: host-memory and storage tiers under the radix cache.
//!
//! This crate owns:
//! - [`HiCache`], a [`PrefixCache`](arbor_engine_core::PrefixCache): kv-radix's
//!   radix cache with its host tier turned on, plus the storage tier;
//! - [`HiCacheConfig`]: SGLang's `--hicache-*` settings, checked;
//! - the storage thread (all storage I/O happens there, never on the
//!   scheduler thread);
//! - the storage backends ([`storage`]: a file directory and redis) that
//!   implement engine-core's [`KvTier`](arbor_engine_core::KvTier).
//!
//! Invariants: the scheduler thread never blocks on storage; a storage fault
//! only costs recomputation; entries of another model, KV dtype, page size
//! or namespace are never loaded (their keys differ, and every entry's
//! header names its identity).

mod config;
mod hicache;
pub mod storage;
mod worker;

pub use arbor_kv_radix::WritePolicy;
pub use config::{HiCacheConfig, HiCacheError, PrefetchPolicy};
pub use hicache::{HiCache, HiCacheOptions};
