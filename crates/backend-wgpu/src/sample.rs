//! Sampling on the device: one workgroup per logits row picks the token
//! (`sample.wgsl`), so only the ids are read back.
//!
//! Greedy rows take the argmax (lowest index among ties, as the host). Other
//! rows keep the tokens passing the top-k, top-p and min-p thresholds (ties
//! at a threshold are kept) and draw one with a uniform value hashed from the
//! row's seed, so the same seed and logits give the same token. The draw maps
//! to tokens in id order, so it selects from the same distribution as the
//! host's `StandardSampler` but not always the same token for a given seed.
//!
//! Logit edits (penalties, logit bias, `min_new_tokens`, grammar masks) run
//! before, in place: one invocation per token edit (`edit_tokens.wgsl`),
//! then one per token of each masked row (`mask_rows.wgsl`), with the bits
//! of `LogitEdits::apply` on the host. Logprob statistics (log-sum-exp and
//! the top alternatives of a row) take one workgroup per row
//! (`logprob_stats.wgsl`).

use crate::context::{Access, Params};
use crate::kernels::{Kernel, grid, grid_threads};
use crate::{WgpuBackend, u32_of};
use arbor_engine_core::backend::SampleRow;
use arbor_engine_core::{CoreError, DType, LogitEdits, Result, Tensor};

/// Words of parameters per row in the kernel's layout.
const ROW_WORDS: usize = 8;

pub fn sample(b: &WgpuBackend, logits: &Tensor, rows: &[SampleRow], out: &Tensor) -> Result<()> {
    let vocab = logits.row_len();
    if logits.dtype() != DType::F32
        || logits.rows() != rows.len()
        || out.dtype() != DType::U32
        || out.numel() != rows.len()
    {
        return Err(CoreError::invalid(format!(
            "sample {} rows of {logits:?} into {out:?}",
            rows.len()
        )));
    }
    out.check_no_overlap(&[logits])?;
    if rows.is_empty() {
        return Ok(());
    }
    if vocab == 0 {
        return Err(CoreError::invalid("sampling from empty logits"));
    }
    let mut words = Vec::with_capacity(rows.len() * ROW_WORDS);
    for r in rows {
        if !(r.top_p > 0.0 && r.top_p <= 1.0 && (0.0..=1.0).contains(&r.min_p)) {
            return Err(CoreError::invalid(format!(
                "sampling row {r:?}: top_p must be in (0, 1] and min_p in [0, 1]"
            )));
        }
        words.extend_from_slice(&[
            r.temperature.to_bits(),
            r.top_k,
            r.top_p.to_bits(),
            r.min_p.to_bits(),
            r.seed as u32,
            (r.seed >> 32) as u32,
            0,
            0,
        ]);
    }
    let params_t = b.upload_words(&words)?;
    let probs = b.alloc_uninit(DType::F32, &[rows.len(), vocab])?;
    let lv = b.view(logits, DType::F32, Access::Read)?;
    let pv = b.view(&params_t, DType::U32, Access::Read)?;
    let sv = b.view(&probs, DType::F32, Access::Write)?;
    let ov = b.view(out, DType::U32, Access::Write)?;
    let gpu = b.gpu();
    let pipe = gpu.kernel(&Kernel::Sample)?;
    let params = Params::new()
        .us(rows.len())?
        .u(u32_of(vocab, "vocabulary")?)
        .u(lv.word_off())
        .u(ov.word_off())
        .u(pv.word_off())
        .u(0)
        .u(0)
        .u(0);
    let groups = grid(rows.len(), gpu.limits.max_compute_workgroups_per_dimension)?;
    gpu.dispatch(&pipe, &params, &[&lv, &pv, &sv, &ov], groups)
}

/// [`Backend::edit_logits`](arbor_engine_core::Backend::edit_logits) on the device.
pub fn edit_logits(b: &WgpuBackend, logits: &Tensor, edits: &LogitEdits) -> Result<()> {
    if logits.dtype() != DType::F32 {
        return Err(CoreError::invalid(format!("logit edits on {logits:?}")));
    }
    let vocab = logits.row_len();
    edits.check(logits.rows(), vocab)?;
    let gpu = b.gpu();
    let max = gpu.limits.max_compute_workgroups_per_dimension;
    let lv = b.view(logits, DType::F32, Access::Write)?;
    if !edits.tokens.is_empty() {
        let words: Vec<u32> = edits.tokens.iter().flat_map(|e| e.device_words()).collect();
        let et = b.upload_words(&words)?;
        let ev = b.view(&et, DType::U32, Access::Read)?;
        let params = Params::new()
            .us(edits.tokens.len())?
            .u(u32_of(vocab, "vocabulary")?)
            .u(lv.word_off())
            .u(ev.word_off())
            .u(0)
            .u(0)
            .u(0)
            .u(0);
        let pipe = gpu.kernel(&Kernel::EditTokens)?;
        let groups = grid_threads(edits.tokens.len(), max)?;
        gpu.dispatch(&pipe, &params, &[&lv, &ev], groups)?;
    }
    if !edits.mask_rows.is_empty() {
        let rt = b.upload_words(&edits.mask_rows)?;
        let mt = b.upload_words(&edits.mask_bits)?;
        let rv = b.view(&rt, DType::U32, Access::Read)?;
        let mv = b.view(&mt, DType::U32, Access::Read)?;
        let params = Params::new()
            .us(edits.mask_rows.len())?
            .u(u32_of(vocab, "vocabulary")?)
            .us(edits.mask_words)?
            .u(lv.word_off())
            .u(rv.word_off())
            .u(mv.word_off())
            .u(0)
            .u(0);
        let pipe = gpu.kernel(&Kernel::MaskRows)?;
        let groups = grid_threads(edits.mask_rows.len() * vocab, max)?;
        gpu.dispatch(&pipe, &params, &[&lv, &rv, &mv], groups)?;
    }
    Ok(())
}

/// [`Backend::logprob_stats`](arbor_engine_core::Backend::logprob_stats) on the device.
pub fn logprob_stats(
    b: &WgpuBackend,
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
    let lv = b.view(logits, DType::F32, Access::Read)?;
    let sv = b.view(lse, DType::F32, Access::Write)?;
    let iv = b.view(top_ids, DType::U32, Access::Write)?;
    let vv = b.view(top_logprobs, DType::F32, Access::Write)?;
    let gpu = b.gpu();
    let pipe = gpu.kernel(&Kernel::LogprobStats)?;
    let params = Params::new()
        .us(rows)?
        .u(u32_of(logits.row_len(), "vocabulary")?)
        .us(top)?
        .u(lv.word_off())
        .u(sv.word_off())
        .u(iv.word_off())
        .u(vv.word_off())
        .u(0);
    let groups = grid(rows, gpu.limits.max_compute_workgroups_per_dimension)?;
    gpu.dispatch(&pipe, &params, &[&lv, &sv, &iv, &vv], groups)
}
