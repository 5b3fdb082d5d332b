//! Paged attention on the GPU (`cuda-paged`): KV writes into pages, decode as
//! flash-decoding and prefill over a cached prefix, with draft trees
//! (kernels/attention.cu). The cache holds f32, f16, bf16 or FP8 (E4M3,
//! E5M2: stored `fp8(x / scale)`, read `stored * scale` with the layer's
//! `KvScales`; kernels/fp8.cuh converts as the CPU backend does). Heads are
//! up to [`MAX_HEAD_DIM`] wide (latent attention's 576 included).
//!
//! `prepare` validates the layout on the host and uploads it once per batch:
//! `seq_info` ([seqs, 4] i32: q_start, q_len, kv_len, page_start),
//! `page_table` (u32) and `slot_mapping` (u32, one slot per new token), and,
//! when some sequence is a draft tree of more than one token, its masks
//! ([`BatchLayout::tree_mask_words`], four u32 per new token) for the prefill
//! kernels, which then mask each key tile by them; without a tree they get a
//! null pointer and mask causally as before. A one-token tree is a decode (it
//! sees the prefix and itself, at position `prefix_len`). A pure
//! decode batch that fits a CUDA-graph bucket also opens the backend's graph
//! step here (see [`crate::exec`]): its metadata is padded to the bucket with
//! empty sequences (kv_len 0, written as zeros) and slots 0xffffffff (skipped),
//! and its page table to a power-of-two capacity, so batches of the same
//! bucket have identical launches. What `forward` needs on the host (sizes,
//! the largest slot) is kept in a small table keyed by the batch's first
//! device buffer.
//!
//! Prefill picks the tensor-core kernel ([`prefill_mma_kernel`]: NVIDIA
//! sm_80+, bf16 cache, head_dim 64 or 128, no draft tree) unless the backend
//! was told not to (`GpuBackend::set_tensor_core_prefill`), else the f32
//! kernel with the largest tile that fits shared memory ([`prefill_kernel`]).
//!
//! Decode splits each sequence's pages into ranges of at least 64 tokens, at
//! most 16 per sequence, sized from that sequence's length alone, so a row's
//! attention is the same bits alone, in any batch and in any graph bucket
//! (batch invariance); the grid has as many splits as the longest sequence
//! needs when lengths are known, else (a graph step) 16.

use crate::GpuBackend;
use crate::device::PREFILL_SMEM_MAX;
use crate::exec::Args;
use crate::kernels::K;
use arbor_engine_core::{
    AttentionBackend, AttentionBatch, AttentionCapabilities, AttentionParams, BatchLayout,
    BufferId, CoreError, DType, KvLayer, Result, Tensor,
};
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

/// The KV cache element types the kernels store and read (FP8 scaled by
/// the layer's `KvScales`).
pub const KV_DTYPES: [DType; 5] = [
    DType::F32,
    DType::F16,
    DType::BF16,
    DType::F8E4M3,
    DType::F8E5M2,
];

/// Host facts about a prepared batch.
#[derive(Clone, Copy, Debug)]
struct Prepared {
    key: BufferId,
    /// Sequences in the device metadata (padded to the bucket in a graph step).
    seqs: usize,
    /// Real sequences.
    real_seqs: usize,
    /// Token rows of the device metadata (padded likewise).
    tokens: usize,
    decode: bool,
    /// Tree masks were uploaded (the fourth device tensor).
    tree: bool,
    max_q_len: usize,
    max_kv_len: usize,
    /// Slots the layout touches: the KV cache must have at least this many.
    needed_slots: usize,
}

/// The CUDA paged attention.
pub struct GpuAttention {
    b: GpuBackend,
    prepared: Mutex<VecDeque<Prepared>>,
}

impl GpuAttention {
    pub(crate) fn new(b: GpuBackend) -> Self {
        Self {
            b,
            prepared: Mutex::new(VecDeque::new()),
        }
    }
}

/// Tokens a decode split covers at least, and splits a sequence has at most
/// (kernels/attention.cu's `DECODE_SPLIT_MIN_TOKENS`, `DECODE_MAX_SPLITS`).
const DECODE_SPLIT_MIN_TOKENS: usize = 64;
const DECODE_MAX_SPLITS: usize = 16;

/// The decode grid's splits: at least as many as any sequence of the batch
/// has (the kernel sizes a sequence's splits from its own length, so that
/// they do not depend on the batch), from the longest length when it is
/// known, else (a graph step, whose lengths change) the most a sequence can
/// have.
pub(crate) fn decode_splits(page_size: usize, max_len: Option<usize>) -> usize {
    let Some(len) = max_len else {
        return DECODE_MAX_SPLITS;
    };
    let min_pages = DECODE_SPLIT_MIN_TOKENS.div_ceil(page_size.max(1));
    len.div_ceil(page_size.max(1))
        .div_ceil(min_pages)
        .clamp(1, DECODE_MAX_SPLITS)
}

/// Shared memory bytes of the prefill kernel with `bq` x `bq` tiles:
/// Q [bq][hd + 1], K [bq][hd + 1], V [bq][hd], P [bq][bq + 1] floats, and
/// for a batch with a draft tree T [bq][4] words (the tile's masks).
pub fn prefill_smem(bq: usize, hd: usize, tree: bool) -> usize {
    4 * (2 * bq * (hd + 1) + bq * hd + bq * (bq + 1) + if tree { 4 * bq } else { 0 })
}

/// Shared memory bytes of the tensor-core prefill kernel: Q high parts, Q
/// remainders and K as bf16 [64][hd + 8], V transposed [hd][72], slots [64].
pub fn prefill_mma_smem(hd: usize) -> usize {
    2 * (3 * 64 * (hd + 8) + hd * (64 + 8)) + 4 * 64
}

/// The tensor-core prefill kernel (64-row tiles, 128 threads) and its shared
/// memory bytes where it applies: an NVIDIA target of sm_80 or newer (`arch`
/// as `sm_90` or `compute_90`), a bf16 cache, head_dim 64 or 128 and no
/// draft tree in the batch.
pub fn prefill_mma_kernel(
    kd: DType,
    hd: usize,
    tree: bool,
    arch: &str,
    max_shared: u32,
) -> Option<(K, usize)> {
    if crate::kernels::nvidia_sm(arch)? < 80 || tree || kd != DType::BF16 {
        return None;
    }
    let kern = match hd {
        64 => K::PrefillMmaBf16D64,
        128 => K::PrefillMmaBf16D128,
        _ => return None,
    };
    let smem = prefill_mma_smem(hd);
    (smem <= max_shared.min(PREFILL_SMEM_MAX) as usize).then_some((kern, smem))
}

/// The kernel that writes new K and V rows into a cache of `kd` (bf16 for
/// any other type, which `forward` refuses before).
fn kv_write_kernel(kd: DType) -> K {
    match kd {
        DType::F32 => K::KvWriteF32,
        DType::F16 => K::KvWriteF16,
        DType::F8E4M3 => K::KvWriteE4m3,
        DType::F8E5M2 => K::KvWriteE5m2,
        _ => K::KvWriteBf16,
    }
}

/// Widest head the attention kernels take: latent attention's 576
/// (DeepSeek's 64 rotary and 512 latent dims).
pub const MAX_HEAD_DIM: usize = 576;

/// The flash-decoding kernel for a cache of `kd` and head_dim `hd` (at most
/// [`MAX_HEAD_DIM`]): the 128-wide variant up to 128, the 256-wide one up
/// to 256, else the 576-wide one.
pub fn decode_kernel(kd: DType, hd: usize) -> K {
    // Per width, the kernel of each cache type: f32, f16, bf16, E4M3, E5M2.
    let ks = if hd <= 128 {
        [
            K::DecodeF32D128,
            K::DecodeF16D128,
            K::DecodeBf16D128,
            K::DecodeE4m3D128,
            K::DecodeE5m2D128,
        ]
    } else if hd <= 256 {
        [
            K::DecodeF32D256,
            K::DecodeF16D256,
            K::DecodeBf16D256,
            K::DecodeE4m3D256,
            K::DecodeE5m2D256,
        ]
    } else {
        [
            K::DecodeF32D576,
            K::DecodeF16D576,
            K::DecodeBf16D576,
            K::DecodeE4m3D576,
            K::DecodeE5m2D576,
        ]
    };
    of_cache_type(kd, ks)
}

/// The kernel of `ks` (for f32, f16, bf16, E4M3 and E5M2 caches) for a
/// cache of `kd` (bf16 for any other type, which `forward` refuses before).
fn of_cache_type(kd: DType, ks: [K; 5]) -> K {
    match kd {
        DType::F32 => ks[0],
        DType::F16 => ks[1],
        DType::F8E4M3 => ks[3],
        DType::F8E5M2 => ks[4],
        _ => ks[2],
    }
}

/// The prefill kernel for KV dtype `kd` and head dim `hd` with the largest
/// tile whose shared memory (with tree masks when `tree`) fits `max_shared`
/// bytes per block: 64-row tiles (head dims up to 128), 32-row tiles (up to
/// 256), then 16-row tiles (for the 64 KiB of LDS of AMD GPUs; up to 576
/// where the device has the shared memory). Returns the tile's rows, the
/// kernel and its shared memory bytes.
pub fn prefill_kernel(
    kd: DType,
    hd: usize,
    tree: bool,
    max_shared: u32,
) -> Result<(usize, K, usize)> {
    let limit = max_shared.min(PREFILL_SMEM_MAX) as usize;
    // Per tile size and widest head, the kernel of each cache type: f32,
    // f16, bf16, E4M3, E5M2.
    let families: &[(usize, usize, [K; 5])] = &[
        (
            64,
            128,
            [
                K::PrefillF32D128,
                K::PrefillF16D128,
                K::PrefillBf16D128,
                K::PrefillE4m3D128,
                K::PrefillE5m2D128,
            ],
        ),
        (
            32,
            256,
            [
                K::PrefillF32D256,
                K::PrefillF16D256,
                K::PrefillBf16D256,
                K::PrefillE4m3D256,
                K::PrefillE5m2D256,
            ],
        ),
        (
            16,
            256,
            [
                K::PrefillF32D256Small,
                K::PrefillF16D256Small,
                K::PrefillBf16D256Small,
                K::PrefillE4m3D256Small,
                K::PrefillE5m2D256Small,
            ],
        ),
        (
            16,
            MAX_HEAD_DIM,
            [
                K::PrefillF32D576,
                K::PrefillF16D576,
                K::PrefillBf16D576,
                K::PrefillE4m3D576,
                K::PrefillE5m2D576,
            ],
        ),
    ];
    let fit = families
        .iter()
        .find(|(bq, widest, _)| hd <= *widest && prefill_smem(*bq, hd, tree) <= limit);
    let Some((bq, _, ks)) = fit else {
        return Err(CoreError::unsupported(format!(
            "prefill attention with head_dim {hd} needs {} bytes of shared memory (device allows {limit})",
            prefill_smem(16, hd, tree)
        )));
    };
    Ok((*bq, of_cache_type(kd, *ks), prefill_smem(*bq, hd, tree)))
}

/// The device metadata of a prepared batch: sequence info, page table and
/// slots, then the tree masks when it has them.
type Metadata<'a> = (Prepared, [&'a Tensor; 3], Option<&'a Tensor>);

impl GpuAttention {
    /// What `prepare` recorded about `batch`, and its device metadata.
    fn prepared_info<'a>(&self, batch: &'a AttentionBatch) -> Result<Metadata<'a>> {
        let key = batch
            .device
            .first()
            .map(Tensor::buffer_id)
            .ok_or_else(|| CoreError::invalid("attention batch without device metadata"))?;
        let info = self
            .prepared
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .find(|p| p.key == key)
            .copied()
            .ok_or_else(|| CoreError::invalid("attention batch was not prepared by cuda-paged"))?;
        let (meta, tree) = match &batch.device[..] {
            [s, p, sl] => ([s, p, sl], None),
            [s, p, sl, tr] => ([s, p, sl], Some(tr)),
            _ => return Err(CoreError::invalid("attention batch metadata is malformed")),
        };
        if tree.is_some() != info.tree {
            return Err(CoreError::invalid("attention batch metadata is malformed"));
        }
        Ok((info, meta, tree))
    }
}

fn to_i32(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| CoreError::unsupported(format!("{what} {v} exceeds i32")))
}

impl AttentionBackend for GpuAttention {
    fn name(&self) -> &str {
        "cuda-paged"
    }

    /// Heads up to [`MAX_HEAD_DIM`] where the prefill kernel's tiles fit
    /// the device's shared memory at that width (NVIDIA), else up to 256
    /// (AMD's 64 KiB of LDS).
    fn capabilities(&self) -> AttentionCapabilities {
        let max_shared = self.b.dev.props().max_shared_per_block;
        let fits = |hd: usize| prefill_kernel(DType::F32, hd, true, max_shared).is_ok();
        AttentionCapabilities {
            tree: true,
            max_head_dim: [MAX_HEAD_DIM, 256, 128].into_iter().find(|&hd| fits(hd)),
        }
    }

    fn prepare(&self, layout: Arc<BatchLayout>) -> Result<AttentionBatch> {
        let needed_slots = layout.needed_slots();
        layout.validate(needed_slots)?;
        let n = layout.seqs.len();
        let t = layout.num_tokens();
        let decode = n > 0 && layout.is_decode();
        // Decode kernels need no mask: a tree of one token sees what a chain's does.
        let tree_words = if decode {
            None
        } else {
            layout.tree_mask_words()?
        };
        let dev = &self.b.dev;
        let mut st = dev.lock()?;
        let bucket = if decode { dev.graphs.bucket(n) } else { None };
        let graph_step = match bucket {
            Some(bk) => dev.begin_step(&mut st, n, bk)?,
            None => {
                dev.flush(&mut st)?;
                false
            }
        };
        let (seqs, tokens, pt_len) = match bucket {
            Some(bk) if graph_step => {
                (bk, bk, layout.page_table.len().next_power_of_two().max(256))
            }
            _ => (n, t, layout.page_table.len().max(1)),
        };
        let mut info = Vec::with_capacity(4 * seqs);
        for s in &layout.seqs {
            info.extend_from_slice(&[
                to_i32(s.q_start, "token row")?,
                to_i32(s.q_len, "query length")?,
                to_i32(s.kv_len(), "sequence length")?,
                to_i32(s.pages.start, "page-table offset")?,
            ]);
        }
        for i in n..seqs {
            info.extend_from_slice(&[i as i32, 1, 0, 0]);
        }
        let info_bytes: Vec<u8> = info.iter().flat_map(|v| v.to_le_bytes()).collect();
        let pt_bytes: Vec<u8> = layout
            .page_table
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let mut slots: Vec<u8> = layout
            .slot_mapping
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        slots.resize(4 * tokens.max(1), 0xff);
        let seq_t = self
            .b
            .alloc_in(&mut st, DType::I32, &[seqs.max(1), 4], false)?;
        let pt_t = self.b.alloc_in(&mut st, DType::U32, &[pt_len], false)?;
        let slot_t = self
            .b
            .alloc_in(&mut st, DType::U32, &[tokens.max(1)], false)?;
        let tree = match &tree_words {
            Some(w) => {
                let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
                Some((
                    self.b.alloc_in(&mut st, DType::U32, &[w.len()], false)?,
                    bytes,
                ))
            }
            None => None,
        };
        let uploads = [(&seq_t, &info_bytes), (&pt_t, &pt_bytes), (&slot_t, &slots)];
        for (tensor, bytes) in uploads
            .into_iter()
            .chain(tree.as_ref().map(|(t, b)| (t, b)))
        {
            let p = dev.ptr(&st, tensor, 4)?;
            let cap = tensor.byte_len()?;
            dev.upload_to(&mut st, p, bytes, cap)?;
        }
        drop(st);
        let prep = Prepared {
            key: seq_t.buffer_id(),
            seqs,
            real_seqs: n,
            tokens,
            decode,
            tree: tree_words.is_some(),
            max_q_len: layout.seqs.iter().map(|s| s.q_len).max().unwrap_or(0),
            max_kv_len: layout.seqs.iter().map(|s| s.kv_len()).max().unwrap_or(0),
            needed_slots,
        };
        let mut table = self.prepared.lock().unwrap_or_else(|e| e.into_inner());
        table.retain(|p| p.key != prep.key);
        table.push_front(prep);
        table.truncate(16);
        let mut device = vec![seq_t, pt_t, slot_t];
        device.extend(tree.map(|(t, _)| t));
        Ok(AttentionBatch { layout, device })
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
        let layout = &*batch.layout;
        let tokens = layout.num_tokens();
        let (hd, nh, nkv) = (p.head_dim, p.num_heads, p.num_kv_heads);
        let (qw, kw) = (nh * hd, nkv * hd);
        for (t, w, what) in [(q, qw, "q"), (k, kw, "k"), (v, kw, "v"), (out, qw, "out")] {
            if t.dtype() != DType::F32 || t.rows() != tokens || t.row_len() != w {
                return Err(CoreError::invalid(format!(
                    "attention {what} {t:?}, expected f32 [{tokens}, {w}]"
                )));
            }
        }
        out.check_no_overlap(&[q, k, v, &kv.k, &kv.v])?;
        let kd = kv.k.dtype();
        for c in [&kv.k, &kv.v] {
            if c.dtype() != kd
                || !KV_DTYPES.contains(&kd)
                || !c.numel().is_multiple_of(kw)
                || c.row_len() != hd
                || c.numel() != kv.k.numel()
            {
                return Err(CoreError::invalid(format!(
                    "KV cache tensor {c:?} for {nkv} heads of {hd}"
                )));
            }
        }
        if hd > MAX_HEAD_DIM {
            return Err(CoreError::unsupported(format!(
                "CUDA attention with head_dim {hd} (at most {MAX_HEAD_DIM})"
            )));
        }
        let slots = kv.k.numel() / kw;
        let (info, [seq_t, pt_t, slot_t], tree_t) = self.prepared_info(batch)?;
        if info.needed_slots > slots {
            return Err(CoreError::invalid(format!(
                "the batch uses KV slot {} of a cache of {slots} slots",
                info.needed_slots - 1
            )));
        }
        let window = p
            .sliding_window
            .filter(|&w| w < i32::MAX as usize)
            .unwrap_or(0);
        let b = &self.b;
        let dev = &b.dev;
        let mut st = dev.lock()?;
        // Padded sequences run only when every activation is padded too.
        let (seqs, rows) =
            if info.seqs > info.real_seqs && st.rows(tokens, &[q, k, v, out]) == info.tokens {
                (info.seqs, info.tokens)
            } else {
                (info.real_seqs, tokens)
            };
        let (qp, kp, vp, op) = (b.p(&st, q)?, b.p(&st, k)?, b.p(&st, v)?, b.p(&st, out)?);
        let (kc, vc) = (b.p(&st, &kv.k)?, b.p(&st, &kv.v)?);
        let (sp, ptp, slp) = (b.p(&st, seq_t)?, b.p(&st, pt_t)?, b.p(&st, slot_t)?);
        let kvk = kv_write_kernel(kd);
        let scales = p.kv_scales.for_cache(kd);
        let args = Args::new()
            .p(kp)
            .p(vp)
            .p(kc)
            .p(vc)
            .p(slp)
            .i(rows)
            .i(kw)
            .i(slots)
            .f(scales.k)
            .f(scales.v);
        dev.launch(&mut st, kvk, [rows, 1, 1], 256, 0, args)?;
        let ps = layout.page_size;
        if info.decode {
            let known_len = if st.step_shape().is_some() {
                None
            } else {
                Some(info.max_kv_len)
            };
            let splits = decode_splits(ps, known_len);
            let part_o = b.alloc_in(&mut st, DType::F32, &[seqs * nh * splits * hd], false)?;
            let part_ml = b.alloc_in(&mut st, DType::F32, &[seqs * nh * splits * 2], false)?;
            let (pop, pmp) = (b.p(&st, &part_o)?, b.p(&st, &part_ml)?);
            let kern = decode_kernel(kd, hd);
            let args = Args::new()
                .p(qp)
                .p(kc)
                .p(vc)
                .p(sp)
                .p(ptp)
                .p(pop)
                .p(pmp)
                .i(nh)
                .i(nkv)
                .i(hd)
                .i(ps)
                .i(splits)
                .f(p.scale)
                .i(window)
                .f(scales.k)
                .f(scales.v);
            dev.launch(&mut st, kern, [seqs, nkv, splits], 128, 0, args)?;
            let args = Args::new().p(pop).p(pmp).p(sp).p(op).i(nh).i(hd).i(splits);
            dev.launch(&mut st, K::DecodeMerge, [seqs, nh, 1], 128, 0, args)
        } else {
            let max_shared = dev.props().max_shared_per_block;
            let mma = if b.tensor_core_prefill.load(Ordering::Relaxed) {
                prefill_mma_kernel(kd, hd, tree_t.is_some(), &dev.props().arch, max_shared)
            } else {
                None
            };
            let (bq, kern, smem, threads) = match mma {
                Some((kern, smem)) => (64, kern, smem, 128),
                None => {
                    let (bq, kern, smem) = prefill_kernel(kd, hd, tree_t.is_some(), max_shared)?;
                    (bq, kern, smem, 256)
                }
            };
            // Null without a tree: the kernels mask causally.
            let treep = tree_t.map(|t| b.p(&st, t)).transpose()?.unwrap_or(0);
            let args = Args::new()
                .p(qp)
                .p(kc)
                .p(vc)
                .p(sp)
                .p(ptp)
                .p(treep)
                .p(op)
                .i(nh)
                .i(nkv)
                .i(hd)
                .i(ps)
                .f(p.scale)
                .i(window)
                .f(scales.k)
                .f(scales.v);
            let tiles = info.max_q_len.div_ceil(bq);
            dev.launch(&mut st, kern, [tiles, nh, seqs], threads, smem as u32, args)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits() {
        // Graph steps: the most a sequence can have.
        assert_eq!(decode_splits(16, None), 16);
        // Known lengths: enough for the longest (64 tokens each, whole pages).
        assert_eq!(decode_splits(16, Some(1)), 1);
        assert_eq!(decode_splits(16, Some(100)), 2);
        assert_eq!(decode_splits(1, Some(100)), 2);
        assert_eq!(decode_splits(16, Some(100_000)), 16);
    }

    #[test]
    fn tensor_core_prefill_where_it_applies() {
        let pick = |kd, hd, tree, arch: &str| {
            prefill_mma_kernel(kd, hd, tree, arch, 227 * 1024).map(|(k, _)| k)
        };
        assert_eq!(
            pick(DType::BF16, 128, false, "sm_90"),
            Some(K::PrefillMmaBf16D128)
        );
        assert_eq!(
            pick(DType::BF16, 64, false, "compute_80"),
            Some(K::PrefillMmaBf16D64)
        );
        assert_eq!(pick(DType::BF16, 128, false, "sm_75"), None);
        assert_eq!(pick(DType::BF16, 128, false, "gfx90a"), None);
        assert_eq!(pick(DType::BF16, 128, true, "sm_90"), None);
        assert_eq!(pick(DType::F16, 128, false, "sm_90"), None);
        assert_eq!(pick(DType::BF16, 80, false, "sm_90"), None);
        // 69 KiB at head_dim 128: over a 48 KiB block, under the opt-in limit.
        assert_eq!(prefill_mma_smem(128), 70_912);
        assert_eq!(
            prefill_mma_kernel(DType::BF16, 128, false, "sm_90", 48 * 1024),
            None
        );
    }

    #[test]
    fn tree_masks_fit_shared_memory() {
        assert_eq!(
            prefill_smem(64, 128, true) - prefill_smem(64, 128, false),
            64 * 16
        );
        // AMD's 64 KiB of LDS, A100's opt-in limit, and above it.
        for limit in [64 * 1024, 163 * 1024, 227 * 1024] {
            for hd in [64, 80, 128, 256] {
                for tree in [false, true] {
                    let (bq, _, smem) = prefill_kernel(DType::BF16, hd, tree, limit)
                        .unwrap_or_else(|e| panic!("{e}"));
                    assert_eq!(smem, prefill_smem(bq, hd, tree));
                    assert!(smem <= limit.min(PREFILL_SMEM_MAX) as usize, "{hd} {tree}");
                }
            }
        }
    }

    #[test]
    fn layout_checks() {
        let mut l = BatchLayout::new(4);
        l.push_seq(0, 5, &[7, 2]).unwrap_or_else(|e| panic!("{e}"));
        l.push_seq(6, 1, &[3, 9, 1])
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(l.needed_slots(), 40);
        assert!(l.validate(40).is_ok());
        l.seqs[1].q_start = 4;
        assert!(l.validate(40).is_err());
    }
}
