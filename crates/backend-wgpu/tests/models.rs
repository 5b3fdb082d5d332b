//! End to end: the tiny HF fixtures (Llama, Mistral, Qwen2, Qwen3; f32, and
//! Llama with f16 weights) and the default SmolLM2-135M Q4_1 GGUF run on the
//! wgpu backend and on the CPU backend from the same checkpoint.
//!
//! Tiny fixtures: for every prompt, the greedy continuation on wgpu must equal
//! the CPU's for 32 tokens, or up to the first position where the CPU's two
//! best logits are within 1e-3 of each other (a near-tie that any change of
//! summation order may flip); the test prints where and why when that
//! happens. Last-position logits agree within 1e-3 (f32 weights) or 2e-3 (f16
//! weights) of their largest magnitude. SmolLM2 quantizes activations to Q8
//! before every matmul, so its rules use the model's measured noise instead
//! (see [`smollm2_matches_cpu_and_llama_cpp`]).
//! Prompts run as one batch (prefill of all, then batched decodes), so batched
//! prefill, paged KV over several sequences and batched decode are covered;
//! one prompt is also run through device sampling (`Backend::sample`), which
//! must pick the same greedy tokens while reading back only ids.
//! SmolLM2 tests skip with a message when the model file is absent.
#![allow(clippy::unwrap_used)]

mod common;

use anyhow::{Context, Result};
use arbor_engine_core::backend::SampleRow;
use arbor_engine_core::runner::{ModelRunner, SeqStep};
use arbor_engine_core::{Backend, DType, LoadOptions, Registry, TokenDecoder};
use arbor_models::{LoadedModel, load_model};
use arbor_quant as _;
use common::*;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::Arc;

const NEW_TOKENS: usize = 32;
const NEAR_TIE: f32 = 1e-3;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn load(path: &Path, backend: &Arc<dyn Backend>, dtype: &str) -> Result<LoadedModel> {
    let registry = Registry::builtin()?;
    let opts = LoadOptions {
        backend: backend.clone(),
        quant: registry.quant_methods.get(dtype)?(&Default::default())?,
        progress: None,
    };
    Ok(load_model(path, &registry, &opts)?)
}

/// Greedy tokens of each prompt, with the top-2 margin of the logits that chose each.
struct Greedy {
    tokens: Vec<Vec<u32>>,
    margins: Vec<Vec<f32>>,
    first_logits: Vec<Vec<f32>>,
}

fn top2(l: &[f32]) -> (u32, f32) {
    let best = arbor_engine_core::sampling::argmax(l);
    let second = l
        .iter()
        .enumerate()
        .filter(|&(i, _)| i as u32 != best)
        .fold(f32::NEG_INFINITY, |m, (_, &v)| m.max(v));
    (best, l[best as usize] - second)
}

fn greedy(
    m: &LoadedModel,
    b: &Arc<dyn Backend>,
    prompts: &[Vec<u32>],
    kv: DType,
) -> Result<Greedy> {
    let runner = ModelRunner::new(m.model.clone(), b.clone(), None, 16, 64, kv)?;
    let hybrid = m.model.spec().state.is_some();
    let pool = runner.new_page_pool();
    let pages: Vec<_> = prompts
        .iter()
        .map(|p| pool.alloc(pool.pages_for(p.len() + NEW_TOKENS)))
        .collect::<Result<_, _>>()?;
    let mut out = Greedy {
        tokens: vec![Vec::new(); prompts.len()],
        margins: vec![Vec::new(); prompts.len()],
        first_logits: Vec::new(),
    };
    for step in 0..NEW_TOKENS {
        let last: Vec<[u32; 1]> = out
            .tokens
            .iter()
            .map(|t| [t.last().copied().unwrap_or(0)])
            .collect();
        let steps: Vec<SeqStep<'_>> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| SeqStep {
                tokens: if step == 0 { p } else { &last[i] },
                prefix_len: if step == 0 { 0 } else { p.len() + step - 1 },
                pages: pages[i].pages(),
                want_logits: true,
                state_slot: hybrid.then_some(i as u32),
            })
            .collect();
        let logits = runner.step(&steps)?;
        if step == 0 {
            out.first_logits = logits.clone();
        }
        for (i, l) in logits.iter().enumerate() {
            let (t, margin) = top2(l);
            out.tokens[i].push(t);
            out.margins[i].push(margin);
        }
    }
    Ok(out)
}

/// Greedy decoding of one prompt with sampling on the device: only ids are read back.
fn greedy_on_device(
    m: &LoadedModel,
    b: &Arc<dyn Backend>,
    prompt: &[u32],
    kv: DType,
) -> Result<Vec<u32>> {
    use arbor_engine_core::{BatchLayout, ForwardBatch, ForwardContext, KvCache, KvSpec};
    let s = m.model.spec();
    let spec = KvSpec {
        num_layers: s.num_layers,
        num_kv_heads: s.num_kv_heads,
        head_dim: s.head_dim,
        page_size: 16,
        num_pages: 64,
        dtype: kv,
        values_in_keys: false,
    };
    let cache = KvCache::allocate(&**b, spec)?;
    let attention = b.attention(None)?;
    let pages: Vec<u32> = (0..(prompt.len() + NEW_TOKENS).div_ceil(16) as u32).collect();
    let ids_t = b.alloc(DType::U32, &[1])?;
    let mut tokens = Vec::new();
    for step in 0..NEW_TOKENS {
        let (ids, prefix) = if step == 0 {
            (prompt.to_vec(), 0)
        } else {
            (vec![tokens[step - 1]], prompt.len() + step - 1)
        };
        let mut layout = BatchLayout::new(16);
        layout.push_seq(prefix, ids.len(), &pages)?;
        let layout = Arc::new(layout);
        let batch = attention.prepare(layout.clone())?;
        let fb = ForwardBatch {
            positions: (prefix..prefix + ids.len()).map(|p| p as u32).collect(),
            logits_rows: vec![ids.len() as u32 - 1],
            input_ids: ids,
            layout,
            hidden_layers: Vec::new(),
            lora: Vec::new(),
            exit_after: None,
            hidden_at_every_row: false,
        };
        let ctx = ForwardContext {
            kv: &cache,
            attention: &*attention,
            attention_batch: &batch,
        };
        let logits = m.model.forward(&fb, &ctx)?.logits;
        let row = SampleRow {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 0,
        };
        b.sample(&logits, &[row], &ids_t)?;
        tokens.push(download_u32(&**b, &ids_t)[0]);
    }
    Ok(tokens)
}

/// Checks the agreement rule and returns how many tokens agree per prompt.
fn check_agreement(what: &str, cpu: &Greedy, gpu: &Greedy) -> Vec<usize> {
    let mut agree = Vec::new();
    for (i, (c, g)) in cpu.tokens.iter().zip(&gpu.tokens).enumerate() {
        let same = c.iter().zip(g).take_while(|(a, b)| a == b).count();
        if same < NEW_TOKENS {
            let margin = cpu.margins[i][same];
            println!(
                "{what} prompt {i}: diverges at token {same}, where the CPU's top-2 logits differ by {margin:.2e}"
            );
            assert!(
                margin < NEAR_TIE,
                "{what} prompt {i}: wgpu {:?} vs cpu {:?} diverge at {same} with a top-2 margin of {margin}",
                g,
                c
            );
        }
        agree.push(same);
    }
    println!("{what}: greedy tokens identical to the CPU: {agree:?} of {NEW_TOKENS}");
    agree
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(Value::as_u64)
                .map(|x| x as u32)
                .collect()
        })
        .unwrap_or_default()
}

fn check_fixture(name: &str, dtype: &str) -> Result<()> {
    let Some(g) = gpu() else { return Ok(()) };
    let c = cpu();
    let dir = fixture(name);
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json"))?)?;
    let prompts: Vec<Vec<u32>> = reference["prompts"]
        .as_array()
        .context("prompts")?
        .iter()
        .map(|p| ids(&p["input_ids"]))
        .collect();
    let mc = load(&dir, &c, dtype)?;
    let mg = load(&dir, &g, dtype)?;
    let want = greedy(&mc, &c, &prompts, DType::F32)?;
    let got = greedy(&mg, &g, &prompts, DType::F32)?;
    for (i, (a, b)) in got.first_logits.iter().zip(&want.first_logits).enumerate() {
        let tol = if dtype == "f32" { 1e-3 } else { 2e-3 };
        assert_close(&format!("{name} {dtype} prompt {i} logits"), a, b, tol);
    }
    check_agreement(&format!("{name} ({dtype})"), &want, &got);
    if mg.model.spec().state.is_some() {
        // Hybrid models: the runner's state slots above; no KV-only path.
        return Ok(());
    }
    let dev = greedy_on_device(&mg, &g, &prompts[0], DType::F32)?;
    assert_eq!(
        dev, got.tokens[0],
        "{name}: device sampling picks the same greedy tokens"
    );
    Ok(())
}

#[test]
fn tiny_llama_matches_cpu() -> Result<()> {
    check_fixture("tiny-llama", "f32")
}

#[test]
fn tiny_llama_f16_weights_match_cpu() -> Result<()> {
    check_fixture("tiny-llama", "f16")
}

#[test]
fn tiny_mistral_matches_cpu() -> Result<()> {
    check_fixture("tiny-mistral", "f32")
}

#[test]
fn tiny_qwen2_matches_cpu() -> Result<()> {
    check_fixture("tiny-qwen2", "f32")
}

#[test]
fn tiny_qwen3_matches_cpu() -> Result<()> {
    check_fixture("tiny-qwen3", "f32")
}

/// Latent attention over a cache whose values are its keys (one buffer
/// bound as both), with DeepSeek-V3's routed and shared experts.
#[test]
fn tiny_deepseek_v3_matches_cpu() -> Result<()> {
    check_fixture("tiny-deepseek-v3", "f32")
}

/// Hybrid models (Qwen3.5 dense and MoE, Qwen3-Next): the recurrence runs
/// through the backend's host default, the rest in WGSL.
#[test]
fn hybrid_models_match_cpu() -> Result<()> {
    for name in ["tiny-qwen3.5", "tiny-qwen3.5-moe", "tiny-qwen3-next"] {
        check_fixture(name, "f32")?;
    }
    Ok(())
}

/// HF quantized checkpoints (tests/fixtures/quant): FP8 blocks, INT4 (AWQ,
/// compressed-tensors W4A16), 8-bit GPTQ and NVFP4, packed as on the CPU
/// and multiplied by `matmul_f.wgsl`.
#[test]
fn quantized_checkpoints_match_cpu() -> Result<()> {
    for name in [
        "quant/fp8-block",
        "quant/awq",
        "quant/w4a16",
        "quant/gptq8-asym",
        "quant/nvfp4",
    ] {
        check_fixture(name, "f32")?;
    }
    Ok(())
}

/// The default model's chats of tests/fixtures/smollm2/llamacpp.json, with
/// llama.cpp's greedy tokens, their top-5 logits and its self-consistency bound.
struct Chat {
    prompt: Vec<u32>,
    want: Vec<u32>,
    top5: Vec<Vec<(usize, f32)>>,
    margins: Vec<f32>,
    bound: f32,
}

fn chats() -> Result<Vec<Chat>> {
    let p = fixture("smollm2/llamacpp.json");
    let fx: Value = serde_json::from_str(&std::fs::read_to_string(p)?)?;
    let floats = |v: &Value| -> Vec<f32> {
        v.as_array()
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_f64)
                    .map(|x| x as f32)
                    .collect()
            })
            .unwrap_or_default()
    };
    fx["chat"]
        .as_array()
        .context("chat")?
        .iter()
        .map(|c| {
            let top5 = c["greedy_top5"]
                .as_array()
                .context("top5")?
                .iter()
                .map(|step| {
                    step.as_array()
                        .map(|a| {
                            a.iter()
                                .filter_map(|p| {
                                    Some((p[0].as_u64()? as usize, p[1].as_f64()? as f32))
                                })
                                .collect()
                        })
                        .unwrap_or_default()
                })
                .collect();
            Ok(Chat {
                prompt: ids(&c["prompt_ids"]),
                want: ids(&c["greedy_ids"]),
                top5,
                margins: floats(&c["greedy_margins"]),
                bound: c["batched_vs_sequential_max_abs_diff"]
                    .as_f64()
                    .context("bound")? as f32,
            })
        })
        .collect()
}

/// The default model (Q4_1 linears, Q8_0 embeddings, f16 KV cache). Its
/// activations are quantized to Q8 before every quantized matmul (as in
/// llama.cpp and the CPU backend), which makes logits sensitive to the last
/// bits of anything upstream: the CPU's own scalar and SIMD paths differ by up
/// to ~0.6 in the logits, llama.cpp's batched and sequential runs by ~1.0
/// (the fixture's bound). So on this model the rules use that bound instead
/// of 1e-3: teacher-forced on llama.cpp's tokens, our logits of its top-5 stay
/// within 1.5x the bound and our argmax is its token wherever its margin
/// exceeds the bound (the CPU backend's own test); against the CPU backend,
/// prefill logits differ by at most 3x the bound (each side is within 1.5x of
/// llama.cpp), and free-running greedy tokens are identical up to the first
/// position where the CPU's top-2 margin is below the bound.
#[test]
fn smollm2_matches_cpu_and_llama_cpp() -> Result<()> {
    let Some(g) = gpu() else { return Ok(()) };
    let Some(path) = arbor_models::default_model_path().filter(|p| p.exists()) else {
        eprintln!("skipping: the default model is absent (run `arbor fetch-default`)");
        return Ok(());
    };
    let chats = chats()?;
    let mg = load(&path, &g, "auto")?;

    // Teacher forcing, all chats in one batch.
    let runner = ModelRunner::new(mg.model.clone(), g.clone(), None, 16, 64, DType::F16)?;
    let pool = runner.new_page_pool();
    let pages: Vec<_> = chats
        .iter()
        .map(|c| pool.alloc(pool.pages_for(c.prompt.len() + c.want.len())))
        .collect::<Result<_, _>>()?;
    let steps = chats.iter().map(|c| c.want.len()).max().unwrap_or(0);
    let mut worst = vec![0f32; chats.len()];
    let mut agree = vec![0usize; chats.len()];
    for step in 0..steps {
        let live: Vec<usize> = (0..chats.len())
            .filter(|&i| step < chats[i].want.len())
            .collect();
        let seqs: Vec<SeqStep<'_>> = live
            .iter()
            .map(|&i| {
                let c = &chats[i];
                let (tokens, prefix_len): (&[u32], usize) = if step == 0 {
                    (&c.prompt, 0)
                } else {
                    (&c.want[step - 1..step], c.prompt.len() + step - 1)
                };
                SeqStep {
                    tokens,
                    prefix_len,
                    pages: pages[i].pages(),
                    want_logits: true,
                    state_slot: None,
                }
            })
            .collect();
        let logits = runner.step(&seqs)?;
        for (l, &i) in logits.iter().zip(&live) {
            let c = &chats[i];
            for &(id, theirs) in &c.top5[step] {
                let d = (l[id] - theirs).abs();
                worst[i] = worst[i].max(d);
                assert!(
                    d <= 1.5 * c.bound,
                    "chat {i} step {step}: logit of {id} is {} vs llama.cpp {theirs}",
                    l[id]
                );
            }
            let ours = arbor_engine_core::sampling::argmax(l);
            if ours == c.want[step] {
                agree[i] += 1;
            } else {
                assert!(
                    c.margins[step] <= c.bound,
                    "chat {i} step {step}: argmax {ours}, llama.cpp {} by a margin of {}",
                    c.want[step],
                    c.margins[step]
                );
            }
        }
    }
    for (i, c) in chats.iter().enumerate() {
        println!(
            "chat {i} vs llama.cpp (teacher-forced): argmax agrees at {}/{} steps, max logit difference {:.3} (llama.cpp's own: {:.3})",
            agree[i],
            c.want.len(),
            worst[i],
            c.bound
        );
    }
    drop(pages);

    // Free running against the CPU backend.
    let c = cpu();
    let mc = load(&path, &c, "auto")?;
    let prompts: Vec<Vec<u32>> = chats.iter().map(|c| c.prompt.clone()).collect();
    let want = greedy(&mc, &c, &prompts, DType::F16)?;
    let got = greedy(&mg, &g, &prompts, DType::F16)?;
    let tok = &mg.tokenizer;
    for (i, ch) in chats.iter().enumerate() {
        let same = want.tokens[i]
            .iter()
            .zip(&got.tokens[i])
            .take_while(|(a, b)| a == b)
            .count();
        let d = got.first_logits[i]
            .iter()
            .zip(&want.first_logits[i])
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        println!(
            "chat {i} vs CPU: prefill logits within {d:.3}; greedy tokens identical for {same}/{NEW_TOKENS}{}",
            if same < NEW_TOKENS {
                format!(
                    ", then a near-tie (CPU top-2 margin {:.3})",
                    want.margins[i][same]
                )
            } else {
                String::new()
            }
        );
        println!("  wgpu: {:?}", tok.decode(&got.tokens[i], true)?);
        println!("  cpu:  {:?}", tok.decode(&want.tokens[i], true)?);
        // Each backend is within 1.5x the bound of llama.cpp, so of each other within 3x.
        assert!(
            d <= 3.0 * ch.bound,
            "chat {i}: prefill logits differ by {d}"
        );
        if same < NEW_TOKENS {
            assert!(
                want.margins[i][same] <= ch.bound,
                "chat {i}: diverges at {same} where the CPU's margin is {}",
                want.margins[i][same]
            );
        }
    }

    // Sampling on the device picks the same greedy tokens (the kernels are
    // batch-invariant: a row's result does not depend on the rest of the batch).
    let dev = greedy_on_device(&mg, &g, &prompts[0], DType::F16)?;
    assert_eq!(dev, got.tokens[0], "device sampling");
    Ok(())
}

/// The question the CPU backend's own test asks, answered with sampling on the
/// device (only token ids are read back).
#[test]
fn smollm2_knows_the_capital_of_france() -> Result<()> {
    let Some(g) = gpu() else { return Ok(()) };
    let Some(path) = arbor_models::default_model_path().filter(|p| p.exists()) else {
        eprintln!("skipping: the default model is absent (run `arbor fetch-default`)");
        return Ok(());
    };
    let m = load(&path, &g, "auto")?;
    let template = m.chat_template.as_ref().context("chat template")?;
    let msgs = vec![
        arbor_models::ChatMessage::new("system", "You are a helpful assistant."),
        arbor_models::ChatMessage::new("user", "What is the capital of France?"),
    ];
    let text = template.render(&msgs, true, None, None, None)?;
    let prompt = m.tokenizer.encode(&text, true)?;
    let out = greedy_on_device(&m, &g, &prompt, DType::F16)?;
    let answer = m.tokenizer.decode(&out, true)?;
    println!("answer: {answer}");
    assert!(answer.contains("Paris"), "answer: {answer}");
    Ok(())
}
