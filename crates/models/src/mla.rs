//! Multi-head latent attention (DeepSeek-V2/V3) over a latent KV cache,
//! with the up-projections absorbed into the query and output weights.
//!
//! Each token caches one "KV head" of width `D = qk_rope_head_dim +
//! kv_lora_rank`, `[k_pe (roped) | c_kv]` (`c_kv` the normed compressed
//! latent), once: it is the key and also the value (`ModelSpec::
//! kv_values_in_keys`), so the cache holds `D` values per token and layer
//! instead of `heads·(qk_head_dim + v_head_dim)` for the expanded keys and
//! values. The attention output's first `qk_rope_head_dim` columns per head
//! then hold the weighted `k_pe`, which the absorbed output projection's zero
//! rotary columns cancel exactly (`0 · x = 0` for finite x). The query is absorbed at load: per head
//! `[q_pe | W_UKᵀ q_nope]`, so that `q·k = q_pe·k_pe + q_nope·(W_UK c_kv)`
//! exactly as the expanded attention; the output projection absorbs `W_UV`
//! (`o_proj · W_UV` per head, exactly zero on the rotary columns, in every
//! storage the absorbed weights take: float casts and symmetric FP8 blocks). Attention is then
//! the ordinary paged kernel with one KV head shared by every query head
//! (MQA) and the softmax scale of the expanded head width.
//!
//! Invariants: absorbed weights are computed in f32, from the stored values
//! of a float checkpoint (f32, f16, bf16) or the dequantized values of a
//! quantized one (FP8 blocks, INT4, GGUF types), and stored in the
//! checkpoint's float dtype; YaRN's
//! attention factor multiplies the rotary rows of q and k (RoPE is linear);
//! the rotary dimensions come first in each head, so the backend's RoPE (which
//! rotates a head's first `qk_rope_head_dim` dimensions) applies to q and k.

use crate::config::{DecoderConfig, Keys, RopeScaling};
use crate::decoder::Loader;
use arbor_engine_core::{
    AttentionParams, Backend, CoreError, DType, ForwardContext, LinearRef, Result, RopeStyle,
    Tensor,
};
use serde_json::Value;

/// The MLA keys of a DeepSeek `config.json`.
#[derive(Clone, Debug, PartialEq)]
pub struct MlaConfig {
    /// Rank of the query compression (`q_lora_rank`); `None`: a plain `q_proj`.
    pub q_lora_rank: Option<usize>,
    /// Rank of the KV latent (`kv_lora_rank`).
    pub kv_lora_rank: usize,
    /// Per-head query/key width without RoPE (`qk_nope_head_dim`).
    pub qk_nope_head_dim: usize,
    /// Per-head query/key width with RoPE (`qk_rope_head_dim`).
    pub qk_rope_head_dim: usize,
    /// Per-head value width (`v_head_dim`).
    pub v_head_dim: usize,
    /// RoPE rotates adjacent pairs (DeepSeek's layout: always for V2, `rope_interleave` for V3).
    pub interleaved: bool,
}

impl MlaConfig {
    /// Parses the MLA keys of `v`; `file` names it in errors.
    pub fn from_json(v: &Value, file: &str, v3: bool) -> Result<Self> {
        let k = Keys { v, file };
        let err = |key: &str, what: &str| k.err(key, what);
        let uint = |key: &str| k.usize_opt(key);
        let need = |key: &str| -> Result<usize> {
            uint(key)?
                .filter(|&n| n > 0)
                .ok_or_else(|| err(key, "is missing or zero"))
        };
        let rope = need("qk_rope_head_dim")?;
        if !rope.is_multiple_of(2) {
            return Err(err("qk_rope_head_dim", &format!("({rope}) must be even")));
        }
        if v.get("attention_bias").and_then(Value::as_bool) == Some(true) {
            return Err(err("attention_bias", "true is not supported for MLA"));
        }
        let interleaved = !v3 || v.get("rope_interleave").and_then(Value::as_bool) != Some(false);
        Ok(Self {
            q_lora_rank: uint("q_lora_rank")?.filter(|&n| n > 0),
            kv_lora_rank: need("kv_lora_rank")?,
            qk_nope_head_dim: need("qk_nope_head_dim")?,
            qk_rope_head_dim: rope,
            v_head_dim: need("v_head_dim")?,
            interleaved,
        })
    }

    /// Width of the cached latent "head": `qk_rope_head_dim + kv_lora_rank`.
    pub fn kv_head_dim(&self) -> usize {
        self.qk_rope_head_dim + self.kv_lora_rank
    }

    /// The softmax scale: `1/sqrt(qk_head_dim)`, times YaRN's `mscale²` for
    /// `mscale_all_dim` (as transformers' `yarn_apply_mscale`).
    pub fn softmax_scale(&self, rope: &RopeScaling) -> f32 {
        let base = 1.0 / ((self.qk_nope_head_dim + self.qk_rope_head_dim) as f32).sqrt();
        match rope {
            RopeScaling::Yarn {
                factor,
                mscale_all_dim,
                ..
            } if *mscale_all_dim != 0.0 => {
                let m = crate::config::yarn_mscale(*factor, *mscale_all_dim);
                base * m * m
            }
            _ => base,
        }
    }

    /// Tensors one layer's attention loads (for load progress).
    pub fn tensors_per_layer(&self) -> usize {
        if self.q_lora_rank.is_some() { 7 } else { 5 }
    }
}

/// What RoPE reads: each token's position and the inverse frequencies.
#[derive(Clone, Copy)]
pub(crate) struct Rope<'a> {
    pub positions: &'a Tensor,
    pub inv_freq: &'a Tensor,
}

/// The query's down-projection and its norm.
struct QueryCompression {
    /// `q_a_proj` `[q_lora_rank, hidden]`, as the method stores it.
    proj: Tensor,
    /// `q_a_layernorm` `[q_lora_rank]` f32.
    norm: Tensor,
    /// The static input scale of a W8A8 FP8 `q_a_proj`: the larger of its
    /// and `kv_a_proj_with_mqa`'s, which take the same input (vLLM fuses
    /// them into one `fused_qkv_a_proj` with `input_scale.max()`).
    input_scale: Option<f32>,
}

/// One layer's latent attention.
pub struct MlaAttn {
    /// `q_a_proj` and `q_a_layernorm` (with a query compression).
    q_a: Option<QueryCompression>,
    /// Absorbed query weight `[heads·D, q_in]`.
    q: Tensor,
    /// `c_kv` rows of `kv_a_proj_with_mqa` `[kv_lora_rank, hidden]`.
    ckv: Tensor,
    /// `k_pe` rows of `kv_a_proj_with_mqa` `[qk_rope_head_dim, hidden]`.
    kpe: Tensor,
    /// `kv_a_layernorm` `[kv_lora_rank]`.
    kv_norm: Tensor,
    /// Absorbed output weight `[hidden, heads·D]`.
    o: Tensor,
    heads: usize,
    mla: MlaConfig,
    scale: f32,
    style: RopeStyle,
}

/// The f32 values of the projection `prefix` (this rank's `out` x `inp`
/// share) that absorption reads, and the dtype the weights absorbed from it
/// are stored in. A float checkpoint's weight is read as stored and keeps
/// its dtype. A quantized one (DeepSeek-V3's FP8 blocks with
/// `weight_scale_inv`, compressed-tensors, INT4) is loaded by its method and
/// dequantized with the format's formula, and the absorbed weights are
/// stored in `float`, the layer's float dtype (vLLM likewise absorbs the
/// dequantized `kv_b_proj`).
fn projection(
    l: &mut Loader<'_>,
    prefix: &str,
    out: usize,
    inp: usize,
    float: DType,
) -> Result<(Vec<f32>, DType)> {
    let name = format!("{prefix}.weight");
    let src = l.source();
    if let Some(t) = src.tensor(&name)?.filter(|t| t.dtype.is_float()) {
        if t.shape != [out, inp] {
            return Err(CoreError::load(format!(
                "{}: tensor '{name}' has shape {:?}, expected {:?}",
                src.describe(),
                t.shape,
                [out, inp]
            )));
        }
        return Ok((t.to_f32_vec()?, t.dtype));
    }
    let (t, _) = l.linear_weight(prefix, out, inp)?;
    if t.dtype.is_float() {
        return Ok((t.to_f32_vec()?, float));
    }
    let mut values = vec![0f32; out * inp];
    arbor_quant::dequantize(t.dtype, &t.data, &mut values)
        .map_err(|e| CoreError::load(format!("{}: tensor '{name}': {e}", src.describe())))?;
    Ok((values, float))
}

impl MlaAttn {
    /// Loads layer `layer`'s attention for `heads` query heads (this rank's).
    pub(crate) fn load(
        l: &mut Loader<'_>,
        cfg: &DecoderConfig,
        mla: &MlaConfig,
        layer: usize,
        heads: usize,
    ) -> Result<Self> {
        let src = l.source();
        let p = format!("model.layers.{layer}.self_attn");
        let h = cfg.hidden_size;
        let (nope, rope, lora, vd) = (
            mla.qk_nope_head_dim,
            mla.qk_rope_head_dim,
            mla.kv_lora_rank,
            mla.v_head_dim,
        );
        let d = mla.kv_head_dim();
        let af = cfg.rope_scaling.attention_factor();
        let (q_a, q_in, q_name) = match mla.q_lora_rank {
            Some(r) => {
                let (proj, own) = l.scaled_matrix(&format!("{p}.q_a_proj"), r, h)?;
                let input_scale = match own {
                    Some(s) => {
                        let kv_a = format!("{p}.kv_a_proj_with_mqa");
                        let kv = l.input_scale_of(&kv_a, lora + rope, h)?;
                        Some(kv.map_or(s, |k| s.max(k)))
                    }
                    None => None,
                };
                let norm = l.f32_matrix(&format!("{p}.q_a_layernorm.weight"), &[r])?;
                let q_a = QueryCompression {
                    proj,
                    norm,
                    input_scale,
                };
                (Some(q_a), r, format!("{p}.q_b_proj"))
            }
            None => (None, h, format!("{p}.q_proj")),
        };
        // The float dtype of this checkpoint's layer: absorbed weights are
        // stored in it when the projections are quantized.
        let float = match src.tensor(&format!("{p}.kv_a_layernorm.weight"))? {
            Some(t) if t.dtype.is_float() => t.dtype,
            _ => DType::F32,
        };
        let (qw, dtype) = projection(l, &q_name, heads * (nope + rope), q_in, float)?;
        let (kvb, _) = projection(
            l,
            &format!("{p}.kv_b_proj"),
            heads * (nope + vd),
            lora,
            float,
        )?;
        let (ow, _) = projection(l, &format!("{p}.o_proj"), h, heads * vd, float)?;
        let (kva, _) = projection(l, &format!("{p}.kv_a_proj_with_mqa"), lora + rope, h, float)?;
        // q_b_proj (or q_proj), kv_b_proj, o_proj and kv_a_proj_with_mqa are read.
        l.skip(4);
        // Absorbed query: per head [q_pe rows · af | W_UKᵀ · W_q_nope].
        let mut q = vec![0f32; heads * d * q_in];
        for hd in 0..heads {
            let qrow = |r: usize| &qw[(hd * (nope + rope) + r) * q_in..][..q_in];
            let out = &mut q[hd * d * q_in..(hd + 1) * d * q_in];
            for r in 0..rope {
                for (o, &w) in out[r * q_in..(r + 1) * q_in].iter_mut().zip(qrow(nope + r)) {
                    *o = w * af;
                }
            }
            for n in 0..nope {
                let uk = &kvb[(hd * (nope + vd) + n) * lora..][..lora];
                let qn = qrow(n);
                for (j, &u) in uk.iter().enumerate() {
                    let row = &mut out[(rope + j) * q_in..(rope + j + 1) * q_in];
                    for (o, &w) in row.iter_mut().zip(qn) {
                        *o += u * w;
                    }
                }
            }
        }
        // Absorbed output: column block of head hd = [0 | o_proj[:, hd] · W_UV].
        let mut o = vec![0f32; h * heads * d];
        for hd in 0..heads {
            for c in 0..vd {
                let uv = &kvb[(hd * (nope + vd) + nope + c) * lora..][..lora];
                for row in 0..h {
                    let w = ow[row * heads * vd + hd * vd + c];
                    let dst = &mut o[row * heads * d + hd * d + rope..][..lora];
                    for (x, &u) in dst.iter_mut().zip(uv) {
                        *x += w * u;
                    }
                }
            }
        }
        let kpe: Vec<f32> = kva[lora * h..].iter().map(|&w| w * af).collect();
        let q = l.absorbed(&format!("{p} (absorbed q)"), &[heads * d, q_in], &q, dtype)?;
        let o = l.absorbed(&format!("{p} (absorbed o)"), &[h, heads * d], &o, dtype)?;
        let ckv = l.absorbed(
            &format!("{p}.kv_a_proj_with_mqa (c_kv)"),
            &[lora, h],
            &kva[..lora * h],
            dtype,
        )?;
        let kpe = l.absorbed(
            &format!("{p}.kv_a_proj_with_mqa (k_pe)"),
            &[rope, h],
            &kpe,
            dtype,
        )?;
        let kv_norm = l.f32_matrix(&format!("{p}.kv_a_layernorm.weight"), &[lora])?;
        Ok(Self {
            q_a,
            q,
            ckv,
            kpe,
            kv_norm,
            o,
            heads,
            mla: mla.clone(),
            scale: mla.softmax_scale(&cfg.rope_scaling),
            style: if mla.interleaved {
                RopeStyle::Interleaved
            } else {
                RopeStyle::Neox
            },
        })
    }

    /// `out = attention(x)` for `x` `[tokens, hidden]` (normed), writing this
    /// layer's latent K and V into `ctx.kv`.
    pub(crate) fn forward(
        &self,
        b: &dyn Backend,
        x: &Tensor,
        rope_in: Rope<'_>,
        layer: usize,
        ctx: &ForwardContext<'_>,
        out: &Tensor,
    ) -> Result<()> {
        let (positions, inv_freq) = (rope_in.positions, rope_in.inv_freq);
        let t = x.rows();
        let (rope, lora, d) = (
            self.mla.qk_rope_head_dim,
            self.mla.kv_lora_rank,
            self.mla.kv_head_dim(),
        );
        let f32t = |shape: &[usize]| b.alloc(DType::F32, shape);
        let q = f32t(&[t, self.heads * d])?;
        match &self.q_a {
            Some(qa) => {
                let c = f32t(&[t, qa.proj.rows()])?;
                let proj = LinearRef {
                    input_scale: qa.input_scale,
                    ..LinearRef::new(&qa.proj, None, &c)
                };
                b.linear_many(x, &[proj])?;
                b.rms_norm(&c, &qa.norm, 1e-6, &c)?;
                b.linear(&c, &self.q, None, &q)?;
            }
            None => b.linear(x, &self.q, None, &q)?,
        }
        b.rope(&q, positions, inv_freq, d, self.style)?;
        let c = f32t(&[t, lora])?;
        b.linear(x, &self.ckv, None, &c)?;
        b.rms_norm(&c, &self.kv_norm, 1e-6, &c)?;
        let kpe = f32t(&[t, rope])?;
        b.linear(x, &self.kpe, None, &kpe)?;
        b.rope(&kpe, positions, inv_freq, rope, self.style)?;
        let k = f32t(&[t, d])?;
        b.copy_cols(&kpe, &k, 0)?;
        b.copy_cols(&c, &k, rope)?;
        let attn = f32t(&[t, self.heads * d])?;
        let params = AttentionParams {
            num_heads: self.heads,
            num_kv_heads: 1,
            head_dim: d,
            scale: self.scale,
            sliding_window: None,
            kv_scales: arbor_engine_core::KvScales::ONE,
        };
        ctx.attention.forward(
            ctx.attention_batch,
            ctx.kv.layer(layer)?,
            &q,
            &k,
            // The values are the keys (the cache stores the latent once).
            &k,
            &attn,
            &params,
        )?;
        b.linear(&attn, &self.o, None, out)
    }
}
