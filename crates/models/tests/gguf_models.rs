//! The GGUF loading paths of qwen2, qwen3, mistral and the mixture-of-experts
//! qwen3moe, qwen2moe and Mixtral (`llama` with `expert_count`; plain llama
//! is covered by the real SmolLM2 file in smollm2.rs): each tiny Hugging Face fixture is
//! converted here to a GGUF file the way llama.cpp's `convert_hf_to_gguf.py`
//! writes one (its metadata keys, tensor names, Q/K row permutation for
//! mistral, experts stacked in `ffn_*_exps` `[experts, out, in]` tensors, a
//! `gpt2` tokenizer from `tokenizer.json`), in f32 so nothing is
//! lost, then loaded through `load_model` like any GGUF file. The result must
//! tokenize the prompts and continue them greedily exactly as transformers
//! did (the fixtures' reference.json), with last-position logits within
//! 1e-4 × max|logit|. Model-level bad input (an unknown architecture, a
//! missing tensor, a tensor of the wrong shape, a missing metadata key) is a
//! clear error naming what is wrong.

mod gguf_common;

use anyhow::{Context, Result};
use arbor_engine_core::runner::{ModelRunner, SamplingSetup, SeqStep, generate_static};
use arbor_engine_core::sampling::StandardSampler;
use arbor_engine_core::{DType, SamplingParams};
use arbor_gguf::{GgufArray, GgufValue, GgufWriter};
use gguf_common::*;
use serde_json::Value;
use std::path::PathBuf;

/// llama.cpp's `LlamaModel.permute`: within each head, rows `[0, d/2)` and
/// `[d/2, d)` (HF's rotate-half halves) are interleaved.
fn permute(data: &[u8], rows: usize, heads: usize) -> Vec<u8> {
    let rb = data.len() / rows;
    let hd = rows / heads;
    let mut out = vec![0u8; data.len()];
    for h in 0..heads {
        for a in 0..2 {
            for b in 0..hd / 2 {
                let src = h * hd + a * (hd / 2) + b;
                let dst = h * hd + 2 * b + a;
                out[dst * rb..(dst + 1) * rb].copy_from_slice(&data[src * rb..(src + 1) * rb]);
            }
        }
    }
    out
}

/// The GGUF file of a tiny HF fixture, as llama.cpp's converter writes it.
fn convert(name: &str, arch: &str) -> Result<GgufWriter> {
    let dir = fixture(name);
    let cfg = json(&dir.join("config.json"))?;
    let u = |k: &str| {
        cfg[k]
            .as_u64()
            .with_context(|| format!("{name}: config {k}"))
    };
    let heads = u("num_attention_heads")?;
    let kv_heads = u("num_key_value_heads")?;
    let hidden = u("hidden_size")?;
    let head_dim = cfg["head_dim"].as_u64().unwrap_or(hidden / heads);
    let theta = cfg["rope_theta"]
        .as_f64()
        .or_else(|| cfg["rope_parameters"]["rope_theta"].as_f64())
        .unwrap_or(10000.0);
    let mut w = GgufWriter::new();
    w.add_str("general.architecture", arch)
        .add_str("general.name", name)
        .add_u32(
            format!("{arch}.block_count"),
            u("num_hidden_layers")? as u32,
        )
        .add_u32(
            format!("{arch}.context_length"),
            u("max_position_embeddings")? as u32,
        )
        .add_u32(format!("{arch}.embedding_length"), hidden as u32)
        .add_u32(
            format!("{arch}.feed_forward_length"),
            u("intermediate_size")? as u32,
        )
        .add_u32(format!("{arch}.attention.head_count"), heads as u32)
        .add_u32(format!("{arch}.attention.head_count_kv"), kv_heads as u32)
        .add_u32(format!("{arch}.attention.key_length"), head_dim as u32)
        .add_u32(format!("{arch}.attention.value_length"), head_dim as u32)
        .add_f32(format!("{arch}.rope.freq_base"), theta as f32)
        .add_f32(
            format!("{arch}.attention.layer_norm_rms_epsilon"),
            cfg["rms_norm_eps"].as_f64().unwrap_or(1e-6) as f32,
        );

    let (tokens, types, merges) = tokenizer_arrays(&dir)?;
    if let Some(n) = cfg["num_experts"]
        .as_u64()
        .or(cfg["num_local_experts"].as_u64())
    {
        w.add_u32(format!("{arch}.expert_count"), n as u32).add_u32(
            format!("{arch}.expert_used_count"),
            u("num_experts_per_tok")? as u32,
        );
        if let Some(m) = cfg["moe_intermediate_size"].as_u64() {
            w.add_u32(format!("{arch}.expert_feed_forward_length"), m as u32);
        }
        if let Some(m) = cfg["shared_expert_intermediate_size"].as_u64() {
            w.add_u32(
                format!("{arch}.expert_shared_feed_forward_length"),
                m as u32,
            );
        }
    }
    let reference = json(&dir.join("reference.json"))?;
    let permuted = matches!(arch, "mistral" | "llama");
    let pre = if permuted { "gpt-2" } else { "qwen2" };
    w.add_str("tokenizer.ggml.model", "gpt2")
        .add_str("tokenizer.ggml.pre", pre)
        .add_array("tokenizer.ggml.tokens", GgufArray::String(tokens))
        .add_array("tokenizer.ggml.token_type", GgufArray::I32(types))
        .add_array("tokenizer.ggml.merges", GgufArray::String(merges))
        .add_u32("tokenizer.ggml.bos_token_id", u("bos_token_id")? as u32)
        .add_u32("tokenizer.ggml.eos_token_id", u("eos_token_id")? as u32)
        .add_bool(
            "tokenizer.ggml.add_bos_token",
            reference["add_bos"].as_bool().unwrap_or(false),
        );
    if let Some(t) = json(&dir.join("tokenizer_config.json"))?["chat_template"].as_str() {
        w.add_str("tokenizer.chat_template", t);
    }

    // Tensors, f32, Q and K permuted for the archs llama.cpp permutes, the
    // routed experts of a layer stacked in expert order.
    let mut shards: Vec<PathBuf> = std::fs::read_dir(&dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    shards.sort();
    let bytes: Vec<Vec<u8>> = shards.iter().map(std::fs::read).collect::<Result<_, _>>()?;
    let mut all = std::collections::BTreeMap::new();
    for b in &bytes {
        let st = safetensors::SafeTensors::deserialize(b)?;
        for (name, t) in st.tensors() {
            anyhow::ensure!(t.dtype() == safetensors::Dtype::F32, "{name}: not f32");
            all.insert(name, (t.shape().to_vec(), t.data().to_vec()));
        }
    }
    let mut stacked: std::collections::BTreeMap<String, Vec<Expert>> = Default::default();
    for (hf, (shape, mut data)) in all {
        if let Some((g, e)) = llama_cpp_expert(&hf) {
            stacked.entry(g).or_default().push((e, shape, data));
            continue;
        }
        let g = llama_cpp_name(&hf).with_context(|| format!("no llama.cpp name for {hf}"))?;
        if permuted {
            if g.ends_with("attn_q.weight") {
                data = permute(&data, shape[0], heads as usize);
            } else if g.ends_with("attn_k.weight") {
                data = permute(&data, shape[0], kv_heads as usize);
            }
        }
        // llama.cpp keeps the shared expert's gate as a vector.
        let shape = if g.ends_with("ffn_gate_inp_shexp.weight") {
            vec![shape.iter().product()]
        } else {
            shape
        };
        w.add_tensor(g, DType::F32, &shape, data)?;
    }
    for (g, mut experts) in stacked {
        experts.sort_by_key(|(e, _, _)| *e);
        let shape = [experts.len(), experts[0].1[0], experts[0].1[1]];
        let data: Vec<u8> = experts.into_iter().flat_map(|(_, _, d)| d).collect();
        w.add_tensor(g, DType::F32, &shape, data)?;
    }
    Ok(w)
}

fn check(name: &str, arch: &str) -> Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("converted.gguf");
    convert(name, arch)?.write(&path)?;
    let (m, backend) = load(&path).with_context(|| format!("loading {name} as GGUF"))?;
    // The model's name is `general.name`, not the file's.
    assert_eq!(m.name, name);
    let (hf, _) = load(&fixture(name))?;
    assert_eq!(hf.name, name, "a folder's model is named after the folder");
    let reference = json(&fixture(name).join("reference.json"))?;
    let prompts = reference["prompts"].as_array().context("prompts")?;
    let runner = ModelRunner::new(m.model.clone(), backend.clone(), None, 16, 32, DType::F32)?;
    let pool = runner.new_page_pool();
    let mut inputs = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let input = ids(&p["input_ids"]);
        let text = p["text"].as_str().context("text")?;
        let add_bos = reference["add_bos"].as_bool().unwrap_or(false);
        assert_eq!(
            m.tokenizer.encode(text, add_bos)?,
            input,
            "{name}: tokens of {text:?}"
        );
        let pages = pool.alloc(pool.pages_for(input.len()))?;
        let got = runner.step(&[SeqStep {
            tokens: &input,
            prefix_len: 0,
            pages: pages.pages(),
            want_logits: true,
            state_slot: None,
        }])?;
        let want: Vec<f32> = p["last_logits"]
            .as_array()
            .context("last_logits")?
            .iter()
            .filter_map(Value::as_f64)
            .map(|x| x as f32)
            .collect();
        let max = want.iter().fold(0f32, |a, b| a.max(b.abs()));
        let err = got[0]
            .iter()
            .zip(&want)
            .fold(0f32, |a, (x, y)| a.max((x - y).abs()));
        println!("{name} (GGUF {arch}) prompt {i}: max abs logit error {err:.2e} of {max:.2}");
        assert!(err <= 1e-4 * max, "{name} prompt {i}: {err} > 1e-4 * {max}");
        inputs.push(input);
    }
    let params = vec![
        SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(32)
        };
        inputs.len()
    ];
    let setup = SamplingSetup {
        sampler: &StandardSampler,
        processors: &[],
        eos_token_ids: &[],
    };
    let (outs, _) = generate_static(&runner, &pool, &inputs, &params, &setup, &mut |_, _| {})?;
    for (o, p) in outs.iter().zip(prompts) {
        assert_eq!(
            o.tokens,
            ids(&p["greedy_ids"]),
            "{name}: greedy continuation"
        );
    }
    assert_eq!(pool.free_pages(), pool.total_pages(), "pages leaked");
    assert!(
        m.chat_template.is_some(),
        "{name}: chat template from tokenizer.chat_template"
    );
    Ok(())
}

#[test]
fn qwen2_gguf_matches_transformers() -> Result<()> {
    check("tiny-qwen2", "qwen2")
}

#[test]
fn qwen3_gguf_matches_transformers() -> Result<()> {
    check("tiny-qwen3", "qwen3")
}

#[test]
fn mistral_gguf_matches_transformers() -> Result<()> {
    check("tiny-mistral", "mistral")
}

#[test]
fn qwen3moe_gguf_matches_transformers() -> Result<()> {
    check("tiny-qwen3-moe", "qwen3moe")
}

#[test]
fn qwen2moe_gguf_matches_transformers() -> Result<()> {
    check("tiny-qwen2-moe", "qwen2moe")
}

/// Mixtral as llama.cpp writes it: architecture `llama` with `expert_count`.
#[test]
fn mixtral_gguf_matches_transformers() -> Result<()> {
    check("tiny-mixtral", "llama")
}

#[test]
fn bad_gguf_models_are_named_errors() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let good = convert("tiny-qwen2", "qwen2")?;
    let err = |w: &GgufWriter, file: &str| -> Result<String> {
        let path = dir.path().join(file);
        w.write(&path)?;
        match load(&path) {
            Ok(_) => anyhow::bail!("{file} loaded"),
            Err(e) => Ok(format!("{e:#}")),
        }
    };
    // An architecture Arbor does not have.
    let mut w = good.clone();
    w.add("general.architecture", GgufValue::String("gpt-neox".into()));
    let e = err(&w, "arch.gguf")?;
    assert!(e.contains("'gpt-neox' is not supported"), "{e}");
    // A metadata key the config needs.
    let mut w = good.clone();
    w.remove("qwen2.block_count");
    let e = err(&w, "key.gguf")?;
    assert!(e.contains("qwen2.block_count"), "{e}");
    // A missing tensor, and one of the wrong shape: rebuild without / with a bad one.
    let rebuild = |skip: &str, reshape: &str| -> Result<GgufWriter> {
        let mut w = GgufWriter::new();
        let file = arbor_gguf::GgufFile::from_bytes(good.to_bytes())?;
        for (k, v) in file.metadata() {
            w.add(k.clone(), v.clone());
        }
        for t in file.tensors() {
            if t.name == skip {
                continue;
            }
            let mut shape = t.shape.clone();
            if t.name == reshape {
                shape.reverse();
            }
            w.add_tensor(t.name.clone(), t.dtype, &shape, file.data_of(t)?.to_vec())?;
        }
        Ok(w)
    };
    let e = err(&rebuild("blk.1.ffn_down.weight", "")?, "missing.gguf")?;
    assert!(e.contains("model.layers.1.mlp.down_proj.weight"), "{e}");
    let e = err(&rebuild("", "blk.0.ffn_up.weight")?, "shape.gguf")?;
    assert!(e.contains("model.layers.0.mlp.up_proj.weight"), "{e}");
    Ok(())
}
