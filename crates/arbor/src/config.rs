//! `arbor serve` configuration: the TOML schema, the command-line flags, and
//! their merge.
//!
//! Precedence is defaults < TOML file < flags: every TOML key and every flag
//! is optional, and [`ServeConfig::resolve`] takes, per setting, the flag if
//! given, else the TOML value, else the default. Sections mirror the crates:
//! `[model]`, `[server]`, `[scheduler]`, `[sampling]`, `[grammar]`, `[cache]`,
//! `[metrics]`, `[speculative]`, `[hicache]`, `[lora]`, `[disaggregation]`,
//! `[parallel]` and `[[plugins]]`. An unknown section or key is an error that names both the
//! section and the key. Flags use SGLang's names.

use anyhow::{Context, Result, anyhow, bail};
use clap::Args;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

pub use crate::disagg::{DisaggregationArgs, DisaggregationSection};
pub use crate::hicache::{HiCacheArgs, HiCacheSection};
pub use crate::lora::{LoraArgs, LoraSection};
pub use crate::parallel::{ParallelArgs, ParallelSection};
pub use crate::speculative::{SpeculativeArgs, SpeculativeSection};

/// `[model]`: what to load and on which device.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    pub model_path: Option<PathBuf>,
    pub served_model_name: Option<String>,
    pub device: Option<String>,
    pub threads: Option<usize>,
    pub dtype: Option<String>,
    pub quantization: Option<String>,
    pub kv_cache_dtype: Option<String>,
    pub wgpu_adapter: Option<String>,
    /// CPU: how HF-quantized weights are multiplied, f32 or amx-bf16.
    pub cpu_quant_matmul: Option<String>,
    /// Recurrent state slots of a hybrid model (one per running request).
    pub max_mamba_cache_size: Option<usize>,
    /// Element type of the recurrent state: float32.
    pub mamba_ssm_dtype: Option<String>,
}

/// `[server]`: the HTTP listener.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ServerSection {
    pub host: Option<String>,
    pub port: Option<u16>,
    pub api_key: Option<String>,
    pub max_request_bytes: Option<usize>,
    /// Seconds in-flight requests get to finish after SIGTERM.
    pub shutdown_timeout: Option<f64>,
    /// Chat answers' `<think>` block into `reasoning_content`: qwen3, deepseek-r1.
    pub reasoning_parser: Option<String>,
}

/// `[scheduler]`: batching and admission (engine-core).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SchedulerSection {
    pub max_running_requests: Option<usize>,
    pub max_queued_requests: Option<usize>,
    pub max_prefill_tokens: Option<usize>,
    pub chunked_prefill_size: Option<i64>,
    pub schedule_policy: Option<String>,
    pub schedule_conservativeness: Option<f32>,
    pub enable_mixed_chunk: Option<bool>,
    pub page_size: Option<usize>,
    pub overlap_schedule: Option<bool>,
}

/// `[sampling]`: the sampler and the logits processors every request runs through.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SamplingSection {
    /// A registered sampler [default: standard].
    pub sampler: Option<String>,
    /// Registered logits processors, in order [default: penalties, logit_bias].
    /// Processors of loaded plugins are appended.
    pub logits_processors: Option<Vec<String>>,
}

/// `[grammar]`: structured output (crates/grammar).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct GrammarSection {
    /// A registered grammar backend, or "none" to turn structured output off [default: llguidance].
    pub grammar_backend: Option<String>,
    /// JSON whitespace between tokens: "compact" (none) or "flexible" (any) [default: compact].
    pub json_whitespace: Option<String>,
    /// Whitespace allowed between JSON tokens, as a regex (overrides json_whitespace).
    pub json_whitespace_pattern: Option<String>,
    /// Compile schemas with keywords the backend cannot enforce by ignoring them [default: false].
    pub json_lenient: Option<bool>,
    /// Refuse schemas whose oneOf branches may overlap instead of compiling them as anyOf [default: false].
    pub json_strict_one_of: Option<bool>,
    /// Append the tokens a grammar forces without a forward pass each [default: true].
    pub jump_forward: Option<bool>,
    /// Compiled grammars kept [default: 1024].
    pub cache_size: Option<usize>,
    /// Longest grammar text accepted, in bytes [default: 4 MiB].
    pub max_grammar_bytes: Option<usize>,
    /// Seconds a request waits for its grammar to compile [default: 10].
    pub compile_timeout: Option<f64>,
}

/// `[cache]`: KV cache size and the prefix cache (kv-radix).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CacheSection {
    pub disable_radix_cache: Option<bool>,
    pub radix_eviction_policy: Option<String>,
    pub max_total_tokens: Option<usize>,
    pub kv_cache_gb: Option<f64>,
    pub mem_fraction_static: Option<f64>,
}

/// `[metrics]`: Prometheus and usage reporting.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct MetricsSection {
    pub enable_metrics: Option<bool>,
    pub prefix: Option<String>,
    pub enable_cache_report: Option<bool>,
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

/// Flags of `arbor serve` (SGLang's names). Each overrides the TOML value.
#[derive(Args, Debug, Clone, Default)]
pub struct ServeArgs {
    /// TOML configuration file (see examples/arbor.toml); flags override it.
    #[arg(long)]
    pub config: Option<PathBuf>,

    /// Model: a Hugging Face folder or a GGUF file [default: the model `arbor fetch-default` downloads].
    #[arg(long = "model-path", help_heading = "Model")]
    pub model_path: Option<PathBuf>,
    /// Model name clients use (OpenAI `model`) [default: the folder name, or the GGUF `general.name`].
    #[arg(long = "served-model-name", help_heading = "Model")]
    pub served_model_name: Option<String>,
    /// Device: a registered backend name [default: cpu].
    #[arg(long, help_heading = "Model")]
    pub device: Option<String>,
    /// CPU threads, 0 for one per core [default: 0].
    #[arg(long, help_heading = "Model")]
    pub threads: Option<usize>,
    /// Weight storage: auto (as the checkpoint), f32, f16 or bf16 [default: auto].
    #[arg(long, help_heading = "Model")]
    pub dtype: Option<String>,
    /// Quantization method, as `arbor info` lists them: fp8 (FP8 weights with f32 inputs; quantizes a float checkpoint at load), w8a8_fp8 (FP8 weights times inputs rounded to E4M3; also over an FP8 checkpoint), compressed-tensors, awq, gptq, modelopt [default: the checkpoint's quantization_config, else none].
    #[arg(long, help_heading = "Model")]
    pub quantization: Option<String>,
    /// KV cache element type: auto (fp8_e4m3 for a checkpoint with FP8 KV scales where the device stores it, else f16 on the CPU, f32 on other devices), f32, f16, bf16, fp8_e4m3 or fp8_e5m2 [default: auto].
    #[arg(long = "kv-cache-dtype", help_heading = "Model")]
    pub kv_cache_dtype: Option<String>,
    /// wgpu adapter (`--device wgpu`): a case-insensitive part of its name, as `arbor info` lists them [default: the first; env ARBOR_WGPU_ADAPTER].
    #[arg(long = "wgpu-adapter", help_heading = "Model")]
    pub wgpu_adapter: Option<String>,
    /// CPU: how HF-quantized weights (FP8, AWQ, GPTQ, W4A16/W8A16, NVFP4) are multiplied: f32 (f32 activations; fastest for one sequence) or amx-bf16 (bf16 weights and activations in AMX tiles: several times faster for batches and prefill, about 0.7x the speed for one sequence; f32 on CPUs without AMX). GGUF formats are unaffected [default: f32].
    #[arg(long = "cpu-quant-matmul", help_heading = "Model")]
    pub cpu_quant_matmul: Option<String>,
    /// Recurrent state slots of a hybrid model (Qwen3.5, Qwen3-Next): the most requests holding recurrent state at once [default: max-running-requests].
    #[arg(long = "max-mamba-cache-size", help_heading = "Model")]
    pub max_mamba_cache_size: Option<usize>,
    /// Element type of a hybrid model's recurrent state: float32 (the only one supported) [default: float32].
    #[arg(long = "mamba-ssm-dtype", help_heading = "Model")]
    pub mamba_ssm_dtype: Option<String>,
    /// Run decode batches without CUDA graphs (`--device cuda`).
    #[arg(long = "disable-cuda-graph", help_heading = "Model")]
    pub disable_cuda_graph: bool,
    /// Largest decode batch run as a CUDA graph [default: max-running-requests].
    #[arg(long = "cuda-graph-max-bs", help_heading = "Model")]
    pub cuda_graph_max_bs: Option<usize>,

    /// Address to listen on [default: 127.0.0.1].
    #[arg(long, help_heading = "Server")]
    pub host: Option<String>,
    /// Port to listen on; 0 picks a free one [default: 30000].
    #[arg(long, help_heading = "Server")]
    pub port: Option<u16>,
    /// Require `Authorization: Bearer <key>` on every route but /health*.
    #[arg(long = "api-key", help_heading = "Server")]
    pub api_key: Option<String>,
    /// Largest request body in bytes; larger ones get 413 [default: 33554432].
    #[arg(long = "max-request-bytes", help_heading = "Server")]
    pub max_request_bytes: Option<usize>,
    /// Seconds in-flight requests get to finish on SIGTERM before they are aborted [default: 30].
    #[arg(long = "shutdown-timeout", help_heading = "Server")]
    pub shutdown_timeout: Option<f64>,
    /// Separate `<think>` reasoning into `reasoning_content` of chat answers: qwen3 or deepseek-r1 [default: off].
    #[arg(long = "reasoning-parser", help_heading = "Server")]
    pub reasoning_parser: Option<String>,

    /// Most requests decoding at once [default: 64].
    #[arg(long = "max-running-requests", help_heading = "Scheduler")]
    pub max_running_requests: Option<usize>,
    /// Most requests waiting; more are refused [default: 4096].
    #[arg(long = "max-queued-requests", help_heading = "Scheduler")]
    pub max_queued_requests: Option<usize>,
    /// Most new prompt tokens in one prefill batch [default: 8192].
    #[arg(long = "max-prefill-tokens", help_heading = "Scheduler")]
    pub max_prefill_tokens: Option<usize>,
    /// Most prompt tokens of one request per iteration; -1 disables chunking [default: 2048].
    #[arg(
        long = "chunked-prefill-size",
        allow_negative_numbers = true,
        help_heading = "Scheduler"
    )]
    pub chunked_prefill_size: Option<i64>,
    /// Admission order: fcfs, lpm, dfs-weight, lof, priority, random [default: lpm].
    #[arg(long = "schedule-policy", help_heading = "Scheduler")]
    pub schedule_policy: Option<String>,
    /// Scales the expected output of running requests; higher admits fewer [default: 1.0].
    #[arg(long = "schedule-conservativeness", help_heading = "Scheduler")]
    pub schedule_conservativeness: Option<f32>,
    /// Run the decodes of running requests in the same batch as a prefill.
    #[arg(long = "enable-mixed-chunk", help_heading = "Scheduler")]
    pub enable_mixed_chunk: bool,
    /// Tokens per KV page [default: 16].
    #[arg(long = "page-size", help_heading = "Scheduler")]
    pub page_size: Option<usize>,
    /// Admit the next batch (and fill grammar masks) while the forward runs [default: on for asynchronous devices, off on the CPU].
    #[arg(
        long = "enable-overlap-schedule",
        help_heading = "Scheduler",
        conflicts_with = "disable_overlap_schedule"
    )]
    pub enable_overlap_schedule: bool,
    /// Never overlap scheduling with the forward.
    #[arg(long = "disable-overlap-schedule", help_heading = "Scheduler")]
    pub disable_overlap_schedule: bool,

    /// Sampler: a registered name, e.g. one a plugin provides [default: standard].
    #[arg(long, help_heading = "Sampling")]
    pub sampler: Option<String>,

    /// Grammar backend for structured output, or "none" [default: llguidance].
    #[arg(long = "grammar-backend", help_heading = "Grammar")]
    pub grammar_backend: Option<String>,
    /// Whitespace allowed between JSON tokens, as a regex (default: none, i.e. compact JSON).
    #[arg(long = "constrained-json-whitespace-pattern", help_heading = "Grammar")]
    pub constrained_json_whitespace_pattern: Option<String>,
    /// Allow any JSON whitespace between tokens (default: compact JSON).
    #[arg(long = "constrained-json-any-whitespace", help_heading = "Grammar")]
    pub constrained_json_any_whitespace: bool,
    /// Sample every forced token too instead of appending them without a forward pass.
    #[arg(long = "disable-jump-forward", help_heading = "Grammar")]
    pub disable_jump_forward: bool,

    /// Turn prefix reuse off (no radix cache).
    #[arg(long = "disable-radix-cache", help_heading = "Cache")]
    pub disable_radix_cache: bool,
    /// Which cached prefix is evicted first: lru, lfu, fifo, mru, filo, priority, slru [default: lru].
    #[arg(long = "radix-eviction-policy", help_heading = "Cache")]
    pub radix_eviction_policy: Option<String>,
    /// KV cache size in tokens; overrides --mem-fraction-static.
    #[arg(long = "max-total-tokens", help_heading = "Cache")]
    pub max_total_tokens: Option<usize>,
    /// KV cache size in GiB (whole pages of the model's KV layout); overrides --mem-fraction-static, not --max-total-tokens.
    #[arg(long = "kv-cache-gb", help_heading = "Cache")]
    pub kv_cache_gb: Option<f64>,
    /// Share of available memory (MemAvailable) for weights plus KV cache; the KV part is capped at 4 GiB (2 GiB of f16 or bf16 on the CPU) and at max-running-requests x context [default: 0.8].
    #[arg(long = "mem-fraction-static", help_heading = "Cache")]
    pub mem_fraction_static: Option<f64>,

    /// Serve Prometheus metrics at /metrics.
    #[arg(long = "enable-metrics", help_heading = "Metrics")]
    pub enable_metrics: bool,
    /// Metric name prefix; "sglang" makes SGLang dashboards work [default: arbor].
    #[arg(long = "metrics-prefix", help_heading = "Metrics")]
    pub metrics_prefix: Option<String>,
    /// Report cached prompt tokens in OpenAI usage.prompt_tokens_details.
    #[arg(long = "enable-cache-report", help_heading = "Metrics")]
    pub enable_cache_report: bool,

    #[command(flatten)]
    pub speculative: SpeculativeArgs,

    #[command(flatten)]
    pub hicache: HiCacheArgs,

    #[command(flatten)]
    pub lora: LoraArgs,

    #[command(flatten)]
    pub disaggregation: DisaggregationArgs,

    #[command(flatten)]
    pub parallel: ParallelArgs,

    /// Load a plugin library (repeatable; adds to [[plugins]] in the config file).
    #[arg(long = "plugin", value_name = "PATH", help_heading = "Plugins")]
    pub plugin: Vec<PathBuf>,

    /// Print the merged configuration as TOML and exit.
    #[arg(long = "print-config")]
    pub print_config: bool,
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

/// Refuses settings of features this binary was built without, naming the cargo feature.
fn compiled_out_check(g: &GrammarSection, c: &CacheSection, a: &ServeArgs) -> Result<()> {
    let backend = a.grammar_backend.clone().or(g.grammar_backend.clone());
    if !cfg!(feature = "grammar")
        && let Some(b) = backend.filter(|b| b != "none")
    {
        bail!(
            "[grammar] grammar_backend / --grammar-backend '{b}': this binary was built without \
             structured output; rebuild arbor with the `grammar` cargo feature"
        );
    }
    if !cfg!(feature = "kv-radix") {
        let wants_radix = c.disable_radix_cache == Some(false)
            || a.radix_eviction_policy.is_some()
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

fn flag(b: bool) -> Option<bool> {
    b.then_some(true)
}

impl ServeConfig {
    /// Defaults < `file` < `args`, with every default filled in (except
    /// `model_path`, `served_model_name`, `api_key` and `max_total_tokens`,
    /// which stay optional).
    pub fn resolve(file: FileConfig, a: &ServeArgs) -> Result<Self> {
        let FileConfig {
            model: m,
            server: s,
            scheduler: q,
            sampling: sp,
            grammar: g,
            cache: c,
            metrics: x,
            speculative: spec,
            hicache,
            lora,
            disaggregation,
            parallel,
            mut plugins,
        } = file;
        compiled_out_check(&g, &c, a)?;
        plugins.extend(a.plugin.iter().map(|p| PluginEntry {
            path: p.clone(),
            config: None,
        }));
        let cfg = ServeConfig {
            model: ModelSection::resolve(m, a),
            server: ServerSection::resolve(s, a),
            scheduler: SchedulerSection::resolve(q, a),
            sampling: SamplingSection::resolve(sp, a),
            grammar: GrammarSection::resolve(g, a),
            cache: CacheSection::resolve(c, a),
            metrics: MetricsSection::resolve(x, a),
            speculative: SpeculativeSection::resolve(spec, &a.speculative),
            hicache: HiCacheSection::resolve(hicache, &a.hicache),
            lora: LoraSection::resolve(lora, &a.lora),
            disaggregation: DisaggregationSection::resolve(disaggregation, &a.disaggregation),
            parallel: ParallelSection::resolve(parallel, &a.parallel),
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

impl ModelSection {
    /// The `[model]` section of the model and device: each key from its flag where it
    /// has one, else the file, else its default.
    fn resolve(m: ModelSection, a: &ServeArgs) -> Self {
        ModelSection {
            model_path: a.model_path.clone().or(m.model_path),
            served_model_name: a.served_model_name.clone().or(m.served_model_name),
            device: Some(
                a.device
                    .clone()
                    .or(m.device)
                    .unwrap_or_else(|| "cpu".into()),
            ),
            threads: Some(a.threads.or(m.threads).unwrap_or(0)),
            dtype: Some(a.dtype.clone().or(m.dtype).unwrap_or_else(|| "auto".into())),
            quantization: a.quantization.clone().or(m.quantization),
            kv_cache_dtype: Some(
                a.kv_cache_dtype
                    .clone()
                    .or(m.kv_cache_dtype)
                    .unwrap_or_else(|| "auto".into()),
            ),
            wgpu_adapter: a
                .wgpu_adapter
                .clone()
                .or(m.wgpu_adapter)
                .or_else(|| std::env::var("ARBOR_WGPU_ADAPTER").ok()),
            cpu_quant_matmul: Some(
                a.cpu_quant_matmul
                    .clone()
                    .or(m.cpu_quant_matmul)
                    .unwrap_or_else(|| "f32".into()),
            ),
            max_mamba_cache_size: a.max_mamba_cache_size.or(m.max_mamba_cache_size),
            mamba_ssm_dtype: Some(
                a.mamba_ssm_dtype
                    .clone()
                    .or(m.mamba_ssm_dtype)
                    .unwrap_or_else(|| "float32".into()),
            ),
        }
    }
}

impl ServerSection {
    /// The `[server]` section of the HTTP server: each key from its flag where it
    /// has one, else the file, else its default.
    fn resolve(s: ServerSection, a: &ServeArgs) -> Self {
        ServerSection {
            host: Some(
                a.host
                    .clone()
                    .or(s.host)
                    .unwrap_or_else(|| "127.0.0.1".into()),
            ),
            port: Some(a.port.or(s.port).unwrap_or(30000)),
            api_key: a.api_key.clone().or(s.api_key),
            max_request_bytes: Some(
                a.max_request_bytes
                    .or(s.max_request_bytes)
                    .unwrap_or(32 * 1024 * 1024),
            ),
            shutdown_timeout: Some(a.shutdown_timeout.or(s.shutdown_timeout).unwrap_or(30.0)),
            reasoning_parser: a.reasoning_parser.clone().or(s.reasoning_parser),
        }
    }
}

impl SchedulerSection {
    /// The `[scheduler]` section of the scheduler: each key from its flag where it
    /// has one, else the file, else its default.
    fn resolve(q: SchedulerSection, a: &ServeArgs) -> Self {
        SchedulerSection {
            max_running_requests: Some(
                a.max_running_requests
                    .or(q.max_running_requests)
                    .unwrap_or(64),
            ),
            max_queued_requests: Some(
                a.max_queued_requests
                    .or(q.max_queued_requests)
                    .unwrap_or(4096),
            ),
            max_prefill_tokens: Some(
                a.max_prefill_tokens
                    .or(q.max_prefill_tokens)
                    .unwrap_or(8192),
            ),
            chunked_prefill_size: Some(
                a.chunked_prefill_size
                    .or(q.chunked_prefill_size)
                    .unwrap_or(2048),
            ),
            schedule_policy: Some(
                a.schedule_policy
                    .clone()
                    .or(q.schedule_policy)
                    .unwrap_or_else(|| "lpm".into()),
            ),
            schedule_conservativeness: Some(
                a.schedule_conservativeness
                    .or(q.schedule_conservativeness)
                    .unwrap_or(1.0),
            ),
            enable_mixed_chunk: Some(
                flag(a.enable_mixed_chunk)
                    .or(q.enable_mixed_chunk)
                    .unwrap_or(false),
            ),
            page_size: Some(a.page_size.or(q.page_size).unwrap_or(16)),
            overlap_schedule: if a.disable_overlap_schedule {
                Some(false)
            } else {
                flag(a.enable_overlap_schedule).or(q.overlap_schedule)
            },
        }
    }
}

impl SamplingSection {
    /// The `[sampling]` section of sampling: each key from its flag where it
    /// has one, else the file, else its default.
    fn resolve(sp: SamplingSection, a: &ServeArgs) -> Self {
        SamplingSection {
            sampler: Some(
                a.sampler
                    .clone()
                    .or(sp.sampler)
                    .unwrap_or_else(|| "standard".into()),
            ),
            logits_processors: Some(
                sp.logits_processors
                    .unwrap_or_else(|| vec!["penalties".into(), "logit_bias".into()]),
            ),
        }
    }
}

impl GrammarSection {
    /// The `[grammar]` section of structured output: each key from its flag where it
    /// has one, else the file, else its default.
    fn resolve(g: GrammarSection, a: &ServeArgs) -> Self {
        GrammarSection {
            grammar_backend: Some(
                a.grammar_backend
                    .clone()
                    .or(g.grammar_backend)
                    .unwrap_or_else(|| DEFAULT_GRAMMAR_BACKEND.into()),
            ),
            json_whitespace: Some(
                if a.constrained_json_any_whitespace {
                    Some("flexible".to_string())
                } else {
                    g.json_whitespace
                }
                .unwrap_or_else(|| "compact".into()),
            ),
            json_whitespace_pattern: a
                .constrained_json_whitespace_pattern
                .clone()
                .or(g.json_whitespace_pattern),
            json_lenient: Some(g.json_lenient.unwrap_or(false)),
            json_strict_one_of: Some(g.json_strict_one_of.unwrap_or(false)),
            jump_forward: Some(!a.disable_jump_forward && g.jump_forward.unwrap_or(true)),
            cache_size: Some(g.cache_size.unwrap_or(1024)),
            max_grammar_bytes: Some(g.max_grammar_bytes.unwrap_or(4 << 20)),
            compile_timeout: Some(g.compile_timeout.unwrap_or(10.0)),
        }
    }
}

impl CacheSection {
    /// The `[cache]` section of the KV and prefix cache: each key from its flag where it
    /// has one, else the file, else its default.
    fn resolve(c: CacheSection, a: &ServeArgs) -> Self {
        CacheSection {
            disable_radix_cache: Some(
                flag(a.disable_radix_cache)
                    .or(c.disable_radix_cache)
                    .unwrap_or(!cfg!(feature = "kv-radix")),
            ),
            radix_eviction_policy: Some(
                a.radix_eviction_policy
                    .clone()
                    .or(c.radix_eviction_policy)
                    .unwrap_or_else(|| "lru".into()),
            ),
            max_total_tokens: a.max_total_tokens.or(c.max_total_tokens),
            kv_cache_gb: a.kv_cache_gb.or(c.kv_cache_gb),
            mem_fraction_static: Some(
                a.mem_fraction_static
                    .or(c.mem_fraction_static)
                    .unwrap_or(0.8),
            ),
        }
    }
}

impl MetricsSection {
    /// The `[metrics]` section of metrics: each key from its flag where it
    /// has one, else the file, else its default.
    fn resolve(x: MetricsSection, a: &ServeArgs) -> Self {
        MetricsSection {
            enable_metrics: Some(flag(a.enable_metrics).or(x.enable_metrics).unwrap_or(false)),
            prefix: Some(
                a.metrics_prefix
                    .clone()
                    .or(x.prefix)
                    .unwrap_or_else(|| "arbor".into()),
            ),
            enable_cache_report: Some(
                flag(a.enable_cache_report)
                    .or(x.enable_cache_report)
                    .unwrap_or(false),
            ),
        }
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
        let args = ServeArgs {
            port: Some(999),
            enable_metrics: true,
            ..Default::default()
        };
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
        let flag = ServeArgs {
            kv_cache_dtype: Some("f32".into()),
            ..Default::default()
        };
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
        let flag = ServeArgs {
            cpu_quant_matmul: Some("f32".into()),
            ..Default::default()
        };
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
        let off = ServeArgs {
            disable_overlap_schedule: true,
            ..Default::default()
        };
        let c = ServeConfig::resolve(on, &off).unwrap();
        assert_eq!(c.scheduler.overlap_schedule, Some(false), "flag beats file");
        let c = ServeConfig::resolve(FileConfig::default(), &ServeArgs::default()).unwrap();
        assert_eq!(c.scheduler.overlap_schedule, None, "auto by default");
        let enable = ServeArgs {
            enable_overlap_schedule: true,
            ..Default::default()
        };
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
}
