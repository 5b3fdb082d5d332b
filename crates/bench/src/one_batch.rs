//! `arbor bench one-batch`: in-process prefill and decode latency of one
//! static batch, like `sglang.bench_one_batch`, for quick model and kernel
//! comparisons without a server.
//!
//! For each (batch size, input length, output length) of the sweep it loads
//! nothing new: the model is loaded once, a KV cache sized for that batch is
//! allocated (`--kv-cache-dtype`, `auto` as `arbor serve`: f16 on the CPU),
//! random prompts (ids below `min(vocab, 10000)`, SGLang's range)
//! are prefilled in one forward pass, then `output_len - 1` decode steps run
//! with greedy picks. Lines are printed in SGLang's format; one JSONL record
//! per run goes to `--result-filename`. Invariants: timings cover the forward
//! passes and the download of their logits, never allocation or loading; a
//! shape that does not fit the model's context is skipped with a message.

use crate::error::{BenchError, Result};
use crate::rng::Rng;
use crate::stats;
use arbor_engine_core::runner::{KvGeometry, ModelRunner, SeqStep};
use arbor_engine_core::{
    BackendOptions, KvDtypeChoice, LoadOptions, QuantMatmul, Registry, ResolvedKvDtype,
};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

/// Options of `arbor bench one-batch` (model options as `arbor generate`'s).
#[derive(Args, Debug, Clone)]
pub struct OneBatchArgs {
    /// Model: a Hugging Face folder (config.json, safetensors, tokenizer.json) or a GGUF file
    /// [default: the model `arbor fetch-default` downloads].
    #[arg(long = "model-path")]
    pub model_path: Option<PathBuf>,
    /// Device: a registered backend name.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// CPU threads (0: one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Weight storage: auto (as the checkpoint), f32, f16 or bf16.
    #[arg(long, default_value = "auto")]
    pub dtype: String,
    /// Quantization method (fp8 quantizes a float checkpoint at load) [default: the checkpoint's].
    #[arg(long)]
    pub quantization: Option<String>,
    /// KV cache element type: auto (f16 on the CPU, f32 on other devices), f32, f16 or bf16.
    #[arg(long = "kv-cache-dtype", default_value = "auto")]
    pub kv_cache_dtype: String,
    /// Tokens per KV page.
    #[arg(long = "page-size", default_value_t = 16)]
    pub page_size: usize,
    /// CPU: how HF-quantized weights are multiplied, f32 or amx-bf16 (as `arbor serve`'s).
    #[arg(long = "cpu-quant-matmul", default_value = "f32")]
    pub cpu_quant_matmul: QuantMatmul,
    /// Batch sizes to sweep.
    #[arg(long = "batch-size", num_args = 1.., default_values_t = [1])]
    pub batch_size: Vec<usize>,
    /// Input lengths to sweep.
    #[arg(long = "input-len", num_args = 1.., default_values_t = [1024])]
    pub input_len: Vec<usize>,
    /// Output lengths to sweep (the prefill's token counts as the first).
    #[arg(long = "output-len", num_args = 1.., default_values_t = [16])]
    pub output_len: Vec<usize>,
    /// Name stored in each result record.
    #[arg(long = "run-name", default_value = "default")]
    pub run_name: String,
    /// Append one JSON record per run to this file.
    #[arg(long = "result-filename")]
    pub result_filename: Option<PathBuf>,
    /// Also print every N-th decode step (0: only the first five).
    #[arg(long = "log-decode-step", default_value_t = 0)]
    pub log_decode_step: usize,
    /// Seed of the random prompts.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Skip the warmup run.
    #[arg(long = "skip-warmup")]
    pub skip_warmup: bool,
}

/// One run's figures (a `--result-filename` record).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct OneBatchResult {
    pub run_name: String,
    pub batch_size: usize,
    pub input_len: usize,
    pub output_len: usize,
    pub prefill_latency: f64,
    pub prefill_throughput: f64,
    pub median_decode_latency: Option<f64>,
    pub median_decode_throughput: Option<f64>,
    pub total_latency: f64,
    pub overall_throughput: f64,
}

fn argmax(xs: &[f32]) -> u32 {
    xs.iter()
        .enumerate()
        .fold((0usize, f32::NEG_INFINITY), |(bi, bv), (i, &v)| {
            if v > bv { (i, v) } else { (bi, bv) }
        })
        .0 as u32
}

struct Loaded {
    model: Arc<dyn arbor_engine_core::Model>,
    backend: Arc<dyn arbor_engine_core::Backend>,
    kv_dtype: ResolvedKvDtype,
}

fn load(args: &OneBatchArgs) -> Result<Loaded> {
    let kv_choice: KvDtypeChoice = args
        .kv_cache_dtype
        .parse()
        .map_err(|e| BenchError::invalid(format!("--kv-cache-dtype: {e}")))?;
    let registry = Registry::builtin()?;
    let factory = registry.backends.get(&args.device)?;
    let backend = factory(&BackendOptions {
        threads: args.threads,
        cpu_quant_matmul: args.cpu_quant_matmul,
        ..Default::default()
    })?;
    let mut quant = registry.quant_methods.get(&args.dtype)?(&Default::default())?;
    if let Some(q) = &args.quantization {
        quant = registry.quant_methods.get(q)?(&arbor_engine_core::QuantInit {
            checkpoint: None,
            base: Some(quant),
        })?;
    }
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("loading {msg} [{bar:30}] {pos}/{len} tensors")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let path = match &args.model_path {
        Some(p) => p.clone(),
        None => arbor_models::default_model_path()
            .filter(|p| p.exists())
            .ok_or_else(|| {
                BenchError::InvalidArgument(
                    "no --model-path given and the default model is absent: run `arbor fetch-default`"
                        .into(),
                )
            })?,
    };
    bar.set_message(path.display().to_string());
    let pb = bar.clone();
    let opts = LoadOptions {
        backend: backend.clone(),
        quant,
        progress: Some(Arc::new(move |done, total| {
            pb.set_length(total as u64);
            pb.set_position(done as u64);
        })),
    };
    let loaded = arbor_models::load_model(&path, &registry, &opts);
    bar.finish_and_clear();
    let model = loaded?.model;
    Ok(Loaded {
        kv_dtype: kv_choice.resolve(&*backend, model.spec().checkpoint_kv_dtype),
        model,
        backend,
    })
}

/// Runs one (batch, input, output) shape; `None` when it does not fit.
fn run_once(
    m: &Loaded,
    args: &OneBatchArgs,
    bs: usize,
    il: usize,
    ol: usize,
    rng: &mut Rng,
    log_decode_step: usize,
) -> Result<Option<OneBatchResult>> {
    let spec = m.model.spec().clone();
    if il == 0 || ol == 0 || bs == 0 {
        println!(
            "skipping ({bs}, {il}, {ol}): batch size, input and output lengths must be at least 1"
        );
        return Ok(None);
    }
    if il + ol > spec.max_position_embeddings {
        println!(
            "skipping ({bs}, {il}, {ol}): input + output exceed the model's context of {}",
            spec.max_position_embeddings
        );
        return Ok(None);
    }
    let ps = args.page_size.max(1);
    let per_seq = (il + ol).div_ceil(ps);
    let runner = ModelRunner::with_state_slots(
        m.model.clone(),
        m.backend.clone(),
        None,
        KvGeometry {
            page_size: ps,
            num_pages: bs * per_seq,
            kv_dtype: m.kv_dtype.dtype,
            state_slots: bs,
        },
    )?;
    let pool = runner.new_page_pool();
    // One recurrent state slot per sequence (a hybrid model's; none otherwise).
    let hybrid = spec.state.is_some();
    let slot = |i: usize| hybrid.then_some(i as u32);
    let pages = (0..bs)
        .map(|_| pool.alloc(per_seq))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let hi = spec.vocab_size.min(10_000) as u64;
    let prompts: Vec<Vec<u32>> = (0..bs)
        .map(|_| (0..il).map(|_| rng.below(hi) as u32).collect())
        .collect();

    let steps: Vec<SeqStep<'_>> = prompts
        .iter()
        .zip(&pages)
        .enumerate()
        .map(|(i, (p, pg))| SeqStep {
            tokens: p,
            prefix_len: 0,
            pages: pg.pages(),
            want_logits: true,
            state_slot: slot(i),
        })
        .collect();
    let tic = Instant::now();
    let logits = runner.step(&steps)?;
    let prefill_latency = tic.elapsed().as_secs_f64();
    let mut next: Vec<[u32; 1]> = logits.iter().map(|l| [argmax(l)]).collect();
    let prefill_throughput = (il * bs) as f64 / prefill_latency.max(1e-12);
    println!(
        "Prefill. latency: {prefill_latency:6.5} s, throughput: {prefill_throughput:9.2} token/s"
    );
    let mut total = prefill_latency;

    let mut decode = Vec::with_capacity(ol.saturating_sub(1));
    for i in 0..ol - 1 {
        let steps: Vec<SeqStep<'_>> = next
            .iter()
            .zip(&pages)
            .enumerate()
            .map(|(j, (t, pg))| SeqStep {
                tokens: t,
                prefix_len: il + i,
                pages: pg.pages(),
                want_logits: true,
                state_slot: slot(j),
            })
            .collect();
        let tic = Instant::now();
        let logits = runner.step(&steps)?;
        let latency = tic.elapsed().as_secs_f64();
        next = logits.iter().map(|l| [argmax(l)]).collect();
        total += latency;
        decode.push(latency);
        if i < 5 || (log_decode_step > 0 && i % log_decode_step == 0) {
            let tp = bs as f64 / latency.max(1e-12);
            println!(
                "Decode {i}. Batch size: {bs}, latency: {latency:6.5} s, throughput: {tp:9.2} token/s"
            );
        }
    }
    let (mut med, mut med_tp) = (None, None);
    if ol > 1 {
        let m = stats::median(&decode);
        let tp = bs as f64 / m.max(1e-12);
        println!("Decode.  median latency: {m:6.5} s, median throughput: {tp:9.2} token/s");
        (med, med_tp) = (Some(m), Some(tp));
    }
    let overall = ((il + ol) * bs) as f64 / total.max(1e-12);
    println!("Total. latency: {total:6.3} s, throughput: {overall:9.2} token/s");
    Ok(Some(OneBatchResult {
        run_name: args.run_name.clone(),
        batch_size: bs,
        input_len: il,
        output_len: ol,
        prefill_latency,
        prefill_throughput,
        median_decode_latency: med,
        median_decode_throughput: med_tp,
        total_latency: total,
        overall_throughput: overall,
    }))
}

/// Runs `arbor bench one-batch`: prints SGLang's lines and returns the results.
pub fn run_one_batch(args: OneBatchArgs) -> Result<Vec<OneBatchResult>> {
    if args.batch_size.is_empty() || args.input_len.is_empty() || args.output_len.is_empty() {
        return Err(BenchError::invalid(
            "--batch-size, --input-len and --output-len need at least one value each",
        ));
    }
    let m = load(&args)?;
    let s = m.model.spec();
    println!(
        "model: {} ({} layers, hidden {}, vocab {}), device: {}, KV cache: {}",
        s.architecture,
        s.num_layers,
        s.hidden_size,
        s.vocab_size,
        m.backend.info().name,
        m.kv_dtype
    );
    let mut rng = Rng::new(args.seed);
    if !args.skip_warmup {
        println!("Warmup ...");
        let ol = args.output_len[0].min(32);
        run_once(
            &m,
            &args,
            args.batch_size[0],
            args.input_len[0],
            ol,
            &mut rng,
            0,
        )?;
    }
    println!("Benchmark ...");
    let mut results = Vec::new();
    for &bs in &args.batch_size {
        for &il in &args.input_len {
            for &ol in &args.output_len {
                if let Some(r) = run_once(&m, &args, bs, il, ol, &mut rng, args.log_decode_step)? {
                    results.push(r);
                }
            }
        }
    }
    if let Some(path) = &args.result_filename {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|e| BenchError::io(path, e))?;
        for r in &results {
            let line =
                serde_json::to_string(r).map_err(|e| BenchError::data(path, e.to_string()))?;
            writeln!(f, "{line}").map_err(|e| BenchError::io(path, e))?;
        }
    }
    Ok(results)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_picks_the_first_largest() {
        assert_eq!(argmax(&[0.1, 3.0, 3.0, -1.0]), 1);
        assert_eq!(argmax(&[]), 0);
    }
}
