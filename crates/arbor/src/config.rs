//! `arbor serve` configuration: the sections (each one struct that is both
//! its TOML keys and its flags, see [`crate::settings`]), the file, and
//! their merge.
//!
//! Precedence is defaults < TOML file < flags: every TOML key and every flag
//! is optional, and [`ServeConfig::resolve`] layers each section generically
//! ([`crate::settings::layered`]). Sections mirror the crates:
//! `[model]`, `[server]`, `[scheduler]`, `[sampling]`, `[grammar]`, `[cache]`,
//! `[metrics]`, `[speculative]`, `[hicache]`, `[lora]`, `[disaggregation]`,
//! `[parallel]` and `[[plugins]]`. An unknown section or key is an error that
//! names both the section and the key. Flags use SGLang's names.

use anyhow::{Context, Result, anyhow, bail};
use clap::Args;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

pub use crate::disagg::DisaggregationSection;
pub use crate::hicache::HiCacheSection;
pub use crate::lora::LoraSection;
pub use crate::parallel::ParallelSection;
use crate::settings::{Section, layered};
pub use crate::speculative::SpeculativeSection;

/// `[model]` and its flags: what to load and on which device.
#[derive(Args, Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// Model: a Hugging Face folder, a GGUF file, or a hub id ORG/NAME (resolved through the Hugging Face cache, downloaded when missing) [default: the model `arbor fetch-default` downloads].
    #[arg(long, help_heading = "Model")]
    pub model_path: Option<PathBuf>,
    /// Branch, tag or commit of a hub id --model-path [default: main].
    #[arg(long, help_heading = "Model")]
    pub revision: Option<String>,
    /// Tokenizer (and chat template): a folder or a hub id [default: the model's].
    #[arg(long, help_heading = "Model")]
    pub tokenizer_path: Option<PathBuf>,
    /// Chat template: a Jinja file, a tokenizer_config.json holding one, or a built-in name (chatml, llama-3-instruct, mistral) [default: the tokenizer's].
    #[arg(long, help_heading = "Model")]
    pub chat_template: Option<String>,
    /// Serve embeddings (`/v1/embeddings`, `/encode`): the final normed hidden states pooled as the checkpoint's sentence-transformers config says (last token or mean; last without one), L2-normalized.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", help_heading = "Model")]
    pub is_embedding: Option<bool>,
    /// Longest sequence (prompt and output) served, at most the model's context [default: the model's max_position_embeddings].
    #[arg(long, help_heading = "Model")]
    pub context_length: Option<usize>,
    /// Model name clients use (OpenAI `model`) [default: the folder name, or the GGUF `general.name`].
    #[arg(long, help_heading = "Model")]
    pub served_model_name: Option<String>,
    /// Device: a registered backend name.
    #[arg(long, help_heading = "Model")]
    pub device: Option<String>,
    /// CPU threads, 0 for one per core.
    #[arg(long, help_heading = "Model")]
    pub threads: Option<usize>,
    /// Weight storage: auto (as the checkpoint), f32, f16 or bf16.
    #[arg(long, help_heading = "Model")]
    pub dtype: Option<String>,
    /// Quantization method, as `arbor info` lists them: fp8 (FP8 weights with f32 inputs; quantizes a float checkpoint at load), w8a8_fp8 (FP8 weights times inputs rounded to E4M3; also over an FP8 checkpoint), compressed-tensors, awq, gptq, modelopt [default: the checkpoint's quantization_config, else none].
    #[arg(long, help_heading = "Model")]
    pub quantization: Option<String>,
    /// KV cache element type: auto (fp8_e4m3 for a checkpoint with FP8 KV scales where the device stores it, else f16 on the CPU, f32 on other devices), f32, f16, bf16, fp8_e4m3 or fp8_e5m2.
    #[arg(long, help_heading = "Model")]
    pub kv_cache_dtype: Option<String>,
    /// wgpu adapter (`--device wgpu`): a case-insensitive part of its name, as `arbor info` lists them [default: the first; env ARBOR_WGPU_ADAPTER].
    #[arg(long, help_heading = "Model")]
    pub wgpu_adapter: Option<String>,
    /// CPU: how HF-quantized weights (FP8, AWQ, GPTQ, W4A16/W8A16, NVFP4) are multiplied: f32 (f32 activations; fastest for one sequence) or amx-bf16 (bf16 weights and activations in AMX tiles: several times faster for batches and prefill, about 0.7x the speed for one sequence; f32 on CPUs without AMX). GGUF formats are unaffected.
    #[arg(long, help_heading = "Model")]
    pub cpu_quant_matmul: Option<String>,
    /// Recurrent state slots of a hybrid model (Qwen3.5, Qwen3-Next): one per running request, the rest for snapshots of cached prefixes [default: twice max-running-requests].
    #[arg(long, help_heading = "Model")]
    pub max_mamba_cache_size: Option<usize>,
    /// Recurrent state memory of a hybrid model over its KV cache's (SGLang's): sizes the slots when max-mamba-cache-size is not given. Under the memory rule (mem-fraction-static) the slots and the KV cache share what the weights leave in this ratio; with max-total-tokens or kv-cache-gb the slots get this times the KV cache's bytes [default: unset: twice max-running-requests slots].
    #[arg(long, help_heading = "Model")]
    pub mamba_full_memory_ratio: Option<f64>,
    /// Element type of a hybrid model's recurrent state: float32 (the only one supported).
    #[arg(long, help_heading = "Model")]
    pub mamba_ssm_dtype: Option<String>,
    /// Run decode batches without CUDA graphs (`--device cuda`).
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", help_heading = "Model")]
    pub disable_cuda_graph: Option<bool>,
    /// Largest decode batch run as a CUDA graph [default: max-running-requests].
    #[arg(long, help_heading = "Model")]
    pub cuda_graph_max_bs: Option<usize>,
    /// Accepted for SGLang's commands: Arbor runs no code from a checkpoint
    /// (every architecture is its own), so this changes nothing; the
    /// summary says so.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", help_heading = "Model")]
    pub trust_remote_code: Option<bool>,
}

impl Section for ModelSection {
    fn defaults() -> Self {
        Self {
            device: Some("cpu".into()),
            threads: Some(0),
            dtype: Some("auto".into()),
            kv_cache_dtype: Some("auto".into()),
            cpu_quant_matmul: Some("f32".into()),
            mamba_ssm_dtype: Some("float32".into()),
            disable_cuda_graph: Some(false),
            trust_remote_code: Some(false),
            is_embedding: Some(false),
            ..Default::default()
        }
    }

    fn settle(&mut self) {
        if self.wgpu_adapter.is_none() {
            self.wgpu_adapter = std::env::var("ARBOR_WGPU_ADAPTER").ok();
        }
    }
}

/// `[server]` and its flags: the HTTP listener.
#[derive(Args, Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ServerSection {
    /// Address to listen on.
    #[arg(long, help_heading = "Server")]
    pub host: Option<String>,
    /// Port to listen on; 0 picks a free one.
    #[arg(long, help_heading = "Server")]
    pub port: Option<u16>,
    /// Require `Authorization: Bearer <key>` on every route but /health*.
    #[arg(long, help_heading = "Server")]
    pub api_key: Option<String>,
    /// Largest request body in bytes; larger ones get 413.
    #[arg(long, help_heading = "Server")]
    pub max_request_bytes: Option<usize>,
    /// Seconds in-flight requests get to finish on SIGTERM before they are aborted.
    #[arg(long, help_heading = "Server")]
    pub shutdown_timeout: Option<f64>,
    /// Separate reasoning into `reasoning_content` of chat answers: deepseek-r1, deepseek-v3, qwen3, qwen3-thinking, glm45, kimi or gpt-oss [default: off].
    #[arg(long, help_heading = "Server")]
    pub reasoning_parser: Option<String>,
    /// Format of the tool calls chat answers hold with `tool_choice: auto` (SGLang's names): qwen25, llama3, mistral, qwen3_coder, deepseekv3, deepseekv31, kimi_k2, glm45, gpt-oss or pythonic [default: qwen25's `<tool_call>` blocks].
    #[arg(long, help_heading = "Server")]
    pub tool_call_parser: Option<String>,
    /// Log each request when it is enqueued and each sample when it finishes (target `arbor::requests`).
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", help_heading = "Server")]
    pub log_requests: Option<bool>,
    /// What --log-requests logs: 0 metadata, 1 and the sampling parameters, 2 and the texts cut to 2048 characters, 3 and the whole texts.
    #[arg(long, help_heading = "Server")]
    pub log_requests_level: Option<u8>,
}

impl Section for ServerSection {
    fn defaults() -> Self {
        Self {
            host: Some("127.0.0.1".into()),
            port: Some(30000),
            max_request_bytes: Some(32 * 1024 * 1024),
            shutdown_timeout: Some(30.0),
            log_requests: Some(false),
            log_requests_level: Some(2),
            ..Default::default()
        }
    }
}

/// `[scheduler]` and its flags: batching and admission (engine-core).
#[derive(Args, Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SchedulerSection {
    /// Most requests decoding at once.
    #[arg(long, help_heading = "Scheduler")]
    pub max_running_requests: Option<usize>,
    /// Most requests waiting; more are refused.
    #[arg(long, help_heading = "Scheduler")]
    pub max_queued_requests: Option<usize>,
    /// Most new prompt tokens in one prefill batch.
    #[arg(long, help_heading = "Scheduler")]
    pub max_prefill_tokens: Option<usize>,
    /// Most prompt tokens of one request per iteration; -1 disables chunking.
    #[arg(long, allow_negative_numbers = true, help_heading = "Scheduler")]
    pub chunked_prefill_size: Option<i64>,
    /// Admission order: fcfs, lpm, dfs-weight, lof, priority, random.
    #[arg(long, help_heading = "Scheduler")]
    pub schedule_policy: Option<String>,
    /// Scales the expected output of running requests; higher admits fewer.
    #[arg(long, help_heading = "Scheduler")]
    pub schedule_conservativeness: Option<f32>,
    /// Run the decodes of running requests in the same batch as a prefill.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", help_heading = "Scheduler")]
    pub enable_mixed_chunk: Option<bool>,
    /// Tokens per KV page.
    #[arg(long, help_heading = "Scheduler")]
    pub page_size: Option<usize>,
    /// Accepted for SGLang's commands: Arbor's output is batch-invariant
    /// (greedy tokens do not depend on batching, caching or chunking)
    /// whatever this says; the summary says so.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", help_heading = "Scheduler")]
    pub enable_deterministic_inference: Option<bool>,
    /// Admit the next batch (and fill grammar masks) while the forward runs
    /// [default: on for asynchronous devices, off on the CPU]. Flags:
    /// --enable-overlap-schedule, --disable-overlap-schedule.
    #[arg(skip)]
    pub overlap_schedule: Option<bool>,
    /// Admit the next batch while the forward runs (`overlap_schedule = true`).
    #[arg(
        long,
        help_heading = "Scheduler",
        conflicts_with = "disable_overlap_schedule"
    )]
    #[serde(skip)]
    pub enable_overlap_schedule: bool,
    /// Never overlap scheduling with the forward (`overlap_schedule = false`).
    #[arg(long, help_heading = "Scheduler")]
    #[serde(skip)]
    pub disable_overlap_schedule: bool,
}

impl Section for SchedulerSection {
    fn defaults() -> Self {
        Self {
            max_running_requests: Some(64),
            max_queued_requests: Some(4096),
            max_prefill_tokens: Some(8192),
            chunked_prefill_size: Some(2048),
            schedule_policy: Some("lpm".into()),
            schedule_conservativeness: Some(1.0),
            enable_mixed_chunk: Some(false),
            page_size: Some(16),
            enable_deterministic_inference: Some(false),
            ..Default::default()
        }
    }

    fn fold_flags(&mut self) {
        if self.enable_overlap_schedule {
            self.overlap_schedule = Some(true);
        }
        if self.disable_overlap_schedule {
            self.overlap_schedule = Some(false);
        }
    }
}

/// `[sampling]` and its flags: the sampler and the logits processors every request runs through.
#[derive(Args, Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SamplingSection {
    /// Sampler: a registered name, e.g. one a plugin provides.
    #[arg(long, help_heading = "Sampling")]
    pub sampler: Option<String>,
    /// Registered logits processors, in order; those of loaded plugins are appended.
    #[arg(long, num_args = 1.., help_heading = "Sampling")]
    pub logits_processors: Option<Vec<String>>,
}

impl Section for SamplingSection {
    fn defaults() -> Self {
        Self {
            sampler: Some("standard".into()),
            logits_processors: Some(vec!["penalties".into(), "logit_bias".into()]),
        }
    }
}

/// `[grammar]` and its flags: structured output (crates/grammar).
#[derive(Args, Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct GrammarSection {
    /// Grammar backend for structured output, or "none".
    #[arg(long, help_heading = "Grammar")]
    pub grammar_backend: Option<String>,
    /// JSON whitespace between tokens: "compact" (none) or "flexible" (any).
    #[arg(long, help_heading = "Grammar")]
    pub json_whitespace: Option<String>,
    /// Allow any JSON whitespace between tokens (`json_whitespace = "flexible"`).
    #[arg(long, help_heading = "Grammar")]
    #[serde(skip)]
    pub constrained_json_any_whitespace: bool,
    /// Whitespace allowed between JSON tokens, as a regex (overrides json_whitespace).
    #[arg(long = "constrained-json-whitespace-pattern", help_heading = "Grammar")]
    pub json_whitespace_pattern: Option<String>,
    /// Compile schemas with keywords the backend cannot enforce by ignoring them.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", help_heading = "Grammar")]
    pub json_lenient: Option<bool>,
    /// Refuse schemas whose oneOf branches may overlap instead of compiling them as anyOf.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", help_heading = "Grammar")]
    pub json_strict_one_of: Option<bool>,
    /// Append the tokens a grammar forces without a forward pass each (flag: --disable-jump-forward).
    #[arg(skip)]
    pub jump_forward: Option<bool>,
    /// Sample every forced token too instead of appending them without a forward pass (`jump_forward = false`).
    #[arg(long, help_heading = "Grammar")]
    #[serde(skip)]
    pub disable_jump_forward: bool,
    /// Compiled grammars kept.
    #[arg(long = "grammar-cache-size", help_heading = "Grammar")]
    pub cache_size: Option<usize>,
    /// Longest grammar text accepted, in bytes.
    #[arg(long, help_heading = "Grammar")]
    pub max_grammar_bytes: Option<usize>,
    /// Seconds a request waits for its grammar to compile.
    #[arg(long = "grammar-compile-timeout", help_heading = "Grammar")]
    pub compile_timeout: Option<f64>,
}

impl Section for GrammarSection {
    fn defaults() -> Self {
        Self {
            grammar_backend: Some(DEFAULT_GRAMMAR_BACKEND.into()),
            json_whitespace: Some("compact".into()),
            json_lenient: Some(false),
            json_strict_one_of: Some(false),
            jump_forward: Some(true),
            cache_size: Some(1024),
            max_grammar_bytes: Some(4 << 20),
            compile_timeout: Some(10.0),
            ..Default::default()
        }
    }

    fn fold_flags(&mut self) {
        if self.constrained_json_any_whitespace {
            self.json_whitespace = Some("flexible".into());
        }
        if self.disable_jump_forward {
            self.jump_forward = Some(false);
        }
    }
}

/// `[cache]` and its flags: KV cache size and the prefix cache (kv-radix).
#[derive(Args, Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CacheSection {
    /// Turn prefix reuse off (no radix cache).
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", help_heading = "Cache")]
    pub disable_radix_cache: Option<bool>,
    /// Which cached prefix is evicted first: lru, lfu, fifo, mru, filo, priority, slru.
    #[arg(long, help_heading = "Cache")]
    pub radix_eviction_policy: Option<String>,
    /// KV cache size in tokens; overrides --mem-fraction-static.
    #[arg(long, help_heading = "Cache")]
    pub max_total_tokens: Option<usize>,
    /// KV cache size in GiB (whole pages of the model's KV layout); overrides --mem-fraction-static, not --max-total-tokens.
    #[arg(long, help_heading = "Cache")]
    pub kv_cache_gb: Option<f64>,
    /// Share of available memory (MemAvailable) for weights plus KV cache; the KV part is capped at 4 GiB (2 GiB of f16 or bf16 on the CPU) and at max-running-requests x context.
    #[arg(long, help_heading = "Cache")]
    pub mem_fraction_static: Option<f64>,
    /// Share of the KV cache that open sessions may hold against eviction (their latest turns), 0 to 1; 0 turns holds off.
    #[arg(long, help_heading = "Cache")]
    pub session_hold_ratio: Option<f64>,
}

impl Section for CacheSection {
    fn defaults() -> Self {
        Self {
            disable_radix_cache: Some(!cfg!(feature = "kv-radix")),
            radix_eviction_policy: Some("lru".into()),
            mem_fraction_static: Some(0.8),
            session_hold_ratio: Some(0.25),
            ..Default::default()
        }
    }
}

/// `[metrics]` and its flags: Prometheus and usage reporting.
#[derive(Args, Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct MetricsSection {
    /// Serve Prometheus metrics at /metrics.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", help_heading = "Metrics")]
    pub enable_metrics: Option<bool>,
    /// Metric name prefix; "sglang" makes SGLang dashboards work.
    #[arg(long = "metrics-prefix", help_heading = "Metrics")]
    pub prefix: Option<String>,
    /// Report cached prompt tokens in OpenAI usage.prompt_tokens_details.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", help_heading = "Metrics")]
    pub enable_cache_report: Option<bool>,
}

impl Section for MetricsSection {
    fn defaults() -> Self {
        Self {
            enable_metrics: Some(false),
            prefix: Some("arbor".into()),
            enable_cache_report: Some(false),
        }
    }
}

/// One `[[plugins]]` entry: a plugin library and the config handed to it.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PluginEntry {
    /// The plugin library.
    pub path: PathBuf,
    /// Settings handed to the plugin.
    #[serde(default)]
    pub config: Option<toml::Table>,
}

/// A parsed `arbor.toml`.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct FileConfig {
    pub model: ModelSection,
    pub server: ServerSection,
    pub scheduler: SchedulerSection,
    pub sampling: SamplingSection,
    pub grammar: GrammarSection,
    pub cache: CacheSection,
    pub metrics: MetricsSection,
    pub speculative: SpeculativeSection,
    pub hicache: HiCacheSection,
    pub lora: LoraSection,
    pub disaggregation: DisaggregationSection,
    pub parallel: ParallelSection,
    pub plugins: Vec<PluginEntry>,
}

const SECTIONS: &str = "[model], [server], [scheduler], [sampling], [grammar], [cache], [metrics], \
                        [speculative], [hicache], [lora], [disaggregation], [parallel], [[plugins]]";

fn section<T: DeserializeOwned>(name: &str, v: toml::Value) -> Result<T> {
    if !v.is_table() {
        bail!("[{name}] must be a table");
    }
    v.try_into().map_err(|e: toml::de::Error| {
        let msg = e.message().trim().to_string();
        match msg
            .strip_prefix("unknown field `")
            .and_then(|r| r.split_once('`'))
        {
            Some((key, rest)) => anyhow!("unknown key '{key}' in section [{name}]{rest}"),
            None => anyhow!("in section [{name}]: {msg}"),
        }
    })
}

impl FileConfig {
    /// Parses TOML text.
    pub fn parse(text: &str) -> Result<Self> {
        let table: toml::Table = toml::from_str(text)?;
        let mut c = FileConfig::default();
        for (k, v) in table {
            match k.as_str() {
                "model" => c.model = section(&k, v)?,
                "server" => c.server = section(&k, v)?,
                "scheduler" => c.scheduler = section(&k, v)?,
                "sampling" => c.sampling = section(&k, v)?,
                "grammar" => c.grammar = section(&k, v)?,
                "cache" => c.cache = section(&k, v)?,
                "metrics" => c.metrics = section(&k, v)?,
                "speculative" => c.speculative = section(&k, v)?,
                "hicache" => c.hicache = section(&k, v)?,
                "lora" => c.lora = section(&k, v)?,
                "disaggregation" => c.disaggregation = section(&k, v)?,
                "parallel" => c.parallel = section(&k, v)?,
                "plugins" => {
                    let toml::Value::Array(items) = v else {
                        bail!("'plugins' must be an array of tables ([[plugins]])");
                    };
                    for it in items {
                        c.plugins.push(section("[plugins]", it)?);
                    }
                }
                other => bail!("unknown section [{other}] (known sections: {SECTIONS})"),
            }
        }
        Ok(c)
    }

    /// Reads and parses a file; errors name the file.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the config file {}", path.display()))?;
        Self::parse(&text).with_context(|| format!("config file {}", path.display()))
    }
}

/// Flags of `arbor serve` (SGLang's names): every section's flags, from
/// the same structs as the TOML sections. Each overrides the TOML value.
#[derive(Args, Debug, Clone, Default)]
pub struct ServeArgs {
    /// TOML configuration file (see examples/arbor.toml); flags override it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub model: ModelSection,
    #[command(flatten)]
    pub server: ServerSection,
    #[command(flatten)]
    pub scheduler: SchedulerSection,
    #[command(flatten)]
    pub sampling: SamplingSection,
    #[command(flatten)]
    pub grammar: GrammarSection,
    #[command(flatten)]
    pub cache: CacheSection,
    #[command(flatten)]
    pub metrics: MetricsSection,
    #[command(flatten)]
    pub speculative: SpeculativeSection,
    #[command(flatten)]
    pub hicache: HiCacheSection,
    #[command(flatten)]
    pub lora: LoraSection,
    #[command(flatten)]
    pub disaggregation: DisaggregationSection,
    #[command(flatten)]
    pub parallel: ParallelSection,
    /// Load a plugin library (repeatable; adds to [[plugins]] in the config file).
    #[arg(long = "plugin", value_name = "PATH", help_heading = "Plugins")]
    pub plugin: Vec<PathBuf>,
    /// Print the merged configuration as TOML and exit.
    #[arg(long = "print-config")]
    pub print_config: bool,
}

/// Every section's defaults, for `arbor serve --help` and the reference pages.
pub fn serve_defaults() -> Vec<(String, String)> {
    use crate::settings::default_values;
    [
        default_values::<ModelSection>(),
        default_values::<ServerSection>(),
        default_values::<SchedulerSection>(),
        default_values::<SamplingSection>(),
        default_values::<GrammarSection>(),
        default_values::<CacheSection>(),
        default_values::<MetricsSection>(),
        default_values::<SpeculativeSection>(),
        default_values::<HiCacheSection>(),
        default_values::<LoraSection>(),
        default_values::<DisaggregationSection>(),
        default_values::<ParallelSection>(),
    ]
    .concat()
}

/// The merged settings of `arbor serve`.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct ServeConfig {
    pub model: ModelSection,
    pub server: ServerSection,
    pub scheduler: SchedulerSection,
    pub sampling: SamplingSection,
    pub grammar: GrammarSection,
    pub cache: CacheSection,
    pub metrics: MetricsSection,
    pub speculative: SpeculativeSection,
    pub hicache: HiCacheSection,
    pub lora: LoraSection,
    pub disaggregation: DisaggregationSection,
    pub parallel: ParallelSection,
    pub plugins: Vec<PluginEntry>,
}

/// The grammar backend when none is configured ("none" without the `grammar` feature).
const DEFAULT_GRAMMAR_BACKEND: &str = if cfg!(feature = "grammar") {
    "llguidance"
} else {
    "none"
};

/// Refuses settings of features this binary was built without, naming the
/// cargo feature (what the file and the flags set, before the defaults).
fn compiled_out_check(file: &FileConfig, a: &ServeArgs) -> Result<()> {
    let backend = a
        .grammar
        .grammar_backend
        .clone()
        .or(file.grammar.grammar_backend.clone());
    if !cfg!(feature = "grammar")
        && let Some(b) = backend.filter(|b| b != "none")
    {
        bail!(
            "[grammar] grammar_backend / --grammar-backend '{b}': this binary was built without \
             structured output; rebuild arbor with the `grammar` cargo feature"
        );
    }
    if !cfg!(feature = "kv-radix") {
        let (c, f) = (&file.cache, &a.cache);
        let wants_radix = c.disable_radix_cache == Some(false)
            || f.disable_radix_cache == Some(false)
            || f.radix_eviction_policy.is_some()
            || c.radix_eviction_policy.is_some();
        if wants_radix {
            bail!(
                "[cache] radix cache settings (disable_radix_cache = false, radix_eviction_policy / \
                 --radix-eviction-policy): this binary was built without prefix reuse; rebuild \
                 arbor with the `kv-radix` cargo feature"
            );
        }
    }
    Ok(())
}

impl ServeConfig {
    /// Defaults < `file` < `args`, with every default filled in (except
    /// `model_path`, `served_model_name`, `api_key` and `max_total_tokens`,
    /// which stay optional).
    pub fn resolve(file: FileConfig, a: &ServeArgs) -> Result<Self> {
        compiled_out_check(&file, a)?;
        let mut plugins = file.plugins;
        plugins.extend(a.plugin.iter().map(|p| PluginEntry {
            path: p.clone(),
            config: None,
        }));
        let cfg = ServeConfig {
            model: layered(file.model, &a.model),
            server: layered(file.server, &a.server),
            scheduler: layered(file.scheduler, &a.scheduler),
            sampling: layered(file.sampling, &a.sampling),
            grammar: layered(file.grammar, &a.grammar),
            cache: layered(file.cache, &a.cache),
            metrics: layered(file.metrics, &a.metrics),
            speculative: layered(file.speculative, &a.speculative),
            hicache: layered(file.hicache, &a.hicache),
            lora: layered(file.lora, &a.lora),
            disaggregation: layered(file.disaggregation, &a.disaggregation),
            parallel: layered(file.parallel, &a.parallel),
            plugins,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Loads `--config` (if any) and merges the flags.
    pub fn from_args(a: &ServeArgs) -> Result<Self> {
        let file = match &a.config {
            Some(p) => FileConfig::load(p)?,
            None => FileConfig::default(),
        };
        Self::resolve(file, a)
    }

    fn validate(&self) -> Result<()> {
        if let Some(d) = self.model.kv_cache_dtype.as_deref() {
            d.parse::<arbor_engine_core::KvDtypeChoice>()
                .context("[model] kv_cache_dtype / --kv-cache-dtype")?;
        }
        if let Some(d) = self.model.mamba_ssm_dtype.as_deref()
            && !matches!(d, "float32" | "f32")
        {
            bail!(
                "[model] mamba_ssm_dtype / --mamba-ssm-dtype: the recurrent state is kept in \
                 float32 only, got \"{d}\""
            );
        }
        if let Some(r) = self.model.mamba_full_memory_ratio
            && !(r.is_finite() && r > 0.0)
        {
            bail!(
                "[model] mamba_full_memory_ratio / --mamba-full-memory-ratio must be a positive \
                 number, got {r}"
            );
        }
        if self.model.max_mamba_cache_size == Some(0) {
            bail!("[model] max_mamba_cache_size / --max-mamba-cache-size must be at least 1");
        }
        if let Some(q) = self.model.cpu_quant_matmul.as_deref() {
            q.parse::<arbor_engine_core::QuantMatmul>()
                .context("[model] cpu_quant_matmul / --cpu-quant-matmul")?;
        }
        if let Some(w) = self.grammar.json_whitespace.as_deref()
            && !matches!(w, "compact" | "flexible")
        {
            bail!("[grammar] json_whitespace must be \"compact\" or \"flexible\", got \"{w}\"");
        }
        if self.grammar.cache_size == Some(0) {
            bail!("[grammar] cache_size must be at least 1");
        }
        if self
            .grammar
            .compile_timeout
            .is_some_and(|t| t.is_nan() || t <= 0.0)
        {
            bail!("[grammar] compile_timeout must be positive");
        }
        let f = self.mem_fraction_static();
        if !(f > 0.0 && f <= 1.0) {
            bail!("[cache] mem_fraction_static / --mem-fraction-static must be in (0, 1], got {f}");
        }
        if let Some(g) = self.cache.kv_cache_gb
            && !(g.is_finite() && g > 0.0)
        {
            bail!("[cache] kv_cache_gb / --kv-cache-gb must be a positive number of GiB, got {g}");
        }
        if let Some(r) = self.cache.session_hold_ratio
            && !(0.0..=1.0).contains(&r)
        {
            bail!("[cache] session_hold_ratio / --session-hold-ratio must be in [0, 1], got {r}");
        }
        if self.cache.max_total_tokens == Some(0) {
            bail!("[cache] max_total_tokens / --max-total-tokens must be positive");
        }
        if self.page_size() == 0 {
            bail!("[scheduler] page_size / --page-size must be positive");
        }
        let t = self.server.shutdown_timeout.unwrap_or(0.0);
        if !(t.is_finite() && t >= 0.0) {
            bail!("[server] shutdown_timeout / --shutdown-timeout must be >= 0 seconds, got {t}");
        }
        if self.server.max_request_bytes == Some(0) {
            bail!("[server] max_request_bytes / --max-request-bytes must be positive");
        }
        if self.server.api_key.as_deref() == Some("") {
            bail!("[server] api_key / --api-key must not be empty");
        }
        self.reasoning_parser()?;
        self.log_requests()?;
        self.tool_call_parser()?;
        self.speculative.to_engine()?;
        self.hicache
            .to_settings(self.cache.disable_radix_cache.unwrap_or(false))?;
        self.lora.to_settings()?;
        self.disaggregation
            .to_settings(self.cache.disable_radix_cache.unwrap_or(false))?;
        self.parallel.to_settings()?;
        Ok(())
    }

    /// The reasoning parser, if any (an unknown name is an error naming the flag).
    pub fn reasoning_parser(&self) -> Result<Option<arbor_server::reasoning::ReasoningParser>> {
        self.server
            .reasoning_parser
            .as_deref()
            .map(|n| {
                n.parse().map_err(|e| {
                    anyhow::anyhow!("[server] reasoning_parser / --reasoning-parser: {e}")
                })
            })
            .transpose()
    }

    /// The tool-call parser, if any (an unknown name is an error naming the flag).
    pub fn tool_call_parser(&self) -> Result<Option<arbor_server::tool_call::ToolCallParser>> {
        self.server
            .tool_call_parser
            .as_deref()
            .map(|n| {
                n.parse().map_err(|e| {
                    anyhow::anyhow!("[server] tool_call_parser / --tool-call-parser: {e}")
                })
            })
            .transpose()
    }

    /// The `--log-requests` level, when on (a level past 3 is an error naming the flag).
    pub fn log_requests(&self) -> Result<Option<arbor_server::request_log::LogLevel>> {
        if !self.server.log_requests.unwrap_or(false) {
            return Ok(None);
        }
        let level = self.server.log_requests_level.unwrap_or(2);
        arbor_server::request_log::LogLevel::new(level)
            .map(Some)
            .ok_or_else(|| {
                anyhow!(
                    "[server] log_requests_level / --log-requests-level must be 0 to {}, got {level}",
                    arbor_server::request_log::LogLevel::MAX
                )
            })
    }

    pub fn page_size(&self) -> usize {
        self.scheduler.page_size.unwrap_or(16)
    }

    pub fn mem_fraction_static(&self) -> f64 {
        self.cache.mem_fraction_static.unwrap_or(0.8)
    }

    /// The configuration as TOML, with the API key redacted.
    pub fn to_toml(&self) -> Result<String> {
        let mut c = self.clone();
        if c.server.api_key.is_some() {
            c.server.api_key = Some("<redacted>".into());
        }
        Ok(toml::to_string(&c)?)
    }

    /// The configuration as JSON (for /get_server_info), with the API key redacted.
    pub fn to_json(&self) -> serde_json::Value {
        let mut c = self.clone();
        if c.server.api_key.is_some() {
            c.server.api_key = Some("<redacted>".into());
        }
        serde_json::to_value(&c).unwrap_or(serde_json::Value::Null)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precedence_defaults_file_flags() {
        let file = FileConfig::parse(
            "[server]\nport = 1234\nhost = \"0.0.0.0\"\n[scheduler]\nmax_running_requests = 8\n[metrics]\nprefix = \"sglang\"\n",
        )
        .unwrap();
        let mut args = ServeArgs::default();
        args.server.port = Some(999);
        args.metrics.enable_metrics = Some(true);
        let c = ServeConfig::resolve(file, &args).unwrap();
        assert_eq!(c.server.port, Some(999), "flag beats file");
        assert_eq!(
            c.server.host.as_deref(),
            Some("0.0.0.0"),
            "file beats default"
        );
        assert_eq!(c.scheduler.max_running_requests, Some(8));
        assert_eq!(c.scheduler.max_prefill_tokens, Some(8192), "default");
        assert_eq!(c.metrics.prefix.as_deref(), Some("sglang"));
        assert_eq!(c.metrics.enable_metrics, Some(true));
        assert!(c.to_toml().unwrap().contains("port = 999"));
    }

    #[test]
    fn unknown_keys_and_sections_are_named() {
        let e = FileConfig::parse("[scheduler]\nmax_runing_requests = 8\n").unwrap_err();
        let m = format!("{e:#}");
        assert!(
            m.contains("max_runing_requests") && m.contains("[scheduler]"),
            "{m}"
        );
        let e = FileConfig::parse("[hicache]\nratio = 2\n").unwrap_err();
        assert!(format!("{e:#}").contains("unknown key 'ratio' in section [hicache]"));
        let e = FileConfig::parse("[tiers]\nratio = 2\n").unwrap_err();
        assert!(format!("{e:#}").contains("unknown section [tiers]"));
        let e = FileConfig::parse("[server]\nport = \"x\"\n").unwrap_err();
        assert!(format!("{e:#}").contains("[server]"));
    }

    #[test]
    fn plugins_from_file_and_flags() {
        let f = FileConfig::parse(
            "[[plugins]]\npath = \"libx.so\"\nconfig = { token_ids = [1, 2] }\n[sampling]\nsampler = \"mine\"\n",
        )
        .unwrap();
        assert_eq!(f.plugins.len(), 1);
        let args = ServeArgs {
            plugin: vec!["liby.so".into()],
            ..Default::default()
        };
        let c = ServeConfig::resolve(f, &args).unwrap();
        let paths: Vec<_> = c
            .plugins
            .iter()
            .map(|p| p.path.display().to_string())
            .collect();
        assert_eq!(paths, vec!["libx.so", "liby.so"]);
        assert!(c.plugins[0].config.is_some());
        assert_eq!(c.sampling.sampler.as_deref(), Some("mine"));
        let e = FileConfig::parse("[sampling]\nsamplr = \"x\"\n").unwrap_err();
        assert!(format!("{e:#}").contains("unknown key 'samplr' in section [sampling]"));
    }

    #[test]
    fn kv_cache_dtype_defaults_to_auto_and_bad_values_name_the_key() {
        let c = ServeConfig::resolve(FileConfig::default(), &ServeArgs::default()).unwrap();
        assert_eq!(c.model.kv_cache_dtype.as_deref(), Some("auto"));
        let f = FileConfig::parse("[model]\nkv_cache_dtype = \"bf16\"\n").unwrap();
        let c = ServeConfig::resolve(f.clone(), &ServeArgs::default()).unwrap();
        assert_eq!(c.model.kv_cache_dtype.as_deref(), Some("bf16"));
        let mut flag = ServeArgs::default();
        flag.model.kv_cache_dtype = Some("f32".into());
        let c = ServeConfig::resolve(f, &flag).unwrap();
        assert_eq!(
            c.model.kv_cache_dtype.as_deref(),
            Some("f32"),
            "flag beats file"
        );
        let bad = FileConfig::parse("[model]\nkv_cache_dtype = \"int3\"\n").unwrap();
        let e = ServeConfig::resolve(bad, &ServeArgs::default()).unwrap_err();
        let m = format!("{e:#}");
        assert!(
            m.contains("[model] kv_cache_dtype / --kv-cache-dtype") && m.contains("int3"),
            "{m}"
        );
    }

    #[test]
    fn cpu_quant_matmul_defaults_to_f32_and_bad_values_name_the_key() {
        let c = ServeConfig::resolve(FileConfig::default(), &ServeArgs::default()).unwrap();
        assert_eq!(c.model.cpu_quant_matmul.as_deref(), Some("f32"));
        let f = FileConfig::parse("[model]\ncpu_quant_matmul = \"amx-bf16\"\n").unwrap();
        let c = ServeConfig::resolve(f.clone(), &ServeArgs::default()).unwrap();
        assert_eq!(c.model.cpu_quant_matmul.as_deref(), Some("amx-bf16"));
        let mut flag = ServeArgs::default();
        flag.model.cpu_quant_matmul = Some("f32".into());
        let c = ServeConfig::resolve(f, &flag).unwrap();
        assert_eq!(
            c.model.cpu_quant_matmul.as_deref(),
            Some("f32"),
            "flag beats file"
        );
        let bad = FileConfig::parse("[model]\ncpu_quant_matmul = \"fp4\"\n").unwrap();
        let m = format!(
            "{:#}",
            ServeConfig::resolve(bad, &ServeArgs::default()).unwrap_err()
        );
        assert!(
            m.contains("[model] cpu_quant_matmul / --cpu-quant-matmul") && m.contains("fp4"),
            "{m}"
        );
    }

    #[test]
    fn overlap_schedule_file_and_flags() {
        let on = FileConfig::parse("[scheduler]\noverlap_schedule = true\n").unwrap();
        let c = ServeConfig::resolve(on.clone(), &ServeArgs::default()).unwrap();
        assert_eq!(c.scheduler.overlap_schedule, Some(true));
        let mut off = ServeArgs::default();
        off.scheduler.disable_overlap_schedule = true;
        let c = ServeConfig::resolve(on, &off).unwrap();
        assert_eq!(c.scheduler.overlap_schedule, Some(false), "flag beats file");
        let c = ServeConfig::resolve(FileConfig::default(), &ServeArgs::default()).unwrap();
        assert_eq!(c.scheduler.overlap_schedule, None, "auto by default");
        let mut enable = ServeArgs::default();
        enable.scheduler.enable_overlap_schedule = true;
        let c = ServeConfig::resolve(FileConfig::default(), &enable).unwrap();
        assert_eq!(c.scheduler.overlap_schedule, Some(true));
    }

    /// examples/arbor.toml shows every key of every section (set, or as a
    /// commented-out `# key = ...` line under its section), and the file as
    /// shipped parses.
    #[test]
    fn example_config_shows_every_key() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/arbor.toml");
        let text = std::fs::read_to_string(path).unwrap();
        FileConfig::parse(&text).unwrap();
        let all = serde_json::to_value(FileConfig::default()).unwrap();
        let mut missing = Vec::new();
        for (name, keys) in all.as_object().unwrap() {
            let Some(keys) = keys.as_object() else {
                continue; // [[plugins]]: an array of tables, shown commented out
            };
            let header = format!("[{name}]");
            let body = text
                .split_once(&format!("\n{header}\n"))
                .map(|(_, rest)| rest.split("\n[").next().unwrap_or(""))
                .unwrap_or_else(|| panic!("examples/arbor.toml has no {header}"));
            for key in keys.keys() {
                let shown = body.lines().any(|l| {
                    let l = l.trim_start_matches('#').trim_start();
                    l.strip_prefix(key.as_str())
                        .is_some_and(|r| r.trim_start().starts_with('='))
                });
                if !shown {
                    missing.push(format!("{header} {key}"));
                }
            }
        }
        assert!(text.contains("[[plugins]]"));
        assert!(missing.is_empty(), "examples/arbor.toml lacks {missing:?}");
    }

    /// Every TOML key is a flag and every flag a key (but `--config`,
    /// `--print-config`, `--plugin` for `[[plugins]]`, and the flags that
    /// spell a key differently, folded into it), each with one default:
    /// the one `Section::defaults` declares, which `--help` shows.
    #[test]
    fn every_flag_has_its_key_and_one_default() {
        let cmd = crate::cli_command();
        let serve = cmd.find_subcommand("serve").unwrap();
        let flag_ids: std::collections::BTreeSet<String> = serve
            .get_arguments()
            .filter(|a| a.get_long().is_some())
            .map(|a| a.get_id().to_string())
            .collect();
        let all = serde_json::to_value(FileConfig::default()).unwrap();
        let mut keys = std::collections::BTreeSet::new();
        for (section, v) in all.as_object().unwrap() {
            let Some(v) = v.as_object() else { continue };
            for key in v.keys() {
                keys.insert(key.clone());
                let file_only = [
                    ("scheduler", "overlap_schedule"),
                    ("grammar", "jump_forward"),
                ];
                if !file_only.contains(&(section.as_str(), key.as_str())) {
                    assert!(flag_ids.contains(key), "[{section}] {key} has no flag");
                }
            }
        }
        let folded = [
            "enable_overlap_schedule",
            "disable_overlap_schedule",
            "constrained_json_any_whitespace",
            "disable_jump_forward",
            "disable_speculative_adaptive",
        ];
        for id in &flag_ids {
            let not_a_setting = ["config", "print_config", "plugin", "help"];
            if !not_a_setting.contains(&id.as_str()) && !folded.contains(&id.as_str()) {
                assert!(keys.contains(id), "--{id} has no TOML key");
            }
        }
        // One default: the help shows the declared one, and a config with
        // nothing set resolves to it.
        let resolved = serde_json::to_value(
            ServeConfig::resolve(FileConfig::default(), &ServeArgs::default()).unwrap(),
        )
        .unwrap();
        for (key, value) in serve_defaults() {
            let arg = serve.get_arguments().find(|a| a.get_id() == key.as_str());
            if let Some(arg) = arg {
                let help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
                assert!(
                    help.contains(&format!("[default: {value}]")),
                    "--{key}: help {help:?} does not show the default {value}"
                );
            }
            let found = resolved
                .as_object()
                .unwrap()
                .values()
                .filter_map(|s| s.get(&key))
                .any(|v| !v.is_null());
            assert!(
                found,
                "{key}: the default {value} is not in the resolved config"
            );
        }
    }
}
