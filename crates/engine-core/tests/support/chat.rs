//! Chat prompts for the default-model tests and benchmarks (included with
//! `#[path]`): a chat template rendering with the usual system prompt, and
//! copy-heavy requests whose answers repeat text of the prompt.
#![allow(dead_code)]

use arbor_engine_core::{CoreError, Result};
use arbor_models::{ChatMessage, LoadedModel};

/// Token ids of `user` as the one user turn after a helpful-assistant system turn.
pub fn chat(m: &LoadedModel, user: &str) -> Result<Vec<u32>> {
    let t = m
        .chat_template
        .as_ref()
        .ok_or_else(|| CoreError::invalid("the model has no chat template"))?;
    let text = t.render(
        &[
            ChatMessage::new("system", "You are a helpful assistant."),
            ChatMessage::new("user", user),
        ],
        true,
        None,
        None,
        None,
    )?;
    m.tokenizer.encode(&text, true)
}

/// Copy-heavy requests: rename a variable in a function, copy a paragraph,
/// repeat a JSON document.
pub fn copy_prompts() -> Vec<String> {
    let code = "fn argmax(values: &[f32]) -> u32 {\n    let mut best = 0usize;\n    let mut best_v = f32::NEG_INFINITY;\n    for (i, &v) in values.iter().enumerate() {\n        if v > best_v {\n            best_v = v;\n            best = i;\n        }\n    }\n    best as u32\n}";
    let para = "The radix cache keeps the KV cache of every finished request in a tree keyed by token ids, so that a new request sharing a prefix with an old one reuses its keys and values instead of computing them again.";
    let json = r#"{"name": "Ada Lovelace", "born": 1815, "fields": ["mathematics", "computing"], "notes": {"first_program": true, "machine": "Analytical Engine"}}"#;
    vec![
        format!("Rewrite this Rust function with the variable `best` renamed to `top`:\n\n{code}"),
        format!("Copy this paragraph exactly:\n\n{para}"),
        format!("Repeat this JSON document exactly:\n\n{json}"),
    ]
}
