//! Errors of the radix prefix cache.
//!
//! [`RadixError`] names every way a caller can misuse the cache (a page count
//! that does not cover the tokens, a node id that is not live, an unlock
//! without a lock). Each converts into engine-core's [`CoreError`] so the
//! [`PrefixCache`](arbor_engine_core::PrefixCache) trait can return it; caller
//! mistakes map to `InvalidArgument`, exhaustion to `OutOfMemory`.

use arbor_engine_core::CoreError;
use thiserror::Error;

/// Errors raised by [`RadixCache`](crate::RadixCache)
/// and the policy lookup.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum RadixError {
    /// The page size is zero.
    #[error("prefix cache page_size must be at least 1")]
    ZeroPageSize,
    /// The `cached_prefix` of an insert is not whole pages or exceeds the tokens.
    #[error(
        "insert: cached prefix of {prefix} tokens is not a whole number of pages \
         (page size {page_size}) within the {tokens} tokens"
    )]
    BadPrefix {
        /// Claimed cached prefix.
        prefix: usize,
        /// Tokens inserted.
        tokens: usize,
        /// Tokens per page.
        page_size: usize,
    },
    /// The pages of an insert do not cover the tokens after the cached prefix.
    #[error(
        "insert: {got} pages given for tokens {prefix}..{tokens}, expected {expected} \
         (page size {page_size})"
    )]
    PageCount {
        /// Pages given.
        got: usize,
        /// Pages needed.
        expected: usize,
        /// Claimed cached prefix.
        prefix: usize,
        /// Tokens inserted.
        tokens: usize,
        /// Tokens per page.
        page_size: usize,
    },
    /// The prefix an insert claims is cached is not (the caller let go of its lock).
    #[error(
        "insert: the first {prefix} tokens should be cached but only {found} are \
         (keep the matched node locked until the insert)"
    )]
    PrefixNotCached {
        /// Claimed cached prefix.
        prefix: usize,
        /// Tokens actually cached.
        found: usize,
    },
    /// The node id does not name a live node.
    #[error("prefix cache node {0} does not exist (evicted, or never created)")]
    UnknownNode(u32),
    /// `unlock` of a node that holds no lock.
    #[error("prefix cache node {0} is not locked")]
    NotLocked(u32),
    /// A lock count would overflow.
    #[error("prefix cache node {0} has too many locks")]
    LockOverflow(u32),
    /// Tiers can only be turned on while the cache is empty.
    #[error("the prefix cache's tiers must be enabled before anything is cached")]
    NotEmpty,
    /// No node id is left.
    #[error("prefix cache has no node ids left")]
    ArenaFull,
    /// No built-in eviction policy has this name.
    #[error("no eviction policy named '{name}' is built in (available: {available})")]
    UnknownPolicy {
        /// Name asked for.
        name: String,
        /// Built-in names.
        available: String,
    },
}

impl From<RadixError> for CoreError {
    fn from(e: RadixError) -> Self {
        match e {
            RadixError::ArenaFull => CoreError::OutOfMemory(e.to_string()),
            RadixError::UnknownPolicy { name, available } => CoreError::NotRegistered {
                kind: "eviction policy",
                name,
                available,
            },
            RadixError::ZeroPageSize => CoreError::Config(e.to_string()),
            other => CoreError::InvalidArgument(other.to_string()),
        }
    }
}
