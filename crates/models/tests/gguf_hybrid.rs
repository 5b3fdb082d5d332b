//! The GGUF loading path of llama.cpp's hybrid architectures `qwen35`,
//! `qwen35moe` and `qwen3next`: each tiny Hugging Face fixture
//! (tests/fixtures/tiny-qwen3.5, a ConditionalGeneration checkpoint whose
//! `model.visual.*` tensors are dropped; tiny-qwen3.5-moe; tiny-qwen3-next)
//! is converted here to an f32 GGUF file the way llama.cpp's
//! `convert_hf_to_gguf.py --outtype f32 --no-mtp` writes one (llama.cpp
//! 0c1e57098: the same metadata keys and values, tensor names, value heads
//! tiled, `ssm_a = -exp(A_log)`, norms stored as `1 + w`, the squeezed
//! convolution, Qwen3-Next's `in_proj_qkvz` split into `attn_qkv` and
//! `attn_gate`, experts stacked, the vocabulary padded to the model's), then
//! loaded through `load_model`. The result must tokenize the prompts and
//! continue them greedily exactly as transformers did (reference.json), with
//! last-position logits within 1e-4 × max|logit| and close to the
//! safetensors checkpoint's. `tools/reference/check_gguf_hybrid.py` compares
//! these files with the real converter's: set `ARBOR_GGUF_HYBRID_OUT` to a
//! folder and the tests leave `<fixture>.gguf` there.
//!
//! Bad input (a missing `ssm` tensor, a missing metadata key, a short
//! `recurrent_layers`) is an error naming what is wrong.

mod gguf_common;

use anyhow::{Context, Result};
use arbor_engine_core::runner::{KvGeometry, ModelRunner, SamplingSetup, SeqStep, generate_static};
use arbor_engine_core::sampling::StandardSampler;
use arbor_engine_core::{Backend, DType, SamplingParams};
use arbor_gguf::{GgufArray, GgufFile, GgufValue, GgufWriter};
use arbor_models::LoadedModel;
use gguf_common::*;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The value heads' layout of the linear-attention layers.
#[derive(Clone, Copy)]
struct Heads {
    k_heads: usize,
    k_dim: usize,
    v_heads: usize,
    v_dim: usize,
}

/// llama.cpp's `_reorder_v_heads`: `k * r * d` units grouped by key head
/// (`[k, r, d]`) to tiled (`[r, k, d]`), each unit `unit` bytes.
fn tile(data: &[u8], unit: usize, k: usize, r: usize, d: usize) -> Vec<u8> {
    let mut out = vec![0u8; data.len()];
    for kk in 0..k {
        for j in 0..r {
            for x in 0..d {
                let src = ((kk * r + j) * d + x) * unit;
                let dst = ((j * k + kk) * d + x) * unit;
                out[dst..dst + unit].copy_from_slice(&data[src..src + unit]);
            }
        }
    }
    out
}

fn f32s(data: &[u8]) -> Vec<f32> {
    data.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn bytes(v: impl IntoIterator<Item = f32>) -> Vec<u8> {
    v.into_iter().flat_map(f32::to_le_bytes).collect()
}

/// llama.cpp's name for a hybrid model's tensor (`tensor_mapping.py` for
/// these architectures, whose post-attention norm is `post_attention_norm`).
fn hybrid_name(hf: &str) -> Option<String> {
    let Some((layer, tail)) = hf
        .strip_prefix("model.layers.")
        .and_then(|r| r.split_once('.'))
    else {
        return llama_cpp_name(hf);
    };
    let g = match tail {
        "post_attention_layernorm.weight" => "post_attention_norm.weight",
        "linear_attn.in_proj_qkv.weight" => "attn_qkv.weight",
        "linear_attn.in_proj_z.weight" => "attn_gate.weight",
        "linear_attn.in_proj_b.weight" => "ssm_beta.weight",
        "linear_attn.in_proj_a.weight" => "ssm_alpha.weight",
        "linear_attn.in_proj_ba.weight" => "ssm_ba.weight",
        "linear_attn.in_proj_qkvz.weight" => "ssm_in.weight",
        "linear_attn.A_log" => "ssm_a",
        "linear_attn.dt_bias" => "ssm_dt.bias",
        "linear_attn.conv1d.weight" => "ssm_conv1d.weight",
        "linear_attn.norm.weight" => "ssm_norm.weight",
        "linear_attn.out_proj.weight" => "ssm_out.weight",
        _ => return llama_cpp_name(hf),
    };
    Some(format!("blk.{layer}.{g}"))
}

/// gguf-py's `model_weight_count_rounded_notation`.
fn rounded_notation(n: u64) -> String {
    let n = n as f64;
    let (scaled, suffix) = if n > 1e12 {
        (n * 1e-12, "T")
    } else if n > 1e9 {
        (n * 1e-9, "B")
    } else if n > 1e6 {
        (n * 1e-6, "M")
    } else {
        (n * 1e-3, "K")
    };
    let r = scaled.round() as u64;
    let digits = if r == 0 { 0 } else { r.to_string().len() };
    let fix = 2usize.saturating_sub(digits);
    format!("{scaled:.fix$}{suffix}")
}

/// gguf-py's `size_label` of the tensors written.
fn size_label(tensors: &[(String, Vec<usize>, Vec<u8>)]) -> String {
    let (mut total, mut shared, mut expert_params) = (0u64, 0u64, 0u64);
    let (mut expert_sum, mut n_expert) = (0u64, 0u64);
    for (name, shape, _) in tensors {
        let size = shape.iter().product::<usize>() as u64;
        total += size;
        if name.contains("_exps.") && shape.len() >= 3 {
            let e = shape[0] as u64;
            expert_params += size / e;
            expert_sum += e;
            n_expert += 1;
        } else {
            shared += size;
        }
    }
    if n_expert == 0 {
        return rounded_notation(total);
    }
    format!(
        "{}x{}",
        expert_sum / n_expert,
        rounded_notation(shared + expert_params)
    )
}

/// The f32 GGUF file `convert_hf_to_gguf.py --outtype f32 --no-mtp` writes
/// for the fixture `name` as architecture `arch`; with `legacy`, Qwen3-Next's
/// fused projection is written whole as `ssm_in` (older converters).
fn convert(name: &str, arch: &str, legacy: bool) -> Result<GgufWriter> {
    let dir = fixture(name);
    let top = json(&dir.join("config.json"))?;
    // convert moves text_config to the root level.
    let mut cfg = top.clone();
    if let (Some(o), Some(Value::Object(t))) = (cfg.as_object_mut(), top.get("text_config")) {
        o.extend(t.clone());
    }
    let u = |k: &str| -> Result<usize> {
        Ok(cfg[k]
            .as_u64()
            .with_context(|| format!("{name}: config {k}"))? as usize)
    };
    let rope = &cfg["rope_parameters"];
    let heads = Heads {
        k_heads: u("linear_num_key_heads")?,
        k_dim: u("linear_key_head_dim")?,
        v_heads: u("linear_num_value_heads")?,
        v_dim: u("linear_value_head_dim")?,
    };
    let group = heads.v_heads / heads.k_heads;
    let tiled = arch != "qwen3next" && group > 1;
    let keys = 2 * heads.k_heads * heads.k_dim;

    // Tensors, in f32, transformed as the converter's model classes do.
    let mut shards: Vec<PathBuf> = std::fs::read_dir(&dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    shards.sort();
    let files: Vec<Vec<u8>> = shards.iter().map(std::fs::read).collect::<Result<_, _>>()?;
    let mut out: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut stacked: BTreeMap<String, Vec<Expert>> = BTreeMap::new();
    for b in &files {
        let st = safetensors::SafeTensors::deserialize(b)?;
        for (hf, t) in st.tensors() {
            anyhow::ensure!(t.dtype() == safetensors::Dtype::F32, "{hf}: not f32");
            if hf.contains("visual.") {
                continue;
            }
            let hf = hf.replace("language_model.", "");
            let mut shape = t.shape().to_vec();
            let mut data = t.data().to_vec();
            if let Some((g, e)) = llama_cpp_expert(&hf) {
                stacked.entry(g).or_default().push((e, shape, data));
                continue;
            }
            let tail = hf.rsplit_once(".linear_attn.").map(|(_, t)| t);
            // `_LinearAttentionVReorderBase`: value heads grouped -> tiled.
            if tiled && let Some(tail) = tail {
                let row = |shape: &[usize], data: &[u8]| data.len() / shape[0];
                match tail {
                    "in_proj_qkv.weight" | "conv1d.weight" => {
                        let rb = row(&shape, &data);
                        let v = tile(&data[keys * rb..], rb, heads.k_heads, group, heads.v_dim);
                        data.truncate(keys * rb);
                        data.extend(v);
                    }
                    "in_proj_z.weight" => {
                        data = tile(&data, row(&shape, &data), heads.k_heads, group, heads.v_dim)
                    }
                    "in_proj_b.weight" | "in_proj_a.weight" | "A_log" | "dt_bias" => {
                        data = tile(&data, row(&shape, &data), heads.k_heads, group, 1)
                    }
                    "out_proj.weight" => {
                        let rb = row(&shape, &data);
                        data = data
                            .chunks_exact(rb)
                            .flat_map(|r| tile(r, heads.v_dim * 4, heads.k_heads, group, 1))
                            .collect();
                    }
                    _ => {}
                }
            }
            // `Qwen3NextModel.modify_tensors`.
            if hf.ends_with(".A_log") {
                data = bytes(f32s(&data).into_iter().map(|a| -a.exp()));
            } else if hf.contains("conv1d") {
                shape.retain(|&d| d != 1);
            } else if hf.ends_with("norm.weight") && !hf.ends_with("linear_attn.norm.weight") {
                data = bytes(f32s(&data).into_iter().map(|w| w + 1.0));
            }
            if hf.ends_with("in_proj_qkvz.weight") && !legacy {
                // [q, k, v, z] per key head -> [all q, all k, all v] and [all z].
                let layer = hybrid_name(&hf)
                    .and_then(|g| g.strip_suffix(".ssm_in.weight").map(str::to_string))
                    .context("layer of in_proj_qkvz")?;
                let rb = data.len() / shape[0];
                let vg = group * heads.v_dim;
                let per = 2 * heads.k_dim + 2 * vg;
                let part = |off: usize, len: usize| -> Vec<u8> {
                    (0..heads.k_heads)
                        .flat_map(|h| {
                            data[(h * per + off) * rb..(h * per + off + len) * rb].to_vec()
                        })
                        .collect()
                };
                let mut qkv = part(0, heads.k_dim);
                qkv.extend(part(heads.k_dim, heads.k_dim));
                qkv.extend(part(2 * heads.k_dim, vg));
                let z = part(2 * heads.k_dim + vg, vg);
                let rows = |d: &[u8]| d.len() / rb;
                out.push((
                    format!("{layer}.attn_qkv.weight"),
                    vec![rows(&qkv), shape[1]],
                    qkv,
                ));
                out.push((
                    format!("{layer}.attn_gate.weight"),
                    vec![rows(&z), shape[1]],
                    z,
                ));
                continue;
            }
            let g = hybrid_name(&hf).with_context(|| format!("no llama.cpp name for {hf}"))?;
            out.push((g, shape, data));
        }
    }
    for (g, mut experts) in stacked {
        experts.sort_by_key(|(e, _, _)| *e);
        let shape = vec![experts.len(), experts[0].1[0], experts[0].1[1]];
        let data: Vec<u8> = experts.into_iter().flat_map(|(_, _, d)| d).collect();
        out.push((g, shape, data));
    }

    // Metadata: TextModel, Qwen2MoeModel, Qwen3NextModel and
    // _Qwen35MRopeMixin's set_gguf_parameters.
    let k = |s: &str| format!("{arch}.{s}");
    let head_dim = u("head_dim")?;
    let mut w = GgufWriter::new();
    w.add_str("general.architecture", arch)
        .add_str("general.type", "model")
        .add_str("general.name", name)
        .add_str("general.size_label", size_label(&out))
        .add_u32(k("block_count"), u("num_hidden_layers")? as u32)
        .add_u32(k("context_length"), u("max_position_embeddings")? as u32)
        .add_u32(k("embedding_length"), u("hidden_size")? as u32)
        .add_u32(k("attention.head_count"), u("num_attention_heads")? as u32)
        .add_u32(
            k("attention.head_count_kv"),
            u("num_key_value_heads")? as u32,
        )
        .add_f32(
            k("rope.freq_base"),
            rope["rope_theta"].as_f64().unwrap_or(10000.0) as f32,
        )
        .add_f32(
            k("attention.layer_norm_rms_epsilon"),
            cfg["rms_norm_eps"].as_f64().context("rms_norm_eps")? as f32,
        )
        .add_u32(k("attention.key_length"), head_dim as u32)
        .add_u32(k("attention.value_length"), head_dim as u32)
        .add_u32("general.file_type", 0)
        .add_u32(k("ssm.conv_kernel"), u("linear_conv_kernel_dim")? as u32)
        .add_u32(k("ssm.state_size"), heads.k_dim as u32)
        .add_u32(k("ssm.group_count"), heads.k_heads as u32)
        .add_u32(k("ssm.time_step_rank"), heads.v_heads as u32)
        .add_u32(k("ssm.inner_size"), (heads.v_dim * heads.v_heads) as u32)
        .add_u32(
            k("full_attention_interval"),
            cfg["full_attention_interval"].as_u64().unwrap_or(4) as u32,
        )
        .add_u32(
            k("rope.dimension_count"),
            (head_dim as f64 * rope["partial_rotary_factor"].as_f64().unwrap_or(0.25)) as u32,
        )
        .add_u32("general.quantization_version", 2);
    if let Some(n) = cfg["intermediate_size"].as_u64() {
        w.add_u32(k("feed_forward_length"), n as u32);
    }
    let recurrent: Vec<bool> = cfg["layer_types"]
        .as_array()
        .context("layer_types")?
        .iter()
        .map(|t| t == "linear_attention")
        .collect();
    w.add_array(k("attention.recurrent_layers"), GgufArray::Bool(recurrent));
    if let Some(n) = cfg["num_experts"].as_u64() {
        w.add_u32(k("expert_count"), n as u32)
            .add_u32(k("expert_used_count"), u("num_experts_per_tok")? as u32)
            .add_u32(
                k("expert_feed_forward_length"),
                u("moe_intermediate_size")? as u32,
            )
            .add_u32(
                k("expert_shared_feed_forward_length"),
                u("shared_expert_intermediate_size")? as u32,
            );
    }
    if arch != "qwen3next" {
        let mut sections: Vec<i32> = rope["mrope_section"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_i64)
                    .map(|x| x as i32)
                    .collect()
            })
            .unwrap_or_else(|| vec![11, 11, 10, 0]);
        sections.resize(4, 0);
        w.add_array(k("rope.dimension_sections"), GgufArray::I32(sections));
    }

    // The tokenizer: `_set_vocab_gpt2` and `SpecialVocab`.
    let (mut tokens, mut types, merges) = tokenizer_arrays(&dir)?;
    for i in tokens.len()..u("vocab_size")? {
        tokens.push(format!("[PAD{i}]"));
        types.push(5);
    }
    let tc = json(&dir.join("tokenizer_config.json"))?;
    let id_of = |key: &str| -> Option<u32> {
        let t = tc[key].as_str()?;
        tokens.iter().position(|x| x == t).map(|i| i as u32)
    };
    let (bos, eos, pad) = (id_of("bos_token"), id_of("eos_token"), id_of("pad_token"));
    w.add_str("tokenizer.ggml.model", "gpt2")
        .add_str("tokenizer.ggml.pre", "qwen2")
        .add_array("tokenizer.ggml.tokens", GgufArray::String(tokens))
        .add_array("tokenizer.ggml.token_type", GgufArray::I32(types))
        .add_array("tokenizer.ggml.merges", GgufArray::String(merges))
        .add_bool("tokenizer.ggml.add_bos_token", false)
        .add_bool("tokenizer.ggml.add_eos_token", false);
    for (key, id) in [("bos", bos), ("eos", eos), ("padding", pad)] {
        if let Some(id) = id {
            w.add_u32(format!("tokenizer.ggml.{key}_token_id"), id);
        }
    }
    if let Some(t) = tc["chat_template"].as_str() {
        w.add_str("tokenizer.chat_template", t);
    }
    for (g, shape, data) in out {
        w.add_tensor(g, DType::F32, &shape, data)?;
    }
    Ok(w)
}

/// Where a test writes its GGUF file: `$ARBOR_GGUF_HYBRID_OUT/<name>.gguf`
/// when set (for tools/reference/check_gguf_hybrid.py), else in `tmp`.
fn out_path(tmp: &Path, name: &str) -> Result<PathBuf> {
    match std::env::var_os("ARBOR_GGUF_HYBRID_OUT") {
        Some(dir) => {
            std::fs::create_dir_all(&dir)?;
            Ok(PathBuf::from(dir).join(format!("{name}.gguf")))
        }
        None => Ok(tmp.join(format!("{name}.gguf"))),
    }
}

fn runner(m: &LoadedModel, backend: &Arc<dyn Backend>) -> Result<ModelRunner> {
    Ok(ModelRunner::with_state_slots(
        m.model.clone(),
        backend.clone(),
        None,
        KvGeometry {
            page_size: 16,
            num_pages: 256,
            kv_dtype: DType::F32,
            state_slots: 8,
        },
    )?)
}

/// The last-position logits of `prompt`, prefilled whole in state slot 0.
fn last_logits(runner: &ModelRunner, prompt: &[u32]) -> Result<Vec<f32>> {
    let pool = runner.new_page_pool();
    let pages = pool.alloc(pool.pages_for(prompt.len()))?;
    let out = runner.step(&[SeqStep {
        tokens: prompt,
        prefix_len: 0,
        pages: pages.pages(),
        want_logits: true,
        state_slot: Some(0),
    }])?;
    out.into_iter().next().context("no logits")
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}

fn check(name: &str, arch: &str) -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let path = out_path(tmp.path(), name)?;
    convert(name, arch, false)?.write(&path)?;
    let (m, backend) = load(&path).with_context(|| format!("loading {name} as GGUF"))?;
    assert_eq!(m.name, name, "the model's name is general.name");
    let state = m
        .model
        .spec()
        .state
        .context("a hybrid model declares its state")?;
    let reference = json(&fixture(name).join("reference.json"))?;
    let types = reference["layer_types"].as_array().context("layer_types")?;
    let recurrent = types.iter().filter(|t| *t == "linear_attention").count();
    assert_eq!(state.layers, recurrent, "{name}: recurrent layers");
    let (hf, hf_backend) = load(&fixture(name))?;
    let run = runner(&m, &backend)?;
    let hf_run = runner(&hf, &hf_backend)?;
    let prompts = reference["prompts"].as_array().context("prompts")?;
    let mut inputs = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let input = ids(&p["input_ids"]);
        let text = p["text"].as_str().context("text")?;
        assert_eq!(
            m.tokenizer.encode(text, false)?,
            input,
            "{name}: tokens of {text:?}"
        );
        let got = last_logits(&run, &input)?;
        let want: Vec<f32> = p["last_logits"]
            .as_array()
            .context("last_logits")?
            .iter()
            .filter_map(Value::as_f64)
            .map(|x| x as f32)
            .collect();
        let max = want.iter().fold(0f32, |a, b| a.max(b.abs()));
        let err = max_diff(&got, &want);
        let vs_hf = max_diff(&got, &last_logits(&hf_run, &input)?);
        println!(
            "{name} (GGUF {arch}) prompt {i} ({} tokens): max abs logit error {err:.2e} of {max:.2}, \
             {vs_hf:.2e} from the safetensors checkpoint",
            input.len()
        );
        assert!(err <= 1e-4 * max, "{name} prompt {i}: {err} > 1e-4 * {max}");
        assert!(
            vs_hf <= 1e-5 * max,
            "{name} prompt {i}: {vs_hf} from safetensors"
        );
        inputs.push(input);
    }
    let pool = run.new_page_pool();
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
    let (outs, _) = generate_static(&run, &pool, &inputs, &params, &setup, &mut |_, _| {})?;
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
fn qwen35_gguf_matches_transformers() -> Result<()> {
    check("tiny-qwen3.5", "qwen35")
}

#[test]
fn qwen35moe_gguf_matches_transformers() -> Result<()> {
    check("tiny-qwen3.5-moe", "qwen35moe")
}

#[test]
fn qwen3next_gguf_matches_transformers() -> Result<()> {
    check("tiny-qwen3-next", "qwen3next")
}

/// An older converter's Qwen3-Next file (the fused projection whole, as
/// `ssm_in`) gives the same logits as the current layout.
#[test]
fn qwen3next_legacy_ssm_in_loads_the_same() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let name = "tiny-qwen3-next";
    let mut logits = Vec::new();
    for legacy in [false, true] {
        let path = dir.path().join(format!("{legacy}.gguf"));
        let w = convert(name, "qwen3next", legacy)?;
        let file = GgufFile::from_bytes(w.to_bytes())?;
        assert_eq!(file.tensor("blk.0.ssm_in.weight").is_some(), legacy);
        assert_eq!(file.tensor("blk.0.attn_qkv.weight").is_some(), !legacy);
        w.write(&path)?;
        let (m, backend) = load(&path)?;
        let prompt = ids(&json(&fixture(name).join("reference.json"))?["prompts"][1]["input_ids"]);
        logits.push(last_logits(&runner(&m, &backend)?, &prompt)?);
    }
    assert_eq!(logits[0], logits[1]);
    Ok(())
}

/// A file with a multi-token-prediction block after the trunk (as convert
/// writes without `--no-mtp`: `nextn_predict_layers`, one more block, its
/// `nextn.*` tensors) loads the trunk and gives the same logits.
#[test]
fn nextn_blocks_are_skipped() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let name = "tiny-qwen3.5";
    let plain = convert(name, "qwen35", false)?;
    let file = GgufFile::from_bytes(plain.to_bytes())?;
    let mut mtp = plain.clone();
    mtp.add_u32("qwen35.block_count", 7)
        .add_u32("qwen35.nextn_predict_layers", 1)
        .add(
            "qwen35.attention.recurrent_layers",
            GgufValue::Array(GgufArray::Bool(vec![
                true, true, true, false, true, true, false,
            ])),
        );
    for (t, from) in [
        ("blk.6.attn_norm.weight", "blk.3.attn_norm.weight"),
        ("blk.6.attn_q.weight", "blk.3.attn_q.weight"),
        ("blk.6.nextn.enorm.weight", "output_norm.weight"),
        ("blk.6.nextn.hnorm.weight", "output_norm.weight"),
    ] {
        let info = file.tensor(from).context(from)?;
        mtp.add_tensor(t, info.dtype, &info.shape, file.data_of(info)?.to_vec())?;
    }
    let prompt = ids(&json(&fixture(name).join("reference.json"))?["prompts"][2]["input_ids"]);
    let mut logits = Vec::new();
    for (w, f) in [(&plain, "plain.gguf"), (&mtp, "mtp.gguf")] {
        let path = dir.path().join(f);
        w.write(&path)?;
        let (m, backend) = load(&path)?;
        assert_eq!(m.model.spec().num_layers, 6, "{f}: the trunk's layers");
        logits.push(last_logits(&runner(&m, &backend)?, &prompt)?);
    }
    assert_eq!(logits[0], logits[1]);
    Ok(())
}

/// `ssm_out` stored as f16 (head columns moved as elements) or Q8_0 (blocks
/// of 32 wider than a head of 16: dequantized, then reordered) loads as the
/// same values stored in f32 do.
#[test]
fn stored_ssm_out_types_load_their_values() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let name = "tiny-qwen3.5-moe";
    let file = GgufFile::from_bytes(convert(name, "qwen35moe", false)?.to_bytes())?;
    let prompt = ids(&json(&fixture(name).join("reference.json"))?["prompts"][1]["input_ids"]);
    for dtype in [DType::F16, DType::Q8_0] {
        // The same file with ssm_out stored in `dtype`, and in f32 holding
        // the values `dtype` keeps.
        let (mut stored, mut exact) = (GgufWriter::new(), GgufWriter::new());
        for (k, v) in file.metadata() {
            stored.add(k.clone(), v.clone());
            exact.add(k.clone(), v.clone());
        }
        for t in file.tensors() {
            let data = file.data_of(t)?.to_vec();
            if !t.name.ends_with("ssm_out.weight") {
                stored.add_tensor(t.name.clone(), t.dtype, &t.shape, data.clone())?;
                exact.add_tensor(t.name.clone(), t.dtype, &t.shape, data)?;
                continue;
            }
            let values = f32s(&data);
            let mut q = vec![0u8; arbor_quant::row_bytes(dtype, values.len())?];
            arbor_quant::quantize(dtype, &values, &mut q)?;
            let mut back = vec![0f32; values.len()];
            arbor_quant::dequantize(dtype, &q, &mut back)?;
            stored.add_tensor(t.name.clone(), dtype, &t.shape, q)?;
            exact.add_tensor(t.name.clone(), DType::F32, &t.shape, bytes(back))?;
        }
        let mut logits = Vec::new();
        for (w, f) in [(&stored, "stored.gguf"), (&exact, "exact.gguf")] {
            let path = dir.path().join(f);
            w.write(&path)?;
            let (m, backend) = load(&path)?;
            logits.push(last_logits(&runner(&m, &backend)?, &prompt)?);
        }
        let max = logits[1].iter().fold(0f32, |a, x| a.max(x.abs()));
        let diff = max_diff(&logits[0], &logits[1]);
        assert!(diff <= 1e-5 * max, "{dtype}: {diff} (max {max})");
    }
    Ok(())
}

/// `good` rebuilt without the tensor `skip`.
fn without_tensor(good: &GgufWriter, skip: &str) -> Result<GgufWriter> {
    let file = GgufFile::from_bytes(good.to_bytes())?;
    let mut w = GgufWriter::new();
    for (k, v) in file.metadata() {
        w.add(k.clone(), v.clone());
    }
    let mut found = false;
    for t in file.tensors() {
        if t.name == skip {
            found = true;
            continue;
        }
        w.add_tensor(t.name.clone(), t.dtype, &t.shape, file.data_of(t)?.to_vec())?;
    }
    anyhow::ensure!(found, "no tensor {skip}");
    Ok(w)
}

#[test]
fn bad_hybrid_gguf_files_are_named_errors() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let err = |w: &GgufWriter, file: &str| -> Result<String> {
        let path = dir.path().join(file);
        w.write(&path)?;
        match load(&path) {
            Ok(_) => anyhow::bail!("{file} loaded"),
            Err(e) => Ok(format!("{e:#}")),
        }
    };
    let good = convert("tiny-qwen3.5", "qwen35", false)?;
    // Recurrent-layer tensors, named as llama.cpp and as Hugging Face name them.
    for (gguf, hf) in [
        ("blk.0.ssm_a", "model.layers.0.linear_attn.A_log"),
        (
            "blk.1.ssm_conv1d.weight",
            "model.layers.1.linear_attn.conv1d.weight",
        ),
        (
            "blk.2.ssm_out.weight",
            "model.layers.2.linear_attn.out_proj.weight",
        ),
        (
            "blk.4.attn_qkv.weight",
            "model.layers.4.linear_attn.in_proj_qkv.weight",
        ),
    ] {
        let e = err(&without_tensor(&good, gguf)?, "missing.gguf")?;
        assert!(e.contains(gguf) && e.contains(hf), "{e}");
    }
    let next = convert("tiny-qwen3-next", "qwen3next", false)?;
    let e = err(&without_tensor(&next, "blk.0.ssm_ba.weight")?, "ba.gguf")?;
    assert!(e.contains("blk.0.ssm_ba.weight"), "{e}");
    // Metadata keys the config needs.
    for key in [
        "qwen35.ssm.group_count",
        "qwen35.ssm.inner_size",
        "qwen35.ssm.conv_kernel",
        "qwen35.block_count",
        "qwen35.attention.layer_norm_rms_epsilon",
    ] {
        let mut w = good.clone();
        w.remove(key);
        let e = err(&w, "key.gguf")?;
        assert!(e.contains(key) && e.contains("missing"), "{key}: {e}");
    }
    let mut w = next.clone();
    w.remove("qwen3next.expert_count");
    let e = err(&w, "experts.gguf")?;
    assert!(e.contains("qwen3next.expert_count"), "{e}");
    // A recurrent-layer pattern shorter than the model.
    let mut w = good.clone();
    w.add(
        "qwen35.attention.recurrent_layers",
        GgufValue::Array(GgufArray::Bool(vec![true, true, true])),
    );
    let e = err(&w, "pattern.gguf")?;
    assert!(
        e.contains("qwen35.attention.recurrent_layers") && e.contains("3 entries"),
        "{e}"
    );
    // Heads that do not divide: the key names it.
    let mut w = good.clone();
    w.add_u32("qwen35.ssm.time_step_rank", 3);
    let e = err(&w, "heads.gguf")?;
    assert!(e.contains("qwen35.ssm.time_step_rank"), "{e}");
    Ok(())
}
