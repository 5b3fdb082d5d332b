//! The multi-token prediction (MTP) layer that Qwen3.5 and Qwen3-Next
//! checkpoints ship under `mtp.*`, loaded as a one-layer hybrid model for
//! the NEXTN drafter (SGLang's `Qwen3_5ForCausalLMMTP`).
//!
//! `mtp.layers.0.*` is one gated full-attention decoder layer (dense or
//! mixture-of-experts like the target's layers) and `mtp.norm` its final
//! (1 + w) norm. The model has no embedding table: it runs from the input
//! the drafter builds (`mtp.fc` over the normed token embedding and the
//! normed target state, which the drafter reads), and shares the target's
//! LM head. Its config is the target's text config with one
//! `full_attention` layer (SGLang's `num_hidden_layers = 1`,
//! `full_attention_interval = 1`); its feed-forward is sparse unless the
//! target's `mlp_only_layers` names layer 0.

use super::{HybridArchitecture, HybridConfig, HybridModel, LayerKind};
use arbor_engine_core::{CoreError, HostTensor, LoadOptions, Result, Tensor, WeightSource};
use serde_json::Value;

/// The config key that gives the number of MTP layers (in the text config).
pub const MTP_LAYERS_KEY: &str = "mtp_num_hidden_layers";

/// The parsed text config of a hybrid checkpoint's `config.json`; `None`
/// when its architecture is not a hybrid one.
pub fn hybrid_config(v: &Value) -> Result<Option<HybridConfig>> {
    let arch = v
        .get("architectures")
        .and_then(|a| a.get(0))
        .and_then(Value::as_str);
    match arch.and_then(HybridArchitecture::named) {
        Some(a) => HybridConfig::from_json(v, a.flavor, a.sparse).map(Some),
        None => Ok(None),
    }
}

/// `mtp.*` under the names the one-layer model reads.
struct MtpSource<'a> {
    inner: &'a dyn WeightSource,
}

impl WeightSource for MtpSource<'_> {
    fn describe(&self) -> String {
        format!("{} (MTP layer)", self.inner.describe())
    }

    fn tensor(&self, name: &str) -> Result<Option<HostTensor<'_>>> {
        if name == "model.norm.weight" {
            return self.inner.tensor("mtp.norm.weight");
        }
        match name.strip_prefix("model.layers.0.") {
            Some(rest) => self.inner.tensor(&format!("mtp.layers.0.{rest}")),
            None => Ok(None),
        }
    }
}

/// Loads the MTP layer of a checkpoint whose target config is `cfg`, with
/// `lm_head` (the target's) as its LM head. Errors name the checkpoint's
/// tensors (`mtp.layers.0.…`, `mtp.norm.weight`).
pub fn load_mtp_layer(
    cfg: &HybridConfig,
    weights: &dyn WeightSource,
    opts: &LoadOptions,
    lm_head: Tensor,
) -> Result<HybridModel> {
    let mut one = cfg.clone();
    one.base.num_hidden_layers = 1;
    one.layer_types = vec![LayerKind::Attention];
    one.state.layers = 0;
    if let Some(m) = &mut one.moe {
        m.dense_layers.retain(|&l| l == 0);
    }
    HybridModel::load_from_embeds(one, &MtpSource { inner: weights }, opts, lm_head).map_err(|e| {
        match e {
            CoreError::ModelLoad(m) => CoreError::ModelLoad(
                m.replace("'model.layers.0.", "'mtp.layers.0.")
                    .replace("'model.norm.weight'", "'mtp.norm.weight'"),
            ),
            other => other,
        }
    })
}
