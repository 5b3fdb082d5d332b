//! Rule 2: a second registration under a taken name makes the registry refuse
//! to build, with a message naming the kind and the name.

use arbor_engine_core::registry::LogitsProcessorEntry;
use arbor_engine_core::{LogitsProcessor, Registry, Result, inventory};
use example_custom_processor::NoRepeat;
use std::sync::Arc;

fn create(_: &serde_json::Value) -> Result<Arc<dyn LogitsProcessor>> {
    Ok(Arc::new(NoRepeat { window: 3 }))
}

inventory::submit! {
    LogitsProcessorEntry { name: "no_repeat", about: "a clash", create }
}

#[test]
fn duplicate_names_are_refused() {
    let err = Registry::builtin()
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        err.contains("duplicate logits processor registration 'no_repeat'"),
        "{err}"
    );
}

#[test]
fn the_processor_itself_works() {
    let p = NoRepeat { window: 1 };
    let mut l = vec![0.0f32; 4];
    let params = arbor_engine_core::SamplingParams::default();
    let ctx = arbor_engine_core::LogitsContext {
        prompt: &[],
        output: &[2],
        params: &params,
    };
    assert!(p.process(&mut l, &ctx).is_ok());
    assert_eq!(l[2], f32::NEG_INFINITY);
}
