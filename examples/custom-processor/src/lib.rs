//! A logits processor that ships as an ordinary Rust crate and registers itself
//! like Arbor's built-ins, with `inventory::submit!`.
//!
//! Registration rules:
//! 1. The binary must reference this crate (`use example_custom_processor as _;`),
//!    or the linker drops the unreferenced object and its registration with it.
//! 2. Names are unique per kind: `Registry::builtin()` refuses a second
//!    `no_repeat` (see tests/duplicate.rs).
//! 3. Registration is static: for code loaded at run time, write a dynamic
//!    plugin (plugins/) instead.

use arbor_engine_core::registry::LogitsProcessorEntry;
use arbor_engine_core::{CoreError, LogitsContext, LogitsProcessor, Result, inventory};
use std::sync::Arc;

/// Forbids repeating the previous token (a simple n-gram blocker).
pub struct NoRepeat {
    /// How many of the latest output tokens may not come again.
    pub window: usize,
}

impl LogitsProcessor for NoRepeat {
    fn name(&self) -> &str {
        "no_repeat"
    }
    fn process(&self, logits: &mut [f32], ctx: &LogitsContext<'_>) -> Result<()> {
        for &t in ctx.output.iter().rev().take(self.window) {
            if let Some(l) = logits.get_mut(t as usize) {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }
}

fn create(config: &serde_json::Value) -> Result<Arc<dyn LogitsProcessor>> {
    let window = match config.get("window") {
        None => 1,
        Some(v) => v.as_u64().ok_or_else(|| {
            CoreError::Config("no_repeat: 'window' must be a positive integer".into())
        })? as usize,
    };
    Ok(Arc::new(NoRepeat { window }))
}

inventory::submit! {
    LogitsProcessorEntry {
        name: "no_repeat",
        about: "forbids the last `window` output tokens (example crate)",
        create,
    }
}
