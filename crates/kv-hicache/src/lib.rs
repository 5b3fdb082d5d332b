//! Arbor's HiCache: host-memory and storage tiers under the radix cache.
//!
//! This crate owns the storage backends ([`storage`]: a file directory and
//! redis) that implement engine-core's [`KvTier`](arbor_engine_core::KvTier).

pub mod storage;
