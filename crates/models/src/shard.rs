//! Tensor-parallel sharding of a decoder checkpoint: the per-rank shape
//! ([`shard_config`]) and the weight source that hands a rank only its
//! slices ([`ShardedSource`]), by the Megatron layout SGLang and vLLM use.
//!
//! - **Column-parallel** (rows split; each rank computes a slice of the
//!   outputs): q/k/v projections and their biases, gate/up projections
//!   (dense, shared expert, routed experts unless expert-parallel), and the
//!   LM head when the vocabulary divides (vocab-parallel: logits are
//!   gathered).
//! - **Row-parallel** (columns split; each rank computes a partial sum that
//!   is all-reduced): o and down projections; their bias is added by rank 0
//!   only (the other ranks read zeros).
//! - **Replicated**: embeddings, norms, the MoE router, the shared expert's
//!   gate, and, with expert parallelism, the routed experts (each rank loads
//!   only its own).
//!
//! With data-parallel attention ([`ShardedSource::with_whole_attention`],
//! `AttentionSharding::DataParallel`) every rank holds the whole attention
//! (`self_attn` tensors), embeddings and LM head, and only the feed-forward
//! layers are split as above.
//!
//! A pre-quantized checkpoint's split layers (FP8 `weight` and its scales,
//! AWQ/GPTQ `qweight`, compressed-tensors `weight_packed`, NVFP4) are not
//! cut tensor by tensor: the loader loads each whole, in the method's
//! stored form, and keeps this rank's rows or columns of that
//! ([`ShardedSource::stored_share`]), so every format splits the same way and
//! a rank's weights are exactly its share of the one-device weights.
//!
//! Invariants: a rank's slice of a column split is rows `[r·n/w, (r+1)·n/w)`,
//! of a row split columns `[r·k/w, (r+1)·k/w)`; quantized rows are cut only
//! at block boundaries; a checkpoint tensor this layout does not know under a
//! split module (pre-quantized `qweight`, scales) is an error when read
//! through this source, not silently replicated.

use crate::config::DecoderConfig;
use crate::moe::MoeConfig;
use arbor_engine_core::{CoreError, DType, HostTensor, Result, WeightSource};
use std::borrow::Cow;

/// How one tensor is split.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Split {
    /// Outermost dimension (output rows).
    Rows,
    /// Innermost dimension (input columns).
    Cols,
    /// Rank 0 holds it, the others zeros (the bias of a row-parallel linear).
    RankZero,
    /// Every rank holds all of it.
    Whole,
}

/// How a rank takes its share of a linear layer it loads whole
/// ([`ShardedSource::stored_share`]): `split` is `Rows` or `Cols`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct StoredShare {
    split: Split,
    world: usize,
}

impl StoredShare {
    /// The whole layer's `(out, in)` features for a rank's `(out, in)`.
    pub(crate) fn whole_shape(self, out: usize, inp: usize) -> (usize, usize) {
        match self.split {
            Split::Rows => (out * self.world, inp),
            Split::Cols => (out, inp * self.world),
            Split::Whole | Split::RankZero => (out, inp),
        }
    }
}

/// The rank's shapes: heads (unless `whole_attention`), MLP and expert
/// widths divided by `world`. Errors name the key that `world` does not
/// divide.
pub fn shard_config(
    cfg: &DecoderConfig,
    moe: Option<&MoeConfig>,
    world: usize,
    expert_parallel: bool,
    whole_attention: bool,
) -> Result<(DecoderConfig, Option<MoeConfig>)> {
    let check = |key: &str, n: usize| -> Result<usize> {
        if world == 0 || !n.is_multiple_of(world) {
            return Err(CoreError::InvalidSetting {
                key: "tp_size",
                reason: format!("{world} does not divide {key} ({n})"),
            });
        }
        Ok(n / world)
    };
    let mut c = cfg.clone();
    if !whole_attention {
        c.num_attention_heads = check("num_attention_heads", cfg.num_attention_heads)?;
        c.num_key_value_heads = check("num_key_value_heads", cfg.num_key_value_heads)?;
    }
    c.intermediate_size = check("intermediate_size", cfg.intermediate_size)?;
    let moe = match moe {
        None if expert_parallel => {
            return Err(CoreError::InvalidSetting {
                key: "ep_size",
                reason: "applies to mixture-of-experts models only".into(),
            });
        }
        None => None,
        Some(m) => {
            let mut m = m.clone();
            if expert_parallel {
                if !m.num_experts.is_multiple_of(world) {
                    return Err(CoreError::InvalidSetting {
                        key: "ep_size",
                        reason: format!("{world} does not divide num_experts ({})", m.num_experts),
                    });
                }
            } else {
                m.expert_intermediate_size =
                    check("moe_intermediate_size", m.expert_intermediate_size)?;
            }
            if let Some(s) = m.shared_expert_intermediate_size {
                m.shared_expert_intermediate_size =
                    Some(check("shared_expert_intermediate_size", s)?);
            }
            Some(m)
        }
    };
    Ok((c, moe))
}

/// A rank's view of a checkpoint: each tensor as this rank's slice.
pub struct ShardedSource<'a> {
    inner: &'a dyn WeightSource,
    rank: usize,
    world: usize,
    /// The LM head is split by vocabulary rows.
    vocab_parallel: bool,
    /// Routed experts are whole (expert parallelism).
    expert_parallel: bool,
    /// Attention tensors are whole (data-parallel attention).
    whole_attention: bool,
}

impl<'a> ShardedSource<'a> {
    /// Rank `rank` of `world` over `inner`.
    pub fn new(
        inner: &'a dyn WeightSource,
        rank: usize,
        world: usize,
        vocab_parallel: bool,
        expert_parallel: bool,
    ) -> Self {
        Self {
            inner,
            rank,
            world,
            vocab_parallel,
            expert_parallel,
            whole_attention: false,
        }
    }

    /// Every rank holds the whole attention (data-parallel attention).
    pub fn with_whole_attention(self, whole: bool) -> Self {
        Self {
            whole_attention: whole,
            ..self
        }
    }

    fn split_of(&self, name: &str) -> Result<Split> {
        if name == "lm_head.weight" {
            return Ok(if self.vocab_parallel {
                Split::Rows
            } else {
                Split::Whole
            });
        }
        let Some((module, kind)) = name.rsplit_once('.') else {
            return Ok(Split::Whole);
        };
        let proj = module.rsplit('.').next().unwrap_or(module);
        let routed = module.contains(".experts.");
        if self.whole_attention && module.contains(".self_attn") {
            return Ok(Split::Whole);
        }
        // A KV cache scale (ModelOpt keeps it on k_proj / v_proj) is one
        // number every rank uses.
        if matches!(kind, "k_scale" | "v_scale" | "output_scale") {
            return Ok(Split::Whole);
        }
        let split = match proj {
            _ if routed && self.expert_parallel => return Ok(Split::Whole),
            "q_proj" | "k_proj" | "v_proj" | "q_b_proj" | "kv_b_proj" | "gate_proj" | "up_proj"
            | "w1" | "w3" => match kind {
                "weight" | "bias" => Split::Rows,
                _ => return Err(self.unknown(name)),
            },
            "o_proj" | "down_proj" | "w2" => match kind {
                "weight" => Split::Cols,
                "bias" => Split::RankZero,
                _ => return Err(self.unknown(name)),
            },
            _ => Split::Whole,
        };
        Ok(split)
    }

    /// The checkpoint this rank's slices are cut from.
    pub fn whole(&self) -> &'a dyn WeightSource {
        self.inner
    }

    /// How this rank takes its share of the linear layer `prefix` when
    /// its checkpoint form is one this source cannot cut (a pre-quantized
    /// checkpoint's `weight` and scales, `qweight`, `weight_packed`): the
    /// loader then loads the whole layer from [`ShardedSource::whole`] and
    /// cuts the stored weight with [`ShardedSource::share_of`]. `None` for
    /// layers this source cuts itself (float and GGUF-typed weights, which
    /// the method then converts share by share) and for whole layers.
    pub(crate) fn stored_share(&self, prefix: &str) -> Result<Option<StoredShare>> {
        let name = format!("{prefix}.weight");
        let cuttable = |d: DType| d.is_float() || (d.is_quantized() && !d.is_scaled_block());
        if self.inner.tensor(&name)?.is_some_and(|t| cuttable(t.dtype)) {
            return Ok(None);
        }
        Ok(match self.split_of(&name)? {
            split @ (Split::Rows | Split::Cols) => Some(StoredShare {
                split,
                world: self.world,
            }),
            Split::Whole | Split::RankZero => None,
        })
    }

    /// This rank's share of the stored weight `t` (the whole linear layer
    /// `prefix`, in the method's stored form): its rows, or its columns in
    /// whole blocks of the stored dtype (an error naming the tensor when
    /// they are not, as vLLM refuses a share that splits a quantization
    /// group).
    pub(crate) fn share_of<'t>(
        &self,
        prefix: &str,
        t: HostTensor<'t>,
        share: StoredShare,
    ) -> Result<HostTensor<'t>> {
        self.slice(&format!("{prefix}.weight"), t, share.split)
    }

    fn unknown(&self, name: &str) -> CoreError {
        CoreError::unsupported(format!(
            "{}: tensor parallelism of checkpoint tensor '{name}' (only float and GGUF-typed \
             weights are split)",
            self.inner.describe()
        ))
    }

    fn slice<'t>(&self, name: &str, t: HostTensor<'t>, split: Split) -> Result<HostTensor<'t>> {
        let (r, w) = (self.rank, self.world);
        let bad = |why: &str| {
            CoreError::load(format!(
                "{}: cannot split tensor '{name}' {:?} over {w} ranks: {why}",
                self.inner.describe(),
                t.shape
            ))
        };
        match split {
            Split::Whole => Ok(t),
            Split::RankZero if r == 0 => Ok(t),
            Split::RankZero => Ok(HostTensor {
                dtype: t.dtype,
                shape: t.shape.clone(),
                data: Cow::Owned(vec![0u8; t.data.len()]),
            }),
            Split::Rows => {
                let n = *t.shape.first().ok_or_else(|| bad("a scalar"))?;
                if !n.is_multiple_of(w) {
                    return Err(bad("rows do not divide"));
                }
                let per = t.data.len() / w;
                let mut shape = t.shape.clone();
                shape[0] = n / w;
                let data = match t.data {
                    Cow::Borrowed(d) => Cow::Borrowed(&d[r * per..(r + 1) * per]),
                    Cow::Owned(d) => Cow::Owned(d[r * per..(r + 1) * per].to_vec()),
                };
                Ok(HostTensor {
                    dtype: t.dtype,
                    shape,
                    data,
                })
            }
            Split::Cols => {
                let [rows, k] = t.shape[..] else {
                    return Err(bad("not a matrix"));
                };
                let block = t.dtype.block_size();
                if !k.is_multiple_of(w) || !(k / w).is_multiple_of(block) {
                    return Err(bad("columns do not divide into whole blocks"));
                }
                let row_bytes = t.data.len() / rows.max(1);
                let part = t.dtype.bytes_for(k / w)?;
                let mut data = Vec::with_capacity(rows * part);
                for row in t.data.chunks_exact(row_bytes) {
                    data.extend_from_slice(&row[r * part..(r + 1) * part]);
                }
                Ok(HostTensor {
                    dtype: t.dtype,
                    shape: vec![rows, k / w],
                    data: Cow::Owned(data),
                })
            }
        }
    }
}

impl WeightSource for ShardedSource<'_> {
    fn describe(&self) -> String {
        format!(
            "{} (rank {} of {})",
            self.inner.describe(),
            self.rank,
            self.world
        )
    }

    fn tensor(&self, name: &str) -> Result<Option<HostTensor<'_>>> {
        let Some(t) = self.inner.tensor(name)? else {
            return Ok(None);
        };
        let split = self.split_of(name)?;
        self.slice(name, t, split).map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arbor_engine_core::DType;

    struct One(HostTensor<'static>);
    impl WeightSource for One {
        fn describe(&self) -> String {
            "test".into()
        }
        fn tensor(&self, _: &str) -> Result<Option<HostTensor<'_>>> {
            Ok(Some(self.0.clone()))
        }
    }

    /// Two tensors by name.
    struct Two(HostTensor<'static>, HostTensor<'static>);
    impl WeightSource for Two {
        fn describe(&self) -> String {
            "test".into()
        }
        fn tensor(&self, name: &str) -> Result<Option<HostTensor<'_>>> {
            Ok(match name {
                "model.layers.0.self_attn.o_proj.weight" => Some(self.0.clone()),
                "model.layers.0.mlp.up_proj.weight" => Some(self.1.clone()),
                _ => None,
            })
        }
    }

    /// Layers whose checkpoint weight is float or GGUF-typed are cut by the
    /// source; others (a pre-quantized FP8 weight, an absent `weight` as
    /// AWQ's) are loaded whole and cut in their stored form: rows as bytes,
    /// columns in whole blocks of the stored dtype.
    #[test]
    fn pre_quantized_layers_are_cut_after_conversion() {
        let f8 = HostTensor {
            dtype: DType::F8E4M3,
            shape: vec![4, 128],
            data: Cow::Owned(vec![0x38; 512]),
        };
        let float = HostTensor::from_f32(&[4, 64], &[0.5; 256]);
        let src = Two(f8, float);
        let s = ShardedSource::new(&src, 1, 2, true, false);
        assert!(
            s.stored_share("model.layers.0.mlp.up_proj")
                .unwrap()
                .is_none()
        );
        assert!(
            s.stored_share("model.layers.0.input_layernorm")
                .unwrap()
                .is_none()
        );
        let cols = s
            .stored_share("model.layers.0.self_attn.o_proj")
            .unwrap()
            .unwrap();
        assert_eq!(cols.whole_shape(4, 64), (4, 128));
        let rows = s
            .stored_share("model.layers.0.mlp.gate_proj")
            .unwrap()
            .unwrap();
        assert_eq!(rows.whole_shape(2, 128), (4, 128));
        // A stored f8_s32 layer of 4 x 128: four blocks of 36 bytes a row,
        // each byte its block's index.
        let data: Vec<u8> = (0..16u8).flat_map(|b| [b; 36]).collect();
        let stored = HostTensor {
            dtype: DType::F8_S32,
            shape: vec![4, 128],
            data: Cow::Owned(data),
        };
        let c = s.share_of("o", stored.clone(), cols).unwrap();
        assert_eq!(c.shape, vec![4, 64]);
        let blocks: Vec<u8> = c.data.chunks(36).map(|b| b[0]).collect();
        assert_eq!(blocks, vec![2, 3, 6, 7, 10, 11, 14, 15]);
        let r = s.share_of("g", stored, rows).unwrap();
        assert_eq!(r.shape, vec![2, 128]);
        assert_eq!(
            r.data.chunks(36).map(|b| b[0]).collect::<Vec<_>>(),
            (8..16).collect::<Vec<u8>>()
        );
        // 96 columns cut in two are not whole blocks of 32.
        let odd = HostTensor {
            dtype: DType::F8_S32,
            shape: vec![1, 96],
            data: Cow::Owned(vec![0; 108]),
        };
        let e = s.share_of("model.x", odd, cols).unwrap_err().to_string();
        assert!(
            e.contains("'model.x.weight'") && e.contains("whole blocks"),
            "{e}"
        );
    }

    #[test]
    fn column_and_row_slices() {
        // A 4 x 4 matrix holding its own index.
        let v: Vec<f32> = (0..16).map(|i| i as f32).collect();
        let src = One(HostTensor::from_f32(&[4, 4], &v));
        let s = ShardedSource::new(&src, 1, 2, true, false);
        let q = s
            .tensor("model.layers.0.self_attn.q_proj.weight")
            .unwrap()
            .unwrap();
        assert_eq!(q.shape, vec![2, 4]);
        assert_eq!(
            q.to_f32_vec().unwrap(),
            (8..16).map(|i| i as f32).collect::<Vec<_>>()
        );
        let o = s
            .tensor("model.layers.0.self_attn.o_proj.weight")
            .unwrap()
            .unwrap();
        assert_eq!(o.shape, vec![4, 2]);
        assert_eq!(
            o.to_f32_vec().unwrap(),
            vec![2., 3., 6., 7., 10., 11., 14., 15.]
        );
        let b = s
            .tensor("model.layers.0.mlp.down_proj.bias")
            .unwrap()
            .unwrap();
        assert!(b.to_f32_vec().unwrap().iter().all(|&x| x == 0.0));
        let n = s
            .tensor("model.layers.0.input_layernorm.weight")
            .unwrap()
            .unwrap();
        assert_eq!(n.shape, vec![4, 4]);
        // KV cache scales (ModelOpt keeps them on k_proj / v_proj) are whole.
        for name in [
            "model.layers.0.self_attn.k_proj.k_scale",
            "model.layers.0.self_attn.v_proj.v_scale",
            "model.layers.0.self_attn.k_proj.output_scale",
        ] {
            assert_eq!(s.tensor(name).unwrap().unwrap().shape, vec![4, 4], "{name}");
        }
        let e = s
            .tensor("model.layers.0.mlp.experts.3.down_proj.weight")
            .unwrap()
            .unwrap();
        assert_eq!(e.shape, vec![4, 2]);
        let ep = ShardedSource::new(&src, 1, 2, true, true);
        let e = ep
            .tensor("model.layers.0.mlp.experts.3.down_proj.weight")
            .unwrap()
            .unwrap();
        assert_eq!(e.shape, vec![4, 4]);
        let head = ShardedSource::new(&src, 0, 2, false, false);
        assert_eq!(
            head.tensor("lm_head.weight").unwrap().unwrap().shape,
            vec![4, 4]
        );
        assert!(s.tensor("model.layers.0.self_attn.q_proj.qweight").is_err());
        // Data-parallel attention: attention whole, the MLP still split.
        let dp = ShardedSource::new(&src, 1, 2, false, false).with_whole_attention(true);
        for name in [
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.self_attn.o_proj.weight",
            "model.layers.0.self_attn.kv_b_proj.weight",
        ] {
            assert_eq!(
                dp.tensor(name).unwrap().unwrap().shape,
                vec![4, 4],
                "{name}"
            );
        }
        let down = dp
            .tensor("model.layers.0.mlp.down_proj.weight")
            .unwrap()
            .unwrap();
        assert_eq!(down.shape, vec![4, 2]);
    }

    #[test]
    fn quantized_columns_split_at_blocks_only() {
        let data = vec![0u8; DType::Q8_0.bytes_for(2 * 64).unwrap()];
        let src = One(HostTensor {
            dtype: DType::Q8_0,
            shape: vec![2, 64],
            data: Cow::Owned(data),
        });
        let two = ShardedSource::new(&src, 0, 2, false, false);
        let o = two
            .tensor("model.layers.0.self_attn.o_proj.weight")
            .unwrap()
            .unwrap();
        assert_eq!(o.shape, vec![2, 32]);
        assert_eq!(o.data.len(), DType::Q8_0.bytes_for(64).unwrap());
        let four = ShardedSource::new(&src, 0, 4, false, false);
        assert!(
            four.tensor("model.layers.0.self_attn.o_proj.weight")
                .is_err()
        );
    }
}
