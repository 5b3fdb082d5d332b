//! What the GGUF tests share: the fixtures, llama.cpp's names for Hugging
//! Face tensors (its `tensor_mapping.py`), the tokenizer as llama.cpp's
//! arrays, and loading a file on the CPU backend.

#![allow(dead_code)] // each test binary uses its own part

use anyhow::{Context, Result};
use arbor_backend_cpu::CpuBackend;
use arbor_engine_core::{Backend, LoadOptions, Registry};
use arbor_models::{LoadedModel, load_model};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

pub fn json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).with_context(|| path.display().to_string())?;
    Ok(serde_json::from_str(&text)?)
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(Value::as_u64)
                .map(|x| x as u32)
                .collect()
        })
        .unwrap_or_default()
}

/// llama.cpp's tensor name for a Hugging Face one (its `tensor_mapping.py`).
pub fn llama_cpp_name(hf: &str) -> Option<String> {
    Some(match hf {
        "model.embed_tokens.weight" => "token_embd.weight".into(),
        "model.norm.weight" => "output_norm.weight".into(),
        "lm_head.weight" => "output.weight".into(),
        _ => {
            let rest = hf.strip_prefix("model.layers.")?;
            let (layer, tail) = rest.split_once('.')?;
            let (module, kind) = tail.rsplit_once('.')?;
            let g = match module {
                "input_layernorm" => "attn_norm",
                "post_attention_layernorm" => "ffn_norm",
                "self_attn.q_proj" => "attn_q",
                "self_attn.k_proj" => "attn_k",
                "self_attn.v_proj" => "attn_v",
                "self_attn.o_proj" => "attn_output",
                "self_attn.q_norm" => "attn_q_norm",
                "self_attn.k_norm" => "attn_k_norm",
                "mlp.gate_proj" => "ffn_gate",
                "mlp.up_proj" => "ffn_up",
                "mlp.down_proj" => "ffn_down",
                "mlp.gate" | "block_sparse_moe.gate" => "ffn_gate_inp",
                "mlp.shared_expert_gate" => "ffn_gate_inp_shexp",
                "mlp.shared_expert.gate_proj" => "ffn_gate_shexp",
                "mlp.shared_expert.up_proj" => "ffn_up_shexp",
                "mlp.shared_expert.down_proj" => "ffn_down_shexp",
                _ => return None,
            };
            format!("blk.{layer}.{g}.{kind}")
        }
    })
}

/// For a routed expert's tensor: the stacked llama.cpp tensor it belongs to
/// and the expert's index.
pub fn llama_cpp_expert(hf: &str) -> Option<(String, usize)> {
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, tail) = rest.split_once('.')?;
    let tail = tail
        .strip_prefix("mlp.experts.")
        .or_else(|| tail.strip_prefix("block_sparse_moe.experts."))?;
    let (e, proj) = tail.split_once('.')?;
    let g = match proj {
        "gate_proj.weight" | "w1.weight" => "ffn_gate_exps",
        "up_proj.weight" | "w3.weight" => "ffn_up_exps",
        "down_proj.weight" | "w2.weight" => "ffn_down_exps",
        _ => return None,
    };
    Some((format!("blk.{layer}.{g}.weight"), e.parse().ok()?))
}

/// One routed expert's tensor: its index, shape and f32 bytes.
pub type Expert = (usize, Vec<usize>, Vec<u8>);

/// The tokenizer of the fixture at `dir` as llama.cpp's arrays: the
/// vocabulary in id order, the token types (1 normal, 3 control, 4 user
/// defined) and the merges.
pub fn tokenizer_arrays(dir: &Path) -> Result<(Vec<String>, Vec<i32>, Vec<String>)> {
    let tj = json(&dir.join("tokenizer.json"))?;
    let vocab = tj["model"]["vocab"].as_object().context("vocab")?;
    let added = tj["added_tokens"].as_array().context("added_tokens")?;
    let n = vocab
        .values()
        .chain(added.iter().map(|a| &a["id"]))
        .filter_map(Value::as_u64)
        .max()
        .context("empty vocabulary")? as usize
        + 1;
    let mut tokens = vec![String::new(); n];
    let mut types = vec![1i32; n];
    for (t, id) in vocab {
        tokens[id.as_u64().context("id")? as usize] = t.clone();
    }
    for a in added {
        let id = a["id"].as_u64().context("id")? as usize;
        tokens[id] = a["content"].as_str().context("content")?.to_string();
        types[id] = if a["special"].as_bool() == Some(true) {
            3
        } else {
            4
        };
    }
    let merges: Vec<String> = tj["model"]["merges"]
        .as_array()
        .context("merges")?
        .iter()
        .map(|m| match m {
            Value::String(s) => s.clone(),
            Value::Array(p) => p
                .iter()
                .filter_map(Value::as_str)
                .collect::<Vec<_>>()
                .join(" "),
            _ => String::new(),
        })
        .collect();
    Ok((tokens, types, merges))
}

pub fn load(path: &Path) -> Result<(LoadedModel, Arc<dyn Backend>)> {
    let registry = Registry::builtin()?;
    let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new(2)?);
    let opts = LoadOptions {
        backend: backend.clone(),
        quant: registry.quant_methods.get("auto")?(&Default::default())?,
        progress: None,
    };
    Ok((load_model(path, &registry, &opts)?, backend))
}
