//! Decode and prefill throughput of a Llama-3.1-8B-shaped model (or, with
//! `--model deepseek-v2-lite`, DeepSeek-V2-Lite's latent attention: 576-wide
//! heads, one shared by 16 query heads, with dense MLPs) with random bf16
//! weights created on the GPU (the host supplies only shapes; see
//! `GpuBackend::set_synthetic_weights`), printed as one table.
//!
//! Decode: batches of 1, 8, 64 and 256 sequences, each with a cached context
//! of `--context` tokens, run step after step through the model, device
//! sampling (greedy) and a download of the ids only; 3 warm-up steps (which
//! capture the CUDA graph of the bucket), then `--steps` timed steps. Batch 1
//! is also run with CUDA graphs off, and compared with the HBM roofline
//! (4.8 TB/s divided by the weight bytes). Prefill: one prompt of `--prefill`
//! tokens, one warm-up and three timed runs, then again with the attention
//! on the f32 kernels instead of the tensor-core one (where that applies).
//!
//! `--quant NAME` loads the weights through that quantization method (`fp8`
//! quantizes the bf16 matrices at load, on the host, so the matrices are
//! zeros rather than random: a speed figure only); `--quant awq` and
//! `--quant nvfp4` give the linear layers in AutoAWQ's INT4 or ModelOpt's
//! NVFP4 checkpoint format (`RandomWeights::quantized`, with zero codes and
//! scales: a speed figure only) and load them through `awq` or `modelopt`,
//! as a checkpoint so quantized would load; with scaled-block weights
//! (FP8, INT4, NVFP4) the prefill and the graph-less batch-1 decode are also
//! timed with the weights dequantized before each GEMM instead of the
//! tensor-core GEMM (decode alternated, best of two each), and FP8 weights'
//! prefill also with W8A8 (E4M3 inputs on FP8 tensor cores, sm_89+).
//! HiCache load-back: a step that loads `--load-back` tokens of prefix KV from
//! host memory and computes 128 more tokens on it, with the loads written one
//! layer tensor at a time on the copy stream (`Backend::write_async`: layer
//! `l` waits for its own pages only), from pinned pages in place (what the
//! executor does with the host tier's pinned pages) and from pageable memory
//! through staging, against the same loads written on the main stream
//! before the forward (alternated, best of two each).
//! `--batches none`, `--prefill 0` and `--load-back 0` leave a phase out (for a profiler).
//!
//! `cargo run --release -p arbor-backend-cuda --example gpu_bench -- [--layers N]
//! [--batches 1,8,64,256|none] [--context 512] [--steps 32] [--prefill 2048]
//! [--load-back 4096] [--quant auto|fp8|w8a8_fp8|awq|nvfp4] [--model llama-8b|deepseek-v2-lite]`
#![allow(clippy::unwrap_used)]

use anyhow::{Context, Result, bail};
use arbor_backend_cuda::GpuBackend;
use arbor_engine_core::backend::SampleRow;
use arbor_engine_core::{
    AttentionBackend, Backend, BackendOptions, BatchLayout, DType, ForwardBatch, ForwardContext,
    HostData, HostRows, HostTensor, KvCache, KvSpec, LoadOptions, Model, PagePool, QuantInit,
    Registry, WeightSource,
};
use arbor_models::config::DecoderConfig;
use arbor_models::decoder::{ArchFlags, DEEPSEEK_V2, DecoderArchitecture, DecoderModel};
use arbor_models::mla::MlaConfig;
use arbor_models::random::{LatentShape, RandomQuant, RandomWeights};
// Registers the quantization methods (`--quant fp8`).
use arbor_quant as _;
use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

const HBM_BYTES_PER_S: f64 = 4.8e12;
const PAGE: usize = 16;
/// Decode steps before timing (the first steps of a bucket grow the arena,
/// warm cuBLAS up and capture the graph).
const WARM: usize = 3;

struct Args {
    layers: usize,
    batches: Vec<usize>,
    context: usize,
    steps: usize,
    prefill: usize,
    load_back: usize,
    quant: String,
    model: String,
}

fn args() -> Result<Args> {
    let mut a = Args {
        layers: 32,
        batches: vec![1, 8, 64, 256],
        context: 512,
        steps: 32,
        prefill: 2048,
        load_back: 4096,
        quant: "auto".into(),
        model: "llama-8b".into(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().with_context(|| format!("{k} needs a value"));
        match k.as_str() {
            "--layers" => a.layers = v()?.parse()?,
            "--batches" => {
                a.batches = match v()? {
                    none if none == "none" => Vec::new(),
                    list => list.split(',').map(str::parse).collect::<Result<_, _>>()?,
                }
            }
            "--context" => a.context = v()?.parse()?,
            "--steps" => a.steps = v()?.parse()?,
            "--prefill" => a.prefill = v()?.parse()?,
            "--load-back" => a.load_back = v()?.parse()?,
            "--quant" => a.quant = v()?,
            "--model" => a.model = v()?,
            other => bail!("unknown argument {other}"),
        }
    }
    Ok(a)
}

/// Shapes of a checkpoint: matrices are answered with zeros of their dtype
/// (the backend never reads float ones: synthetic uploads; packed codes and
/// their scales stay zero), norm weights, biases and scalar scales with ones.
struct Synthetic {
    tensors: HashMap<String, (Vec<usize>, DType)>,
    zeros: Vec<u8>,
}

impl Synthetic {
    /// The tensors `RandomWeights` names for the model (only their shapes
    /// and dtypes).
    fn new(model: &RandomWeights) -> Result<Self> {
        let tensors: HashMap<String, (Vec<usize>, DType)> = model
            .tensors()
            .map(|(n, s, d)| (n.to_string(), (s.to_vec(), d)))
            .collect();
        let mut largest = 0;
        for (shape, dtype) in tensors.values() {
            largest = largest.max(dtype.bytes_for(shape.iter().product())?);
        }
        // calloc'd: the pages are never touched, so this costs no memory.
        Ok(Synthetic {
            tensors,
            zeros: vec![0u8; largest],
        })
    }
}

impl WeightSource for Synthetic {
    fn describe(&self) -> String {
        "synthetic weights (float matrices filled on the GPU)".into()
    }
    fn tensor(&self, name: &str) -> arbor_engine_core::Result<Option<HostTensor<'_>>> {
        let Some((shape, dtype)) = self.tensors.get(name) else {
            return Ok(None);
        };
        let n: usize = shape.iter().product();
        Ok(Some(if shape.len() <= 1 {
            HostTensor::from_f32(shape, &vec![1.0; n])
        } else {
            HostTensor {
                dtype: *dtype,
                shape: shape.clone(),
                data: Cow::Borrowed(&self.zeros[..dtype.bytes_for(n)?]),
            }
        }))
    }
}

/// The benchmarked model: its `config.json`, architecture flags, tensors
/// and the quantization method that loads them.
struct BenchModel {
    name: &'static str,
    config: serde_json::Value,
    flags: ArchFlags,
    tensors: RandomWeights,
    method: String,
}

impl BenchModel {
    /// `llama-8b`: Llama-3.1-8B's shape; `deepseek-v2-lite`: DeepSeek-V2-Lite's
    /// attention (576-wide latent heads, 16 query heads) with dense MLPs of
    /// its dense layer's width. `quant` is a method name, or `awq` /
    /// `nvfp4` for the weights in that checkpoint format.
    fn new(name: &str, layers: usize, quant: &str) -> Result<Self> {
        let (name, config, flags) = match name {
            "llama-8b" => (
                "Llama-3.1-8B shape",
                serde_json::json!({
                    "architectures": ["LlamaForCausalLM"],
                    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": layers,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                    "vocab_size": 128256, "max_position_embeddings": 131072,
                    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": false,
                    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 8192, "rope_type": "llama3"}
                }),
                ArchFlags {
                    qkv_bias: false,
                    qk_norm: false,
                    moe: None,
                    mla: false,
                },
            ),
            "deepseek-v2-lite" => {
                let shape = LatentShape {
                    hidden: 2048,
                    heads: 16,
                    intermediate: 10944,
                    layers,
                    vocab: 102400,
                    q_lora_rank: None,
                };
                (
                    "DeepSeek-V2-Lite attention, dense MLPs",
                    shape.config(),
                    DEEPSEEK_V2,
                )
            }
            other => bail!("unknown model {other} (llama-8b, deepseek-v2-lite)"),
        };
        let mut config = config;
        let cfg = DecoderConfig::from_json(&config, "config.json")?;
        let mut tensors = RandomWeights::new(&cfg, flags, DType::BF16, 0)?;
        if flags.mla {
            let mla = MlaConfig::from_json(&config, "config.json", false)?;
            tensors = tensors.with_mla(&cfg, &mla);
        }
        let mut method = quant.to_string();
        if let Some(q) = RandomQuant::from_name(quant) {
            tensors = tensors.quantized(q)?;
            let qc = q.config();
            method = qc["quant_method"].as_str().unwrap_or(quant).to_string();
            config["quantization_config"] = qc;
        }
        Ok(Self {
            name,
            config,
            flags,
            tensors,
            method,
        })
    }
}

struct Setup {
    backend: Arc<GpuBackend>,
    model: DecoderModel,
    kv: KvCache,
    attention: Arc<dyn AttentionBackend>,
    pool: PagePool,
}

fn setup(graphs: bool, m: &BenchModel, kv_tokens: usize) -> Result<Setup> {
    let backend = Arc::new(arbor_backend_cuda::open(&BackendOptions {
        disable_cuda_graph: !graphs,
        cuda_graph_max_bs: Some(256),
        ..Default::default()
    })?);
    let dynb: Arc<dyn Backend> = backend.clone();
    let registry = Registry::builtin()?;
    let opts = LoadOptions {
        backend: dynb.clone(),
        quant: registry.quant_methods.get(&m.method)?(&QuantInit {
            checkpoint: m.config.get("quantization_config").cloned(),
            base: None,
        })?,
        progress: None,
    };
    backend.set_synthetic_weights(Some(0x5eed));
    let model = DecoderArchitecture::new(m.flags).load_model(
        &m.config,
        &Synthetic::new(&m.tensors)?,
        &opts,
    );
    backend.set_synthetic_weights(None);
    let model = model?;
    let s = model.spec();
    let spec = KvSpec {
        num_layers: s.num_layers,
        num_kv_heads: s.num_kv_heads,
        head_dim: s.head_dim,
        page_size: PAGE,
        num_pages: kv_tokens.div_ceil(PAGE),
        dtype: DType::BF16,
        values_in_keys: s.kv_values_in_keys,
    };
    let kv = KvCache::allocate(&*dynb, spec)?;
    let attention = dynb.attention(None)?;
    backend.synchronize()?;
    Ok(Setup {
        backend,
        model,
        kv,
        attention,
        pool: PagePool::new(spec.num_pages, PAGE),
    })
}

/// One forward pass of `seqs` (prefix length, new tokens) and a greedy device sample.
fn step(
    s: &Setup,
    seqs: &[(usize, Vec<u32>)],
    pages: &[arbor_engine_core::PageSet],
) -> Result<Vec<u32>> {
    let b: &dyn Backend = &*s.backend;
    let mut layout = BatchLayout::new(PAGE);
    let (mut ids, mut pos, mut rows) = (Vec::new(), Vec::new(), Vec::new());
    for ((prefix, toks), pg) in seqs.iter().zip(pages) {
        layout.push_seq(*prefix, toks.len(), pg.pages())?;
        ids.extend_from_slice(toks);
        pos.extend((*prefix..prefix + toks.len()).map(|p| p as u32));
        rows.push((ids.len() - 1) as u32);
    }
    let layout = Arc::new(layout);
    let ab = s.attention.prepare(layout.clone())?;
    let batch = ForwardBatch {
        input_ids: ids,
        positions: pos,
        layout,
        logits_rows: rows,
        hidden_layers: Vec::new(),
        lora: Vec::new(),
        exit_after: None,
        hidden_at_every_row: false,
    };
    let ctx = ForwardContext {
        kv: &s.kv,
        attention: &*s.attention,
        attention_batch: &ab,
    };
    let logits = s.model.forward(&batch, &ctx)?.logits;
    let out = b.alloc(DType::U32, &[seqs.len()])?;
    let greedy = SampleRow {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        seed: 0,
    };
    b.sample(&logits, &vec![greedy; seqs.len()], &out)?;
    let mut bytes = vec![0u8; 4 * seqs.len()];
    b.download(&out, &mut bytes)?;
    Ok(bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// Decode tok/s of `bs` sequences with `context` cached tokens.
fn decode(s: &Setup, bs: usize, context: usize, steps: usize) -> Result<(f64, f64)> {
    let warm = WARM;
    let total = context + warm + steps + 1;
    let pages: Vec<_> = (0..bs)
        .map(|_| s.pool.alloc(s.pool.pages_for(total)))
        .collect::<arbor_engine_core::Result<_>>()?;
    let mut last: Vec<u32> = (0..bs).map(|i| (i * 7 % 1000) as u32 + 1).collect();
    let mut t0 = Instant::now();
    for i in 0..warm + steps {
        if i == warm {
            s.backend.synchronize()?;
            t0 = Instant::now();
        }
        let seqs: Vec<(usize, Vec<u32>)> = last.iter().map(|&t| (context + i, vec![t])).collect();
        last = step(s, &seqs, &pages)?;
    }
    let dt = t0.elapsed().as_secs_f64();
    Ok(((bs * steps) as f64 / dt, dt / steps as f64 * 1e3))
}

fn prefill(s: &Setup, n: usize) -> Result<f64> {
    let pages = vec![s.pool.alloc(s.pool.pages_for(n))?];
    let toks: Vec<u32> = (0..n).map(|i| (i * 31 % 128_000) as u32).collect();
    step(s, &[(0, toks.clone())], &pages)?;
    let t0 = Instant::now();
    for _ in 0..3 {
        step(s, &[(0, toks.clone())], &pages)?;
    }
    Ok(3.0 * n as f64 / t0.elapsed().as_secs_f64())
}

/// Tokens computed on a loaded prefix.
const LOAD_BACK_SUFFIX: usize = 128;

/// How [`load_back`] writes the loaded pages.
#[derive(Clone, Copy, PartialEq)]
enum LoadMode {
    /// From pageable memory on the main stream, before the forward.
    First,
    /// From pageable memory through pinned staging on the copy stream.
    Staged,
    /// From the backend's pinned host memory, in place, on the copy stream
    /// (what HiCache's load-back does on GPUs).
    InPlace,
}

/// Milliseconds of a step that loads `prefix` tokens of KV from host memory
/// and computes [`LOAD_BACK_SUFFIX`] tokens on them, the loads written one
/// layer tensor at a time as `mode` says. Best of 3.
fn load_back(s: &Setup, prefix: usize, mode: LoadMode) -> Result<f64> {
    let b: &dyn Backend = &*s.backend;
    let pages = s.pool.alloc(s.pool.pages_for(prefix + LOAD_BACK_SUFFIX))?;
    let prefix_pages = &pages.pages()[..prefix / PAGE];
    let spec = *s.kv.spec();
    let page_bytes = spec
        .dtype
        .bytes_for(PAGE * spec.num_kv_heads * spec.head_dim)?;
    let fill = |p: &mut [u8]| {
        for (i, x) in p.iter_mut().enumerate() {
            *x = (i * 131 % 251) as u8 & 0x3f;
        }
    };
    // One host page per device page and layer tensor.
    let parts = spec.num_layers * spec.tensors_per_layer();
    let n = parts * prefix_pages.len();
    let mut heap = vec![vec![0u8; page_bytes]; if mode == LoadMode::InPlace { 0 } else { n }];
    heap.iter_mut().for_each(|p| fill(p));
    let mut pinned = Vec::new();
    if mode == LoadMode::InPlace {
        let mem = b.host_memory().context("no pinned host memory")?;
        for _ in 0..n {
            let mut r = mem.alloc(page_bytes).context("pinned host memory")?;
            fill(r.bytes_mut());
            pinned.push(r);
        }
    }
    let page = |i: usize| -> &[u8] {
        match mode {
            LoadMode::InPlace => pinned[i].bytes(),
            _ => &heap[i],
        }
    };
    let toks: Vec<u32> = (0..LOAD_BACK_SUFFIX)
        .map(|i| (i * 17 % 1000) as u32)
        .collect();
    let mut best = f64::MAX;
    for _ in 0..3 {
        s.backend.synchronize()?;
        let t0 = Instant::now();
        let mut part = 0;
        for l in 0..spec.num_layers {
            for t in s.kv.layer(l)?.stored() {
                let views = prefix_pages
                    .iter()
                    .map(|&p| t.narrow(p as usize * PAGE, PAGE))
                    .collect::<arbor_engine_core::Result<Vec<_>>>()?;
                let first = part * prefix_pages.len();
                let writes: Vec<_> = views
                    .iter()
                    .enumerate()
                    .map(|(j, v)| (v, HostRows::whole(page(first + j))))
                    .collect();
                part += 1;
                match mode {
                    LoadMode::First => writes.iter().try_for_each(|(v, d)| b.write(v, d.span()))?,
                    LoadMode::Staged => b.write_async(&writes, HostData::Transient)?,
                    // The pages stay unchanged until the step's download syncs.
                    LoadMode::InPlace => b.write_async(&writes, HostData::UntilSync)?,
                }
            }
        }
        step(s, &[(prefix, toks.clone())], std::slice::from_ref(&pages))?;
        best = best.min(t0.elapsed().as_secs_f64() * 1e3);
    }
    Ok(best)
}

fn main() -> Result<()> {
    let a = args()?;
    let model = BenchModel::new(&a.model, a.layers, &a.quant)?;
    let max_bs = a.batches.iter().copied().max().unwrap_or(1);
    // Every decode sequence holds its context, the warm-up and timed steps.
    let per_seq = (a.context + WARM + a.steps + 1).div_ceil(PAGE) * PAGE;
    let kv_tokens = (max_bs * per_seq)
        .max(a.prefill.div_ceil(PAGE) * PAGE)
        .max((a.load_back / PAGE + LOAD_BACK_SUFFIX.div_ceil(PAGE)) * PAGE)
        + PAGE;
    let t0 = Instant::now();
    let s = setup(true, &model, kv_tokens)?;
    let weight_bytes = s.model.spec().weight_bytes as f64;
    let info = s.backend.info();
    println!(
        "loaded {:.2} GB of weights ({} layers, quantization {}) on {} in {:.1} s; kernels for {}",
        weight_bytes / 1e9,
        a.layers,
        a.quant,
        info.name,
        t0.elapsed().as_secs_f64(),
        s.backend.kernel_target()
    );
    let mut rows: Vec<(String, String)> = vec![
        ("device".into(), info.name.clone()),
        (
            "model".into(),
            format!(
                "{}, {} layers, {:.2} GB weights (quantization {}), bf16 KV",
                model.name,
                a.layers,
                weight_bytes / 1e9,
                a.quant
            ),
        ),
    ];
    let roofline = HBM_BYTES_PER_S / weight_bytes;
    // Scaled-block weights (FP8, INT4, NVFP4): also timed through the
    // dequantizing GEMM, to compare with the tensor-core GEMM.
    let scaled = s.model.spec().weight_dtype.is_scaled_block();
    for &bs in &a.batches {
        let (tps, ms) = decode(&s, bs, a.context, a.steps)?;
        println!("decode bs={bs}: {tps:.1} tok/s ({ms:.2} ms/step)");
        rows.push((
            format!("decode bs={bs} (context {})", a.context),
            format!("{tps:.1} tok/s, {ms:.2} ms/step"),
        ));
        if bs == 1 {
            rows.push((
                "HBM roofline at bs=1 (4.8 TB/s / weight bytes)".into(),
                format!(
                    "{roofline:.1} tok/s; reached {:.1}%",
                    100.0 * tps / roofline
                ),
            ));
        }
    }
    if a.prefill > 0 {
        let pf = prefill(&s, a.prefill)?;
        println!("prefill {}: {pf:.0} tok/s", a.prefill);
        rows.push((
            format!("prefill {} tokens", a.prefill),
            format!("{pf:.0} tok/s"),
        ));
        // The same prefill with attention on the f32 kernels (no tensor cores).
        s.backend.set_tensor_core_prefill(false);
        let simt = prefill(&s, a.prefill);
        s.backend.set_tensor_core_prefill(true);
        let simt = simt?;
        println!("prefill {} with f32 attention: {simt:.0} tok/s", a.prefill);
        rows.push((
            format!("prefill {} tokens, f32 attention kernel", a.prefill),
            format!("{simt:.0} tok/s ({:.2}x slower)", pf / simt),
        ));
        if scaled {
            // The same prefill with the weights dequantized before each GEMM.
            s.backend.set_tensor_core_linear(false);
            let dq = prefill(&s, a.prefill);
            s.backend.set_tensor_core_linear(true);
            let dq = dq?;
            println!(
                "prefill {} with the dequantizing GEMM: {dq:.0} tok/s",
                a.prefill
            );
            rows.push((
                format!("prefill {} tokens, dequantizing GEMM", a.prefill),
                format!("{dq:.0} tok/s (tensor-core GEMM {:.2}x)", pf / dq),
            ));
        }
    }
    if a.load_back >= PAGE {
        let prefix = a.load_back / PAGE * PAGE;
        // Alternated: loaded first, staged, in place, twice over.
        let modes = [LoadMode::First, LoadMode::Staged, LoadMode::InPlace];
        let mut best = [f64::MAX; 3];
        for round in 0..6 {
            let i = round % 3;
            best[i] = best[i].min(load_back(&s, prefix, modes[i])?);
        }
        let ls = s.backend.load_stats();
        println!(
            "load-back of {prefix} tokens + {LOAD_BACK_SUFFIX} computed: loaded first {:.2} ms, \
             overlapped per layer through staging {:.2} ms, in place from pinned pages {:.2} ms \
             ({} batches on the copy stream, {} fallbacks, {} of {} bytes in place)",
            best[0], best[1], best[2], ls.batches, ls.fallbacks, ls.in_place_bytes, ls.bytes
        );
        rows.push((
            format!("HiCache load-back of {prefix} tokens + prefill {LOAD_BACK_SUFFIX}"),
            format!(
                "loaded first {:.2} ms; overlapped per layer: staged {:.2} ms ({:.2}x), \
                 in place from pinned {:.2} ms ({:.2}x)",
                best[0],
                best[1],
                best[0] / best[1],
                best[2],
                best[0] / best[2]
            ),
        ));
    }
    let st = s.backend.graph_stats();
    rows.push((
        "CUDA graphs".into(),
        format!(
            "{} captured, {} replays, {} eager steps, {} failed",
            st.captures, st.replays, st.eager_steps, st.failures
        ),
    ));
    drop(s);
    if a.batches.contains(&1) {
        let e = setup(false, &model, kv_tokens)?;
        let (tps, ms) = decode(&e, 1, a.context, a.steps)?;
        println!("decode bs=1 without graphs: {tps:.1} tok/s ({ms:.2} ms/step)");
        rows.push((
            "decode bs=1, CUDA graphs off".into(),
            format!("{tps:.1} tok/s, {ms:.2} ms/step"),
        ));
        if scaled {
            // Alternated: dequantizing GEMM, tensor cores, dequantizing, tensor cores.
            let mut best = [0f64; 2];
            for round in 0..4 {
                let tc = round % 2 == 1;
                e.backend.set_tensor_core_linear(tc);
                let (tps, _) = decode(&e, 1, a.context, a.steps)?;
                best[tc as usize] = best[tc as usize].max(tps);
            }
            e.backend.set_tensor_core_linear(true);
            println!(
                "decode bs=1 without graphs, best of 2 alternated: dequantizing GEMM {:.1}, tensor-core GEMM {:.1} tok/s",
                best[0], best[1]
            );
            rows.push((
                "decode bs=1, graphs off, dequantizing vs tensor-core GEMM".into(),
                format!(
                    "{:.1} vs {:.1} tok/s ({:.2}x)",
                    best[0],
                    best[1],
                    best[1] / best[0]
                ),
            ));
        }
    }
    let w = rows.iter().map(|r| r.0.len()).max().unwrap_or(10);
    println!("\n== arbor CUDA benchmark ==");
    for (k, v) in &rows {
        println!("{k:<w$}  {v}");
    }
    Ok(())
}
