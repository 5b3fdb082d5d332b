//! Throughput of a model on the wgpu backend (or any registered backend):
//! prefill tokens/s of one prompt, and decode tokens/s at batch 1 and 8 with
//! greedy sampling on the device (only token ids are read back per step).
//!
//! ```text
//! cargo run --release -p arbor-backend-wgpu --example bench -- \
//!     [--model PATH] [--device wgpu|cpu] [--adapter NAME] [--prompt 128] [--steps 32]
//! ```
//! The model defaults to SmolLM2-135M-Instruct Q4_1 (`arbor fetch-default`).

use anyhow::{Context, Result, bail};
use arbor_backend_cpu as _;
use arbor_backend_wgpu as _;
use arbor_engine_core::backend::SampleRow;
use arbor_engine_core::{
    Backend, BackendOptions, BatchLayout, DType, ForwardBatch, ForwardContext, KvCache, KvSpec,
    LoadOptions, Registry, Tensor,
};
use std::sync::Arc;
use std::time::Instant;

struct Args {
    model: Option<String>,
    device: String,
    adapter: Option<String>,
    prompt: usize,
    steps: usize,
}

fn args() -> Result<Args> {
    let mut a = Args {
        model: None,
        device: "wgpu".into(),
        adapter: None,
        prompt: 128,
        steps: 32,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().with_context(|| format!("{k} needs a value"));
        match k.as_str() {
            "--model" => a.model = Some(v()?),
            "--device" => a.device = v()?,
            "--adapter" => a.adapter = Some(v()?),
            "--prompt" => a.prompt = v()?.parse()?,
            "--steps" => a.steps = v()?.parse()?,
            other => bail!("unknown argument {other}"),
        }
    }
    Ok(a)
}

/// Runs one forward of `seqs` (prefix length, new tokens) and samples greedily on the device.
fn step(
    model: &dyn arbor_engine_core::Model,
    b: &dyn Backend,
    kv: &KvCache,
    attn: &dyn arbor_engine_core::AttentionBackend,
    seqs: &[(usize, Vec<u32>, Vec<u32>)],
    ids_out: &Tensor,
) -> Result<Vec<u32>> {
    let mut layout = BatchLayout::new(kv.spec().page_size);
    let mut ids = Vec::new();
    let mut positions = Vec::new();
    let mut rows = Vec::new();
    for (prefix, tokens, pages) in seqs {
        layout.push_seq(*prefix, tokens.len(), pages)?;
        ids.extend_from_slice(tokens);
        positions.extend((*prefix..prefix + tokens.len()).map(|p| p as u32));
        rows.push(ids.len() as u32 - 1);
    }
    let layout = Arc::new(layout);
    let batch = attn.prepare(layout.clone())?;
    let fb = ForwardBatch {
        input_ids: ids,
        positions,
        layout,
        logits_rows: rows,
        hidden_layers: Vec::new(),
        lora: Vec::new(),
        exit_after: None,
        hidden_at_every_row: false,
    };
    let ctx = ForwardContext {
        kv,
        attention: attn,
        attention_batch: &batch,
    };
    let logits = model.forward(&fb, &ctx)?.logits;
    let greedy = SampleRow {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        seed: 0,
    };
    let out = ids_out.narrow(0, seqs.len())?;
    b.sample(&logits, &vec![greedy; seqs.len()], &out)?;
    let mut bytes = vec![0u8; 4 * seqs.len()];
    b.download(&out, &mut bytes)?;
    Ok(bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

fn main() -> Result<()> {
    let a = args()?;
    let registry = Registry::builtin()?;
    let backend = registry.backends.get(&a.device)?(&BackendOptions {
        adapter: a.adapter.clone(),
        ..Default::default()
    })?;
    println!("device: {}", backend.info().name);
    let path = match &a.model {
        Some(p) => p.into(),
        None => arbor_models::default_model_path()
            .filter(|p| p.exists())
            .context("the default model is absent (run `arbor fetch-default`)")?,
    };
    let opts = LoadOptions {
        backend: backend.clone(),
        quant: registry.quant_methods.get("auto")?(&Default::default())?,
        progress: None,
    };
    let t = Instant::now();
    let m = arbor_models::load_model(&path, &registry, &opts)?;
    println!("model: {} (loaded in {:.2?})", path.display(), t.elapsed());
    let s = m.model.spec().clone();
    let page = 16;
    let per_seq = (a.prompt + a.steps + 1).div_ceil(page);
    let kv = KvCache::allocate(
        &*backend,
        KvSpec {
            num_layers: s.num_layers,
            num_kv_heads: s.num_kv_heads,
            head_dim: s.head_dim,
            page_size: page,
            num_pages: per_seq * 8,
            dtype: DType::F16,
            values_in_keys: false,
        },
    )?;
    let attn = backend.attention(None)?;
    let ids_out = backend.alloc(DType::U32, &[8])?;
    let prompt: Vec<u32> = (0..a.prompt)
        .map(|i| (i as u32 * 7919 + 17) % s.vocab_size as u32)
        .collect();
    let pages = |seq: usize| -> Vec<u32> {
        ((seq * per_seq) as u32..((seq + 1) * per_seq) as u32).collect()
    };
    let run = |seqs: &[(usize, Vec<u32>, Vec<u32>)]| {
        step(&*m.model, &*backend, &kv, &*attn, seqs, &ids_out)
    };

    // Warm-up (compiles the kernels), then prefill of one prompt.
    run(&[(0, prompt[..a.prompt.min(16)].to_vec(), pages(0))])?;
    run(&[(0, vec![1], pages(0)), (0, vec![1; 9], pages(1))])?;
    let t = Instant::now();
    let first = run(&[(0, prompt.clone(), pages(0))])?;
    let prefill = t.elapsed();
    println!(
        "prefill: {} tokens in {:.2?} = {:.1} tok/s",
        a.prompt,
        prefill,
        a.prompt as f64 / prefill.as_secs_f64()
    );

    for batch in [1usize, 8] {
        // Every sequence starts from the same prefilled prompt (copied by re-running prefill).
        let mut states: Vec<(usize, Vec<u32>, Vec<u32>)> = Vec::new();
        for b in 0..batch {
            if b > 0 {
                run(&[(0, prompt.clone(), pages(b))])?;
            }
            states.push((a.prompt, vec![first[0]], pages(b)));
        }
        let t = Instant::now();
        for _ in 0..a.steps {
            let next = run(&states)?;
            for (st, id) in states.iter_mut().zip(next) {
                st.0 += 1;
                st.1 = vec![id];
            }
        }
        let dt = t.elapsed();
        println!(
            "decode batch {batch}: {} steps in {:.2?} = {:.2} tok/s ({:.1} ms/step)",
            a.steps,
            dt,
            (batch * a.steps) as f64 / dt.as_secs_f64(),
            dt.as_secs_f64() * 1e3 / a.steps as f64
        );
    }
    Ok(())
}
