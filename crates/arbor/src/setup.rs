//! Shared start-up steps: building the registry, the device and the model,
//! with a progress bar while weights load, and assembling a serving engine
//! ([`build_engine`]) with its KV cache sized by [`KvBudget`].
//!
//! The KV element type is `--kv-cache-dtype` ([`kv_dtype`]): `auto` (the
//! default) is f16 on the CPU and f32 on the other devices. The automatic
//! size ([`KvAuto`]) is `mem_fraction_static` of the available memory minus
//! the weights, capped at [`kv_auto_cap_bytes`] and at what the configured
//! concurrency can hold; the start-up summary prints which bound applied.

use anyhow::{Context, Result, bail};
use arbor_engine_core::engine::{Engine, EngineConfig, EngineParts};
use arbor_engine_core::{
    Backend, BackendOptions, DType, KvDtypeChoice, LoadOptions, ModelSpec, QuantMatmul, Registry,
    ResolvedKvDtype,
};
use arbor_models::LoadedModel;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;
use std::sync::Arc;

/// Model and device options shared by the subcommands that load a model.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// Model: a Hugging Face folder (config.json, safetensors, tokenizer.json) or a
    /// GGUF file. Default: the model `arbor fetch-default` downloads.
    #[arg(long = "model-path")]
    pub model_path: Option<PathBuf>,
    /// Branch, tag or commit of a hub id --model-path [default: main].
    #[arg(long)]
    pub revision: Option<String>,
    /// Tokenizer: a folder or a hub id [default: the model's].
    #[arg(long = "tokenizer-path")]
    pub tokenizer_path: Option<PathBuf>,
    /// Longest sequence served, at most the model's context [default: the model's].
    #[arg(long = "context-length")]
    pub context_length: Option<usize>,
    /// Device: a registered backend name.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// CPU threads (0: one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Weight storage: auto (as the checkpoint), f32, f16 or bf16.
    #[arg(long, default_value = "auto")]
    pub dtype: String,
    /// Quantization method (`arbor info` lists them): a checkpoint's own
    /// (`quantization_config` in config.json) is used without this; `fp8`
    /// quantizes a float checkpoint's linear layers at load, and `w8a8_fp8`
    /// does too (or takes an FP8 checkpoint's) and rounds their inputs to E4M3.
    #[arg(long)]
    pub quantization: Option<String>,
    /// KV cache element type: auto (f16 on the CPU, f32 on other devices), f32, f16 or bf16.
    #[arg(long = "kv-cache-dtype", default_value = "auto")]
    pub kv_cache_dtype: String,
    /// Tokens per KV page.
    #[arg(long = "page-size", default_value_t = 16)]
    pub page_size: usize,
    /// wgpu adapter: a case-insensitive part of its name (`arbor info` lists them).
    #[arg(long = "wgpu-adapter", env = "ARBOR_WGPU_ADAPTER")]
    pub wgpu_adapter: Option<String>,
    /// CPU: how HF-quantized weights are multiplied, f32 or amx-bf16 (bf16
    /// in AMX tiles: faster for batches and prefill, slower for one
    /// sequence; f32 without AMX).
    #[arg(long = "cpu-quant-matmul", default_value = "f32")]
    pub cpu_quant_matmul: QuantMatmul,
    /// Recurrent state slots of a hybrid model [default: twice max-running-requests].
    #[arg(long = "max-mamba-cache-size")]
    pub max_mamba_cache_size: Option<usize>,
    /// A hybrid model's recurrent state memory over its KV cache's, which
    /// sizes the slots when `--max-mamba-cache-size` is not given.
    #[arg(long = "mamba-full-memory-ratio")]
    pub mamba_full_memory_ratio: Option<f64>,
    /// Run decode batches without CUDA graphs.
    #[arg(long = "disable-cuda-graph")]
    pub disable_cuda_graph: bool,
    /// Largest decode batch run as a CUDA graph [default: 256].
    #[arg(long = "cuda-graph-max-bs")]
    pub cuda_graph_max_bs: Option<usize>,
    /// Tensor-parallel ranks (CPU: in-process ranks on split cores).
    #[arg(
        long = "tp-size",
        visible_alias = "tensor-parallel-size",
        default_value_t = 1
    )]
    pub tp_size: usize,
    /// Expert-parallel ranks of a MoE model: 1, or equal to --tp-size.
    #[arg(
        long = "ep-size",
        visible_alias = "expert-parallel-size",
        default_value_t = 1
    )]
    pub ep_size: usize,
    /// How expert-parallel ranks exchange tokens: none or all-to-all [default: none].
    #[arg(long = "moe-a2a-backend")]
    pub moe_a2a_backend: Option<String>,
    /// The device index of rank 0 (of the one device without tensor parallelism).
    #[arg(long = "base-gpu-id", default_value_t = 0)]
    pub base_gpu_id: usize,
    /// Rank r runs on device base-gpu-id + r * gpu-id-step (0: all on one device).
    #[arg(long = "gpu-id-step", default_value_t = 1)]
    pub gpu_id_step: usize,
    /// Data-parallel replicas, each with its own scheduler and KV cache
    /// (CPU: on split cores).
    #[arg(
        long = "dp-size",
        visible_alias = "data-parallel-size",
        default_value_t = 1
    )]
    pub dp_size: usize,
    /// How requests are spread over data-parallel replicas: round_robin,
    /// shortest_queue or minimum_tokens [default: round_robin].
    #[arg(long = "load-balance-method")]
    pub load_balance_method: Option<String>,
    /// Data-parallel attention (--dp-size equal to --tp-size > 1).
    #[arg(long = "enable-dp-attention")]
    pub enable_dp_attention: bool,
}

impl ModelArgs {
    /// The longest sequence served: `--context-length`, which may shorten
    /// the model's `max_position_embeddings` but not lengthen it (positions
    /// past it were never trained; SGLang's
    /// `SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1` allows it all the same).
    pub fn context_len(&self, spec: &ModelSpec) -> Result<usize> {
        let model = spec.max_position_embeddings;
        match self.context_length {
            None => Ok(model),
            Some(0) => bail!("--context-length must be at least 1"),
            Some(n) if n > model && !allow_longer_context() => bail!(
                "--context-length {n} is longer than the model's context of {model} tokens \
                 (max_position_embeddings); set SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 to \
                 serve it anyway"
            ),
            Some(n) => Ok(n),
        }
    }

    /// The checked parallelism of `--tp-size`, `--ep-size`, `--moe-a2a-backend`,
    /// the device placement and `--dp-size`.
    pub fn parallel(&self) -> Result<crate::parallel::Parallel> {
        crate::parallel::ParallelSection {
            tp_size: Some(self.tp_size),
            ep_size: Some(self.ep_size),
            moe_a2a_backend: self.moe_a2a_backend.clone(),
            base_gpu_id: Some(self.base_gpu_id),
            gpu_id_step: Some(self.gpu_id_step),
            dp_size: Some(self.dp_size),
            load_balance_method: self.load_balance_method.clone(),
            enable_dp_attention: Some(self.enable_dp_attention),
        }
        .to_settings()
    }
}

fn allow_longer_context() -> bool {
    std::env::var("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN")
        .is_ok_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true"))
}

/// With `--tokenizer-path`, the tokenizer (and, when that folder has one,
/// the chat template) of that folder or hub id replaces the model's. Its
/// vocabulary must fit the model's embedding rows.
pub fn apply_tokenizer_path(model: &mut LoadedModel, args: &ModelArgs) -> Result<()> {
    let Some(given) = &args.tokenizer_path else {
        return Ok(());
    };
    // The model's revision applies when the tokenizer is the same repository.
    let revision = args
        .revision
        .as_deref()
        .filter(|_| args.model_path.as_ref() == Some(given));
    let dir = crate::hub::local_path(given, revision, crate::hub::Want::Tokenizer)?;
    if !dir.is_dir() {
        bail!(
            "--tokenizer-path {}: not a folder holding tokenizer.json",
            given.display()
        );
    }
    let tokenizer = arbor_models::TextTokenizer::from_dir(&dir, &model.config)
        .with_context(|| format!("--tokenizer-path {}", given.display()))?;
    let vocab = model.model.spec().vocab_size;
    if tokenizer.vocab_size() > vocab {
        bail!(
            "--tokenizer-path {}: its {} tokens do not fit the model's {vocab} embedding rows",
            given.display(),
            tokenizer.vocab_size()
        );
    }
    model.tokenizer = Arc::new(tokenizer);
    if let Some(t) = arbor_models::ChatTemplate::from_dir(&dir)
        .with_context(|| format!("--tokenizer-path {}", given.display()))?
    {
        model.chat_template = Some(Arc::new(t));
    }
    Ok(())
}

/// The registry of built-in implementations.
pub fn registry() -> Result<Registry> {
    Registry::builtin().context("building the registry")
}

/// Creates the device.
pub fn backend(registry: &Registry, args: &ModelArgs) -> Result<Arc<dyn Backend>> {
    let factory = registry.backends.get(&args.device)?;
    factory(&backend_options(args)).with_context(|| {
        format!(
            "starting device '{}' {} (--base-gpu-id)",
            args.device, args.base_gpu_id
        )
    })
}

/// The device options `args` give (one device: `--base-gpu-id`'s).
pub fn backend_options(args: &ModelArgs) -> BackendOptions {
    BackendOptions {
        threads: args.threads,
        device_index: args.base_gpu_id,
        adapter: args.wgpu_adapter.clone(),
        disable_cuda_graph: args.disable_cuda_graph,
        cuda_graph_max_bs: args.cuda_graph_max_bs,
        cpu_quant_matmul: args.cpu_quant_matmul,
    }
}

/// The `--cpu-quant-matmul` a CPU device runs: amx-bf16 needs AMX-BF16, and
/// is f32 without it.
pub fn cpu_quant_matmul(args: &ModelArgs) -> QuantMatmul {
    arbor_quant::quant_matmul_here(args.cpu_quant_matmul)
}

/// The KV element type `args.kv_cache_dtype` comes to on `backend` for a
/// model of `spec` (whose checkpoint may carry FP8 KV scales; an unknown
/// name is an error naming the flag).
pub fn kv_dtype(
    args: &ModelArgs,
    backend: &dyn Backend,
    spec: &ModelSpec,
) -> Result<ResolvedKvDtype> {
    let choice: KvDtypeChoice = args.kv_cache_dtype.parse().context("--kv-cache-dtype")?;
    Ok(choice.resolve(backend, spec.checkpoint_kv_dtype))
}

/// Loads the model with a progress bar.
pub fn load(
    registry: &Registry,
    backend: Arc<dyn Backend>,
    args: &ModelArgs,
) -> Result<LoadedModel> {
    let quant = quant_method(registry, &args.dtype, args.quantization.as_deref())?;
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("loading {msg} [{bar:30}] {pos}/{len} tensors")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let path =
        crate::fetch::resolve_model_path(args.model_path.as_deref(), args.revision.as_deref())?;
    bar.set_message(path.display().to_string());
    let pb = bar.clone();
    let opts = LoadOptions {
        backend,
        quant,
        progress: Some(Arc::new(move |done, total| {
            pb.set_length(total as u64);
            pb.set_position(done as u64);
        })),
    };
    let loaded = arbor_models::load_model(&path, registry, &opts)
        .with_context(|| format!("loading {}", path.display()));
    bar.finish_and_clear();
    loaded
}

/// The method `--dtype` and `--quantization` choose: the quantization
/// method on the float method's base, else the float method. A checkpoint's
/// own `quantization_config` takes over at load (`arbor_models::load_model`).
pub fn quant_method(
    registry: &Registry,
    dtype: &str,
    quantization: Option<&str>,
) -> Result<Arc<dyn arbor_engine_core::QuantMethod>> {
    let float = registry.quant_methods.get(dtype).context("--dtype")?(&Default::default())
        .context("--dtype")?;
    let Some(q) = quantization else {
        return Ok(float);
    };
    let init = arbor_engine_core::QuantInit {
        checkpoint: None,
        base: Some(float),
    };
    registry.quant_methods.get(q).context("--quantization")?(&init).context("--quantization")
}

/// How big the KV cache is.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KvBudget {
    /// Exactly this many tokens (rounded up to whole pages).
    Tokens(usize),
    /// As many tokens as this many bytes of KV hold (rounded down to whole
    /// pages, at least one page).
    Bytes(u64),
    /// This share of the memory available before loading (MemAvailable) holds
    /// the weights plus the KV cache; see [`kv_tokens_for_fraction`].
    Fraction(f64),
}

/// Scheduler and cache settings for [`build_engine`].
#[derive(Clone, Debug)]
pub struct EngineSetup {
    /// The scheduler's settings.
    pub engine: EngineConfig,
    /// KV cache size.
    pub kv: KvBudget,
    /// Eviction policy of the radix cache (a registered name).
    pub eviction_policy: String,
    /// Sampler (a registered name).
    pub sampler: String,
    /// Logits processors in order: registered names and the config each is created with.
    pub processors: Vec<(String, serde_json::Value)>,
    /// Host and storage KV tiers under the radix cache, when on.
    pub hicache: Option<crate::hicache::HiCacheSettings>,
    /// The draft checkpoint of `--speculative-algorithm STANDALONE` (a
    /// model, loaded here) or EAGLE3 (a head the speculator loads).
    pub draft_model: Option<std::path::PathBuf>,
}

/// An engine with the model it runs.
pub struct BuiltEngine {
    pub engine: Engine,
    pub model: LoadedModel,
    /// Each of the engine's data-parallel ranks' devices, in rank order (a
    /// tensor-parallel replica's ranks in turn): where a weight update loads
    /// each rank's copy or shard.
    pub rank_devices: Vec<Vec<ShardDevice>>,
    /// KV capacity in tokens.
    pub kv_tokens: usize,
    /// KV cache bytes.
    pub kv_bytes: u64,
    /// The KV element type, and why when `auto` chose it.
    pub kv_dtype: ResolvedKvDtype,
    /// How the capacity was chosen (for the start-up summary).
    pub kv_note: String,
    /// A hybrid model's recurrent state slots per replica (0 for others).
    pub state_slots: usize,
}

/// Most KV cache the fraction rule allocates on its own. On the CPU the KV
/// cache is ordinary (zero-filled, so resident) memory shared with everything
/// else on the host, and a CPU cannot keep hundreds of thousands of cached
/// tokens busy anyway: beyond 4 GiB the operator says how much with
/// `--max-total-tokens` or `--kv-cache-gb`.
pub const KV_AUTO_CAP_BYTES: u64 = 4 << 30;

/// The cap of a 16-bit (f16, bf16) KV cache on the CPU: the tokens 4 GiB of
/// f32 hold, in half the memory. The 4 GiB cap is about how many cached
/// tokens a CPU can use, so a narrower element saves memory rather than
/// buying tokens nobody serves.
pub const KV_AUTO_CAP_BYTES_CPU_16BIT: u64 = 2 << 30;

/// The byte cap of the fraction rule: [`KV_AUTO_CAP_BYTES_CPU_16BIT`] for a
/// 16-bit or 8-bit cache on the CPU (an FP8 cache then holds twice the
/// tokens of an f16 one), else [`KV_AUTO_CAP_BYTES`] (other devices as
/// before).
pub fn kv_auto_cap_bytes(on_cpu: bool, dtype: DType) -> u64 {
    if on_cpu
        && matches!(
            dtype,
            DType::F16 | DType::BF16 | DType::F8E4M3 | DType::F8E5M2
        )
    {
        KV_AUTO_CAP_BYTES_CPU_16BIT
    } else {
        KV_AUTO_CAP_BYTES
    }
}

/// `MemAvailable` from /proc/meminfo, in bytes.
pub fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// The inputs of the automatic KV size (no `--max-total-tokens` or
/// `--kv-cache-gb`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvAuto {
    /// `mem_fraction_static`.
    pub fraction: f64,
    /// `MemAvailable` before loading, in bytes.
    pub available: u64,
    /// Bytes of the loaded weights.
    pub weight_bytes: u64,
    /// KV bytes of one token (all layers, K and V).
    pub bytes_per_token: u64,
    /// Most KV bytes ([`kv_auto_cap_bytes`]).
    pub cap_bytes: u64,
    /// `max_running_requests`.
    pub max_running_requests: usize,
    /// The model's context length.
    pub context_len: usize,
    /// Tokens per KV page.
    pub page_size: usize,
}

impl KvAuto {
    /// KV tokens: `fraction × available − weights`, capped at `cap_bytes`
    /// and at `max_running_requests × context_len` (every running request
    /// holding a full context), rounded down to whole pages; with the reason
    /// naming the bound that applied.
    pub fn tokens(&self) -> (usize, String) {
        let ps = self.page_size.max(1);
        let whole = |t: usize| t / ps * ps;
        let budget = (self.fraction * self.available as f64) as u64;
        let by_fraction = budget.saturating_sub(self.weight_bytes);
        let kv_bytes = by_fraction.min(self.cap_bytes);
        let by_mem = whole((kv_bytes / self.bytes_per_token.max(1)) as usize);
        let concurrency = self
            .max_running_requests
            .max(1)
            .saturating_mul(self.context_len);
        let tokens = by_mem.min(whole(concurrency));
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        let why = if tokens < by_mem {
            format!(
                "capped at max_running_requests {} x context {} = {concurrency} tokens",
                self.max_running_requests.max(1),
                self.context_len
            )
        } else if by_fraction >= self.cap_bytes {
            format!(
                "capped at {} GiB; set --max-total-tokens or --kv-cache-gb for more",
                gib(self.cap_bytes)
            )
        } else {
            format!(
                "mem_fraction_static {} of {:.1} GiB available, minus {:.2} GiB of weights",
                self.fraction,
                gib(self.available),
                gib(self.weight_bytes)
            )
        };
        (tokens, why)
    }
}

/// Builds the whole engine: registry → backend → model → KV cache and model
/// runner → prefix cache and eviction policy → sampler and logits processors
/// → [`Engine`]; with `--dp-size` N > 1, N such replicas (each on its share
/// of the threads or its own devices, with its own share of the memory)
/// behind one engine.
pub fn build_engine(
    registry: &Registry,
    args: &ModelArgs,
    setup: &EngineSetup,
) -> Result<BuiltEngine> {
    let parallel = args.parallel()?;
    crate::parallel::check_supported(registry, parallel, &args.device)?;
    // Each data-parallel replica sizes its KV from its share of the memory.
    let n = parallel.replicas();
    let available = mem_available().map(|a| a / n as u64);
    // The replicas (each on its own devices or share of the threads) load
    // at once.
    let rargs: Vec<ModelArgs> = (0..n)
        .map(|d| crate::parallel::replica_args(args, parallel, d))
        .collect();
    let replicas = crate::parallel::on_threads(&rargs, |d, a| {
        let r = crate::replica::build_replica(registry, a, setup, available);
        if n > 1 {
            r.with_context(|| format!("data-parallel rank {d} of {}", parallel.dp))
        } else {
            r
        }
    })
    .into_iter()
    .collect::<Result<Vec<_>>>()?;
    let rank_devices: Vec<Vec<ShardDevice>> = replicas
        .iter()
        .flat_map(|r| {
            if r.parts.len() > 1 {
                // Data-parallel attention: one engine rank per device.
                r.devices.iter().map(|d| vec![d.clone()]).collect()
            } else {
                vec![r.devices.clone()]
            }
        })
        .collect();
    let mut replicas = replicas.into_iter();
    let first = replicas.next().context("no data-parallel replica")?;
    let per_token = first.per_token;
    let parts: Vec<EngineParts> = first
        .parts
        .into_iter()
        .chain(replicas.flat_map(|r| r.parts))
        .collect();
    let engine = Engine::data_parallel(setup.engine.clone(), parts, parallel.balance)
        .context("starting the engine")?;
    Ok(BuiltEngine {
        kv_tokens: engine.capacity_tokens(),
        kv_bytes: per_token * engine.capacity_tokens() as u64,
        kv_note: first.kv_note,
        state_slots: first.state_slots,
        kv_dtype: first.kv_dtype,
        engine,
        model: first.model,
        rank_devices,
    })
}

/// Where one rank's weights load: its device, and its share of the model
/// (`None`: the whole model).
#[derive(Clone)]
pub struct ShardDevice {
    pub backend: Arc<dyn Backend>,
    pub shard: Option<arbor_engine_core::ShardSpec>,
}

/// Loads new weights for a running server (`/update_weights_from_disk`,
/// `/resume_memory_occupation`) with its dtype: one copy per data-parallel
/// rank, each on that rank's device.
pub struct DiskWeightLoader {
    pub registry: Arc<Registry>,
    /// Each data-parallel rank's devices ([`BuiltEngine::rank_devices`]).
    pub ranks: Vec<Vec<ShardDevice>>,
    /// Data-parallel attention ranks refuse weight updates (refused here,
    /// before anything loads).
    pub dp_attention: bool,
    pub dtype: String,
    pub quantization: Option<String>,
}

impl arbor_server::refit::WeightLoader for DiskWeightLoader {
    fn load(
        &self,
        path: &std::path::Path,
    ) -> std::result::Result<Vec<arbor_engine_core::RankWeights>, String> {
        if self.dp_attention {
            return Err(
                "weight updates with --enable-dp-attention are not supported yet \
                 (the ranks would swap at different steps of the shared feed-forward)"
                    .into(),
            );
        }
        if !path.exists() {
            return Err(format!("{}: no such file or folder", path.display()));
        }
        let quant = quant_method(&self.registry, &self.dtype, self.quantization.as_deref())
            .map_err(|e| format!("{e:#}"))?;
        let load = |d: &ShardDevice| {
            let opts = LoadOptions {
                backend: d.backend.clone(),
                quant: quant.clone(),
                progress: None,
            };
            match &d.shard {
                Some(s) => arbor_models::load_model_shard(path, &self.registry, &opts, s),
                None => arbor_models::load_model(path, &self.registry, &opts),
            }
            .map(|m| m.model)
            .map_err(|e| e.to_string())
        };
        // Every device of every replica loads its copy at once.
        let devices: Vec<&ShardDevice> = self.ranks.iter().flatten().collect();
        let mut models = crate::parallel::on_threads(&devices, |_, d| load(d)).into_iter();
        self.ranks
            .iter()
            .map(|r| models.by_ref().take(r.len()).collect())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn auto(fraction: f64, available: u64, weights: u64, cap: u64, running: usize) -> KvAuto {
        KvAuto {
            fraction,
            available,
            weight_bytes: weights,
            bytes_per_token: 1024,
            cap_bytes: cap,
            max_running_requests: running,
            context_len: 1000,
            page_size: 16,
        }
    }

    #[test]
    fn fraction_rule_subtracts_weights_and_caps() {
        let gib = 1u64 << 30;
        let big = usize::MAX / 1000;
        // 0.5 of 6 GiB minus 1 GiB of weights = 2 GiB at 1 KiB per token.
        let (t, why) = auto(0.5, 6 * gib, gib, KV_AUTO_CAP_BYTES, big).tokens();
        assert_eq!(t, 2 * 1024 * 1024);
        assert!(why.contains("mem_fraction_static 0.5"), "{why}");
        let (t, why) = auto(0.8, 100 * gib, gib, KV_AUTO_CAP_BYTES, big).tokens();
        assert_eq!(t as u64, KV_AUTO_CAP_BYTES / 1024);
        assert!(
            why.contains("capped at 4 GiB") && why.contains("--max-total-tokens"),
            "{why}"
        );
        let (t, why) = auto(0.8, 100 * gib, gib, KV_AUTO_CAP_BYTES_CPU_16BIT, big).tokens();
        assert_eq!(t as u64, KV_AUTO_CAP_BYTES_CPU_16BIT / 1024);
        assert!(why.contains("capped at 2 GiB"), "{why}");
        // One running request of a 1000-token context: 992 tokens (whole pages).
        let (t, why) = auto(0.5, 10 * gib, gib, KV_AUTO_CAP_BYTES, 1).tokens();
        assert_eq!(t, 992);
        assert!(
            why.contains("max_running_requests 1 x context 1000 = 1000 tokens"),
            "{why}"
        );
        let (t, _) = auto(0.1, gib, gib, KV_AUTO_CAP_BYTES, big).tokens();
        assert_eq!(t, 0);
    }

    #[test]
    fn the_16_bit_cap_is_for_the_cpu_only() {
        assert_eq!(kv_auto_cap_bytes(true, DType::F16), 2 << 30);
        assert_eq!(kv_auto_cap_bytes(true, DType::BF16), 2 << 30);
        assert_eq!(kv_auto_cap_bytes(true, DType::F32), KV_AUTO_CAP_BYTES);
        assert_eq!(kv_auto_cap_bytes(false, DType::F16), KV_AUTO_CAP_BYTES);
    }
}
