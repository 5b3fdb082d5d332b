//! Model architectures and the forward pass interface.
//!
//! A [`ModelArchitecture`] is registered under the Hugging Face
//! `architectures` name and builds a [`Model`] from the parsed `config.json`
//! and a [`WeightSource`] (safetensors files or a GGUF file). A model owns its
//! weights and nothing else: the KV cache, the batch layout and the attention
//! implementation arrive as arguments of [`Model::forward`].
//!
//! The `model` room also holds what a model's weights are made of:
//! [`quant`] (quantization methods), [`moe`] (expert routing and sharding)
//! and [`lora`] (adapters).

pub mod lora;
pub mod moe;
pub mod quant;
use crate::backend::Backend;
use crate::backend::attention::{AttentionBackend, AttentionBatch, BatchLayout};
use crate::dtype::DType;
use crate::error::{CoreError, Result};
use crate::kv::KvCache;
use crate::model::lora::LoraSegment;
use crate::model::quant::QuantMethod;
use crate::tensor::Tensor;
use std::sync::Arc;

/// The architecture-independent shape of a loaded model.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelSpec {
    /// Registered architecture name (e.g. `LlamaForCausalLM`).
    pub architecture: String,
    /// Transformer layers.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// KV heads.
    pub num_kv_heads: usize,
    /// Dimension of one head.
    pub head_dim: usize,
    /// Hidden size.
    pub hidden_size: usize,
    /// Width of the MLP's gate/up projections.
    pub intermediate_size: usize,
    /// Vocabulary size (rows of the logits).
    pub vocab_size: usize,
    /// Longest context the model supports.
    pub max_position_embeddings: usize,
    /// Sliding attention window, when the model uses one.
    pub sliding_window: Option<usize>,
    /// Dtype most linear weights are stored in on the device.
    pub weight_dtype: DType,
    /// Bytes of all weights on the device.
    pub weight_bytes: u64,
    /// The quantization method that loaded the weights (`QuantMethod::name`),
    /// followed by `, N layers with static input scales` where W8A8 FP8
    /// layers round their inputs with the checkpoint's `input_scale`.
    pub quantization: String,
    /// The KV element type the checkpoint's KV cache scales were calibrated
    /// for (FP8 E4M3 when it declares an FP8 KV cache and carries per-layer
    /// `k_scale`/`v_scale`); `--kv-cache-dtype auto` then chooses it.
    pub checkpoint_kv_dtype: Option<DType>,
    /// The model reads its values from its keys: its KV cache stores one
    /// row per token and layer (multi-head latent attention's latent), see
    /// [`crate::KvSpec::values_in_keys`].
    pub kv_values_in_keys: bool,
    /// The recurrent state of a hybrid model's recurrent (Gated DeltaNet)
    /// layers, kept per sequence in state slots instead of KV pages; `None`
    /// for a model whose every layer is attention. Its layers keep no KV:
    /// the KV cache has [`kv_layers`](Self::kv_layers) layers.
    pub state: Option<crate::kv::state::StateSpec>,
}

impl ModelSpec {
    /// The whole model's shape from a rank's in a tensor-parallel group of
    /// `world`: the ranks' heads and MLP widths together, `weight_bytes`
    /// the sum of their weights (the hidden size and the vocabulary are
    /// every rank's).
    pub fn for_group(&self, world: usize, weight_bytes: u64) -> ModelSpec {
        let mut spec = self.clone();
        spec.num_heads *= world;
        spec.num_kv_heads *= world;
        spec.intermediate_size *= world;
        spec.weight_bytes = weight_bytes;
        spec
    }

    /// Layers that keep KV pages: every layer but the recurrent ones.
    pub fn kv_layers(&self) -> usize {
        self.num_layers - self.state.map_or(0, |s| s.layers)
    }

    /// Checks that `other` can replace a model of this spec (RL weight refit):
    /// the same architecture and tensor shapes (weight dtype and size may
    /// differ); the error names the first difference.
    pub fn same_shape(&self, other: &ModelSpec) -> crate::Result<()> {
        let fields: [(&str, String, String); 10] = [
            (
                "architecture",
                self.architecture.clone(),
                other.architecture.clone(),
            ),
            (
                "num_layers",
                self.num_layers.to_string(),
                other.num_layers.to_string(),
            ),
            (
                "num_heads",
                self.num_heads.to_string(),
                other.num_heads.to_string(),
            ),
            (
                "num_kv_heads",
                self.num_kv_heads.to_string(),
                other.num_kv_heads.to_string(),
            ),
            (
                "head_dim",
                self.head_dim.to_string(),
                other.head_dim.to_string(),
            ),
            (
                "hidden_size",
                self.hidden_size.to_string(),
                other.hidden_size.to_string(),
            ),
            (
                "intermediate_size",
                self.intermediate_size.to_string(),
                other.intermediate_size.to_string(),
            ),
            (
                "vocab_size",
                self.vocab_size.to_string(),
                other.vocab_size.to_string(),
            ),
            (
                "max_position_embeddings",
                self.max_position_embeddings.to_string(),
                other.max_position_embeddings.to_string(),
            ),
            (
                "sliding_window",
                format!("{:?}", self.sliding_window),
                format!("{:?}", other.sliding_window),
            ),
        ];
        match fields.into_iter().find(|(_, a, b)| a != b) {
            None => Ok(()),
            Some((name, a, b)) => Err(crate::CoreError::invalid(format!(
                "the new weights do not fit the served model: {name} is {b}, the served model's is {a}"
            ))),
        }
    }
}

/// The inputs of one forward pass.
#[derive(Clone, Debug)]
pub struct ForwardBatch {
    /// Token ids of the new tokens, packed sequence after sequence.
    pub input_ids: Vec<u32>,
    /// Absolute position of each new token.
    pub positions: Vec<u32>,
    /// KV layout of the batch.
    pub layout: Arc<BatchLayout>,
    /// Rows of the packed batch whose logits are wanted (usually each sequence's last).
    pub logits_rows: Vec<u32>,
    /// Layers whose output hidden states are wanted at `logits_rows` (or at
    /// every row: `hidden_at_every_row`; for EAGLE/MTP drafters): `i < num_layers` is the residual stream after
    /// layer `i`; `num_layers` is the final normed state the LM head reads.
    pub hidden_layers: Vec<usize>,
    /// LoRA adapters by packed row range (empty: the base model for every
    /// row); see [`crate::model::lora`].
    pub lora: Vec<LoraSegment>,
    /// Run only the first `n` decoder layers, then the final norm and the LM
    /// head (self-speculative layer-skip drafting); `None` runs every layer.
    /// The KV of layers past `n` is neither read nor written.
    pub exit_after: Option<usize>,
    /// Capture `hidden_layers` at every row of the batch (a drafter that
    /// reads the target's features at every computed position: EAGLE, MTP)
    /// instead of at `logits_rows`.
    pub hidden_at_every_row: bool,
}

impl ForwardBatch {
    /// Checks that ids, positions, layout and logits rows agree.
    pub fn validate(&self, vocab_size: usize) -> Result<()> {
        let n = self.input_ids.len();
        if n == 0 {
            return Err(CoreError::invalid("empty forward batch"));
        }
        if self.positions.len() != n || self.layout.num_tokens() != n {
            return Err(CoreError::invalid(format!(
                "forward batch with {n} ids, {} positions, {} slots",
                self.positions.len(),
                self.layout.num_tokens()
            )));
        }
        if let Some(bad) = self.input_ids.iter().find(|&&t| t as usize >= vocab_size) {
            return Err(CoreError::invalid(format!(
                "token id {bad} is outside the vocabulary of {vocab_size}"
            )));
        }
        if let Some(bad) = self.logits_rows.iter().find(|&&r| r as usize >= n) {
            return Err(CoreError::invalid(format!(
                "logits row {bad} past {n} tokens"
            )));
        }
        if self.exit_after == Some(0) {
            return Err(CoreError::invalid(
                "a forward pass must run at least one layer",
            ));
        }
        let mut end = 0;
        for s in &self.lora {
            if s.rows.start < end || s.rows.end > n || s.rows.is_empty() {
                return Err(CoreError::invalid(format!(
                    "LoRA segment {:?} overlaps another or leaves the {n} tokens",
                    s.rows
                )));
            }
            end = s.rows.end;
        }
        Ok(())
    }
}

/// What a forward pass returns.
#[derive(Clone, Debug)]
pub struct ForwardOutput {
    /// f32 logits `[logits_rows.len(), vocab_size]` on the device.
    pub logits: Tensor,
    /// One f32 `[logits_rows.len(), hidden_size]` tensor (`[tokens,
    /// hidden_size]` with `hidden_at_every_row`) per entry of
    /// [`ForwardBatch::hidden_layers`], in that order.
    pub hidden: Vec<Tensor>,
}

/// The per-batch state a forward pass reads and writes.
pub struct ForwardContext<'a> {
    /// The KV cache; new K and V are written into it.
    pub kv: &'a KvCache,
    /// The attention implementation.
    pub attention: &'a dyn AttentionBackend,
    /// The batch layout prepared by `attention`.
    pub attention_batch: &'a AttentionBatch,
}

/// A loaded model.
pub trait Model: Send + Sync {
    /// The model's shape.
    fn spec(&self) -> &ModelSpec;
    /// Runs the batch: logits of `logits_rows`, and the hidden states of
    /// `hidden_layers` at those rows.
    fn forward(&self, batch: &ForwardBatch, ctx: &ForwardContext<'_>) -> Result<ForwardOutput>;
    /// The input embedding table `[vocab, hidden]` on the device, for a
    /// drafter that shares it (an EAGLE head without its own); `None` when
    /// the model does not expose it.
    fn input_embedding(&self) -> Option<Tensor> {
        None
    }
    /// The LM head `[vocab, hidden]` on the device (the input embedding when
    /// tied), for a drafter that shares it; `None` when not exposed.
    fn lm_head(&self) -> Option<Tensor> {
        None
    }
    /// The final norm's weight `[hidden]` on the device, for a drafter that
    /// shares it; `None` when not exposed.
    fn final_norm(&self) -> Option<Tensor> {
        None
    }
    /// Tokens routed to each expert of each MoE layer so far (empty for a
    /// dense model).
    fn expert_load(&self) -> Vec<crate::model::moe::ExpertLoad> {
        Vec::new()
    }
}

/// Checkpoint tensors: declared beside [`crate::tensor::HostTensor`] (the quantization
/// methods read them without depending on models).
pub use crate::tensor::WeightSource;

/// How a model is loaded.
#[derive(Clone)]
pub struct LoadOptions {
    /// Device to put the weights on.
    pub backend: Arc<dyn Backend>,
    /// How linear weights are stored.
    pub quant: Arc<dyn QuantMethod>,
    /// Called with (tensors loaded, tensors total) as loading progresses.
    pub progress: Option<Arc<dyn Fn(usize, usize) + Send + Sync>>,
}

/// One rank's share of a tensor-parallel model (and of its experts, with
/// expert parallelism): the rank and group size come from `comm`.
#[derive(Clone)]
pub struct ShardSpec {
    /// This rank's end of the group; the model reduces its partial sums
    /// through it.
    pub comm: Arc<dyn crate::comm::Communicator>,
    /// How the ranks share the routed experts of a MoE model.
    pub experts: crate::model::moe::ExpertSharding,
    /// How the ranks share attention.
    pub attention: AttentionSharding,
}

/// How the ranks of a group share attention.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttentionSharding {
    /// Heads split over the ranks; every rank sees every token (tensor
    /// parallelism).
    #[default]
    Heads,
    /// Data-parallel attention (SGLang's `--enable-dp-attention`): each rank
    /// holds the whole attention, embeddings and LM head and runs its own
    /// requests' tokens with a KV cache of its own; the feed-forward layers
    /// stay sharded and run on every rank's tokens, gathered before and
    /// handed back after each one. A rank with no tokens still joins every
    /// layer's collectives.
    DataParallel,
}

impl std::fmt::Debug for ShardSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ShardSpec(rank {} of {}, experts: {:?}, attention: {:?})",
            self.comm.rank(),
            self.comm.world_size(),
            self.experts,
            self.attention
        )
    }
}

/// A model architecture: builds models of one `architectures` name.
pub trait ModelArchitecture: Send + Sync {
    /// Loads a model from its `config.json` value and weights.
    fn load(
        &self,
        config: &serde_json::Value,
        weights: &dyn WeightSource,
        options: &LoadOptions,
    ) -> Result<Box<dyn Model>>;

    /// Loads one rank's shard of the model (tensor parallelism): only that
    /// rank's slices of the weights, heads split, partial sums reduced
    /// through `shard.comm`. Architectures without it refuse.
    fn load_shard(
        &self,
        _config: &serde_json::Value,
        _weights: &dyn WeightSource,
        _options: &LoadOptions,
        _shard: &ShardSpec,
    ) -> Result<Box<dyn Model>> {
        Err(CoreError::unsupported(
            "tensor parallelism for this architecture",
        ))
    }
}
