//! [`DraftHead`]: what a drafter that reads the target's hidden states
//! needs of its head (EAGLE3's `Eagle3Head`, EAGLE's `EagleHead`; MTP's next-n layer).
//!
//! A head runs over positions `p` given the token at `p + 1` and a state of
//! position `p`: either the target's features (`feature_width` wide: its
//! [`target_layers`](DraftHead::target_layers) concatenated in order) or the
//! head's own previous output state (`hidden_size` wide). It writes its KV
//! into a cache of [`kv_spec`](DraftHead::kv_spec) and returns, at the
//! batch's `logits_rows`, logits over its draft vocabulary and its output
//! state (the next draft step's input).

use arbor_engine_core::error::Result;
use arbor_engine_core::kv::KvSpec;
use arbor_engine_core::model::{ForwardBatch, ForwardContext};
use arbor_engine_core::{DType, Tensor};

/// A head's outputs at the batch's `logits_rows`.
pub struct HeadOutput {
    /// f32 `[rows, draft_vocab]`.
    pub logits: Tensor,
    /// f32 `[rows, hidden_size]`.
    pub state: Tensor,
}

/// A draft head over the target's hidden states.
pub trait DraftHead: Send {
    /// Registered name of the drafter it makes (`eagle3`, `eagle`, `nextn`).
    fn name(&self) -> &'static str;
    /// Width of the head's own state.
    fn hidden_size(&self) -> usize;
    /// Target layers it reads (see `ForwardBatch::hidden_layers`).
    fn target_layers(&self) -> Vec<usize>;
    /// Width of the target features of one position (all its layers).
    fn feature_width(&self) -> usize;
    /// Longest sequence it runs over.
    fn max_position_embeddings(&self) -> usize;
    /// Its KV cache's shape for pages like the target's.
    fn kv_spec(&self, page_size: usize, num_pages: usize, dtype: DType) -> KvSpec;
    /// One forward; `hidden` is `[tokens, feature_width]` or `[tokens, hidden_size]`.
    fn forward(
        &self,
        batch: &ForwardBatch,
        hidden: &Tensor,
        ctx: &ForwardContext<'_>,
    ) -> Result<HeadOutput>;
    /// The target id of a draft-vocabulary id.
    fn target_id(&self, draft_id: u32) -> Result<u32>;
    /// Target features `[tokens, feature_width]` as the head's state input
    /// `[tokens, hidden_size]` (what `forward` does to them first; the
    /// features themselves when the widths agree).
    fn fuse(&self, features: &Tensor) -> Result<Tensor> {
        Ok(features.clone())
    }
}

impl DraftHead for crate::eagle3::Eagle3Head {
    fn name(&self) -> &'static str {
        "eagle3"
    }
    fn hidden_size(&self) -> usize {
        crate::eagle3::Eagle3Head::hidden_size(self)
    }
    fn target_layers(&self) -> Vec<usize> {
        self.aux_layers().to_vec()
    }
    fn feature_width(&self) -> usize {
        3 * self.config().target_hidden_size
    }
    fn max_position_embeddings(&self) -> usize {
        self.config().decoder.max_position_embeddings
    }
    fn kv_spec(&self, page_size: usize, num_pages: usize, dtype: DType) -> KvSpec {
        crate::eagle3::Eagle3Head::kv_spec(self, page_size, num_pages, dtype)
    }
    fn forward(
        &self,
        batch: &ForwardBatch,
        hidden: &Tensor,
        ctx: &ForwardContext<'_>,
    ) -> Result<HeadOutput> {
        let out = crate::eagle3::Eagle3Head::forward(self, batch, hidden, ctx)?;
        Ok(HeadOutput {
            logits: out.logits,
            state: out.aux,
        })
    }
    fn target_id(&self, draft_id: u32) -> Result<u32> {
        crate::eagle3::Eagle3Head::target_id(self, draft_id)
    }
    fn fuse(&self, features: &Tensor) -> Result<Tensor> {
        crate::eagle3::Eagle3Head::fuse(self, features)
    }
}

impl DraftHead for crate::eagle::EagleHead {
    fn name(&self) -> &'static str {
        "eagle"
    }
    fn hidden_size(&self) -> usize {
        crate::eagle::EagleHead::hidden_size(self)
    }
    fn target_layers(&self) -> Vec<usize> {
        vec![self.target_layer()]
    }
    fn feature_width(&self) -> usize {
        crate::eagle::EagleHead::hidden_size(self)
    }
    fn max_position_embeddings(&self) -> usize {
        self.config().decoder.max_position_embeddings
    }
    fn kv_spec(&self, page_size: usize, num_pages: usize, dtype: DType) -> KvSpec {
        crate::eagle::EagleHead::kv_spec(self, page_size, num_pages, dtype)
    }
    fn forward(
        &self,
        batch: &ForwardBatch,
        hidden: &Tensor,
        ctx: &ForwardContext<'_>,
    ) -> Result<HeadOutput> {
        let out = crate::eagle::EagleHead::forward(self, batch, hidden, ctx)?;
        Ok(HeadOutput {
            logits: out.logits,
            state: out.state,
        })
    }
    fn target_id(&self, draft_id: u32) -> Result<u32> {
        crate::eagle::EagleHead::target_id(self, draft_id)
    }
}
