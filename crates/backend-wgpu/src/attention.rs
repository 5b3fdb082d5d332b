//! Paged attention on the device: causal prefill over a cached prefix,
//! decode and draft trees, with grouped-query attention and an optional
//! sliding window.
//!
//! [`WgpuAttention::prepare`] uploads the batch layout once as one u32 tensor
//! ([`Meta`]): per sequence `(q_start, q_len, prefix_len, first page-table
//! index)`, the page table, the slot of every new token, the sequence of
//! every new token and, when some sequence is a draft tree, the tree masks of
//! [`BatchLayout::tree_mask_words`] (four words per new token). `forward` then
//! records two dispatches per layer: `kv_write.wgsl` stores the new K and V
//! rows in their slots (converted to the cache dtype), and `attention.wgsl`
//! computes, for every (token, query head), an online softmax over the keys
//! the token sees, read through the page table: exactly the keys the CPU
//! backend uses. On an adapter that caps an invocation's loop iterations
//! (llvmpipe: 65,535 in all, then every loop silently ends) the walk is
//! split over several attention dispatches of at most
//! `WgpuAttention::chunk_keys` positions, the running maximum, sum and tree
//! depth kept in a state tensor and the unnormalized accumulator in `out`
//! between them: the same operations in the same order, so the same bits.
//!
//! Visibility and order: a chain's token at position `pos` sees the keys
//! `lo..=pos` (`lo = pos + 1 - window` with a sliding window, else 0); a
//! tree token at depth `d` (position `pos = prefix_len + d`) sees the prefix
//! keys from `lo`, then its ancestors root first, then itself, each kept when
//! its position (`prefix_len` + its depth) is at least `lo`. One loop body
//! consumes the keys in that order, so a tree token's output has the same
//! bits as the same token computed in a chain of only its ancestors.
//!
//! Invariant: the layout is validated on the host (pages and slots inside the
//! cache, sequences packed in order, trees well formed and of at most
//! [`arbor_engine_core::TREE_MASK_TOKENS`] tokens) before any kernel reads it.

use crate::context::{Access, Params, View};
use crate::kernels::{self, Kernel, grid_threads};
use crate::{WgpuBackend, u32_of};
use arbor_engine_core::{
    AttentionBackend, AttentionBatch, AttentionCapabilities, AttentionParams, BatchLayout,
    CoreError, DType, KvLayer, KvScales, Result, TREE_MASK_WORDS, Tensor,
};
use std::sync::Arc;

/// `tree_off` of the attention shader when no sequence is a tree.
const NO_TREE: u32 = u32::MAX;

/// The paged attention of the wgpu backend.
pub struct WgpuAttention {
    backend: WgpuBackend,
    /// The state binding of dispatches that walk in one go (never read).
    no_state: std::sync::OnceLock<Tensor>,
}

/// Word offsets of the sections of the uploaded layout.
#[derive(Clone, Copy, Debug)]
struct Meta {
    seqs: usize,
    page_table: usize,
    slots: usize,
    token_seq: usize,
    /// The tree masks, when some sequence is a tree.
    tree: Option<usize>,
    len: usize,
}

impl Meta {
    fn of(layout: &BatchLayout) -> Self {
        let seqs = 0;
        let page_table = 4 * layout.seqs.len();
        let slots = page_table + layout.page_table.len();
        let token_seq = slots + layout.slot_mapping.len();
        let trees = token_seq + layout.num_tokens();
        let (tree, len) = if layout.has_tree() {
            (Some(trees), trees + TREE_MASK_WORDS * layout.num_tokens())
        } else {
            (None, trees)
        };
        Self {
            seqs,
            page_table,
            slots,
            token_seq,
            tree,
            len,
        }
    }
}

/// One attention call's views and cache format, shared by its KV write
/// and its attention dispatches.
struct Call {
    meta: Meta,
    /// The batch metadata, q, the new K and V rows, and the output.
    mv: View,
    qv: View,
    kv_in: View,
    vv_in: View,
    ov: View,
    /// The cache's element code ([`kernels::cache_code`]).
    cdt: u32,
    scales: KvScales,
}

/// Checks the KV cache against the step's K and V (no overlap; K and V
/// caches alike; whole heads of `head_dim` per row, which must be even) and
/// returns its element code.
fn check_cache(kv: &KvLayer, k: &Tensor, v: &Tensor, p: &AttentionParams) -> Result<u32> {
    let (hd, nkv) = (p.head_dim, p.num_kv_heads);
    let kw = nkv * hd;
    // A latent cache's values are its keys: one buffer, written once per
    // row with the same values through both bindings.
    if kv.values_in_keys() {
        kv.k.check_no_overlap(&[k, v])?;
    } else {
        kv.k.check_no_overlap(&[&kv.v, k, v])?;
    }
    kv.v.check_no_overlap(&[k, v])?;
    if kv.k.dtype() != kv.v.dtype() || kv.k.numel() != kv.v.numel() {
        return Err(CoreError::invalid(format!(
            "KV cache tensors {:?} and {:?} differ",
            kv.k, kv.v
        )));
    }
    for c in [&kv.k, &kv.v] {
        if !c.numel().is_multiple_of(kw) || c.row_len() != hd {
            return Err(CoreError::invalid(format!(
                "KV cache tensor {c:?} for {nkv} heads of {hd}"
            )));
        }
    }
    let cdt = kernels::cache_code(kv.k.dtype())?;
    if !hd.is_multiple_of(2) {
        return Err(CoreError::unsupported(format!(
            "attention with an odd head_dim {hd} on the wgpu backend"
        )));
    }
    Ok(cdt)
}

/// The kernels read the cache by 32-bit words: an FP8 cache needs a
/// head_dim that is a multiple of 4, and every cache a word-aligned start
/// and row.
fn check_cache_alignment(kv: &KvLayer, kw: usize, hd: usize, cdt: u32) -> Result<()> {
    if cdt >= 3 && !hd.is_multiple_of(4) {
        return Err(CoreError::unsupported(format!(
            "an FP8 KV cache with head_dim {hd} (not a multiple of 4) on the wgpu backend"
        )));
    }
    for c in [&kv.k, &kv.v] {
        if !c.offset().is_multiple_of(4) || !(kw * c.dtype().block_bytes()).is_multiple_of(4) {
            return Err(CoreError::invalid(format!(
                "KV cache {c:?} is not word-aligned"
            )));
        }
    }
    Ok(())
}

impl WgpuAttention {
    pub(crate) fn new(backend: WgpuBackend) -> Self {
        Self {
            backend,
            no_state: std::sync::OnceLock::new(),
        }
    }

    /// Cache positions one dispatch walks per (token, head), or `None` for
    /// the whole walk: on an adapter that caps the loop iterations of an
    /// invocation ([`crate::context::Gpu::loop_budget`]), as many as fit
    /// beside the loops over the head (load q, resume, save: `3 * hd / 2`)
    /// with each position costing `hd + 1` iterations (scores, values, the
    /// walk) and a margin for how the driver counts loop entries and exits
    /// (measured on llvmpipe: `hd + 1` per position alone overruns).
    fn chunk_keys(&self, hd: usize, longest_walk: usize) -> Option<usize> {
        let budget = self.backend.gpu().loop_budget()? * 9 / 10;
        let per_key = hd + 4;
        let fixed = 2 * hd + 256;
        let chunk = (budget.saturating_sub(fixed) / per_key).max(1);
        (fixed + longest_walk * per_key > budget).then_some(chunk)
    }

    /// Writes the step's new K and V rows into their cache slots (converted
    /// to the cache's element type, times its scales).
    fn write_kv(&self, c: &Call, kv: &KvLayer, tokens: usize, kw: usize) -> Result<()> {
        let b = &self.backend;
        let gpu = b.gpu();
        let maxg = gpu.limits.max_compute_workgroups_per_dimension;
        let kcw = b.view(&kv.k, kv.k.dtype(), Access::Write)?;
        let vcw = b.view(&kv.v, kv.v.dtype(), Access::Write)?;
        let write = gpu.kernel(&Kernel::KvWrite { cdt: c.cdt })?;
        let params = Params::new()
            .us(tokens)?
            .us(kw)?
            .u(c.kv_in.word_off())
            .u(c.vv_in.word_off())
            .u(kcw.word_off())
            .u(vcw.word_off())
            .u(c.mv.word_off() + u32_of(c.meta.slots, "metadata offset")?)
            .u(0)
            .f(c.scales.k)
            .f(c.scales.v);
        let per_token = match c.cdt {
            0 => kw,
            1 | 2 => kw / 2,
            _ => kw / 4,
        };
        gpu.dispatch(
            &write,
            &params,
            &[&c.kv_in, &c.vv_in, &c.mv, &kcw, &vcw],
            grid_threads(tokens * per_token, maxg)?,
        )
    }

    /// Attention over the paged keys and values: one dispatch, or one per
    /// chunk of keys when the longest walk would pass the device's loop
    /// budget (the chunks carry their state in a scratch buffer).
    fn attend(
        &self,
        c: &Call,
        kv: &KvLayer,
        layout: &BatchLayout,
        p: &AttentionParams,
    ) -> Result<()> {
        let b = &self.backend;
        let gpu = b.gpu();
        let maxg = gpu.limits.max_compute_workgroups_per_dimension;
        let (tokens, hd, nh) = (layout.num_tokens(), p.head_dim, p.num_heads);
        let kcr = b.view(&kv.k, kv.k.dtype(), Access::Read)?;
        let vcr = b.view(&kv.v, kv.v.dtype(), Access::Read)?;
        let attn = gpu.kernel(&Kernel::Attention { cdt: c.cdt, hd })?;
        let off = |s: usize| -> Result<u32> { Ok(c.mv.word_off() + u32_of(s, "metadata offset")?) };
        // Positions a token walks: at most its sequence's length.
        let longest = layout
            .seqs
            .iter()
            .map(|s| s.prefix_len + s.q_len)
            .max()
            .unwrap_or(0);
        let chunk = self.chunk_keys(hd, longest);
        let state = match chunk {
            Some(_) => b.alloc_uninit(DType::U32, &[tokens * nh * 4])?,
            None => match self.no_state.get() {
                Some(t) => t.clone(),
                None => {
                    let t = b.alloc_uninit(DType::U32, &[4])?;
                    self.no_state.get_or_init(|| t).clone()
                }
            },
        };
        let sv = b.view(&state, DType::U32, Access::Write)?;
        let (step, dispatches) = match chunk {
            Some(c) => (c, longest.div_ceil(c)),
            None => (0, 1),
        };
        let meta = c.meta;
        for d in 0..dispatches {
            let params = Params::new()
                .us(tokens)?
                .us(nh)?
                .us(p.num_kv_heads)?
                .us(layout.page_size)?
                .u(c.qv.word_off())
                .u(c.ov.word_off())
                .u(kcr.word_off())
                .u(vcr.word_off())
                .u(off(meta.seqs)?)
                .u(off(meta.page_table)?)
                .u(off(meta.token_seq)?)
                .us(p.sliding_window.unwrap_or(0))?
                .f(p.scale)
                .u(match meta.tree {
                    Some(t) => off(t)?,
                    None => NO_TREE,
                })
                .us(step)?
                .us(d * step)?
                .u(sv.word_off())
                .f(c.scales.k)
                .f(c.scales.v);
            gpu.dispatch(
                &attn,
                &params,
                &[&c.qv, &c.mv, &kcr, &vcr, &c.ov, &sv],
                grid_threads(tokens * nh, maxg)?,
            )?;
        }
        Ok(())
    }

    fn f32_input(&self, t: &Tensor, rows: usize, width: usize, what: &str) -> Result<()> {
        if t.dtype() != DType::F32 || t.rows() != rows || t.row_len() != width {
            return Err(CoreError::invalid(format!(
                "attention {what} {t:?}, expected f32 [{rows}, {width}]"
            )));
        }
        Ok(())
    }
}

impl AttentionBackend for WgpuAttention {
    fn name(&self) -> &str {
        "wgpu-paged"
    }

    fn capabilities(&self) -> AttentionCapabilities {
        AttentionCapabilities {
            tree: true,
            max_head_dim: None,
        }
    }

    fn prepare(&self, layout: Arc<BatchLayout>) -> Result<AttentionBatch> {
        // Slots are checked against the cache in `forward`; the sequences here.
        layout.validate(layout.needed_slots())?;
        let trees = layout.tree_mask_words()?;
        let meta = Meta::of(&layout);
        let mut words = Vec::with_capacity(meta.len);
        for s in &layout.seqs {
            words.push(u32_of(s.q_start, "token index")?);
            words.push(u32_of(s.q_len, "sequence length")?);
            words.push(u32_of(s.prefix_len, "prefix length")?);
            words.push(u32_of(s.pages.start, "page-table index")?);
        }
        words.extend_from_slice(&layout.page_table);
        words.extend_from_slice(&layout.slot_mapping);
        for (i, s) in layout.seqs.iter().enumerate() {
            let i = u32_of(i, "sequence index")?;
            words.extend(std::iter::repeat_n(i, s.q_len));
        }
        if let Some(t) = trees {
            words.extend_from_slice(&t);
        }
        debug_assert_eq!(words.len(), meta.len);
        let device = self.backend.upload_words(&words)?;
        Ok(AttentionBatch {
            layout,
            device: vec![device],
        })
    }

    fn forward(
        &self,
        batch: &AttentionBatch,
        kv: &KvLayer,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        p: &AttentionParams,
    ) -> Result<()> {
        p.validate()?;
        let b = &self.backend;
        let layout = &*batch.layout;
        let tokens = layout.num_tokens();
        let (hd, nh, nkv) = (p.head_dim, p.num_heads, p.num_kv_heads);
        let (qw, kw) = (nh * hd, nkv * hd);
        self.f32_input(q, tokens, qw, "q")?;
        self.f32_input(k, tokens, kw, "k")?;
        self.f32_input(v, tokens, kw, "v")?;
        self.f32_input(out, tokens, qw, "out")?;
        out.check_no_overlap(&[q, k, v, &kv.k, &kv.v])?;
        let cdt = check_cache(kv, k, v, p)?;
        let slots = kv.k.numel() / kw;
        layout.validate(slots)?;
        if tokens == 0 {
            return Ok(());
        }
        let meta_t = batch
            .device
            .first()
            .ok_or_else(|| CoreError::invalid("attention batch was not prepared by wgpu-paged"))?;
        let meta = Meta::of(layout);
        if meta_t.dtype() != DType::U32 || meta_t.numel() < meta.len {
            return Err(CoreError::invalid(format!(
                "attention batch metadata {meta_t:?} does not match its layout"
            )));
        }
        let call = Call {
            meta,
            mv: b.view(meta_t, DType::U32, Access::Read)?,
            qv: b.view(q, DType::F32, Access::Read)?,
            kv_in: b.view(k, DType::F32, Access::Read)?,
            vv_in: b.view(v, DType::F32, Access::Read)?,
            ov: b.view(out, DType::F32, Access::Write)?,
            cdt,
            scales: p.kv_scales.for_cache(kv.k.dtype()),
        };
        check_cache_alignment(kv, kw, hd, cdt)?;
        self.write_kv(&call, kv, tokens, kw)?;
        self.attend(&call, kv, layout, p)
    }
}
