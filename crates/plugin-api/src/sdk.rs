//! Helpers for writing plugins in Rust: implement the small traits here and
//! export them with [`export_plugin!`](crate::export_plugin). Every call into
//! plugin code is wrapped in `catch_unwind`, so a panic becomes
//! [`STATUS_PANIC`](crate::STATUS_PANIC) instead of aborting the host.

use crate::*;
use std::panic::{AssertUnwindSafe, catch_unwind};

/// A logits processor written in Rust.
pub trait LogitsProcessor: Send + Sync + 'static {
    /// Builds the processor from its JSON config (`"null"` when none).
    fn new(config: &str) -> Result<Self, String>
    where
        Self: Sized;
    /// Changes the logits of one request.
    fn process(&self, logits: &mut [f32], prompt: &[u32], output: &[u32]) -> Result<(), String>;
}

/// A sampler written in Rust.
pub trait Sampler: Send + Sync + 'static {
    /// Builds the sampler from its JSON config.
    fn new(config: &str) -> Result<Self, String>
    where
        Self: Sized;
    /// Picks a token.
    fn sample(&self, logits: &mut [f32], params: &SamplingParamsV1) -> Result<u32, String>;
}

/// # Safety
/// `err` is null or points to `err_len` writable bytes.
unsafe fn write_err(err: *mut c_char, err_len: usize, msg: &str) {
    if err.is_null() || err_len == 0 {
        return;
    }
    let bytes = msg.as_bytes();
    let n = bytes.len().min(err_len - 1);
    // SAFETY: the host gives a buffer of `err_len` bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), err as *mut u8, n);
        *err.add(n) = 0;
    }
}

/// # Safety
/// `config` is null or points to `len` readable bytes that outlive the result.
unsafe fn config_str<'a>(config: *const u8, len: usize) -> Result<&'a str, String> {
    if config.is_null() {
        return Ok("null");
    }
    // SAFETY: the host passes `len` readable bytes that outlive the call.
    let b = unsafe { std::slice::from_raw_parts(config, len) };
    std::str::from_utf8(b).map_err(|e| format!("config is not UTF-8: {e}"))
}

/// `create` for a [`LogitsProcessor`] or [`Sampler`] type.
///
/// # Safety
/// The pointers are those the host passes to a `create` function (see the ABI).
pub unsafe fn create<T: Send + Sync + 'static>(
    build: fn(&str) -> Result<T, String>,
    config: *const u8,
    len: usize,
    state: *mut *mut c_void,
    err: *mut c_char,
    err_len: usize,
) -> i32 {
    // SAFETY: see this function's contract.
    let r = catch_unwind(AssertUnwindSafe(|| {
        unsafe { config_str(config, len) }.and_then(build)
    }));
    match r {
        Ok(Ok(v)) => {
            // SAFETY: `state` is a valid out-pointer from the host.
            unsafe { *state = Box::into_raw(Box::new(v)) as *mut c_void };
            STATUS_OK
        }
        Ok(Err(msg)) => {
            // SAFETY: the host's error buffer.
            unsafe { write_err(err, err_len, &msg) };
            STATUS_ERROR
        }
        Err(_) => {
            // SAFETY: the host's error buffer.
            unsafe { write_err(err, err_len, "the plugin panicked while starting") };
            STATUS_PANIC
        }
    }
}

/// `destroy` for a state made by [`create`].
///
/// # Safety
/// `state` was made by [`create`] for the same `T` and is not used again.
pub unsafe fn destroy<T>(state: *mut c_void) {
    if !state.is_null() {
        // SAFETY: made by `Box::into_raw` in `create` with the same `T`.
        drop(unsafe { Box::from_raw(state as *mut T) });
    }
}

/// `process` for a [`LogitsProcessor`] type.
///
/// # Safety
/// The pointers are those the host passes to `process` (see the ABI).
pub unsafe fn process<T: LogitsProcessor>(
    state: *mut c_void,
    logits: *mut f32,
    vocab: usize,
    ctx: *const LogitsContextV1,
) -> i32 {
    let r = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: the host passes the state from `create`, `vocab` writable
        // logits and a context whose slices outlive the call.
        let (p, l, c) = unsafe {
            (
                &*(state as *const T),
                std::slice::from_raw_parts_mut(logits, vocab),
                &*ctx,
            )
        };
        let slice = |ptr: *const u32, n: usize| -> &[u32] {
            if ptr.is_null() || n == 0 {
                &[]
            } else {
                // SAFETY: see above.
                unsafe { std::slice::from_raw_parts(ptr, n) }
            }
        };
        p.process(l, slice(c.prompt, c.n_prompt), slice(c.output, c.n_output))
    }));
    match r {
        Ok(Ok(())) => STATUS_OK,
        Ok(Err(_)) => STATUS_ERROR,
        Err(_) => STATUS_PANIC,
    }
}

/// `sample` for a [`Sampler`] type.
///
/// # Safety
/// The pointers are those the host passes to `sample` (see the ABI).
pub unsafe fn sample<T: Sampler>(
    state: *mut c_void,
    logits: *mut f32,
    vocab: usize,
    params: *const SamplingParamsV1,
    token: *mut u32,
) -> i32 {
    let r = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: as in `process`.
        let (s, l, p) = unsafe {
            (
                &*(state as *const T),
                std::slice::from_raw_parts_mut(logits, vocab),
                &*params,
            )
        };
        s.sample(l, p)
    }));
    match r {
        Ok(Ok(t)) => {
            // SAFETY: a valid out-pointer from the host.
            unsafe { *token = t };
            STATUS_OK
        }
        Ok(Err(_)) => STATUS_ERROR,
        Err(_) => STATUS_PANIC,
    }
}

/// `key` for an eviction policy given as a plain function.
///
/// # Safety
/// The pointers are those the host passes to `key` (see the ABI).
pub unsafe fn eviction_key(
    f: fn(&NodeMetaV1) -> (f64, f64),
    meta: *const NodeMetaV1,
    out: *mut f64,
) -> i32 {
    match catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: the host passes a valid meta and a 2-element output.
        f(unsafe { &*meta })
    })) {
        Ok((a, b)) => {
            // SAFETY: see above.
            unsafe {
                *out = a;
                *out.add(1) = b;
            }
            STATUS_OK
        }
        Err(_) => STATUS_PANIC,
    }
}

/// A NUL-terminated static C string from a literal: `c!("name")`.
#[macro_export]
macro_rules! c {
    ($s:expr) => {
        concat!($s, "\0").as_ptr() as *const ::std::ffi::c_char
    };
}

/// Exports a plugin. Example:
/// ```ignore
/// arbor_plugin_api::export_plugin! {
///     name: "banned-words", version: "0.1.0",
///     eviction_policies: [],
///     logits_processors: [("banned_words", "never emit the configured words", BannedWords)],
///     samplers: [],
/// }
/// ```
#[macro_export]
macro_rules! export_plugin {
    (
        name: $name:expr, version: $version:expr,
        eviction_policies: [$(($pn:expr, $pa:expr, $pf:expr)),* $(,)?],
        logits_processors: [$(($ln:expr, $la:expr, $lt:ty)),* $(,)?],
        samplers: [$(($sn:expr, $sa:expr, $st:ty)),* $(,)?] $(,)?
    ) => {
        const _: () = {
            use $crate::*;
            use ::std::ffi::{c_char, c_void};
            static POLICIES: &[EvictionPolicyV1] = &[$(EvictionPolicyV1 {
                name: $crate::c!($pn),
                about: $crate::c!($pa),
                key: {
                    extern "C" fn key(meta: *const NodeMetaV1, out: *mut f64) -> i32 {
                        unsafe { $crate::sdk::eviction_key($pf, meta, out) }
                    }
                    key
                },
            }),*];
            static PROCESSORS: &[LogitsProcessorV1] = &[$(LogitsProcessorV1 {
                name: $crate::c!($ln),
                about: $crate::c!($la),
                create: {
                    extern "C" fn create(c: *const u8, l: usize, s: *mut *mut c_void, e: *mut c_char, el: usize) -> i32 {
                        unsafe { $crate::sdk::create::<$lt>(<$lt as $crate::sdk::LogitsProcessor>::new, c, l, s, e, el) }
                    }
                    create
                },
                process: {
                    extern "C" fn process(s: *mut c_void, l: *mut f32, v: usize, c: *const LogitsContextV1) -> i32 {
                        unsafe { $crate::sdk::process::<$lt>(s, l, v, c) }
                    }
                    process
                },
                destroy: {
                    extern "C" fn destroy(s: *mut c_void) {
                        unsafe { $crate::sdk::destroy::<$lt>(s) }
                    }
                    destroy
                },
            }),*];
            static SAMPLERS: &[SamplerV1] = &[$(SamplerV1 {
                name: $crate::c!($sn),
                about: $crate::c!($sa),
                create: {
                    extern "C" fn create(c: *const u8, l: usize, s: *mut *mut c_void, e: *mut c_char, el: usize) -> i32 {
                        unsafe { $crate::sdk::create::<$st>(<$st as $crate::sdk::Sampler>::new, c, l, s, e, el) }
                    }
                    create
                },
                sample: {
                    extern "C" fn sample(s: *mut c_void, l: *mut f32, v: usize, p: *const SamplingParamsV1, t: *mut u32) -> i32 {
                        unsafe { $crate::sdk::sample::<$st>(s, l, v, p, t) }
                    }
                    sample
                },
                destroy: {
                    extern "C" fn destroy(s: *mut c_void) {
                        unsafe { $crate::sdk::destroy::<$st>(s) }
                    }
                    destroy
                },
            }),*];
            static PLUGIN: PluginV1 = PluginV1 {
                abi_version: ABI_VERSION,
                name: $crate::c!($name),
                version: $crate::c!($version),
                eviction_policies: POLICIES.as_ptr(),
                n_eviction_policies: POLICIES.len(),
                logits_processors: PROCESSORS.as_ptr(),
                n_logits_processors: PROCESSORS.len(),
                samplers: SAMPLERS.as_ptr(),
                n_samplers: SAMPLERS.len(),
                extensions: ::std::ptr::null(),
                n_extensions: 0,
            };
            #[unsafe(no_mangle)]
            pub extern "C" fn arbor_plugin_entry() -> *const PluginV1 {
                &PLUGIN
            }
        };
    };
}

// SAFETY: the tables hold pointers to static, immutable data.
unsafe impl Sync for EvictionPolicyV1 {}
// SAFETY: as above.
unsafe impl Sync for LogitsProcessorV1 {}
// SAFETY: as above.
unsafe impl Sync for SamplerV1 {}
