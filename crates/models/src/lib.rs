//! Model architectures and everything needed to load a model folder.
//!
//! [`load_model`] reads a Hugging Face folder (`config.json`, safetensors
//! or `pytorch_model.bin` shards,
//! `tokenizer.json`, `tokenizer_config.json`, `generation_config.json`),
//! builds the architecture registered under `architectures[0]`, and returns a
//! [`LoadedModel`]: the model, its tokenizer with special tokens, and its chat
//! template.

pub mod chat;
pub mod config;
pub mod decoder;
mod dp_attention;
pub mod gguf_source;
pub mod hybrid;
pub mod kv_scales;
mod loader;
pub mod mla;
pub mod moe;
pub mod quant_methods;
pub mod random;
pub mod safetensors_source;
pub mod shard;
pub mod tokenizer;
pub mod torch_bin;

/// Where `arbor fetch-default` keeps the default model.
pub use arbor_gguf::default_model_path;
pub use chat::{
    BUILTIN_TEMPLATES, ChatMessage, ChatTemplate, RESERVED_TEMPLATE_VARS, TemplateVars,
};
pub use config::DecoderConfig;
pub use tokenizer::TextTokenizer;

use arbor_engine_core::{
    CoreError, LoadOptions, Model, QuantInit, QuantMethod, Registry, Result, ShardSpec,
};
use safetensors_source::SafetensorsSource;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A model ready to serve.
pub struct LoadedModel {
    /// The network.
    pub model: Arc<dyn Model>,
    /// Tokenizer and special tokens.
    pub tokenizer: Arc<TextTokenizer>,
    /// Chat template, when the model has one.
    pub chat_template: Option<Arc<ChatTemplate>>,
    /// Where the model was loaded from.
    pub path: PathBuf,
    /// The model's name: the folder's name for a Hugging Face folder, the
    /// `general.name` metadata (else the file stem) for a GGUF file. The
    /// default served model name.
    pub name: String,
    /// The `config.json` value (or its GGUF equivalent).
    pub config: serde_json::Value,
}

impl std::fmt::Debug for LoadedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "LoadedModel({}, {:?})",
            self.path.display(),
            self.model.spec()
        )
    }
}

/// A folder's `config.json`. ModelOpt's older exports keep their
/// quantization config in `hf_quant_config.json`: when config.json has no
/// `quantization_config`, that file's object (with `quant_method:
/// "modelopt"`) becomes it.
fn read_config(dir: &Path) -> Result<serde_json::Value> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| CoreError::io(&path, e))?;
    let mut config: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| CoreError::load(format!("{}: invalid JSON: {e}", path.display())))?;
    let modelopt = dir.join("hf_quant_config.json");
    if config.get("quantization_config").is_none() && modelopt.is_file() {
        let text = std::fs::read_to_string(&modelopt)
            .map_err(|e| CoreError::load(format!("{}: {e}", modelopt.display())))?;
        let mut v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| CoreError::load(format!("{}: {e}", modelopt.display())))?;
        let Some(obj) = v.as_object_mut() else {
            return Err(CoreError::load(format!(
                "{}: expected a JSON object",
                modelopt.display()
            )));
        };
        obj.insert("quant_method".into(), "modelopt".into());
        if let Some(c) = config.as_object_mut() {
            c.insert("quantization_config".into(), v);
        }
    }
    Ok(config)
}

/// Loads a Hugging Face model folder, or a GGUF file, with the architectures in `registry`.
pub fn load_model(path: &Path, registry: &Registry, opts: &LoadOptions) -> Result<LoadedModel> {
    load(path, registry, opts, None)
}

/// Loads one tensor-parallel rank's shard of the model at `path` (only that
/// rank's slices of the weights reach its device).
pub fn load_model_shard(
    path: &Path,
    registry: &Registry,
    opts: &LoadOptions,
    shard: &ShardSpec,
) -> Result<LoadedModel> {
    load(path, registry, opts, Some(shard))
}

/// Builds `arch` from its config and weights, whole or as `shard`.
pub(crate) fn build(
    arch: &dyn arbor_engine_core::ModelArchitecture,
    config: &serde_json::Value,
    weights: &dyn arbor_engine_core::WeightSource,
    opts: &LoadOptions,
    shard: Option<&ShardSpec>,
) -> Result<Box<dyn Model>> {
    match shard {
        Some(s) => arch.load_shard(config, weights, opts, s),
        None => arch.load(config, weights, opts),
    }
}

fn load(
    path: &Path,
    registry: &Registry,
    opts: &LoadOptions,
    shard: Option<&ShardSpec>,
) -> Result<LoadedModel> {
    if path.is_file() && gguf_source::is_gguf(path) {
        return gguf_source::load_gguf(path, registry, opts, shard);
    }
    if !path.is_dir() {
        return Err(CoreError::load(format!(
            "{}: not a model folder (config.json, safetensors, tokenizer.json) or a GGUF file",
            path.display()
        )));
    }
    let config = read_config(path)?;
    let arch = config
        .get("architectures")
        .and_then(|a| a.as_array())
        .and_then(|a| a.first())
        .and_then(|a| a.as_str())
        .ok_or_else(|| {
            CoreError::load(format!(
                "{}: key 'architectures' is missing or empty",
                path.join("config.json").display()
            ))
        })?;
    let factory = registry.architectures.get(arch).map_err(|_| {
        CoreError::load(format!(
            "{}: architecture '{arch}' is not supported (supported: {})",
            path.join("config.json").display(),
            registry.architectures.names().join(", ")
        ))
    })?;
    let tokenizer = TextTokenizer::from_dir(path, &config)?;
    let chat_template = ChatTemplate::from_dir(path)?.map(Arc::new);
    let weights = SafetensorsSource::open(path)?;
    let opts = &LoadOptions {
        quant: checkpoint_quant(path, &config, registry, opts)?,
        ..opts.clone()
    };
    let model = build(&*factory(), &config, &weights, opts, shard).map_err(|e| match e {
        CoreError::ModelLoad(m) if m.starts_with("config.json") => CoreError::ModelLoad(format!(
            "{}{}",
            path.display(),
            m.strip_prefix("config.json")
                .map(|r| format!("/config.json{r}"))
                .unwrap_or(m.clone())
        )),
        other => other,
    })?;
    Ok(LoadedModel {
        model: Arc::from(model),
        tokenizer: Arc::new(tokenizer),
        chat_template,
        path: path.to_path_buf(),
        name: path_name(path),
        config,
    })
}

/// The quantization method that loads the checkpoint at `path`: the one its
/// `config.json` names in `quantization_config.quant_method` (built on the
/// chosen float method), else the chosen method. Choosing a different
/// non-float method than the checkpoint's is an error unless the chosen
/// method applies over it ([`QuantMethod::over_checkpoint`]: `w8a8_fp8`
/// over an FP8 checkpoint).
fn checkpoint_quant(
    path: &Path,
    config: &serde_json::Value,
    registry: &Registry,
    opts: &LoadOptions,
) -> Result<Arc<dyn QuantMethod>> {
    let Some(qc) = config.get("quantization_config") else {
        return Ok(opts.quant.clone());
    };
    let where_ = || format!("{}", path.join("config.json").display());
    let name = qc
        .get("quant_method")
        .and_then(|v| v.as_str())
        .ok_or_else(|| {
            CoreError::load(format!(
                "{}: quantization_config.quant_method is missing",
                where_()
            ))
        })?
        .to_ascii_lowercase();
    let chosen = opts.quant.name().to_string();
    let factory = registry.quant_methods.get(&name).map_err(|_| {
        CoreError::load(format!(
            "{}: quantization_config.quant_method '{name}' is not supported (supported: {})",
            where_(),
            registry.quant_methods.names().join(", ")
        ))
    })?;
    let init = QuantInit {
        checkpoint: Some(qc.clone()),
        base: opts.quant.is_float().then(|| opts.quant.clone()),
    };
    let own = factory(&init)
        .map_err(|e| CoreError::load(format!("{}: quantization_config: {e}", where_())))?;
    if opts.quant.is_float() || chosen == name {
        return Ok(own);
    }
    opts.quant.over_checkpoint(own).ok_or_else(|| {
        CoreError::load(format!(
            "{}: the checkpoint is quantized with '{name}' (quantization_config); \
             --quantization {chosen} cannot load it",
            where_()
        ))
    })
}

/// The last component of `path` (without a file extension for files), or
/// the whole path when it has none.
pub(crate) fn path_name(path: &Path) -> String {
    let stem = if path.is_file() {
        path.file_stem()
    } else {
        path.file_name()
    };
    stem.and_then(|s| s.to_str())
        .filter(|s| !s.is_empty() && *s != "." && *s != "..")
        .map_or_else(|| path.display().to_string(), str::to_string)
}
