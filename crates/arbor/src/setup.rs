//! Shared start-up steps: building the registry, the device and the model,
//! with a progress bar while weights load.

use anyhow::{Context, Result};
use arbor_engine_core::{Backend, BackendOptions, LoadOptions, Registry};
use arbor_models::LoadedModel;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;
use std::sync::Arc;

/// Model and device options shared by the subcommands that load a model.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// Model folder in Hugging Face format (config.json, safetensors, tokenizer.json).
    #[arg(long = "model-path")]
    pub model_path: PathBuf,
    /// Device: a registered backend name.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// CPU threads (0: one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Weight storage: auto (as the checkpoint), f32, f16 or bf16.
    #[arg(long, default_value = "auto")]
    pub dtype: String,
    /// KV cache element type: f32, f16 or bf16.
    #[arg(long = "kv-cache-dtype", default_value = "f32")]
    pub kv_cache_dtype: String,
    /// Tokens per KV page.
    #[arg(long = "page-size", default_value_t = 16)]
    pub page_size: usize,
}

/// The registry of built-in implementations.
pub fn registry() -> Result<Registry> {
    Registry::builtin().context("building the registry")
}

/// Creates the device.
pub fn backend(registry: &Registry, args: &ModelArgs) -> Result<Arc<dyn Backend>> {
    let factory = registry.backends.get(&args.device)?;
    let opts = BackendOptions {
        threads: args.threads,
        ..Default::default()
    };
    factory(&opts).with_context(|| format!("starting device '{}'", args.device))
}

/// Loads the model with a progress bar.
pub fn load(registry: &Registry, backend: Arc<dyn Backend>, args: &ModelArgs) -> Result<LoadedModel> {
    let quant = registry.quant_methods.get(&args.dtype)?()?;
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("loading {msg} [{bar:30}] {pos}/{len} tensors")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message(args.model_path.display().to_string());
    let pb = bar.clone();
    let opts = LoadOptions {
        backend,
        quant,
        progress: Some(Arc::new(move |done, total| {
            pb.set_length(total as u64);
            pb.set_position(done as u64);
        })),
    };
    let loaded = arbor_models::load_model(&args.model_path, registry, &opts)
        .with_context(|| format!("loading {}", args.model_path.display()));
    bar.finish_and_clear();
    loaded
}
