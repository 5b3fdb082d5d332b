//! Shows the registration rules in action: referencing the crate keeps its
//! `inventory` entry, so the registry lists `no_repeat` as built-in.
//!
//! `cargo run -p example-custom-processor`

use arbor_engine_core::{LogitsContext, Registry, SamplingParams};
use example_custom_processor as _; // rule 1: keep the registration linked

fn main() -> anyhow::Result<()> {
    let registry = Registry::builtin()?;
    for (kind, name, about, origin) in registry.listing() {
        if kind == "logits processor" {
            println!("{name:<12} {about} ({origin:?})");
        }
    }
    let p = registry.logits_processors.get("no_repeat")?(&serde_json::json!({"window": 2}))?;
    let mut logits = vec![0.0f32; 8];
    let params = SamplingParams::default();
    p.process(
        &mut logits,
        &LogitsContext {
            prompt: &[1],
            output: &[3, 4, 5],
            params: &params,
        },
    )?;
    println!("after no_repeat(window 2) on output [3, 4, 5]: {logits:?}");
    Ok(())
}
