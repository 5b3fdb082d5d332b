//! Device sampling ([`Backend::sample`](arbor_engine_core::Backend::sample)):
//! one block per row picks a token on the GPU (kernels/sampling.cu), so only
//! the ids cross to the host.
//!
//! Greedy rows give exactly the host's argmax. Other rows follow the same
//! distribution as the host's `StandardSampler` after temperature, top-k,
//! top-p and min-p, and the row's seed determines the draw (the same uniform
//! as `SeqRng::new(seed).next_f32()`), but the token drawn for a given seed
//! can differ from the host's, which walks its candidates in another order.
//! Tokens tied at the top-k or top-p boundary are all kept here.

use crate::GpuBackend;
use crate::exec::Args;
use crate::kernels::K;
use arbor_engine_core::backend::SampleRow;
use arbor_engine_core::{CoreError, DType, Result, Tensor};

impl GpuBackend {
    pub(crate) fn op_sample(
        &self,
        logits: &Tensor,
        rows: &[SampleRow],
        out: &Tensor,
    ) -> Result<()> {
        logits.check_dtype(DType::F32)?;
        out.check_dtype(DType::U32)?;
        let vocab = logits.row_len();
        if logits.rows() != rows.len() || out.numel() != rows.len() || vocab == 0 {
            return Err(CoreError::invalid(format!(
                "sample {} rows of {logits:?} into {out:?}",
                rows.len()
            )));
        }
        if rows.is_empty() {
            return Ok(());
        }
        let mut params = Vec::with_capacity(rows.len() * 24);
        for r in rows {
            for v in [
                r.temperature.to_bits(),
                r.top_k,
                r.top_p.to_bits(),
                r.min_p.to_bits(),
                r.seed as u32,
                (r.seed >> 32) as u32,
            ] {
                params.extend_from_slice(&v.to_le_bytes());
            }
        }
        let mut st = self.dev.lock()?;
        let n = st.rows(rows.len(), &[logits, out]);
        // Padded rows are greedy (all-zero parameters) and never read back.
        let pt = self.alloc_in(&mut st, DType::U32, &[n, 6], false)?;
        let pp = self.p(&st, &pt)?;
        self.dev.upload_to(&mut st, pp, &params, n * 24)?;
        let args = Args::new()
            .p(self.p(&st, logits)?)
            .p(pp)
            .p(self.p(&st, out)?)
            .i(n)
            .i(vocab);
        self.dev
            .launch(&mut st, K::SampleRows, [n, 1, 1], 1024, 0, args)
    }
}
