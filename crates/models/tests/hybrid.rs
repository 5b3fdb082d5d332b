//! Hybrid models (Qwen3.5 dense and MoE, Qwen3-Next) against transformers
//! (tests/fixtures/tiny-qwen3.5*, tiny-qwen3-next, written by
//! tools/reference/make_hybrid_fixtures.py): last-position logits within
//! 1e-4 × max|logit| and 32 greedy tokens, on prompts up to four GDN chunks
//! long. Then the recurrent state's invariants: chunked prefill of any size
//! and batching give bit-identical logits and tokens, a state slot reused by
//! a new sequence starts from zero, and the host implementation of the
//! Gated DeltaNet (what devices without their own kernel run) equals the
//! CPU's. Bad checkpoints and configs fail naming what is wrong.

use anyhow::{Context, Result};
use arbor_backend_cpu::CpuBackend;
use arbor_engine_core::runner::{KvGeometry, ModelRunner, SamplingSetup, SeqStep, generate_static};
use arbor_engine_core::sampling::StandardSampler;
use arbor_engine_core::state::{
    GatedDeltaNet, GatedDeltaWeights, StateCache, StateSeq, StateSpec, gated_delta_net_on_host,
};
use arbor_engine_core::{
    Backend, BatchLayout, DType, ForwardBatch, LoadOptions, Registry, SamplingParams,
};
use arbor_models::{LoadedModel, load_model};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::Arc;

const FIXTURES: [&str; 3] = ["tiny-qwen3.5", "tiny-qwen3.5-moe", "tiny-qwen3-next"];

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn backend() -> Result<Arc<dyn Backend>> {
    Ok(Arc::new(CpuBackend::new(2)?))
}

fn load_dir(dir: &Path, backend: &Arc<dyn Backend>) -> Result<LoadedModel> {
    load_as(dir, backend, "f32")
}

fn load_as(dir: &Path, backend: &Arc<dyn Backend>, dtype: &str) -> Result<LoadedModel> {
    let registry = Registry::builtin()?;
    let opts = LoadOptions {
        backend: backend.clone(),
        quant: registry.quant_methods.get(dtype)?(&Default::default())?,
        progress: None,
    };
    Ok(load_model(dir, &registry, &opts)?)
}

fn reference(name: &str) -> Result<Value> {
    let text = std::fs::read_to_string(fixture(name).join("reference.json"))?;
    Ok(serde_json::from_str(&text)?)
}

fn u32s(v: &Value) -> Vec<u32> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(Value::as_u64)
                .map(|x| x as u32)
                .collect()
        })
        .unwrap_or_default()
}

fn prompts(r: &Value) -> Result<Vec<Vec<u32>>> {
    Ok(r["prompts"]
        .as_array()
        .context("prompts")?
        .iter()
        .map(|p| u32s(&p["input_ids"]))
        .collect())
}

fn runner(m: &LoadedModel, backend: &Arc<dyn Backend>, slots: usize) -> Result<ModelRunner> {
    runner_kv(m, backend, slots, DType::F32)
}

/// A runner of 256 pages of 16 tokens in `kv_dtype` and `slots` state slots.
fn runner_kv(
    m: &LoadedModel,
    backend: &Arc<dyn Backend>,
    slots: usize,
    kv_dtype: DType,
) -> Result<ModelRunner> {
    Ok(ModelRunner::with_state_slots(
        m.model.clone(),
        backend.clone(),
        None,
        KvGeometry {
            page_size: 16,
            num_pages: 256,
            kv_dtype,
            state_slots: slots,
        },
    )?)
}

/// A reference prompt's last-position logits.
fn last_logits(want: &Value) -> Result<Vec<f32>> {
    Ok(want["last_logits"]
        .as_array()
        .context("last_logits")?
        .iter()
        .filter_map(Value::as_f64)
        .map(|x| x as f32)
        .collect())
}

/// The largest difference of `got` from a reference prompt's last logits,
/// and the largest reference logit.
fn logit_error(got: &[f32], want: &Value) -> Result<(f32, f32)> {
    let expected = last_logits(want)?;
    let max = expected.iter().fold(0f32, |a, x| a.max(x.abs()));
    let err = got
        .iter()
        .zip(&expected)
        .fold(0f32, |a, (g, e)| a.max((g - e).abs()));
    Ok((err, max))
}

fn greedy_all(runner: &ModelRunner, prompts: &[Vec<u32>]) -> Result<Vec<Vec<u32>>> {
    let pool = runner.new_page_pool();
    let params = vec![
        SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(32)
        };
        prompts.len()
    ];
    let setup = SamplingSetup {
        sampler: &StandardSampler,
        processors: &[],
        eos_token_ids: &[],
    };
    let (outs, _) = generate_static(runner, &pool, prompts, &params, &setup, &mut |_, _| {})?;
    assert_eq!(pool.free_pages(), pool.total_pages(), "pages leaked");
    Ok(outs.into_iter().map(|o| o.tokens).collect())
}

/// Last logits of `prompt` computed in chunks of `chunk` tokens in slot `slot`.
fn chunked_logits(
    runner: &ModelRunner,
    prompt: &[u32],
    chunk: usize,
    slot: u32,
) -> Result<Vec<f32>> {
    let pool = runner.new_page_pool();
    let pages = pool.alloc(pool.pages_for(prompt.len()))?;
    let mut last = Vec::new();
    let mut start = 0;
    while start < prompt.len() {
        let end = (start + chunk).min(prompt.len());
        let out = runner.step(&[SeqStep {
            tokens: &prompt[start..end],
            prefix_len: start,
            pages: pages.pages(),
            want_logits: end == prompt.len(),
            state_slot: Some(slot),
        }])?;
        if let Some(l) = out.into_iter().next() {
            last = l;
        }
        start = end;
    }
    Ok(last)
}

#[test]
fn hybrid_models_match_transformers() -> Result<()> {
    let b = backend()?;
    for name in FIXTURES {
        let m = load_dir(&fixture(name), &b).with_context(|| format!("loading {name}"))?;
        let r = reference(name)?;
        let spec = m.model.spec().clone();
        let state = spec.state.context("a hybrid model declares its state")?;
        let types = r["layer_types"].as_array().context("layer_types")?;
        let recurrent = types.iter().filter(|t| *t == "linear_attention").count();
        assert_eq!(state.layers, recurrent, "{name}");
        assert_eq!(spec.kv_layers(), types.len() - recurrent, "{name}");
        let run = runner(&m, &b, 8)?;
        assert_eq!(
            run.kv_spec().num_layers,
            spec.kv_layers(),
            "{name}: KV for attention layers only"
        );
        let ps = prompts(&r)?;
        for (i, (p, want)) in ps
            .iter()
            .zip(r["prompts"].as_array().context("prompts")?)
            .enumerate()
        {
            let got = chunked_logits(&run, p, p.len(), 0)?;
            let (err, max) = logit_error(&got, want)?;
            assert!(
                err <= 1e-4 * max,
                "{name} prompt {i} ({} tokens): logits off by {err} (max {max})",
                p.len()
            );
            let alone = greedy_all(&run, std::slice::from_ref(p))?;
            assert_eq!(
                alone[0],
                u32s(&want["greedy_ids"]),
                "{name} prompt {i}: greedy tokens"
            );
        }
        // All prompts as one batch: the same tokens.
        let batched = greedy_all(&run, &ps)?;
        for (i, want) in r["prompts"]
            .as_array()
            .context("prompts")?
            .iter()
            .enumerate()
        {
            assert_eq!(
                batched[i],
                u32s(&want["greedy_ids"]),
                "{name} prompt {i} in a batch"
            );
        }
        eprintln!("{name}: {} prompts match transformers", ps.len());
    }
    Ok(())
}

#[test]
fn chunking_batching_and_slot_reuse_are_bit_identical() -> Result<()> {
    let b = backend()?;
    for name in FIXTURES {
        let m = load_dir(&fixture(name), &b)?;
        let r = reference(name)?;
        let run = runner(&m, &b, 20)?;
        let ps = prompts(&r)?;
        let long = ps.last().context("long prompt")?;
        let whole = chunked_logits(&run, long, long.len(), 3)?;
        for chunk in [1, 7, 64, 100] {
            // Slot 3 now holds the previous run's final state: a fresh
            // sequence must not see it.
            let got = chunked_logits(&run, long, chunk, 3)?;
            assert!(
                got.iter()
                    .zip(&whole)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{name}: chunks of {chunk} changed the logits"
            );
        }
        // A batch of 16 (every prompt, several times, in mixed order) gives
        // each the tokens it gets alone.
        let batch: Vec<Vec<u32>> = (0..16).map(|i| ps[(i * 3) % ps.len()].clone()).collect();
        let together = greedy_all(&run, &batch)?;
        for (i, p) in batch.iter().enumerate() {
            let alone = greedy_all(&run, std::slice::from_ref(p))?;
            assert_eq!(together[i], alone[0], "{name}: sequence {i} of 16");
        }
    }
    Ok(())
}

#[test]
fn more_sequences_than_slots_is_a_clear_error() -> Result<()> {
    let b = backend()?;
    let m = load_dir(&fixture("tiny-qwen3.5"), &b)?;
    let run = runner(&m, &b, 2)?;
    let e = greedy_all(&run, &[vec![1, 2], vec![3, 4], vec![5, 6]])
        .err()
        .context("three sequences in two slots")?;
    assert!(e.to_string().contains("state slot"), "{e}");
    // A step without a slot for a recurrent model names the slots.
    let pool = run.new_page_pool();
    let pages = pool.alloc(1)?;
    let e = run
        .step(&[SeqStep {
            tokens: &[1, 2],
            prefix_len: 0,
            pages: pages.pages(),
            want_logits: true,
            state_slot: None,
        }])
        .err()
        .context("no slot")?;
    assert!(e.to_string().contains("state slots"), "{e}");
    Ok(())
}

fn copy_fixture(name: &str, to: &Path) -> Result<()> {
    std::fs::create_dir_all(to)?;
    for f in std::fs::read_dir(fixture(name))? {
        let f = f?;
        std::fs::copy(f.path(), to.join(f.file_name()))?;
    }
    Ok(())
}

#[test]
fn bad_checkpoints_name_what_is_wrong() -> Result<()> {
    let b = backend()?;
    let tmp = std::env::temp_dir().join(format!("arbor-hybrid-bad-{}", std::process::id()));
    // A layer type this build does not know.
    let dir = tmp.join("layer-type");
    copy_fixture("tiny-qwen3-next", &dir)?;
    let cfg_path = dir.join("config.json");
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(&cfg_path)?)?;
    cfg["layer_types"][1] = Value::from("sliding_attention");
    std::fs::write(&cfg_path, serde_json::to_string(&cfg)?)?;
    let e = load_dir(&dir, &b)
        .err()
        .context("unknown layer type")?
        .to_string();
    assert!(
        e.contains("layer_types") && e.contains("sliding_attention"),
        "{e}"
    );
    // A checkpoint missing a GDN tensor.
    let dir = tmp.join("missing");
    copy_fixture("tiny-qwen3.5", &dir)?;
    let st = dir.join("model.safetensors");
    let bytes = std::fs::read(&st)?;
    let tensors = safetensors::SafeTensors::deserialize(&bytes)?;
    let gone = "model.language_model.layers.1.linear_attn.A_log";
    let kept: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .tensors()
        .into_iter()
        .filter(|(n, _)| n != gone)
        .collect();
    safetensors::serialize_to_file(kept, None, &st)?;
    let e = load_dir(&dir, &b)
        .err()
        .context("missing tensor")?
        .to_string();
    assert!(
        e.contains("layers.1.linear_attn.A_log") && e.contains("missing"),
        "{e}"
    );
    std::fs::remove_dir_all(&tmp)?;
    Ok(())
}

/// Seeded values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

#[test]
fn host_gated_delta_net_equals_the_cpu_kernel() -> Result<()> {
    let b = backend()?;
    let spec = StateSpec {
        layers: 1,
        conv_channels: 2 * 2 * 8 + 4 * 8,
        conv_kernel: 4,
        k_heads: 2,
        v_heads: 4,
        k_dim: 8,
        v_dim: 8,
    };
    let seqs = [
        StateSeq {
            rows: 0..5,
            slot: 2,
            fresh: true,
            snapshots: vec![(3, 3)],
        },
        StateSeq {
            rows: 5..6,
            slot: 0,
            fresh: false,
            snapshots: Vec::new(),
        },
        StateSeq {
            rows: 6..13,
            slot: 1,
            fresh: false,
            snapshots: vec![(2, 4), (7, 5)],
        },
    ];
    let t = 13;
    let up = |shape: &[usize], seed| b.upload_f32(shape, &values(shape.iter().product(), seed));
    let (mixed, a, beta) = (
        up(&[t, spec.conv_channels], 1)?,
        up(&[t, 4], 2)?,
        up(&[t, 4], 3)?,
    );
    let (conv, a_log, dt) = (up(&[spec.conv_channels, 4], 4)?, up(&[4], 5)?, up(&[4], 6)?);
    let mut results = Vec::new();
    for host in [false, true] {
        let cache = StateCache::allocate(&*b, spec, 6)?;
        let layer = cache.layer(0)?;
        b.write(&layer.conv, &bytes(&values(6 * spec.conv_len(), 7)))?;
        b.write(
            &layer.recurrent,
            &bytes(&values(6 * spec.recurrent_len(), 8)),
        )?;
        let out = b.alloc(DType::F32, &[t, 32])?;
        let call = GatedDeltaNet {
            spec: &spec,
            mixed: &mixed,
            a: &a,
            b: &beta,
            weights: GatedDeltaWeights {
                conv: &conv,
                a_log: &a_log,
                dt_bias: &dt,
            },
            state: layer,
            seqs: &seqs,
            out: &out,
        };
        if host {
            gated_delta_net_on_host(&*b, &call)?;
        } else {
            b.gated_delta_net(&call)?;
        }
        results.push((
            b.download_f32(&out)?,
            b.download_f32(&layer.conv)?,
            b.download_f32(&layer.recurrent)?,
        ));
    }
    assert_eq!(results[0], results[1]);
    Ok(())
}

/// A snapshot taken mid-prefill, restored into another slot, continues
/// exactly as the uninterrupted sequence: the logits after the rest of the
/// prompt are bit-identical, for a snapshot inside a chunk and at its end.
#[test]
fn a_restored_snapshot_continues_bit_identically() -> Result<()> {
    let b = backend()?;
    for name in FIXTURES {
        let m = load_dir(&fixture(name), &b)?;
        let r = reference(name)?;
        let run = runner(&m, &b, 8)?;
        let prompt = prompts(&r)?.pop().context("long prompt")?;
        let whole = chunked_logits(&run, &prompt, prompt.len(), 0)?;
        let pool = run.new_page_pool();
        let pages = pool.alloc(pool.pages_for(prompt.len()))?;
        for (chunk, at) in [(100, 64), (64, 64), (prompt.len(), 32)] {
            // Slot 1 computes the first `chunk` tokens, snapshotting at `at` into slot 2.
            let mut layout = BatchLayout::new(16);
            layout.push_seq(0, chunk, pages.pages())?;
            layout.state_slots.push(1);
            layout.state_snapshots.push((0, at, 2));
            forward(&run, &prompt[..chunk], 0, layout, false)?;
            // Slot 3 restores it and computes the rest.
            let mut layout = BatchLayout::new(16);
            layout.push_seq(at, prompt.len() - at, pages.pages())?;
            layout.state_slots.push(3);
            layout.state_restores.push((2, 3));
            let got = forward(&run, &prompt[at..], at, layout, true)?;
            assert!(
                got.iter()
                    .zip(&whole)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{name}: snapshot at {at} of a {chunk}-token chunk"
            );
        }
    }
    Ok(())
}

/// One sequence's forward over `layout`: the last row's logits when asked.
fn forward(
    run: &ModelRunner,
    tokens: &[u32],
    start: usize,
    layout: BatchLayout,
    logits: bool,
) -> Result<Vec<f32>> {
    let batch = ForwardBatch {
        input_ids: tokens.to_vec(),
        positions: (start..start + tokens.len()).map(|p| p as u32).collect(),
        layout: Arc::new(layout),
        logits_rows: if logits {
            vec![tokens.len() as u32 - 1]
        } else {
            Vec::new()
        },
        hidden_layers: Vec::new(),
        lora: Vec::new(),
        exit_after: None,
        hidden_at_every_row: false,
    };
    let out = run.forward(&batch)?;
    Ok(run.backend().download_f32(&out.logits)?)
}

fn bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The default precision stays close to transformers' f32 logits on the
/// dense Qwen3.5: bf16 weights (bf16-rounded activations on AMX CPUs) with an
/// f16 KV cache within 8% of the largest logit (measured: 3.6% and 6.2% on
/// the 61- and 404-token prompts), f16 weights within 5% (measured 0.4%).
/// The MoE fixtures are held to no such bound: their routers' gaps are near
/// 1e-3, so 16-bit weights flip experts (errors of 15-59% seen). The first
/// greedy token is the same wherever transformers' top two differ by more
/// than twice the bound.
#[test]
fn default_precision_stays_close() -> Result<()> {
    let b = backend()?;
    let cases = [
        ("tiny-qwen3.5", "bf16", 8e-2),
        ("tiny-qwen3.5", "f16", 5e-2),
    ];
    for (name, dtype, bound) in cases {
        let m = load_as(&fixture(name), &b, dtype)?;
        let r = reference(name)?;
        let run = runner_kv(&m, &b, 4, DType::F16)?;
        let mut worst = 0f32;
        for (i, (p, want)) in prompts(&r)?
            .iter()
            .zip(r["prompts"].as_array().context("prompts")?)
            .enumerate()
        {
            let got = chunked_logits(&run, p, p.len(), 0)?;
            let (abs, max) = logit_error(&got, want)?;
            let err = abs / max;
            worst = worst.max(err);
            assert!(
                err <= bound,
                "{name} {dtype} prompt {i}: logits off by {err} of the max"
            );
            let margin = want["min_margin"].as_f64().unwrap_or(0.0) as f32;
            let top = |l: &[f32]| arbor_engine_core::sampling::argmax(l);
            if margin > 2.0 * bound * max {
                assert_eq!(
                    top(&got),
                    top(&last_logits(want)?),
                    "{name} {dtype} prompt {i}: first token"
                );
            }
        }
        eprintln!("{name}: {dtype} weights, f16 KV: worst logit error {worst:.2e} of the max");
    }
    Ok(())
}
