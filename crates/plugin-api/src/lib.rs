//! The C ABI between Arbor and its dynamic plugins.
//!
//! Rust trait objects have no stable layout across separately built libraries,
//! so a plugin (a `cdylib`) exports one `extern "C"` function, [`ENTRY_SYMBOL`],
//! returning a pointer to a static [`PluginV1`]: the ABI version, the plugin's
//! name and version, and C-ABI function tables for what it provides (eviction
//! policies, logits processors, samplers). Further kinds (speculators, grammar
//! backends, KV tiers) follow as [`ExtensionV1`] entries tagged by kind, so old
//! hosts skip tables they do not know and the version only changes when an
//! existing table changes.
//!
//! Rules both sides follow: every string is NUL-terminated UTF-8 with static
//! lifetime; every function returns [`STATUS_OK`] or an error status, never
//! unwinds (a panic across `extern "C"` aborts the process, so plugins catch
//! panics themselves — the [`sdk`] does it); states created by a `create`
//! function are released only by the matching `destroy`.
//!
//! This crate has no dependencies so plugins build in seconds.
#![allow(unsafe_code)]

use std::ffi::{c_char, c_void};

/// Version of the tables below. The host refuses any other.
pub const ABI_VERSION: u32 = 1;
/// Name of the entry point: `extern "C" fn() -> *const PluginV1`.
pub const ENTRY_SYMBOL: &[u8] = b"arbor_plugin_entry\0";

/// Success.
pub const STATUS_OK: i32 = 0;
/// The call failed; the host fails the request (or uses a fallback where noted).
pub const STATUS_ERROR: i32 = 1;
/// The plugin panicked; the SDK caught it.
pub const STATUS_PANIC: i32 = 2;

/// A plugin's description.
#[repr(C)]
pub struct PluginV1 {
    /// Must equal [`ABI_VERSION`].
    pub abi_version: u32,
    /// Plugin name.
    pub name: *const c_char,
    /// Plugin version.
    pub version: *const c_char,
    /// Eviction policies.
    pub eviction_policies: *const EvictionPolicyV1,
    pub n_eviction_policies: usize,
    /// Logits processors.
    pub logits_processors: *const LogitsProcessorV1,
    pub n_logits_processors: usize,
    /// Samplers.
    pub samplers: *const SamplerV1,
    pub n_samplers: usize,
    /// Tables of later kinds.
    pub extensions: *const ExtensionV1,
    pub n_extensions: usize,
}

// SAFETY: the table holds pointers to static, immutable data.
unsafe impl Sync for PluginV1 {}

/// A table of a kind added after version 1, tagged by `kind`.
#[repr(C)]
pub struct ExtensionV1 {
    /// Kind tag (assigned by Arbor).
    pub kind: u32,
    /// The kind's own table.
    pub table: *const c_void,
}

/// What an eviction policy sees of a radix node.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeMetaV1 {
    pub last_access: u64,
    pub created: u64,
    pub hit_count: u64,
    pub priority: i64,
    pub tokens: u64,
}

/// An eviction policy: smaller keys (compared lexicographically) are evicted first.
#[repr(C)]
pub struct EvictionPolicyV1 {
    pub name: *const c_char,
    pub about: *const c_char,
    /// Writes the node's key to `out[0..2]`.
    pub key: extern "C" fn(meta: *const NodeMetaV1, out: *mut f64) -> i32,
}

/// What a logits processor sees of a request.
#[repr(C)]
pub struct LogitsContextV1 {
    pub prompt: *const u32,
    pub n_prompt: usize,
    pub output: *const u32,
    pub n_output: usize,
}

/// A logits processor: changes one row of logits in place.
#[repr(C)]
pub struct LogitsProcessorV1 {
    pub name: *const c_char,
    pub about: *const c_char,
    /// Creates a state from a JSON config (`len` bytes, not NUL-terminated); writes a
    /// NUL-terminated error message into `err` (capacity `err_len`) on failure.
    pub create: extern "C" fn(
        config: *const u8,
        len: usize,
        state: *mut *mut c_void,
        err: *mut c_char,
        err_len: usize,
    ) -> i32,
    pub process: extern "C" fn(
        state: *mut c_void,
        logits: *mut f32,
        vocab: usize,
        ctx: *const LogitsContextV1,
    ) -> i32,
    pub destroy: extern "C" fn(state: *mut c_void),
}

/// Sampling parameters a sampler receives.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SamplingParamsV1 {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: i32,
    pub min_p: f32,
    /// 64 random bits from the request's seeded RNG (same seed, same draws).
    pub random: u64,
}

/// A sampler: picks the next token from processed logits.
#[repr(C)]
pub struct SamplerV1 {
    pub name: *const c_char,
    pub about: *const c_char,
    pub create: extern "C" fn(
        config: *const u8,
        len: usize,
        state: *mut *mut c_void,
        err: *mut c_char,
        err_len: usize,
    ) -> i32,
    pub sample: extern "C" fn(
        state: *mut c_void,
        logits: *mut f32,
        vocab: usize,
        params: *const SamplingParamsV1,
        token: *mut u32,
    ) -> i32,
    pub destroy: extern "C" fn(state: *mut c_void),
}

pub mod sdk;
