//! A custom engine in a few dozen lines: engine-core + backend-cpu + models +
//! kv-radix, no server. [`answer`] loads a model, assembles an engine with a
//! radix prefix cache, and streams a chat answer.

use anyhow::{Context, Result};
use arbor_backend_cpu::CpuBackend;
use arbor_engine_core::engine::{Engine, EngineConfig, EngineParts, GenerateRequest};
use arbor_engine_core::runner::ModelRunner;
use arbor_engine_core::{DType, LoadOptions, PrefixCacheOptions, Registry, SamplingParams};
use arbor_kv_radix::RadixCache;
use arbor_models::ChatMessage;
use std::path::Path;
use std::sync::Arc;

/// Answers `question` greedily with the model at `model`, calling `on_text` with each piece.
pub fn answer(
    model: &Path,
    question: &str,
    max_tokens: usize,
    on_text: &mut dyn FnMut(&str),
) -> Result<String> {
    // Pick the parts: a CPU device, the model, a radix cache with LRU eviction.
    let registry = Registry::builtin()?;
    let backend = Arc::new(CpuBackend::new(0)?);
    let quant = registry.quant_methods.get("auto")?(&Default::default())?;
    let opts = LoadOptions {
        backend: backend.clone(),
        quant,
        progress: None,
    };
    let m = arbor_models::load_model(model, &registry, &opts)?;
    let runner = ModelRunner::new(m.model.clone(), backend, None, 16, 256, DType::F16)?;
    let policy = registry.eviction_policies.get("lru")?()?;
    let cache = RadixCache::new(&PrefixCacheOptions {
        page_size: 16,
        policy,
    })?;
    let engine = Engine::new(
        EngineConfig::default(),
        EngineParts::local(
            runner,
            Box::new(cache),
            registry.samplers.get("standard")?()?,
            vec![],
            m.tokenizer.clone(),
            m.tokenizer.eos_token_ids.clone(),
        ),
    )?;

    // Chat template -> tokens -> stream the answer.
    let template = m
        .chat_template
        .as_ref()
        .context("the model has no chat template")?;
    let messages = [
        ChatMessage::new("system", "You are a helpful assistant."),
        ChatMessage::new("user", question),
    ];
    let text = template.render(&messages, true, None, None, None)?;
    let ids = m.tokenizer.encode(&text, true)?;
    let mut stream = engine.submit(GenerateRequest::new(
        ids,
        SamplingParams::greedy(max_tokens),
    ))?;
    let mut all = String::new();
    while let Some(chunk) = stream.blocking_next() {
        on_text(&chunk.text);
        all.push_str(&chunk.text);
    }
    Ok(all)
}

#[cfg(test)]
mod tests {
    #[test]
    fn answers_with_the_tiny_fixture() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/tiny-qwen2");
        let mut pieces = 0;
        let text = super::answer(&dir, "hello", 8, &mut |_| pieces += 1).unwrap();
        assert!(pieces >= 1);
        assert!(!text.is_empty());
    }
}
