//! Dynamic plugins: loading `cdylib`s that speak the C ABI of
//! `arbor-plugin-api`, and adapters that turn their tables into the ordinary
//! traits ([`EvictionPolicy`], [`LogitsProcessor`], [`Sampler`]).
//!
//! Safety rules: only paths the operator lists are loaded; a library whose ABI
//! version differs is refused with both versions named; a loaded library is
//! never unloaded (its code may be referenced until the process exits); every
//! string the plugin gives is checked for UTF-8; every call's status is
//! checked, and a failing or panicking plugin call (the plugin SDK catches
//! panics on its side, since unwinding through `extern "C"` aborts) fails the
//! request that made it, never the server. A plugin state is used by one
//! thread at a time (a mutex guards it).
#![allow(unsafe_code)]

use crate::error::{CoreError, Result};
use crate::kv::prefix_cache::{EvictionKey, EvictionPolicy, NodeMeta};
use crate::registry::{Origin, Registry};
use crate::sampling::{LogitsContext, LogitsProcessor, Sampler, SamplingParams, SeqRng};
use arbor_plugin_api as api;
use std::ffi::{CStr, c_char, c_void};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// What a loaded plugin provided.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PluginInfo {
    /// The library's path.
    pub path: PathBuf,
    /// The plugin's name.
    pub name: String,
    /// The plugin's version.
    pub version: String,
    /// Eviction policies it registered.
    pub eviction_policies: Vec<String>,
    /// Logits processors it registered.
    pub logits_processors: Vec<String>,
    /// Samplers it registered.
    pub samplers: Vec<String>,
}

fn text(ptr: *const c_char, what: &str, path: &Path) -> Result<String> {
    if ptr.is_null() {
        return Err(CoreError::Plugin(format!(
            "{}: {what} is a null pointer",
            path.display()
        )));
    }
    // SAFETY: the ABI requires NUL-terminated static strings.
    unsafe { CStr::from_ptr(ptr) }
        .to_str()
        .map(str::to_string)
        .map_err(|_| CoreError::Plugin(format!("{}: {what} is not UTF-8", path.display())))
}

fn table<'a, T>(ptr: *const T, n: usize, what: &str, path: &Path) -> Result<&'a [T]> {
    if n == 0 {
        return Ok(&[]);
    }
    if ptr.is_null() {
        return Err(CoreError::Plugin(format!(
            "{}: {what} table is null",
            path.display()
        )));
    }
    // SAFETY: the ABI requires `n` static entries at `ptr`.
    Ok(unsafe { std::slice::from_raw_parts(ptr, n) })
}

/// Loads the plugin at `path` and registers what it provides in `registry`.
/// `config` is handed to its processors and samplers when they are created.
pub fn load_plugin(
    path: &Path,
    config: &serde_json::Value,
    registry: &mut Registry,
) -> Result<PluginInfo> {
    if !path.is_file() {
        return Err(CoreError::Plugin(format!(
            "plugin {}: no such file",
            path.display()
        )));
    }
    // SAFETY: loading a library runs its initializers; the operator listed this
    // path in the configuration, which is the trust boundary for plugins.
    let lib = unsafe { libloading::Library::new(path) }
        .map_err(|e| CoreError::Plugin(format!("plugin {}: cannot load: {e}", path.display())))?;
    // Never unloaded: function pointers into it live as long as the process.
    let lib: &'static libloading::Library = Box::leak(Box::new(lib));
    // SAFETY: the symbol's type is fixed by the ABI.
    let entry: libloading::Symbol<'static, extern "C" fn() -> *const api::PluginV1> =
        unsafe { lib.get(api::ENTRY_SYMBOL) }.map_err(|e| {
            CoreError::Plugin(format!(
                "plugin {}: no `arbor_plugin_entry` symbol ({e}); is it an Arbor plugin?",
                path.display()
            ))
        })?;
    let desc = entry();
    if desc.is_null() {
        return Err(CoreError::Plugin(format!(
            "plugin {}: entry point returned null",
            path.display()
        )));
    }
    // SAFETY: a non-null pointer to the plugin's static description.
    let d: &'static api::PluginV1 = unsafe { &*desc };
    if d.abi_version != api::ABI_VERSION {
        return Err(CoreError::Plugin(format!(
            "plugin {} was built for plugin ABI version {}, but this Arbor speaks version {}; rebuild it against arbor-plugin-api {}",
            path.display(),
            d.abi_version,
            api::ABI_VERSION,
            env!("CARGO_PKG_VERSION")
        )));
    }
    let name = text(d.name, "name", path)?;
    let version = text(d.version, "version", path)?;
    let origin = Origin::Plugin(path.display().to_string());
    let mut info = PluginInfo {
        path: path.to_path_buf(),
        name: name.clone(),
        version,
        eviction_policies: Vec::new(),
        logits_processors: Vec::new(),
        samplers: Vec::new(),
    };
    let config_text = Arc::new(config.to_string());

    for t in table(
        d.eviction_policies,
        d.n_eviction_policies,
        "eviction policy",
        path,
    )? {
        let pname = text(t.name, "eviction policy name", path)?;
        let about = text(t.about, "eviction policy description", path)?;
        let key = t.key;
        let n = pname.clone();
        registry.eviction_policies.add(
            &pname,
            &about,
            origin.clone(),
            Arc::new(move || {
                Ok(Arc::new(PluginEvictionPolicy {
                    name: n.clone(),
                    key,
                }) as Arc<dyn EvictionPolicy>)
            }),
        )?;
        info.eviction_policies.push(pname);
    }
    for t in table(
        d.logits_processors,
        d.n_logits_processors,
        "logits processor",
        path,
    )? {
        let pname = text(t.name, "logits processor name", path)?;
        let about = text(t.about, "logits processor description", path)?;
        let (n, cfg, plugin) = (pname.clone(), config_text.clone(), name.clone());
        registry.logits_processors.add(
            &pname,
            &about,
            origin.clone(),
            Arc::new(move |arg: &serde_json::Value| {
                let cfg = if arg.is_null() {
                    cfg.as_str().to_string()
                } else {
                    arg.to_string()
                };
                let state = create_state(t.create, &cfg, &plugin, &n)?;
                Ok(Arc::new(PluginLogitsProcessor {
                    name: n.clone(),
                    plugin: plugin.clone(),
                    table: t,
                    state: Mutex::new(state),
                }) as Arc<dyn LogitsProcessor>)
            }),
        )?;
        info.logits_processors.push(pname);
    }
    for t in table(d.samplers, d.n_samplers, "sampler", path)? {
        let pname = text(t.name, "sampler name", path)?;
        let about = text(t.about, "sampler description", path)?;
        let (n, cfg, plugin) = (pname.clone(), config_text.clone(), name.clone());
        registry.samplers.add(
            &pname,
            &about,
            origin.clone(),
            Arc::new(move || {
                let state = create_state(t.create, &cfg, &plugin, &n)?;
                Ok(Arc::new(PluginSampler {
                    name: n.clone(),
                    plugin: plugin.clone(),
                    table: t,
                    state: Mutex::new(state),
                }) as Arc<dyn Sampler>)
            }),
        )?;
        info.samplers.push(pname);
    }
    tracing::info!(
        "loaded plugin {} {} from {}",
        info.name,
        info.version,
        path.display()
    );
    Ok(info)
}

type CreateFn = extern "C" fn(*const u8, usize, *mut *mut c_void, *mut c_char, usize) -> i32;

/// A plugin-owned state pointer.
struct State(*mut c_void);
// SAFETY: the state is only touched under the owner's mutex, and the ABI
// requires states to be usable from any one thread at a time.
unsafe impl Send for State {}

fn create_state(create: CreateFn, config: &str, plugin: &str, what: &str) -> Result<State> {
    let mut state: *mut c_void = std::ptr::null_mut();
    let mut err = [0u8; 512];
    let status = create(
        config.as_ptr(),
        config.len(),
        &mut state,
        err.as_mut_ptr() as *mut c_char,
        err.len(),
    );
    if status != api::STATUS_OK {
        let msg = CStr::from_bytes_until_nul(&err)
            .ok()
            .and_then(|c| c.to_str().ok())
            .unwrap_or("no message");
        return Err(CoreError::Plugin(format!(
            "plugin {plugin}: creating {what} failed: {msg}"
        )));
    }
    Ok(State(state))
}

fn status_error(status: i32, plugin: &str, what: &str) -> CoreError {
    if status == api::STATUS_PANIC {
        CoreError::Plugin(format!("plugin {plugin}: {what} panicked"))
    } else {
        CoreError::Plugin(format!("plugin {plugin}: {what} failed (status {status})"))
    }
}

struct PluginEvictionPolicy {
    name: String,
    key: extern "C" fn(*const api::NodeMetaV1, *mut f64) -> i32,
}

impl EvictionPolicy for PluginEvictionPolicy {
    fn name(&self) -> &str {
        &self.name
    }
    fn key(&self, m: &NodeMeta) -> EvictionKey {
        let meta = api::NodeMetaV1 {
            last_access: m.last_access,
            created: m.created,
            hit_count: m.hit_count,
            priority: m.priority,
            tokens: m.tokens as u64,
        };
        let mut out = [0f64; 2];
        if (self.key)(&meta, out.as_mut_ptr()) == api::STATUS_OK {
            EvictionKey(out[0], out[1])
        } else {
            // A failing policy must not stop eviction: fall back to LRU order.
            tracing::warn!(
                "eviction policy {} failed; using LRU order for this node",
                self.name
            );
            EvictionKey(m.last_access as f64, 0.0)
        }
    }
}

struct PluginLogitsProcessor {
    name: String,
    plugin: String,
    table: &'static api::LogitsProcessorV1,
    state: Mutex<State>,
}

impl LogitsProcessor for PluginLogitsProcessor {
    fn name(&self) -> &str {
        &self.name
    }
    fn process(&self, logits: &mut [f32], ctx: &LogitsContext<'_>) -> Result<()> {
        let c = api::LogitsContextV1 {
            prompt: ctx.prompt.as_ptr(),
            n_prompt: ctx.prompt.len(),
            output: ctx.output.as_ptr(),
            n_output: ctx.output.len(),
        };
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let status = (self.table.process)(state.0, logits.as_mut_ptr(), logits.len(), &c);
        if status == api::STATUS_OK {
            Ok(())
        } else {
            Err(status_error(
                status,
                &self.plugin,
                &format!("logits processor {}", self.name),
            ))
        }
    }
}

impl Drop for PluginLogitsProcessor {
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        (self.table.destroy)(state.0);
    }
}

struct PluginSampler {
    name: String,
    plugin: String,
    table: &'static api::SamplerV1,
    state: Mutex<State>,
}

impl Sampler for PluginSampler {
    fn name(&self) -> &str {
        &self.name
    }
    fn sample(&self, logits: &mut [f32], params: &SamplingParams, rng: &mut SeqRng) -> Result<u32> {
        let p = api::SamplingParamsV1 {
            temperature: params.temperature,
            top_p: params.top_p,
            top_k: params.top_k,
            min_p: params.min_p,
            random: rng.next_u64(),
        };
        let mut token = 0u32;
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let status =
            (self.table.sample)(state.0, logits.as_mut_ptr(), logits.len(), &p, &mut token);
        if status != api::STATUS_OK {
            return Err(status_error(
                status,
                &self.plugin,
                &format!("sampler {}", self.name),
            ));
        }
        if token as usize >= logits.len() {
            return Err(CoreError::Plugin(format!(
                "plugin {}: sampler {} returned token {token} outside the vocabulary of {}",
                self.plugin,
                self.name,
                logits.len()
            )));
        }
        Ok(token)
    }
}

impl Drop for PluginSampler {
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        (self.table.destroy)(state.0);
    }
}
