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
//!
//! Logit edits (penalties, logit bias, `min_new_tokens`, grammar masks,
//! [`LogitEdits`]) run before, in place: one thread per token edit, then one
//! per token of each masked row, with the bits of `LogitEdits::apply` on the
//! host. Their sizes change from step to step, so a step that edits logits
//! runs without a graph. Logprob statistics (log-sum-exp and the top
//! alternatives of a row) take one block per row.

use crate::GpuBackend;
use crate::exec::Args;
use crate::kernels::K;
use arbor_engine_core::backend::SampleRow;
use arbor_engine_core::{CoreError, DType, LogitEdits, Result, Tensor};

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

    pub(crate) fn op_edit_logits(&self, logits: &Tensor, edits: &LogitEdits) -> Result<()> {
        logits.check_dtype(DType::F32)?;
        let (rows, vocab) = (logits.rows(), logits.row_len());
        edits.check(rows, vocab)?;
        if edits.is_empty() {
            return Ok(());
        }
        let words = |v: &mut Vec<u8>, w: u32| v.extend_from_slice(&w.to_le_bytes());
        let mut st = self.dev.lock()?;
        st.no_graph("logit edits change size every step");
        let lp = self.p(&st, logits)?;
        if !edits.tokens.is_empty() {
            let n = edits.tokens.len();
            let mut bytes = Vec::with_capacity(n * 24);
            for e in &edits.tokens {
                e.device_words()
                    .into_iter()
                    .for_each(|w| words(&mut bytes, w));
            }
            let et = self.alloc_in(&mut st, DType::U32, &[n, 6], false)?;
            let ep = self.p(&st, &et)?;
            self.dev.upload_to(&mut st, ep, &bytes, bytes.len())?;
            let args = Args::new().p(lp).p(ep).i(n).i(vocab);
            self.dev.launch(
                &mut st,
                K::EditTokens,
                [n.div_ceil(256), 1, 1],
                256,
                0,
                args,
            )?;
        }
        let masked = edits.mask_rows.len();
        if masked > 0 {
            if masked > 65535 {
                return Err(CoreError::invalid(format!(
                    "grammar masks on {masked} rows in one step"
                )));
            }
            let mut rb = Vec::with_capacity(masked * 4);
            edits.mask_rows.iter().for_each(|&r| words(&mut rb, r));
            let mut mb = Vec::with_capacity(edits.mask_bits.len() * 4);
            edits.mask_bits.iter().for_each(|&w| words(&mut mb, w));
            let rt = self.alloc_in(&mut st, DType::U32, &[masked], false)?;
            let mt = self.alloc_in(&mut st, DType::U32, &[edits.mask_bits.len().max(1)], false)?;
            let (rp, mp) = (self.p(&st, &rt)?, self.p(&st, &mt)?);
            self.dev.upload_to(&mut st, rp, &rb, rb.len())?;
            self.dev.upload_to(&mut st, mp, &mb, mb.len())?;
            let args = Args::new()
                .p(lp)
                .p(rp)
                .p(mp)
                .i(masked)
                .i(vocab)
                .i(edits.mask_words);
            self.dev.launch(
                &mut st,
                K::MaskRows,
                [vocab.div_ceil(256), masked, 1],
                256,
                0,
                args,
            )?;
        }
        Ok(())
    }

    pub(crate) fn op_logprob_stats(
        &self,
        logits: &Tensor,
        top: usize,
        lse: &Tensor,
        top_ids: &Tensor,
        top_logprobs: &Tensor,
    ) -> Result<()> {
        arbor_engine_core::backend::check_logprob_stats(logits, top, lse, top_ids, top_logprobs)?;
        let rows = logits.rows();
        if rows == 0 {
            return Ok(());
        }
        let mut st = self.dev.lock()?;
        // Which rows want logprobs changes from step to step.
        st.no_graph("logprob statistics");
        let args = Args::new()
            .p(self.p(&st, logits)?)
            .p(self.p(&st, lse)?)
            .p(self.p(&st, top_ids)?)
            .p(self.p(&st, top_logprobs)?)
            .i(rows)
            .i(logits.row_len())
            .i(top);
        self.dev
            .launch(&mut st, K::LogprobStats, [rows, 1, 1], 256, 0, args)
    }
}
