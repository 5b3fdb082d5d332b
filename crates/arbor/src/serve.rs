//! `arbor serve`: merge the configuration, build the engine, and run the
//! HTTP server until SIGTERM or Ctrl-C.
//!
//! Start-up prints a summary (model, dtype, KV capacity, limits, address) on
//! stdout; the last line is `listening on http://HOST:PORT`, which scripts
//! and tests wait for (`--port 0` picks a free port). Shutdown stops
//! accepting, lets in-flight requests finish within `shutdown_timeout`,
//! aborts the rest, stops the engine and exits 0.

use crate::config::{ServeArgs, ServeConfig};
use crate::setup::{self, EngineSetup, KvBudget, ModelArgs};
use anyhow::{Context, Result, bail};
use arbor_engine_core::engine::{EngineConfig, SchedulePolicy};
use arbor_engine_core::{DType, QuantMatmul};
use arbor_server::{Server, ServerOptions};
use std::sync::Arc;
use std::time::Duration;

fn mib(b: u64) -> String {
    let m = b as f64 / (1u64 << 20) as f64;
    if m >= 1024.0 {
        format!("{:.2} GiB", m / 1024.0)
    } else {
        format!("{m:.1} MiB")
    }
}

/// What `/get_server_info` echoes: the merged settings (`model.kv_cache_dtype`
/// as configured, e.g. "auto"), plus what start-up made of them:
/// `kv_cache_dtype` (the element type in use), `kv_cache_dtype_reason` (why,
/// when `auto` chose it) and `kv_cache_bytes`.
fn server_info(cfg: &ServeConfig, built: &setup::BuiltEngine) -> serde_json::Value {
    let mut info = cfg.to_json();
    if let Some(o) = info.as_object_mut() {
        o.insert("kv_cache_dtype".into(), built.kv_dtype.dtype.name().into());
        o.insert(
            "kv_cache_dtype_reason".into(),
            built.kv_dtype.auto_reason.clone().into(),
        );
        o.insert("kv_cache_bytes".into(), built.kv_bytes.into());
        // SGLang's top-level names.
        o.insert("tp_size".into(), cfg.parallel.tp_size.unwrap_or(1).into());
        o.insert("ep_size".into(), cfg.parallel.ep_size.unwrap_or(1).into());
        o.insert(
            "base_gpu_id".into(),
            cfg.parallel.base_gpu_id.unwrap_or(0).into(),
        );
        o.insert(
            "gpu_id_step".into(),
            cfg.parallel.gpu_id_step.unwrap_or(1).into(),
        );
        o.insert("dp_size".into(), cfg.parallel.dp_size.unwrap_or(1).into());
        o.insert(
            "enable_dp_attention".into(),
            cfg.parallel.enable_dp_attention.unwrap_or(false).into(),
        );
        o.insert(
            "load_balance_method".into(),
            cfg.parallel
                .load_balance_method
                .clone()
                .unwrap_or_else(|| "round_robin".into())
                .into(),
        );
        o.insert(
            "moe_a2a_backend".into(),
            cfg.parallel
                .moe_a2a_backend
                .clone()
                .unwrap_or_else(|| "none".into())
                .into(),
        );
    }
    info
}

/// Runs `arbor serve`.
pub fn run(args: ServeArgs) -> Result<()> {
    let mut cfg = ServeConfig::from_args(&args)?;
    if args.print_config {
        print!("{}", cfg.to_toml()?);
        return Ok(());
    }
    let hub_model = resolve_hub_paths(&mut cfg)?;
    let m = &cfg.model;
    let model_args = model_args(&cfg);
    let engine_cfg = engine_config(&cfg)?;
    let lora = cfg.lora.to_settings()?;
    if model_args.enable_dp_attention {
        check_dp_attention(&cfg, &engine_cfg, lora.is_some())?;
    }
    let eviction_policy = cfg
        .cache
        .radix_eviction_policy
        .clone()
        .unwrap_or_else(|| "lru".into());
    let mut registry = setup::registry()?;
    let processors = load_plugins(&cfg, &mut registry)?;
    let sampler = cfg
        .sampling
        .sampler
        .clone()
        .unwrap_or_else(|| "standard".into());
    registry
        .samplers
        .get(&sampler)
        .context("[sampling] sampler / --sampler")?;
    // Fail on a bad policy name before spending time on the weights.
    if !engine_cfg.disable_radix_cache {
        registry
            .eviction_policies
            .get(&eviction_policy)
            .context("[cache] radix_eviction_policy / --radix-eviction-policy")?;
    }
    let built = setup::build_engine(
        &registry,
        &model_args,
        &EngineSetup {
            engine: engine_cfg.clone(),
            kv: kv_budget(&cfg),
            eviction_policy: eviction_policy.clone(),
            sampler,
            processors,
            hicache: cfg.hicache.to_settings(engine_cfg.disable_radix_cache)?,
            draft_model: engine_cfg
                .speculative
                .as_ref()
                .and(cfg.speculative.draft_model_path.clone()),
        },
    )?;
    let spec = built.model.model.spec().clone();
    let host_memory = built
        .rank_devices
        .first()
        .and_then(|r| r.first())
        .and_then(|d| d.backend.host_memory())
        .map_or("heap", |m| m.kind());
    let context_len = model_args.context_len(&spec)?;
    // A hub id is the model's name, as SGLang reports it.
    let model_path = hub_model
        .clone()
        .unwrap_or_else(|| built.model.path.display().to_string());
    let served = m
        .served_model_name
        .clone()
        .or_else(|| hub_model.clone())
        .unwrap_or_else(|| built.model.name.clone());
    let local_path = built.model.path.display().to_string();
    let mut built = built;
    if let Some(t) = &m.chat_template {
        built.model.chat_template = Some(Arc::new(chat_template(t)?));
    }
    let host = cfg
        .server
        .host
        .clone()
        .unwrap_or_else(|| "127.0.0.1".into());
    let port = cfg.server.port.unwrap_or(30000);
    let mut opts = server_options(&cfg, &built, &served, &model_path, context_len)?;
    if m.is_embedding.unwrap_or(false) {
        if model_args.tp_size > 1
            || model_args.enable_dp_attention
            || engine_cfg.speculative.is_some()
        {
            bail!(
                "--is-embedding: embeddings are computed on one rank per replica, without \
                 speculation (drop --tp-size, --enable-dp-attention, --speculative-algorithm)"
            );
        }
        opts.embedding = Some(arbor_server::embeddings::EmbeddingOptions {
            pooling: embedding_pooling(&built.model.path)?,
            dimensions: spec.hidden_size,
        });
    }
    let grammar = grammar_cache(&registry, &cfg.grammar, &built.model)?;
    let engine = Arc::new(built.engine);
    if spec.state.is_some() && matches!(cfg.disaggregation.to_settings(false), Ok(Some(_))) {
        bail!(
            "--disaggregation-mode with {}: moving a hybrid model's recurrent state between \
             workers is not supported yet",
            spec.architecture
        );
    }
    let disaggregation = cfg
        .disaggregation
        .to_settings(engine_cfg.disable_radix_cache)?
        .map(|d| crate::disagg::start(&d, &engine, &host))
        .transpose()?;
    let disagg_line = disaggregation.as_ref().map(|d| {
        let (line, info) = describe_disaggregation(d);
        if let Some(o) = opts.server_info.as_object_mut() {
            o.insert("disaggregation".into(), info);
        }
        line
    });
    let mut server = Server::new(
        engine.clone(),
        built.model.tokenizer.clone(),
        built.model.chat_template.clone(),
        opts.clone(),
    )?;
    if let Some(g) = grammar {
        server = server.with_grammar(g);
    }
    if let Some(d) = &disaggregation {
        server = server.with_disaggregation(d.server_part());
    }
    if let Some(l) = &lora {
        if spec.state.is_some() {
            bail!(
                "--enable-lora / --lora-paths with {}: LoRA adapters on a hybrid model's \
                 recurrent layers are not supported yet",
                spec.architecture
            );
        }
        server = server.with_lora(load_lora(l, &built.rank_devices, &spec)?);
    }
    server = server.with_weight_loader(Arc::new(setup::DiskWeightLoader {
        registry: Arc::new(registry),
        ranks: built.rank_devices.clone(),
        dp_attention: model_args.enable_dp_attention,
        dtype: model_args.dtype.clone(),
        quantization: model_args.quantization.clone(),
    }));
    // Only the engine holds the weights from here on (released memory is freed).
    drop(built.model);
    let summary = Summary {
        cfg: &cfg,
        model: &model_args,
        spec: &spec,
        model_path: &model_path,
        local_path: Some(&local_path),
        served: &served,
        kv: (built.kv_tokens, built.kv_bytes),
        kv_dtype: built.kv_dtype.to_string(),
        kv_note: &built.kv_note,
        state_slots: built.state_slots,
        engine: &engine_cfg,
        opts: &opts,
        eviction_policy: &eviction_policy,
        disaggregation: disagg_line.as_deref(),
        host_memory,
    };
    let result = serve_until_stopped(server, &host, port, &summary);
    // The last handle stops the scheduler thread.
    drop(engine);
    result?;
    println!("arbor serve: stopped");
    Ok(())
}

/// Resolves the hub ids among `--model-path`, `--tokenizer-path` and
/// `--speculative-draft-model-path` to folders of the Hugging Face cache
/// (downloading what is missing) before anything loads; returns the model's
/// hub id when it was one.
fn resolve_hub_paths(cfg: &mut ServeConfig) -> Result<Option<String>> {
    use crate::hub::{Want, hub_id, local_path};
    let revision = cfg.model.revision.clone();
    let mut hub_model = None;
    if let Some(p) = cfg.model.model_path.clone() {
        hub_model = hub_id(&p).map(str::to_string);
        cfg.model.model_path = Some(
            local_path(&p, revision.as_deref(), Want::Model)
                .context("[model] model_path / --model-path")?,
        );
    } else if revision.is_some() {
        bail!("--revision needs a hub id in --model-path");
    }
    if let Some(p) = cfg.model.tokenizer_path.clone() {
        // The model's revision applies when the tokenizer is the same repository.
        let same = cfg.model.model_path.is_some() && hub_model.as_deref() == p.to_str();
        cfg.model.tokenizer_path = Some(
            local_path(&p, revision.as_deref().filter(|_| same), Want::Tokenizer)
                .context("[model] tokenizer_path / --tokenizer-path")?,
        );
    }
    if let Some(p) = cfg.speculative.draft_model_path.clone() {
        cfg.speculative.draft_model_path = Some(
            local_path(&p, None, Want::Model)
                .context("[speculative] draft_model_path / --speculative-draft-model-path")?,
        );
    }
    Ok(hub_model)
}

/// How the checkpoint at `dir` pools an embedding: its sentence-transformers
/// `1_Pooling/config.json` (`pooling_mode_lasttoken` or
/// `pooling_mode_mean_tokens`), else the last token (what a causal model's
/// last position has seen all of).
fn embedding_pooling(dir: &std::path::Path) -> Result<arbor_engine_core::engine::Pooling> {
    use arbor_engine_core::engine::Pooling;
    let path = dir.join("1_Pooling").join("config.json");
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(Pooling::Last);
    };
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{}", path.display()))?;
    let on = |k: &str| v.get(k).and_then(serde_json::Value::as_bool) == Some(true);
    if on("pooling_mode_lasttoken") {
        Ok(Pooling::Last)
    } else if on("pooling_mode_mean_tokens") {
        Ok(Pooling::Mean)
    } else {
        bail!(
            "{}: --is-embedding pools by the last token or the mean; this config asks for \
             another pooling",
            path.display()
        )
    }
}

/// The `--chat-template`: a file (Jinja, or a JSON tokenizer config) or a
/// built-in name.
fn chat_template(given: &str) -> Result<arbor_models::ChatTemplate> {
    let path = std::path::Path::new(given);
    if path.is_file() {
        return arbor_models::ChatTemplate::from_file(path)
            .with_context(|| format!("[model] chat_template / --chat-template {given}"));
    }
    match arbor_models::ChatTemplate::named(given) {
        Some(t) => t.context("[model] chat_template / --chat-template"),
        None => bail!(
            "[model] chat_template / --chat-template: '{given}' is neither a file nor a built-in \
             template ({})",
            arbor_models::BUILTIN_TEMPLATES
                .iter()
                .map(|(n, _)| *n)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// The HTTP server's options from the `[server]` and `[metrics]` sections
/// and the built engine.
fn server_options(
    cfg: &ServeConfig,
    built: &setup::BuiltEngine,
    served: &str,
    model_path: &str,
    context_length: usize,
) -> Result<ServerOptions> {
    Ok(ServerOptions {
        served_model_name: served.to_string(),
        model_path: model_path.to_string(),
        context_length,
        api_key: cfg.server.api_key.clone(),
        max_request_bytes: cfg.server.max_request_bytes.unwrap_or(32 << 20),
        shutdown_timeout: Duration::from_secs_f64(cfg.server.shutdown_timeout.unwrap_or(30.0)),
        enable_metrics: cfg.metrics.enable_metrics.unwrap_or(false),
        metrics_prefix: cfg.metrics.prefix.clone().unwrap_or_else(|| "arbor".into()),
        enable_cache_report: cfg.metrics.enable_cache_report.unwrap_or(false),
        server_info: server_info(cfg, built),
        reasoning_parser: cfg.reasoning_parser()?,
        log_requests: cfg.log_requests()?,
        tool_call_parser: cfg.tool_call_parser()?,
        ..Default::default()
    })
}

/// Listens on `host:port`, prints the start-up summary and serves until a
/// shutdown signal; the runtime then gets two seconds to finish.
fn serve_until_stopped(server: Server, host: &str, port: u16, summary: &Summary) -> Result<()> {
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 4));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .thread_name("arbor-http")
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let result: Result<()> = rt.block_on(async {
        let listener = tokio::net::TcpListener::bind((host, port))
            .await
            .with_context(|| format!("listening on {host}:{port}"))?;
        let addr = listener.local_addr()?;
        summary.print()?;
        println!("listening on http://{addr}");
        server
            .serve(listener, arbor_server::shutdown_signal())
            .await
            .context("serving")?;
        Ok(())
    });
    rt.shutdown_timeout(Duration::from_secs(2));
    result
}

/// The model settings of `[model]`, `[scheduler]` and `[parallel]`.
fn model_args(cfg: &ServeConfig) -> ModelArgs {
    let m = &cfg.model;
    ModelArgs {
        model_path: m.model_path.clone(),
        revision: m.revision.clone(),
        tokenizer_path: m.tokenizer_path.clone(),
        context_length: m.context_length,
        device: m.device.clone().unwrap_or_else(|| "cpu".into()),
        threads: m.threads.unwrap_or(0),
        dtype: m.dtype.clone().unwrap_or_else(|| "auto".into()),
        quantization: m.quantization.clone(),
        kv_cache_dtype: m.kv_cache_dtype.clone().unwrap_or_else(|| "auto".into()),
        page_size: cfg.page_size(),
        wgpu_adapter: m.wgpu_adapter.clone(),
        // Checked by `ServeConfig::validate`.
        cpu_quant_matmul: m
            .cpu_quant_matmul
            .as_deref()
            .and_then(|q| q.parse().ok())
            .unwrap_or_default(),
        max_mamba_cache_size: m.max_mamba_cache_size,
        mamba_full_memory_ratio: m.mamba_full_memory_ratio,
        disable_cuda_graph: m.disable_cuda_graph.unwrap_or(false),
        cuda_graph_max_bs: m.cuda_graph_max_bs.or(cfg.scheduler.max_running_requests),
        tp_size: cfg.parallel.tp_size.unwrap_or(1),
        ep_size: cfg.parallel.ep_size.unwrap_or(1),
        moe_a2a_backend: cfg.parallel.moe_a2a_backend.clone(),
        base_gpu_id: cfg.parallel.base_gpu_id.unwrap_or(0),
        gpu_id_step: cfg.parallel.gpu_id_step.unwrap_or(1),
        dp_size: cfg.parallel.dp_size.unwrap_or(1),
        load_balance_method: cfg.parallel.load_balance_method.clone(),
        enable_dp_attention: cfg.parallel.enable_dp_attention.unwrap_or(false),
    }
}

/// The engine settings of `[scheduler]`, `[cache]`, `[grammar]`,
/// `[speculative]` and `[lora]`, SGLang's defaults elsewhere.
fn engine_config(cfg: &ServeConfig) -> Result<EngineConfig> {
    let (q, c) = (&cfg.scheduler, &cfg.cache);
    let policy: SchedulePolicy = q
        .schedule_policy
        .as_deref()
        .unwrap_or("lpm")
        .parse()
        .context("[scheduler] schedule_policy / --schedule-policy")?;
    let defaults = EngineConfig::default();
    Ok(EngineConfig {
        // Checked against the model's context when the replica loads.
        context_length: cfg.model.context_length,
        max_running_requests: q
            .max_running_requests
            .unwrap_or(defaults.max_running_requests),
        max_prefill_tokens: q.max_prefill_tokens.unwrap_or(defaults.max_prefill_tokens),
        chunked_prefill_size: q
            .chunked_prefill_size
            .unwrap_or(defaults.chunked_prefill_size),
        schedule_policy: policy,
        schedule_conservativeness: q
            .schedule_conservativeness
            .unwrap_or(defaults.schedule_conservativeness),
        enable_mixed_chunk: q.enable_mixed_chunk.unwrap_or(false),
        overlap_schedule: q.overlap_schedule,
        disable_radix_cache: c.disable_radix_cache.unwrap_or(false),
        hold_ratio: c.session_hold_ratio.unwrap_or(defaults.hold_ratio),
        max_queued_requests: q
            .max_queued_requests
            .unwrap_or(defaults.max_queued_requests),
        enable_jump_forward: cfg.grammar.jump_forward.unwrap_or(true),
        speculative: cfg.speculative.to_engine()?,
        max_loras_per_batch: cfg.lora.max_loras_per_batch.unwrap_or(8),
        ..defaults
    })
}

/// What data-parallel attention cannot run with.
fn check_dp_attention(cfg: &ServeConfig, engine: &EngineConfig, lora: bool) -> Result<()> {
    if lora {
        bail!(
            "--lora-paths with --enable-dp-attention: LoRA adapters are not supported with data-parallel attention"
        );
    }
    if cfg
        .disaggregation
        .to_settings(engine.disable_radix_cache)?
        .is_some()
    {
        bail!(
            "--disaggregation-mode with --enable-dp-attention: PD disaggregation is not supported with data-parallel attention"
        );
    }
    Ok(())
}

/// The KV cache budget: `max_total_tokens`, else `kv_cache_gb`, else the
/// memory fraction.
fn kv_budget(cfg: &ServeConfig) -> KvBudget {
    let c = &cfg.cache;
    match (c.max_total_tokens, c.kv_cache_gb) {
        (Some(t), _) => KvBudget::Tokens(t),
        (None, Some(g)) => KvBudget::Bytes((g * (1u64 << 30) as f64) as u64),
        (None, None) => KvBudget::Fraction(cfg.mem_fraction_static()),
    }
}

/// Loads the `[[plugins]]` into `registry`; returns the logits processors
/// every request runs: `[sampling] logits_processors` and the plugins'.
fn load_plugins(
    cfg: &ServeConfig,
    registry: &mut arbor_engine_core::Registry,
) -> Result<Vec<(String, serde_json::Value)>> {
    let mut processors: Vec<(String, serde_json::Value)> = cfg
        .sampling
        .logits_processors
        .clone()
        .unwrap_or_default()
        .into_iter()
        .map(|n| (n, serde_json::Value::Null))
        .collect();
    for p in &cfg.plugins {
        let config = match &p.config {
            Some(t) => serde_json::to_value(t)?,
            None => serde_json::Value::Null,
        };
        let info = arbor_engine_core::plugin::load_plugin(&p.path, &config, registry)
            .with_context(|| format!("[[plugins]] {}", p.path.display()))?;
        eprintln!(
            "loaded plugin {} {} from {}: eviction policies {:?}, logits processors {:?}, samplers {:?}",
            info.name,
            info.version,
            p.path.display(),
            info.eviction_policies,
            info.logits_processors,
            info.samplers
        );
        // A loaded plugin's logits processors apply to every request.
        processors.extend(
            info.logits_processors
                .iter()
                .map(|n| (n.clone(), config.clone())),
        );
    }
    Ok(processors)
}

/// The summary line of a started disaggregation role, and its
/// `/get_server_info` entry.
fn describe_disaggregation(d: &crate::disagg::Started) -> (String, serde_json::Value) {
    match d {
        crate::disagg::Started::Prefill { transfer, rooms } => (
            format!(
                "prefill (sends prompts' KV to decode workers over {}; bootstrap rooms on {})",
                transfer.name(),
                rooms.local_addr()
            ),
            serde_json::json!({
                "mode": "prefill",
                "transfer_backend": "tcp",
                "kv_transfer_address": null,
                "bootstrap_address": rooms.local_addr().to_string(),
                "bootstrap_port": rooms.local_addr().port(),
            }),
        ),
        crate::disagg::Started::Decode { receiver, .. } => (
            format!("decode (receives KV over tcp on {})", receiver.local_addr()),
            serde_json::json!({
                "mode": "decode",
                "transfer_backend": "tcp",
                "kv_transfer_address": receiver.local_addr().to_string(),
            }),
        ),
    }
}

/// Loads the `[lora]` adapters onto every replica's devices, printing each.
fn load_lora(
    l: &crate::lora::LoraSettings,
    rank_devices: &[Vec<setup::ShardDevice>],
    spec: &arbor_engine_core::ModelSpec,
) -> Result<Arc<arbor_lora::LoraRegistry>> {
    let replicas = rank_devices
        .iter()
        .map(|devices| devices.iter().map(|d| d.backend.clone()).collect())
        .collect();
    let registry = crate::lora::build(l, replicas, spec)?;
    for (name, loaded) in registry.list() {
        eprintln!(
            "LoRA adapter '{name}': rank {}, {:.2} MiB on {:?}, from {}",
            loaded.adapter.rank(),
            loaded.adapter.bytes() as f64 / (1u64 << 20) as f64,
            loaded
                .adapter
                .targets()
                .iter()
                .map(|t| t.module())
                .collect::<Vec<_>>(),
            loaded.path.display()
        );
    }
    Ok(registry)
}

/// What the start-up summary reports.
struct Summary<'a> {
    cfg: &'a ServeConfig,
    model: &'a ModelArgs,
    spec: &'a arbor_engine_core::ModelSpec,
    model_path: &'a str,
    /// The folder a hub id resolved to.
    local_path: Option<&'a str>,
    served: &'a str,
    /// KV capacity in tokens and bytes.
    kv: (usize, u64),
    kv_dtype: String,
    kv_note: &'a str,
    /// A hybrid model's recurrent state slots per replica.
    state_slots: usize,
    engine: &'a EngineConfig,
    opts: &'a ServerOptions,
    eviction_policy: &'a str,
    disaggregation: Option<&'a str>,
    /// What a host tier's pages live in (`pinned` on GPUs, `heap`).
    host_memory: &'static str,
}

impl Summary<'_> {
    /// `, quant matmul ...` for weights the choice applies to (the scaled
    /// blocks with f32 inputs) on the CPU (with why amx-bf16 was not taken,
    /// if asked for), else nothing.
    fn quant_matmul_note(&self) -> String {
        let args = self.model;
        let amx_applies = matches!(
            arbor_quant::act_dtype_with(self.spec.weight_dtype, QuantMatmul::AmxBf16),
            Ok(DType::BF16)
        ) && self.spec.weight_dtype.is_scaled_block();
        if args.device != "cpu" || !amx_applies {
            return String::new();
        }
        let runs = crate::setup::cpu_quant_matmul(args);
        if runs == args.cpu_quant_matmul {
            format!(", quant matmul {}", runs.name())
        } else {
            format!(
                ", quant matmul {} ({} needs AMX-BF16, which this CPU lacks)",
                runs.name(),
                args.cpu_quant_matmul.name()
            )
        }
    }

    /// What the flags SGLang's commands carry and Arbor accepts without
    /// effect mean here.
    fn compat_notes(&self) -> Vec<&'static str> {
        let mut notes = Vec::new();
        if self.cfg.model.trust_remote_code == Some(true) {
            notes.push(
                "--trust-remote-code: no checkpoint code runs; every architecture is Arbor's own",
            );
        }
        if self.cfg.scheduler.enable_deterministic_inference == Some(true) {
            notes.push(
                "--enable-deterministic-inference: output is batch-invariant by default (greedy tokens do not depend on batching, caching or chunking)",
            );
        }
        notes
    }

    /// Prints the summary on stdout (before the `listening on` line).
    fn print(&self) -> Result<()> {
        let (spec, model_args, engine_cfg, opts) = (self.spec, self.model, self.engine, self.opts);
        let (kv_tokens, kv_bytes) = self.kv;
        println!("arbor serve");
        let context = match model_args.context_len(spec) {
            Ok(c) if c != spec.max_position_embeddings => {
                format!("context {c} of {}", spec.max_position_embeddings)
            }
            _ => format!("context {}", spec.max_position_embeddings),
        };
        println!(
            "  model:      {} ({}, {} layers, {context}) served as '{}'",
            self.model_path, spec.architecture, spec.num_layers, self.served
        );
        if let Some(local) = self.local_path.filter(|l| *l != self.model_path) {
            println!("  files:      {local}");
        }
        println!(
            "  weights:    {} ({}), {} on {} ({} threads{})",
            spec.weight_dtype,
            spec.quantization,
            mib(spec.weight_bytes),
            model_args.device,
            if model_args.threads == 0 {
                "all".to_string()
            } else {
                model_args.threads.to_string()
            },
            self.quant_matmul_note()
        );
        println!(
            "  KV cache:   {} tokens ({} pages of {}), {}, {} [{}]",
            kv_tokens,
            kv_tokens / model_args.page_size.max(1),
            model_args.page_size,
            self.kv_dtype,
            mib(kv_bytes),
            self.kv_note
        );
        for note in self.compat_notes() {
            println!("  note:       {note}");
        }
        println!(
            "  scheduler:  max_running_requests {}, max_prefill_tokens {}, chunked_prefill_size {}, policy {}, mixed chunk {}, overlap schedule {}",
            engine_cfg.max_running_requests,
            engine_cfg.max_prefill_tokens,
            engine_cfg.chunked_prefill_size,
            engine_cfg.schedule_policy.name(),
            engine_cfg.enable_mixed_chunk,
            match engine_cfg.overlap_schedule {
                Some(true) => "on",
                Some(false) => "off",
                None => "auto (on for asynchronous devices)",
            }
        );
        println!("  cache:      {}", self.cache_line());
        println!(
            "  limits:     request body {}, shutdown timeout {} s, API key {}, metrics {}, cache report {}",
            mib(opts.max_request_bytes as u64),
            opts.shutdown_timeout.as_secs_f64(),
            if opts.api_key.is_some() {
                "required"
            } else {
                "off"
            },
            if opts.enable_metrics {
                format!("on ({}:)", opts.metrics_prefix)
            } else {
                "off".into()
            },
            if opts.enable_cache_report {
                "on"
            } else {
                "off"
            }
        );
        if let Some(line) = self.disaggregation {
            println!("  disaggregation: {line}");
        }
        self.print_parallel()
    }

    /// The prefix cache and its tiers.
    fn cache_line(&self) -> String {
        if let Some(st) = self.spec.state {
            let running = self.engine.max_running_requests.max(1);
            let total = self.state_slots;
            let snapshots = total.saturating_sub(running);
            let reuse = if snapshots == 0 || self.engine.disable_radix_cache {
                "prefix reuse off (no state slot left for snapshots)".to_string()
            } else {
                format!(
                    "radix, eviction {}; prefixes reused up to their recurrent state snapshots",
                    self.eviction_policy
                )
            };
            return format!(
                "{reuse}; {total} recurrent state slots ({} running, {snapshots} snapshots) of {} \
                 ({} recurrent layers), {} in all",
                total.min(running),
                mib(st.bytes_per_slot()),
                st.layers,
                mib(st.bytes_per_slot() * total as u64)
            );
        }
        if self.engine.disable_radix_cache {
            return "prefix reuse off".to_string();
        }
        let tiers = match self.cfg.hicache.to_settings(false).ok().flatten() {
            None => match self.cfg.hicache.storage_without_enable() {
                Some(b) => format!(
                    "; HiCache off (--hicache-storage-backend {b} has no effect without \
                     --enable-hierarchical-cache)"
                ),
                None => String::new(),
            },
            Some(h) => format!(
                "; HiCache host tier {} ({} memory), {}, storage {} (prefetch {})",
                if h.size_gb > 0.0 {
                    format!("{} GB", h.size_gb)
                } else {
                    format!("{}x the device pool", h.ratio)
                },
                self.host_memory,
                h.write_policy,
                h.storage.as_ref().map_or("none", |(b, _)| b.as_str()),
                h.prefetch_policy
            ),
        };
        format!("radix, eviction {}{tiers}", self.eviction_policy)
    }

    /// Tensor, expert and data parallelism, where there is any.
    fn print_parallel(&self) -> Result<()> {
        let (model_args, cfg) = (self.model, self.cfg);
        let kv_tokens = self.kv.0;
        let parallel = model_args.parallel()?;
        let tp = parallel.tp;
        if tp > 1 {
            let device = &model_args.device;
            let placement = if device == "cpu" {
                "the threads split between them".to_string()
            } else {
                let ids: Vec<String> = (0..tp)
                    .map(|r| parallel.device_index(r).to_string())
                    .collect();
                format!(
                    "{device} devices {}, collectives through host memory",
                    ids.join(", ")
                )
            };
            println!(
                "  parallel:   tensor-parallel {tp} ranks (in-process, {placement}), \
                 expert-parallel {} (moe-a2a-backend {})",
                cfg.parallel.ep_size.unwrap_or(1),
                cfg.parallel.moe_a2a_backend.as_deref().unwrap_or("none")
            );
        }
        if parallel.attention == arbor_engine_core::AttentionSharding::DataParallel {
            println!(
                "  data-parallel attention: {} ranks, each running attention whole for its own \
                 requests with its own scheduler and KV cache of {} tokens (feed-forward split \
                 over the ranks), load balance {}",
                parallel.dp,
                kv_tokens / parallel.dp,
                parallel.balance
            );
        } else if parallel.dp > 1 {
            let placement = if model_args.device == "cpu" {
                "the threads split between them".to_string()
            } else {
                let ids: Vec<String> = (0..parallel.dp)
                    .map(|d| parallel.replica_device_index(d).to_string())
                    .collect();
                format!("first devices {}", ids.join(", "))
            };
            println!(
                "  data-parallel: {} replicas ({placement}), each with its own scheduler and \
                 KV cache of {} tokens, load balance {}",
                parallel.dp,
                kv_tokens / parallel.dp,
                parallel.balance
            );
        }
        Ok(())
    }
}

/// The grammar backend for the served model's tokenizer, behind a compile cache
/// (`None` with `grammar_backend = "none"`).
fn grammar_cache(
    registry: &arbor_engine_core::Registry,
    g: &crate::config::GrammarSection,
    model: &arbor_models::LoadedModel,
) -> Result<Option<Arc<arbor_engine_core::grammar::GrammarCache>>> {
    use arbor_engine_core::grammar::{
        GrammarBackendConfig, GrammarCache, GrammarCacheConfig, GrammarOptions, GrammarVocab,
        JsonWhitespace, VocabSource,
    };
    let name = g
        .grammar_backend
        .clone()
        .unwrap_or_else(|| "llguidance".into());
    if name == "none" {
        return Ok(None);
    }
    let factory = registry
        .grammar_backends
        .get(&name)
        .context("[grammar] grammar_backend / --grammar-backend")?;
    let json =
        model.tokenizer.inner().to_string(false).map_err(|e| {
            anyhow::anyhow!("serializing the tokenizer for the grammar backend: {e}")
        })?;
    let json_whitespace = match (&g.json_whitespace_pattern, g.json_whitespace.as_deref()) {
        (Some(p), _) => JsonWhitespace::Pattern(p.clone()),
        (None, Some("flexible")) => JsonWhitespace::Flexible,
        _ => JsonWhitespace::Compact,
    };
    let backend = factory(&GrammarBackendConfig {
        vocab: GrammarVocab {
            source: VocabSource::TokenizerJson(json.into()),
            eos_token_ids: model.tokenizer.eos_token_ids.clone(),
            vocab_size: Some(model.model.spec().vocab_size),
        },
        options: GrammarOptions {
            json_whitespace,
            json_lenient: g.json_lenient.unwrap_or(false),
            json_strict_one_of: g.json_strict_one_of.unwrap_or(false),
            ..Default::default()
        },
    })
    .with_context(|| format!("starting grammar backend '{name}'"))?;
    Ok(Some(Arc::new(GrammarCache::new(
        backend,
        GrammarCacheConfig {
            capacity: g.cache_size.unwrap_or(1024),
            max_grammar_bytes: g.max_grammar_bytes.unwrap_or(4 << 20),
            compile_timeout: Some(std::time::Duration::from_secs_f64(
                g.compile_timeout.unwrap_or(10.0),
            )),
        },
    ))))
}
