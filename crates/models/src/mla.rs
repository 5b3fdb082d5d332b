//! Multi-head latent attention (DeepSeek-V2/V3) over a latent KV cache,
//! with the key and value up-projections applied per head in latent space
//! (the "absorbed" form vLLM and SGLang decode with).
//!
//! Each token caches one "KV head" of width `D = qk_rope_head_dim +
//! kv_lora_rank`, `[k_pe (roped) | c_kv]` (`c_kv` the normed compressed
//! latent), once: it is the key and also the value (`ModelSpec::
//! kv_values_in_keys`), so the cache holds `D` values per token and layer
//! instead of `heads·(qk_head_dim + v_head_dim)` for the expanded keys and
//! values. Every projection of the checkpoint but `kv_b_proj` is a linear
//! stored as the method decides (FP8 blocks stay FP8, and under W8A8 each
//! rounds its inputs as vLLM's: `q_a_proj` and `kv_a_proj_with_mqa` share a
//! scale, as its `fused_qkv_a_proj`). `kv_b_proj` is cut at load into two
//! per-head float matrices: the query's `[af² on q_pe | W_UKᵀ on q_nope]`
//! (`D × (qk_nope + qk_rope)` per head), so that `q·k = af²·q_pe·k_pe +
//! q_nope·(W_UK c_kv)` exactly as the expanded attention, and the value's
//! `[0 | W_UV]` (`v_head_dim × D`), whose zero rotary columns cancel the
//! weighted `k_pe` the attention output carries there (`0 · x = 0` for
//! finite x). Attention is then the ordinary paged kernel with one KV head
//! shared by every query head (MQA) and the softmax scale of the expanded
//! head width; `o_proj` follows the value's up-projection. The per-head
//! products are the backend's `linear_heads` (one batched GEMM on GPUs),
//! and the key's halves are cut and joined into tensors of their own
//! (`take_cols`, `concat_cols`), so on GPUs every op of a padded decode
//! step runs on whole step buffers and the step replays its graph.
//!
//! Invariants: the up-projections are cut in f32 from the stored values of
//! a float `kv_b_proj` (f32, f16, bf16) or the dequantized values of a
//! quantized one (FP8 blocks, INT4, GGUF types), and stored in the
//! checkpoint's float dtype (the query's in f32 when YaRN's attention
//! factor `af` is not 1, so that `af²` is exact); RoPE is linear, so `af`
//! on both q_pe and k_pe is `af²` on q_pe alone; the rotary dimensions come
//! first in each head, so the backend's RoPE (which rotates a head's first
//! `qk_rope_head_dim` dimensions) applies to q and k.

use crate::config::{DecoderConfig, Keys, RopeScaling};
use crate::decoder::{Linear, Loader, share_input_scale};
use arbor_engine_core::columns::take_cols;
use arbor_engine_core::{
    AttentionParams, Backend, CoreError, DType, ForwardContext, Result, RopeStyle, Tensor,
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
    /// `q_a_proj` `[q_lora_rank, hidden]`, as the method stores it. Under
    /// W8A8 FP8 with static scales it shares `kv_a_proj_with_mqa`'s input
    /// rounding (the larger scale: vLLM fuses them into one
    /// `fused_qkv_a_proj` with `input_scale.max()`).
    proj: Linear,
    /// `q_a_layernorm` `[q_lora_rank]` f32.
    norm: Tensor,
}

/// One layer's latent attention.
pub struct MlaAttn {
    /// `q_a_proj` and `q_a_layernorm` (with a query compression).
    q_a: Option<QueryCompression>,
    /// `q_b_proj` (or `q_proj`) `[heads·(nope + rope), q_in]`, as the
    /// method stores it.
    q_b: Linear,
    /// The query's per-head up-projection `[heads·D, nope + rope]`, float:
    /// head h's rows are `af²` on its `q_pe` column (the rotary rows), then
    /// `W_UKᵀ` on its `q_nope` columns (the latent rows).
    q_up: Tensor,
    /// `kv_a_proj_with_mqa` `[kv_lora_rank + rope, hidden]`, as the method
    /// stores it: the latent `c_kv`, then `k_pe`.
    kv_a: Linear,
    /// `kv_a_layernorm` `[kv_lora_rank]`.
    kv_norm: Tensor,
    /// The value's per-head up-projection `[heads·v_head_dim, D]`, float:
    /// zero on the rotary columns, `W_UV` on the latent ones.
    o_up: Tensor,
    /// `o_proj` `[hidden, heads·v_head_dim]`, as the method stores it.
    o: Linear,
    heads: usize,
    mla: MlaConfig,
    scale: f32,
    style: RopeStyle,
}

/// The f32 values of the projection `prefix` (this rank's `out` x `inp`
/// share) that the per-head up-projections are cut from, and the dtype
/// they are stored in. A float checkpoint's weight is read as stored and
/// keeps its dtype. A quantized one (DeepSeek-V3's FP8 blocks with
/// `weight_scale_inv`, compressed-tensors, INT4) is loaded by its method and
/// dequantized with the format's formula, and the up-projections are
/// stored in `float`, the layer's float dtype (vLLM likewise dequantizes
/// `kv_b_proj` into its `W_UK` and `W_UV`).
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

/// A projection without bias as the method stores it, with its static
/// input scale (W8A8 FP8).
fn stored(l: &mut Loader<'_>, prefix: &str, out: usize, inp: usize) -> Result<Linear> {
    let (w, input_scale) = l.scaled_matrix(prefix, out, inp)?;
    Ok(Linear {
        w,
        b: None,
        input_scale,
    })
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
        let mut kv_a = stored(l, &format!("{p}.kv_a_proj_with_mqa"), lora + rope, h)?;
        let kv_norm = l.f32_matrix(&format!("{p}.kv_a_layernorm.weight"), &[lora])?;
        let (q_a, q_in, q_name) = match mla.q_lora_rank {
            Some(r) => {
                let mut proj = stored(l, &format!("{p}.q_a_proj"), r, h)?;
                share_input_scale(&mut [&mut proj, &mut kv_a]);
                let norm = l.f32_matrix(&format!("{p}.q_a_layernorm.weight"), &[r])?;
                (
                    Some(QueryCompression { proj, norm }),
                    r,
                    format!("{p}.q_b_proj"),
                )
            }
            None => (None, h, format!("{p}.q_proj")),
        };
        let q_b = stored(l, &q_name, heads * (nope + rope), q_in)?;
        let o = stored(l, &format!("{p}.o_proj"), h, heads * vd)?;
        // The float dtype of this checkpoint's layer: the up-projections
        // are stored in it when kv_b_proj is quantized.
        let float = match src.tensor(&format!("{p}.kv_a_layernorm.weight"))? {
            Some(t) if t.dtype.is_float() => t.dtype,
            _ => DType::F32,
        };
        let (kvb, dtype) = projection(
            l,
            &format!("{p}.kv_b_proj"),
            heads * (nope + vd),
            lora,
            float,
        )?;
        l.skip(1);
        let w_uk = |hd: usize, n: usize| &kvb[(hd * (nope + vd) + n) * lora..][..lora];
        let w_uv = |hd: usize, c: usize| &kvb[(hd * (nope + vd) + nope + c) * lora..][..lora];
        // YaRN's attention factor scales q_pe and k_pe (RoPE is linear):
        // both factors go on q_pe, in f32 unless they are 1.
        let af = cfg.rope_scaling.attention_factor();
        let (q_up_dtype, af2) = if af == 1.0 {
            (dtype, 1.0)
        } else {
            (DType::F32, af * af)
        };
        // Head hd: [af² on its q_pe column | W_UKᵀ on its q_nope columns].
        let qw = nope + rope;
        let mut q_up = vec![0f32; heads * d * qw];
        for hd in 0..heads {
            let rows = &mut q_up[hd * d * qw..(hd + 1) * d * qw];
            for r in 0..rope {
                rows[r * qw + nope + r] = af2;
            }
            for n in 0..nope {
                for (j, &u) in w_uk(hd, n).iter().enumerate() {
                    rows[(rope + j) * qw + n] = u;
                }
            }
        }
        // Head hd: [0 on the rotary columns | W_UV on the latent ones].
        let mut o_up = vec![0f32; heads * vd * d];
        for hd in 0..heads {
            for c in 0..vd {
                o_up[(hd * vd + c) * d + rope..][..lora].copy_from_slice(w_uv(hd, c));
            }
        }
        let q_up = l.up_projection(&format!("{p} (W_UK)"), &[heads * d, qw], &q_up, q_up_dtype)?;
        let o_up = l.up_projection(&format!("{p} (W_UV)"), &[heads * vd, d], &o_up, dtype)?;
        Ok(Self {
            q_a,
            q_b,
            q_up,
            kv_a,
            kv_norm,
            o_up,
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

    /// The stored dtype of the output projection (the layer's weights).
    pub(crate) fn weight_dtype(&self) -> DType {
        self.o.w.dtype()
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
        let (nope, rope, lora, vd, d) = (
            self.mla.qk_nope_head_dim,
            self.mla.qk_rope_head_dim,
            self.mla.kv_lora_rank,
            self.mla.v_head_dim,
            self.mla.kv_head_dim(),
        );
        let f32t = |shape: &[usize]| b.alloc(DType::F32, shape);
        let kv = f32t(&[t, lora + rope])?;
        let qb = f32t(&[t, self.heads * (nope + rope)])?;
        match &self.q_a {
            Some(qa) => {
                let c = f32t(&[t, qa.proj.w.rows()])?;
                b.linear_many(x, &[qa.proj.to(&c), self.kv_a.to(&kv)])?;
                b.rms_norm(&c, &qa.norm, 1e-6, &c)?;
                b.linear_many(&c, &[self.q_b.to(&qb)])?;
            }
            None => b.linear_many(x, &[self.q_b.to(&qb), self.kv_a.to(&kv)])?,
        }
        let q = f32t(&[t, self.heads * d])?;
        b.linear_heads(&qb, &self.q_up, self.heads, &q)?;
        b.rope(&q, positions, inv_freq, d, self.style)?;
        // k = [k_pe (roped) | c_kv (normed)], split from kv_a's [c_kv | k_pe]
        // and joined on the device, each half a tensor of its own.
        let c = take_cols(b, &kv, 0, lora)?;
        let kpe = take_cols(b, &kv, lora, rope)?;
        b.rms_norm(&c, &self.kv_norm, 1e-6, &c)?;
        b.rope(&kpe, positions, inv_freq, rope, self.style)?;
        let k = f32t(&[t, d])?;
        b.concat_cols(&[&kpe, &c], &k)?;
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
        let v = f32t(&[t, self.heads * vd])?;
        b.linear_heads(&attn, &self.o_up, self.heads, &v)?;
        b.linear_many(&v, &[self.o.to(out)])
    }
}
