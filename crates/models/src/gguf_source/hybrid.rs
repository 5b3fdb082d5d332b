//! GGUF files of llama.cpp's hybrid architectures `qwen35`, `qwen35moe` and
//! `qwen3next` (Gated DeltaNet layers interleaved with gated attention), as
//! `convert_hf_to_gguf.py` writes them (conventions of llama.cpp 0c1e57098,
//! vendored by llama-cpp-python 0.3.36, gguf-py 0.19.0): the config from the
//! `{arch}.ssm.*` keys, `{arch}.attention.recurrent_layers` (or
//! `full_attention_interval`) and the usual ones, and the tensors presented
//! under Qwen3.5's Hugging Face text names with every converter transform
//! undone, so [`crate::hybrid`] loads exactly what it loads from safetensors:
//!
//! - the zero-centred RMSNorm weights (`attn_norm`, `post_attention_norm`,
//!   `attn_q_norm`, `attn_k_norm`, `output_norm`) are stored as `1 + w`:
//!   `w = x - 1` (the gated `ssm_norm` is stored as is);
//! - `ssm_a` is `-exp(A_log)`: `A_log = ln(-a)`;
//! - `ssm_dt.bias` is `dt_bias`; `ssm_conv1d` is the convolution squeezed to
//!   `[channels, kernel]`: `[channels, 1, kernel]` again;
//! - `qwen35` / `qwen35moe` reorder the value heads from grouped by key head
//!   (`k0v0 k0v1 k1v0 k1v1`) to tiled (`k0v0 k1v0 k0v1 k1v1`) in
//!   `attn_qkv`'s value rows, `attn_gate`, `ssm_beta`, `ssm_alpha`, `ssm_a`,
//!   `ssm_dt`, `ssm_conv1d`'s value channels and `ssm_out`'s columns: put
//!   back by moving whole rows (or whole column blocks; a block-quantized
//!   `ssm_out` whose head width is not a multiple of its block is
//!   dequantized to f32);
//! - `qwen3next` splits Qwen3-Next's fused `in_proj_qkvz` into `attn_qkv`
//!   (all heads' queries, then keys, then values) and `attn_gate`, which are
//!   Qwen3.5's `in_proj_qkv` and `in_proj_z`, and keeps `in_proj_ba` as
//!   `ssm_ba` (per key head its betas then its alphas), whose rows give
//!   `in_proj_b` and `in_proj_a`; so a `qwen3next` file loads through the
//!   Qwen3.5 MoE reader, as the safetensors checkpoint does through
//!   [`crate::hybrid`]'s fused-projection view. An older file's `ssm_in`
//!   (the fused `in_proj_qkvz` as is) is split by rows the same way.
//!
//! Multi-token-prediction blocks (`{arch}.nextn_predict_layers`, stored after
//! the trunk's) are never read. A tensor this view needs that the file lacks
//! is an error naming both the GGUF and the Hugging Face name.

use super::GgufWeights;
use arbor_engine_core::{CoreError, HostTensor, Result, WeightSource};
use arbor_gguf::{GgufArray, GgufFile, GgufValue};
use serde_json::{Value, json};
use std::borrow::Cow;

/// One of llama.cpp's hybrid architectures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum HybridArch {
    /// `qwen35`: Qwen3.5 dense.
    Qwen35,
    /// `qwen35moe`: Qwen3.5 mixture of experts.
    Qwen35Moe,
    /// `qwen3next`: Qwen3-Next.
    Qwen3Next,
}

impl HybridArch {
    /// The architecture of a GGUF `general.architecture`, if it is hybrid.
    pub(super) fn from_gguf(arch: &str) -> Option<Self> {
        Some(match arch {
            "qwen35" => Self::Qwen35,
            "qwen35moe" => Self::Qwen35Moe,
            "qwen3next" => Self::Qwen3Next,
            _ => return None,
        })
    }

    /// The Hugging Face `architectures` name the config carries.
    fn hf_name(self) -> &'static str {
        match self {
            Self::Qwen35 => "Qwen3_5ForCausalLM",
            Self::Qwen35Moe => "Qwen3_5MoeForCausalLM",
            Self::Qwen3Next => "Qwen3NextForCausalLM",
        }
    }

    /// The registered architecture that reads the tensors as [`HybridWeights`]
    /// presents them (Qwen3.5's split projections).
    pub(super) fn loader(self) -> &'static str {
        match self {
            Self::Qwen35 => "Qwen3_5ForCausalLM",
            Self::Qwen35Moe | Self::Qwen3Next => "Qwen3_5MoeForCausalLM",
        }
    }

    fn sparse(self) -> bool {
        self != Self::Qwen35
    }

    /// Whether the converter tiled the value heads (`_LinearAttentionVReorderBase`).
    fn tiled_values(self) -> bool {
        self != Self::Qwen3Next
    }
}

/// The recurrent layers' head geometry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Geometry {
    k_heads: usize,
    k_dim: usize,
    v_heads: usize,
    v_dim: usize,
}

impl Geometry {
    /// Value heads per key head.
    fn group(&self) -> usize {
        self.v_heads / self.k_heads
    }
    fn key_rows(&self) -> usize {
        self.k_heads * self.k_dim
    }
    fn value_rows(&self) -> usize {
        self.v_heads * self.v_dim
    }
    fn conv_channels(&self) -> usize {
        2 * self.key_rows() + self.value_rows()
    }
}

/// A hybrid GGUF file's `config.json` equivalent and the geometry its
/// tensors are laid out by.
pub(super) struct HybridConfig {
    pub(super) config: Value,
    pub(super) geometry: Geometry,
}

fn missing_key(key: &str) -> CoreError {
    CoreError::load(format!("GGUF metadata key '{key}' is missing"))
}

/// The config of a hybrid GGUF file (`arch` is `general.architecture`).
pub(super) fn config(f: &GgufFile, arch: &str, h: HybridArch) -> Result<HybridConfig> {
    let key = |k: &str| format!("{arch}.{k}");
    let need = |k: &str| -> Result<usize> {
        let v = f.get_u64(&key(k))?.ok_or_else(|| missing_key(&key(k)))?;
        usize::try_from(v).map_err(|_| CoreError::load(format!("'{}' = {v} is too large", key(k))))
    };
    let opt = |k: &str| -> Result<Option<usize>> {
        f.get_u64(&key(k))?
            .map(|v| {
                usize::try_from(v)
                    .map_err(|_| CoreError::load(format!("'{}' = {v} is too large", key(k))))
            })
            .transpose()
    };
    let bad = |k: &str, what: String| CoreError::load(format!("GGUF metadata '{}' {what}", key(k)));

    let blocks = need("block_count")?;
    let nextn = opt("nextn_predict_layers")?.unwrap_or(0);
    if nextn >= blocks {
        return Err(bad(
            "nextn_predict_layers",
            format!("({nextn}) leaves no trunk layers of block_count {blocks}"),
        ));
    }
    let layers = blocks - nextn;
    let hidden = need("embedding_length")?;
    let heads = need("attention.head_count")?;
    if heads == 0 {
        return Err(bad("attention.head_count", "is 0".into()));
    }
    let kv_heads = match f.get_u64_or_array(&key("attention.head_count_kv"))? {
        None => heads as u64,
        Some(v) => {
            // Per-layer arrays hold 0 for the recurrent layers.
            let mut set: Vec<u64> = v.into_iter().filter(|&x| x > 0).collect();
            set.dedup();
            match set.as_slice() {
                [one] => *one,
                _ => {
                    return Err(bad(
                        "attention.head_count_kv",
                        "must give one head count for every attention layer".into(),
                    ));
                }
            }
        }
    };
    let head_dim = opt("attention.key_length")?.unwrap_or(hidden / heads);
    let rope_dim = opt("rope.dimension_count")?.unwrap_or(head_dim);
    if rope_dim == 0 || rope_dim > head_dim || !rope_dim.is_multiple_of(2) {
        return Err(bad(
            "rope.dimension_count",
            format!("({rope_dim}) must be even and at most the head dimension {head_dim}"),
        ));
    }
    let eps = f
        .get_f32(&key("attention.layer_norm_rms_epsilon"))?
        .ok_or_else(|| missing_key(&key("attention.layer_norm_rms_epsilon")))?;

    let k_heads = need("ssm.group_count")?;
    let v_heads = need("ssm.time_step_rank")?;
    let k_dim = need("ssm.state_size")?;
    let inner = need("ssm.inner_size")?;
    let conv_kernel = need("ssm.conv_kernel")?;
    if k_heads == 0 || v_heads == 0 || !v_heads.is_multiple_of(k_heads) {
        return Err(bad(
            "ssm.time_step_rank",
            format!("({v_heads}) must be a positive multiple of ssm.group_count ({k_heads})"),
        ));
    }
    if inner == 0 || !inner.is_multiple_of(v_heads) {
        return Err(bad(
            "ssm.inner_size",
            format!("({inner}) must be a positive multiple of ssm.time_step_rank ({v_heads})"),
        ));
    }
    let geometry = Geometry {
        k_heads,
        k_dim,
        v_heads,
        v_dim: inner / v_heads,
    };
    let layer_types = layer_types(f, &key, layers)?;

    let embd = f
        .tensor("token_embd.weight")
        .ok_or_else(|| CoreError::load("GGUF tensor 'token_embd.weight' is missing"))?;
    let mut cfg = json!({
        "architectures": [h.hf_name()],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": embd.shape.first().copied().unwrap_or(0),
        "max_position_embeddings": opt("context_length")?.unwrap_or(4096),
        "rms_norm_eps": eps,
        "rope_theta": f.get_f32(&key("rope.freq_base"))?.unwrap_or(10000.0),
        // Qwen3.5's interleaved M-RoPE (`rope.dimension_sections`) is plain
        // RoPE for text, every axis having the token's position.
        "partial_rotary_factor": rope_dim as f64 / head_dim as f64,
        "tie_word_embeddings": f.tensor("output.weight").is_none(),
        "torch_dtype": embd.dtype.name(),
        "layer_types": layer_types,
        "linear_conv_kernel_dim": conv_kernel,
        "linear_num_key_heads": k_heads,
        "linear_num_value_heads": v_heads,
        "linear_key_head_dim": k_dim,
        "linear_value_head_dim": geometry.v_dim,
    });
    match (opt("feed_forward_length")?, h.sparse()) {
        (Some(n), _) => cfg["intermediate_size"] = json!(n),
        (None, false) => return Err(missing_key(&key("feed_forward_length"))),
        // The MoE readers fall back to the experts' width.
        (None, true) => {}
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
    if h.sparse() {
        let experts = f
            .get_u64(&key("expert_count"))?
            .filter(|&n| n > 0)
            .ok_or_else(|| missing_key(&key("expert_count")))?;
        super::moe_config(f, arch, experts, &mut cfg)?;
        // llama.cpp's qwen35moe and qwen3next graphs always renormalize the
        // top-k weights (as transformers' Qwen3.5-MoE does).
        cfg["norm_topk_prob"] = json!(true);
        if cfg.get("shared_expert_intermediate_size").is_none()
            && let Some(t) = f.tensor("blk.0.ffn_up_shexp.weight")
        {
            cfg["shared_expert_intermediate_size"] = json!(t.shape.first().copied().unwrap_or(0));
        }
    }
    Ok(HybridConfig {
        config: cfg,
        geometry,
    })
}

/// `layer_types` of the first `layers` blocks: `{arch}.attention.recurrent_layers`
/// (one flag per block, MTP blocks included), or llama.cpp's default of
/// every `full_attention_interval`-th layer (4 when absent) attention.
fn layer_types(
    f: &GgufFile,
    key: &dyn Fn(&str) -> String,
    layers: usize,
) -> Result<Vec<&'static str>> {
    let name = |recurrent: bool| {
        if recurrent {
            "linear_attention"
        } else {
            "full_attention"
        }
    };
    let k = key("attention.recurrent_layers");
    let flags: Option<Vec<bool>> = match f.get(&k) {
        None => None,
        Some(GgufValue::Array(GgufArray::Bool(v))) => Some(v.clone()),
        Some(_) => Some(
            f.get_u64_array(&k)?
                .unwrap_or_default()
                .into_iter()
                .map(|x| x != 0)
                .collect(),
        ),
    };
    match flags {
        Some(v) if v.len() < layers => Err(CoreError::load(format!(
            "GGUF metadata '{k}' has {} entries for {layers} layers",
            v.len()
        ))),
        Some(v) => Ok(v[..layers].iter().map(|&r| name(r)).collect()),
        None => {
            let every = f
                .get_u64(&key("full_attention_interval"))?
                .unwrap_or(4)
                .max(1) as usize;
            Ok((0..layers).map(|i| name((i + 1) % every != 0)).collect())
        }
    }
}

/// The GGUF tensors of a hybrid file under Qwen3.5's Hugging Face names.
pub(super) struct HybridWeights<'a> {
    inner: &'a GgufWeights,
    arch: HybridArch,
    g: Geometry,
}

/// Which tensor of a recurrent layer a name asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ssm {
    Qkv,
    Z,
    B,
    A,
    ALog,
    DtBias,
    Conv,
    Norm,
    Out,
}

/// A Hugging Face name this view transforms.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Mapped {
    /// A (1 + w) norm: the GGUF tensor's name.
    OffsetNorm(String),
    /// A recurrent layer's tensor: its layer and part.
    Ssm(usize, Ssm),
}

fn mapped(hf: &str) -> Option<Mapped> {
    if hf == "model.norm.weight" {
        return Some(Mapped::OffsetNorm("output_norm.weight".into()));
    }
    let (layer, tail) = hf.strip_prefix("model.layers.")?.split_once('.')?;
    let i: usize = layer.parse().ok()?;
    let norm = match tail {
        "input_layernorm.weight" => Some("attn_norm"),
        "post_attention_layernorm.weight" => Some("post_attention_norm"),
        "self_attn.q_norm.weight" => Some("attn_q_norm"),
        "self_attn.k_norm.weight" => Some("attn_k_norm"),
        _ => None,
    };
    if let Some(n) = norm {
        return Some(Mapped::OffsetNorm(format!("blk.{i}.{n}.weight")));
    }
    let part = match tail.strip_prefix("linear_attn.")? {
        "in_proj_qkv.weight" => Ssm::Qkv,
        "in_proj_z.weight" => Ssm::Z,
        "in_proj_b.weight" => Ssm::B,
        "in_proj_a.weight" => Ssm::A,
        "A_log" => Ssm::ALog,
        "dt_bias" => Ssm::DtBias,
        "conv1d.weight" => Ssm::Conv,
        "norm.weight" => Ssm::Norm,
        "out_proj.weight" => Ssm::Out,
        _ => return None,
    };
    Some(Mapped::Ssm(i, part))
}

/// For each position in Hugging Face's grouped order of `k_heads * group`
/// heads of `d` entries, its position in llama.cpp's tiled order.
fn untile(k_heads: usize, group: usize, d: usize) -> Vec<usize> {
    let mut src = Vec::with_capacity(k_heads * group * d);
    for k in 0..k_heads {
        for j in 0..group {
            src.extend((0..d).map(|x| (j * k_heads + k) * d + x));
        }
    }
    src
}

impl<'a> HybridWeights<'a> {
    pub(super) fn new(inner: &'a GgufWeights, arch: HybridArch, g: Geometry) -> Self {
        Self { inner, arch, g }
    }

    /// Value-head order to undo for `d` entries per head (`None`: none).
    fn untiled(&self, d: usize) -> Option<Vec<usize>> {
        (self.arch.tiled_values() && self.g.group() > 1)
            .then(|| untile(self.g.k_heads, self.g.group(), d))
    }

    fn lookup(&self, gguf: &str) -> Result<Option<HostTensor<'a>>> {
        let file = &self.inner.file;
        let Some(info) = file.tensor(gguf) else {
            return Ok(None);
        };
        let t = HostTensor {
            dtype: info.dtype,
            shape: info.shape.clone(),
            data: Cow::Borrowed(file.data_of(info)?),
        };
        t.validate(gguf)?;
        Ok(Some(t))
    }

    fn required(&self, gguf: &str, hf: &str) -> Result<HostTensor<'a>> {
        self.lookup(gguf)?.ok_or_else(|| {
            CoreError::load(format!(
                "{}: GGUF tensor '{gguf}' (Hugging Face '{hf}') is missing",
                self.describe()
            ))
        })
    }

    fn wrong_shape(&self, gguf: &str, t: &HostTensor<'_>, expected: &str) -> CoreError {
        CoreError::load(format!(
            "{}: GGUF tensor '{gguf}' has shape {:?}, expected {expected} (from the ssm.* metadata)",
            self.describe(),
            t.shape
        ))
    }

    /// The rows `rows` of a tensor of `n` rows.
    fn rows(
        &self,
        gguf: &str,
        t: HostTensor<'a>,
        n: usize,
        rows: Option<&[usize]>,
    ) -> Result<HostTensor<'a>> {
        if t.shape.first() != Some(&n) {
            return Err(self.wrong_shape(gguf, &t, &format!("{n} rows")));
        }
        let Some(rows) = rows else {
            return Ok(t);
        };
        let rb = t.data.len() / n;
        let mut data = Vec::with_capacity(rows.len() * rb);
        for &r in rows {
            data.extend_from_slice(&t.data[r * rb..(r + 1) * rb]);
        }
        let mut shape = t.shape;
        shape[0] = rows.len();
        Ok(HostTensor {
            dtype: t.dtype,
            shape,
            data: Cow::Owned(data),
        })
    }

    /// f32 values of a float vector of `n` entries.
    fn floats(&self, gguf: &str, t: &HostTensor<'_>, n: usize) -> Result<Vec<f32>> {
        if t.shape.as_slice() != [n] {
            return Err(self.wrong_shape(gguf, t, &format!("[{n}]")));
        }
        t.to_f32_vec()
            .map_err(|e| CoreError::load(format!("{}: GGUF tensor '{gguf}': {e}", self.describe())))
    }

    /// A (1 + w) norm stored as `1 + w`, as `w` (f32).
    fn offset_norm(&self, gguf: &str, hf: &str) -> Result<HostTensor<'a>> {
        let t = self.required(gguf, hf)?;
        let n = t.numel();
        let v: Vec<f32> = self.floats(gguf, &t, n)?.iter().map(|x| x - 1.0).collect();
        Ok(HostTensor::from_f32(&t.shape, &v))
    }

    /// `ssm_out` with its columns (`v_heads` blocks of `v_dim`) in Hugging
    /// Face's head order.
    fn out_columns(&self, gguf: &str, t: HostTensor<'a>) -> Result<HostTensor<'a>> {
        let g = self.g;
        let width = g.value_rows();
        let [rows, cols] = t.shape[..] else {
            return Err(self.wrong_shape(gguf, &t, &format!("[hidden, {width}]")));
        };
        if cols != width {
            return Err(self.wrong_shape(gguf, &t, &format!("[hidden, {width}]")));
        }
        let Some(order) = self.untiled(1) else {
            return Ok(t);
        };
        let err = |e: &dyn std::fmt::Display| {
            CoreError::load(format!("{}: GGUF tensor '{gguf}': {e}", self.describe()))
        };
        if g.v_dim.is_multiple_of(t.dtype.block_size()) {
            // Whole blocks (or elements) move.
            let seg = t.dtype.bytes_for(g.v_dim).map_err(|e| err(&e))?;
            let rb = t.data.len() / rows;
            let mut data = Vec::with_capacity(t.data.len());
            for row in t.data.chunks_exact(rb) {
                for &h in &order {
                    data.extend_from_slice(&row[h * seg..(h + 1) * seg]);
                }
            }
            return Ok(HostTensor {
                dtype: t.dtype,
                shape: t.shape,
                data: Cow::Owned(data),
            });
        }
        let mut values = vec![0f32; rows * cols];
        arbor_quant::dequantize(t.dtype, &t.data, &mut values).map_err(|e| err(&e))?;
        let mut out = Vec::with_capacity(values.len());
        for row in values.chunks_exact(cols) {
            for &h in &order {
                out.extend_from_slice(&row[h * g.v_dim..(h + 1) * g.v_dim]);
            }
        }
        Ok(HostTensor::from_f32(&[rows, cols], &out))
    }

    /// Qwen3-Next's input projections: `attn_qkv` / `attn_gate`, or the
    /// rows of an older file's fused `ssm_in`.
    fn next_projection(&self, i: usize, part: Ssm, hf: &str) -> Result<HostTensor<'a>> {
        let g = self.g;
        let (split, n) = match part {
            Ssm::Qkv => (format!("blk.{i}.attn_qkv.weight"), g.conv_channels()),
            _ => (format!("blk.{i}.attn_gate.weight"), g.value_rows()),
        };
        if let Some(t) = self.lookup(&split)? {
            return self.rows(&split, t, n, None);
        }
        let fused = format!("blk.{i}.ssm_in.weight");
        let Some(t) = self.lookup(&fused)? else {
            return Err(CoreError::load(format!(
                "{}: GGUF tensor '{split}' (or an older file's '{fused}'; Hugging Face '{hf}') is missing",
                self.describe()
            )));
        };
        // Per key head: queries, keys, values, then z.
        let (dk, vg) = (g.k_dim, g.group() * g.v_dim);
        let per = 2 * dk + 2 * vg;
        let head = |h: usize, off: usize, len: usize| h * per + off..h * per + off + len;
        let rows: Vec<usize> = match part {
            Ssm::Qkv => (0..g.k_heads)
                .flat_map(|h| head(h, 0, dk))
                .chain((0..g.k_heads).flat_map(|h| head(h, dk, dk)))
                .chain((0..g.k_heads).flat_map(|h| head(h, 2 * dk, vg)))
                .collect(),
            _ => (0..g.k_heads)
                .flat_map(|h| head(h, 2 * dk + vg, vg))
                .collect(),
        };
        self.rows(&fused, t, g.k_heads * per, Some(&rows))
    }

    fn ssm(&self, i: usize, part: Ssm, hf: &str) -> Result<HostTensor<'a>> {
        let g = self.g;
        let next = self.arch == HybridArch::Qwen3Next;
        let name = |s: &str| format!("blk.{i}.{s}");
        match part {
            Ssm::Qkv | Ssm::Z if next => self.next_projection(i, part, hf),
            Ssm::Qkv => {
                let n = name("attn_qkv.weight");
                let t = self.required(&n, hf)?;
                let keys = 2 * g.key_rows();
                let rows = self.untiled(g.v_dim).map(|v| {
                    (0..keys)
                        .chain(v.into_iter().map(|r| keys + r))
                        .collect::<Vec<_>>()
                });
                self.rows(&n, t, g.conv_channels(), rows.as_deref())
            }
            Ssm::Z => {
                let n = name("attn_gate.weight");
                let t = self.required(&n, hf)?;
                self.rows(&n, t, g.value_rows(), self.untiled(g.v_dim).as_deref())
            }
            Ssm::B | Ssm::A if next => {
                let n = name("ssm_ba.weight");
                let t = self.required(&n, hf)?;
                // Per key head: its `group` betas, then its `group` alphas.
                let gr = g.group();
                let off = if part == Ssm::B { 0 } else { gr };
                let rows: Vec<usize> = (0..g.k_heads)
                    .flat_map(|h| h * 2 * gr + off..h * 2 * gr + off + gr)
                    .collect();
                self.rows(&n, t, 2 * g.v_heads, Some(&rows))
            }
            Ssm::B | Ssm::A => {
                let n = name(if part == Ssm::B {
                    "ssm_beta.weight"
                } else {
                    "ssm_alpha.weight"
                });
                let t = self.required(&n, hf)?;
                self.rows(&n, t, g.v_heads, self.untiled(1).as_deref())
            }
            Ssm::ALog | Ssm::DtBias => {
                let n = name(if part == Ssm::ALog {
                    "ssm_a"
                } else {
                    "ssm_dt.bias"
                });
                let t = self.required(&n, hf)?;
                let v = self.floats(&n, &t, g.v_heads)?;
                let mut v = match self.untiled(1) {
                    Some(order) => order.iter().map(|&h| v[h]).collect(),
                    None => v,
                };
                if part == Ssm::ALog {
                    // ssm_a = -exp(A_log).
                    for (h, a) in v.iter_mut().enumerate() {
                        if !(*a < 0.0 && a.is_finite()) {
                            return Err(CoreError::load(format!(
                                "{}: GGUF tensor '{n}' holds {a} for head {h}; \
                                 -exp(A_log) must be negative and finite",
                                self.describe()
                            )));
                        }
                        *a = (-*a).ln();
                    }
                }
                Ok(HostTensor::from_f32(&[g.v_heads], &v))
            }
            Ssm::Conv => {
                let n = name("ssm_conv1d.weight");
                let t = self.required(&n, hf)?;
                let keys = 2 * g.key_rows();
                let rows = self.untiled(g.v_dim).map(|v| {
                    (0..keys)
                        .chain(v.into_iter().map(|r| keys + r))
                        .collect::<Vec<_>>()
                });
                let mut t = self.rows(&n, t, g.conv_channels(), rows.as_deref())?;
                if let [c, k] = t.shape[..] {
                    t.shape = vec![c, 1, k];
                }
                Ok(t)
            }
            Ssm::Norm => self.required(&name("ssm_norm.weight"), hf),
            Ssm::Out => {
                let n = name("ssm_out.weight");
                let t = self.required(&n, hf)?;
                self.out_columns(&n, t)
            }
        }
    }
}

impl WeightSource for HybridWeights<'_> {
    fn describe(&self) -> String {
        self.inner.describe()
    }

    fn tensor(&self, name: &str) -> Result<Option<HostTensor<'_>>> {
        match mapped(name) {
            None => self.inner.tensor(name),
            Some(Mapped::OffsetNorm(g)) => self.offset_norm(&g, name).map(Some),
            Some(Mapped::Ssm(i, part)) => self.ssm(i, part, name).map(Some),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn untile_inverts_the_converters_v_head_reorder() {
        // convert: reshape(K, r, d) -> swap the first two axes -> reshape.
        let (k, r, d) = (2, 3, 2);
        let hf: Vec<usize> = (0..k * r * d).collect();
        let mut tiled = vec![0; hf.len()];
        for kk in 0..k {
            for j in 0..r {
                for x in 0..d {
                    tiled[(j * k + kk) * d + x] = hf[(kk * r + j) * d + x];
                }
            }
        }
        let back: Vec<usize> = untile(k, r, d).iter().map(|&s| tiled[s]).collect();
        assert_eq!(back, hf);
    }

    #[test]
    fn names_map() {
        assert_eq!(
            mapped("model.norm.weight"),
            Some(Mapped::OffsetNorm("output_norm.weight".into()))
        );
        assert_eq!(
            mapped("model.layers.3.post_attention_layernorm.weight"),
            Some(Mapped::OffsetNorm(
                "blk.3.post_attention_norm.weight".into()
            ))
        );
        assert_eq!(
            mapped("model.layers.0.linear_attn.A_log"),
            Some(Mapped::Ssm(0, Ssm::ALog))
        );
        assert_eq!(mapped("model.layers.0.self_attn.q_proj.weight"), None);
        assert_eq!(mapped("lm_head.weight"), None);
    }
}
