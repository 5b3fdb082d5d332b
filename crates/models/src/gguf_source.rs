//! Models from GGUF files (llama.cpp's format): architecture and shape from
//! the `general.*` and `<arch>.*` metadata, tensors mapped to Hugging Face
//! names, and the tokenizer and chat template from `tokenizer.*`.
//!
//! llama.cpp's converter permutes the rows of Llama's Q and K projections for
//! its interleaved RoPE; [`GgufWeights`] undoes that permutation (rows are
//! whole blocks in every format, so quantized rows move as they are), so the
//! same decoder with Hugging Face's rotate-half RoPE runs both formats. A
//! `rope_freqs.weight` tensor (Llama 3 scaling) is exposed under that name.
//!
//! Mixture-of-experts files (`qwen3moe`, `qwen2moe`, and `llama` with an
//! `expert_count`: Mixtral) stack each layer's experts in one 3-D tensor
//! (`blk.N.ffn_{gate,up,down}_exps`, `[experts, out, in]`); expert `e` of a
//! Hugging Face name is the `e`-th outermost slice of it, borrowed as is
//! (slices are whole rows, so quantized blocks stay intact).
//!
//! The hybrid architectures (`qwen35`, `qwen35moe`, `qwen3next`: Gated
//! DeltaNet layers with gated attention) have their own config and tensor
//! view, [`hybrid`].

mod hybrid;

use crate::{ChatTemplate, LoadedModel, TextTokenizer};
use arbor_engine_core::{CoreError, HostTensor, LoadOptions, Registry, Result, WeightSource};
use arbor_gguf::GgufFile;
use serde_json::{Value, json};
use std::borrow::Cow;
use std::path::Path;
use std::sync::Arc;

/// True if the file starts with the GGUF magic.
pub fn is_gguf(path: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok()
        && &magic == b"GGUF"
}

/// The HF `architectures` name of a GGUF `general.architecture`.
fn hf_architecture(arch: &str) -> Option<&'static str> {
    Some(match arch {
        "llama" => "LlamaForCausalLM",
        "mistral" => "MistralForCausalLM",
        "qwen2" => "Qwen2ForCausalLM",
        "qwen3" => "Qwen3ForCausalLM",
        "qwen3moe" => "Qwen3MoeForCausalLM",
        "qwen2moe" => "Qwen2MoeForCausalLM",
        _ => return None,
    })
}

/// A GGUF tensor name, and which outermost slice of it (an expert) is meant.
type GgufRef = (String, Option<usize>);

/// The GGUF tensor of a Hugging Face MoE tensor name (the router, an
/// expert's projection, the shared expert), `None` for other names.
fn gguf_moe_name(hf: &str) -> Option<GgufRef> {
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, tail) = rest.split_once('.')?;
    let tail = tail
        .strip_prefix("mlp.")
        .or_else(|| tail.strip_prefix("block_sparse_moe."))?;
    let fixed = match tail {
        "gate.weight" => Some("ffn_gate_inp"),
        "shared_expert_gate.weight" => Some("ffn_gate_inp_shexp"),
        "shared_expert.gate_proj.weight" => Some("ffn_gate_shexp"),
        "shared_expert.up_proj.weight" => Some("ffn_up_shexp"),
        "shared_expert.down_proj.weight" => Some("ffn_down_shexp"),
        _ => None,
    };
    if let Some(g) = fixed {
        return Some((format!("blk.{layer}.{g}.weight"), None));
    }
    let (expert, proj) = tail.strip_prefix("experts.")?.split_once('.')?;
    let g = match proj {
        "gate_proj.weight" | "w1.weight" => "ffn_gate_exps",
        "up_proj.weight" | "w3.weight" => "ffn_up_exps",
        "down_proj.weight" | "w2.weight" => "ffn_down_exps",
        _ => return None,
    };
    Some((
        format!("blk.{layer}.{g}.weight"),
        Some(expert.parse().ok()?),
    ))
}

/// Tensors of a GGUF file under their Hugging Face names.
pub struct GgufWeights {
    file: GgufFile,
    /// Rows per head of Q and K when they must be un-permuted (llama, mistral).
    unpermute: Option<(usize, usize)>,
}

fn gguf_name(hf: &str) -> Option<String> {
    Some(match hf {
        "model.embed_tokens.weight" => "token_embd.weight".into(),
        "model.norm.weight" => "output_norm.weight".into(),
        "lm_head.weight" => "output.weight".into(),
        "rope_freqs.weight" => "rope_freqs.weight".into(),
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
                _ => return None,
            };
            format!("blk.{layer}.{g}.{kind}")
        }
    })
}

/// Reorders rows from llama.cpp's interleaved-RoPE order back to HF's.
fn unpermute_rows(data: &[u8], rows: usize, heads: usize) -> Result<Vec<u8>> {
    if heads == 0
        || !rows.is_multiple_of(heads)
        || !(rows / heads).is_multiple_of(2)
        || !data.len().is_multiple_of(rows)
    {
        return Err(CoreError::load(format!(
            "cannot un-permute {rows} rows for {heads} heads"
        )));
    }
    let rb = data.len() / rows;
    let hd = rows / heads;
    let mut out = Vec::with_capacity(data.len());
    for h in 0..heads {
        for a in 0..2 {
            for b in 0..hd / 2 {
                let src = h * hd + 2 * b + a;
                out.extend_from_slice(&data[src * rb..(src + 1) * rb]);
            }
        }
    }
    Ok(out)
}

impl WeightSource for GgufWeights {
    fn describe(&self) -> String {
        format!(
            "GGUF file {}",
            self.file
                .path()
                .map_or_else(|| "(memory)".into(), |p| p.display().to_string())
        )
    }

    fn tensor(&self, name: &str) -> Result<Option<HostTensor<'_>>> {
        let Some((g, expert)) = gguf_name(name)
            .map(|g| (g, None))
            .or_else(|| gguf_moe_name(name))
        else {
            return Ok(None);
        };
        let Some(info) = self.file.tensor(&g) else {
            return Ok(None);
        };
        let data = self.file.data_of(info)?;
        let mut t = HostTensor {
            dtype: info.dtype,
            shape: info.shape.clone(),
            data: Cow::Borrowed(data),
        };
        // llama.cpp keeps the shared expert's gate as a vector.
        if g.ends_with("ffn_gate_inp_shexp.weight") && t.shape.len() == 1 {
            t.shape = vec![1, t.shape[0]];
        }
        if let Some(e) = expert {
            let [n, out, inp] = info.shape[..] else {
                return Err(CoreError::load(format!(
                    "{}: tensor '{g}' has shape {:?}, expected [experts, out, in]",
                    self.describe(),
                    info.shape
                )));
            };
            if e >= n {
                return Ok(None);
            }
            let per = data.len() / n;
            t = HostTensor {
                dtype: info.dtype,
                shape: vec![out, inp],
                data: Cow::Borrowed(&data[e * per..(e + 1) * per]),
            };
        }
        if let Some((heads, kv_heads)) = self.unpermute {
            let h = if g.ends_with("attn_q.weight") {
                Some(heads)
            } else if g.ends_with("attn_k.weight") {
                Some(kv_heads)
            } else {
                None
            };
            if let (Some(h), Some(&rows)) = (h, t.shape.first()) {
                t.data = Cow::Owned(unpermute_rows(data, rows, h)?);
            }
        }
        Ok(Some(t))
    }
}

/// The `config.json` equivalent of a GGUF file's metadata.
fn synth_config(f: &GgufFile, arch: &str, hf: &str) -> Result<Value> {
    let key = |k: &str| format!("{arch}.{k}");
    let need = |k: &str| -> Result<u64> {
        f.get_u64(&key(k))?
            .ok_or_else(|| CoreError::load(format!("GGUF metadata key '{}' is missing", key(k))))
    };
    let hidden = need("embedding_length")?;
    let heads = need("attention.head_count")?;
    let kv_heads = match f.get_u64_or_array(&key("attention.head_count_kv"))? {
        Some(v) => {
            let first = v.first().copied().unwrap_or(heads);
            if v.iter().any(|&x| x != first) {
                return Err(CoreError::unsupported(format!(
                    "'{}' differs between layers",
                    key("attention.head_count_kv")
                )));
            }
            first
        }
        None => heads,
    };
    let embd = f
        .tensor("token_embd.weight")
        .ok_or_else(|| CoreError::load("GGUF tensor 'token_embd.weight' is missing"))?;
    let vocab = embd.shape.first().copied().unwrap_or(0);
    let head_dim = f
        .get_u64(&key("attention.key_length"))?
        .unwrap_or(hidden / heads.max(1));
    let mut cfg = json!({
        "architectures": [hf],
        "hidden_size": hidden,
        "intermediate_size": need("feed_forward_length")?,
        "num_hidden_layers": need("block_count")?,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "max_position_embeddings": f.get_u64(&key("context_length"))?.unwrap_or(4096),
        "rms_norm_eps": f.get_f32(&key("attention.layer_norm_rms_epsilon"))?.unwrap_or(1e-6),
        "rope_theta": f.get_f32(&key("rope.freq_base"))?.unwrap_or(10000.0),
        "tie_word_embeddings": f.tensor("output.weight").is_none(),
        "torch_dtype": embd.dtype.name(),
    });
    if let Some(dim) = f.get_u64(&key("rope.dimension_count"))?
        && dim != head_dim
    {
        cfg["partial_rotary_factor"] = json!(dim as f64 / head_dim as f64);
    }
    match f.get_str(&key("rope.scaling.type"))? {
        None | Some("none") => {}
        Some("linear") => {
            let factor = f.get_f32(&key("rope.scaling.factor"))?.unwrap_or(1.0);
            cfg["rope_scaling"] = json!({"rope_type": "linear", "factor": factor});
        }
        Some(other) => {
            return Err(CoreError::unsupported(format!(
                "GGUF rope scaling '{other}' ({})",
                key("rope.scaling.type")
            )));
        }
    }
    if let Some(w) = f.get_u64(&key("attention.sliding_window"))? {
        cfg["sliding_window"] = json!(w);
    }
    if let Some(experts) = f.get_u64(&key("expert_count"))?.filter(|&n| n > 0) {
        moe_config(f, arch, experts, &mut cfg)?;
    }
    Ok(cfg)
}

/// The MoE keys of the `config.json` equivalent: counts and widths from the
/// metadata (llama.cpp's `expert_*` keys), dense layers where a block has no
/// router, and llama.cpp's top-k weight normalization per architecture
/// unless `expert_weights_norm` says otherwise.
fn moe_config(f: &GgufFile, arch: &str, experts: u64, cfg: &mut Value) -> Result<()> {
    let key = |k: &str| format!("{arch}.{k}");
    let used = f.get_u64(&key("expert_used_count"))?.ok_or_else(|| {
        CoreError::load(format!(
            "GGUF metadata key '{}' is missing",
            key("expert_used_count")
        ))
    })?;
    cfg["num_experts"] = json!(experts);
    cfg["num_experts_per_tok"] = json!(used);
    if let Some(w) = f.get_u64(&key("expert_feed_forward_length"))? {
        cfg["moe_intermediate_size"] = json!(w);
    } else if let Some(t) = f.tensor("blk.0.ffn_gate_exps.weight") {
        cfg["moe_intermediate_size"] = json!(t.shape.get(1).copied().unwrap_or(0));
    }
    if let Some(w) = f.get_u64(&key("expert_shared_feed_forward_length"))? {
        cfg["shared_expert_intermediate_size"] = json!(w);
    }
    let norm = match f.get_bool(&key("expert_weights_norm"))? {
        Some(b) => b,
        None => arch != "qwen2moe",
    };
    cfg["norm_topk_prob"] = json!(norm);
    let layers = cfg["num_hidden_layers"].as_u64().unwrap_or(0);
    let dense: Vec<u64> = (0..layers)
        .filter(|i| f.tensor(&format!("blk.{i}.ffn_gate_inp.weight")).is_none())
        .collect();
    cfg["mlp_only_layers"] = json!(dense);
    if arch == "llama" {
        cfg["architectures"] = json!(["MixtralForCausalLM"]);
        cfg["num_local_experts"] = json!(experts);
    }
    Ok(())
}

/// Loads a model, tokenizer and chat template from one GGUF file.
pub fn load_gguf(
    path: &Path,
    registry: &Registry,
    opts: &LoadOptions,
    shard: Option<&arbor_engine_core::ShardSpec>,
) -> Result<LoadedModel> {
    let file = GgufFile::open(path)?;
    let arch = file.architecture()?.to_string();
    let in_file = |e: CoreError| CoreError::load(format!("{}: {e}", path.display()));
    let (config, hybrid) = match hybrid::HybridArch::from_gguf(&arch) {
        Some(h) => {
            let c = hybrid::config(&file, &arch, h).map_err(in_file)?;
            (c.config, Some((h, c.geometry)))
        }
        None => {
            let hf = hf_architecture(&arch).ok_or_else(|| {
                CoreError::load(format!(
                    "{}: GGUF architecture '{arch}' is not supported (supported: llama, mistral, \
                     qwen2, qwen3, qwen3moe, qwen2moe, qwen35, qwen35moe, qwen3next)",
                    path.display()
                ))
            })?;
            (synth_config(&file, &arch, hf).map_err(in_file)?, None)
        }
    };
    let gt = arbor_gguf::load_tokenizer(&file)?;
    for w in &gt.warnings {
        tracing::warn!("{}: {w}", path.display());
    }
    let chat_template = gt
        .chat_template
        .as_deref()
        .map(ChatTemplate::new)
        .transpose()?
        .map(Arc::new);
    let tokenizer = TextTokenizer::new(gt.tokenizer, gt.bos_token_id, gt.eos_token_ids);
    let unpermute = if matches!(arch.as_str(), "llama" | "mistral") {
        let heads = config["num_attention_heads"].as_u64().unwrap_or(1) as usize;
        let kv = config["num_key_value_heads"].as_u64().unwrap_or(1) as usize;
        Some((heads, kv))
    } else {
        None
    };
    let name = match file.get_str("general.name") {
        Ok(Some(n)) if !n.trim().is_empty() => n.trim().to_string(),
        _ => crate::path_name(path),
    };
    let weights = GgufWeights { file, unpermute };
    let hybrid_weights = hybrid.map(|(h, g)| hybrid::HybridWeights::new(&weights, h, g));
    let src: &dyn WeightSource = match &hybrid_weights {
        Some(w) => w,
        None => &weights,
    };
    let hf = match hybrid {
        Some((h, _)) => h.loader(),
        None => config["architectures"][0].as_str().unwrap_or_default(),
    };
    let factory = registry.architectures.get(hf)?;
    let model = crate::build(&*factory(), &config, src, opts, shard)?;
    Ok(LoadedModel {
        model: Arc::from(model),
        tokenizer: Arc::new(tokenizer),
        chat_template,
        path: path.to_path_buf(),
        name,
        config,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map() {
        assert_eq!(
            gguf_name("model.layers.3.self_attn.q_proj.weight").as_deref(),
            Some("blk.3.attn_q.weight")
        );
        assert_eq!(
            gguf_name("model.layers.0.mlp.down_proj.weight").as_deref(),
            Some("blk.0.ffn_down.weight")
        );
        assert_eq!(
            gguf_name("model.layers.1.self_attn.k_proj.bias").as_deref(),
            Some("blk.1.attn_k.bias")
        );
        assert_eq!(
            gguf_name("model.embed_tokens.weight").as_deref(),
            Some("token_embd.weight")
        );
        assert_eq!(gguf_name("nonsense"), None);
        assert_eq!(
            gguf_moe_name("model.layers.2.mlp.experts.5.up_proj.weight"),
            Some(("blk.2.ffn_up_exps.weight".into(), Some(5)))
        );
        assert_eq!(
            gguf_moe_name("model.layers.0.block_sparse_moe.experts.1.w2.weight"),
            Some(("blk.0.ffn_down_exps.weight".into(), Some(1)))
        );
        assert_eq!(
            gguf_moe_name("model.layers.1.mlp.shared_expert_gate.weight"),
            Some(("blk.1.ffn_gate_inp_shexp.weight".into(), None))
        );
    }

    #[test]
    fn unpermute_inverts_llama_cpp_permutation() {
        // Two heads of head_dim 4, one byte per row: HF rows 0..8.
        let hf: Vec<u8> = (0..8).collect();
        // llama.cpp: reshape(heads, 2, hd/2).swapaxes(1, 2): row (h, 2b + a) = HF (h, a*hd/2 + b).
        let mut gg = vec![0u8; 8];
        for h in 0..2 {
            for a in 0..2 {
                for b in 0..2 {
                    gg[h * 4 + 2 * b + a] = hf[h * 4 + a * 2 + b];
                }
            }
        }
        assert_eq!(unpermute_rows(&gg, 8, 2).unwrap(), hf);
        assert!(unpermute_rows(&gg, 8, 3).is_err());
    }
}
