//! Paged attention on the CPU: causal prefill over a cached prefix and decode,
//! with grouped-query attention and an optional sliding window.
//!
//! `forward` first writes the batch's new K and V rows into their KV slots
//! (converting to the cache dtype), then runs one task per (sequence, KV head,
//! block of queries): it gathers that head's keys and values from their pages
//! into contiguous f32 rows, stacks the block's queries of every head of the
//! GQA group, and computes `scores = Q·Kᵀ` and `out = softmax(scores)·V` as two
//! small GEMMs, masking keys outside `lo..=pos` (causal, sliding window).
//! Tasks are handed out through an atomic counter, so long and short sequences
//! balance across threads. Each task writes only its own (token, head) slices
//! of the output.

use crate::memory::{HostMemory, SendPtr};
use crate::pool::{ThreadPool, share};
use arbor_engine_core::{
    AttentionBackend, AttentionBatch, AttentionParams, BatchLayout, CoreError, DType, KvLayer,
    Result, Tensor,
};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Queries per task.
const Q_BLOCK: usize = 16;

/// Per-thread scratch of one attention task, reused across calls.
#[derive(Default)]
struct Scratch {
    k: Vec<f32>,
    v: Vec<f32>,
    q: Vec<f32>,
    s: Vec<f32>,
    o: Vec<f32>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

/// The CPU's paged attention.
pub struct CpuAttention {
    mem: Arc<HostMemory>,
    pool: Arc<ThreadPool>,
}

impl CpuAttention {
    pub(crate) fn new(mem: Arc<HostMemory>, pool: Arc<ThreadPool>) -> Self {
        Self { mem, pool }
    }

    fn f32_view(&self, t: &Tensor, rows: usize, width: usize, what: &str) -> Result<SendPtr<f32>> {
        if t.dtype() != DType::F32 || t.rows() != rows || t.row_len() != width {
            return Err(CoreError::invalid(format!(
                "attention {what} {t:?}, expected f32 [{rows}, {width}]"
            )));
        }
        Ok(SendPtr(self.mem.resolve(t, 4)?.ptr as *mut f32))
    }
}

#[derive(Clone, Copy)]
struct KvPtr {
    ptr: SendPtr<u8>,
    dtype: DType,
}

impl KvPtr {
    /// Reads element row `row` (of `width` values) into `dst` as f32.
    ///
    /// # Safety
    /// `row` must be inside the cache tensor this pointer was resolved from.
    unsafe fn read(&self, row: usize, width: usize, dst: &mut [f32]) {
        // SAFETY: the caller guarantees the row is in bounds.
        unsafe {
            match self.dtype {
                DType::F16 => {
                    let s = std::slice::from_raw_parts(
                        (self.ptr.get() as *const f16).add(row * width),
                        width,
                    );
                    s.convert_to_f32_slice(&mut dst[..width]);
                }
                DType::BF16 => {
                    let s = std::slice::from_raw_parts(
                        (self.ptr.get() as *const bf16).add(row * width),
                        width,
                    );
                    s.convert_to_f32_slice(&mut dst[..width]);
                }
                _ => {
                    let s = std::slice::from_raw_parts(
                        (self.ptr.get() as *const f32).add(row * width),
                        width,
                    );
                    dst[..width].copy_from_slice(s);
                }
            }
        }
    }

    /// Writes `src` as element row `row`.
    ///
    /// # Safety
    /// `row` must be inside the cache tensor and no other thread may touch it.
    unsafe fn write(&self, row: usize, src: &[f32]) {
        let width = src.len();
        // SAFETY: the caller guarantees the row is in bounds and exclusive.
        unsafe {
            match self.dtype {
                DType::F16 => {
                    let d = std::slice::from_raw_parts_mut(
                        (self.ptr.get() as *mut f16).add(row * width),
                        width,
                    );
                    d.convert_from_f32_slice(src);
                }
                DType::BF16 => {
                    let d = std::slice::from_raw_parts_mut(
                        (self.ptr.get() as *mut bf16).add(row * width),
                        width,
                    );
                    d.convert_from_f32_slice(src);
                }
                _ => {
                    std::ptr::copy_nonoverlapping(
                        src.as_ptr(),
                        (self.ptr.get() as *mut f32).add(row * width),
                        width,
                    );
                }
            }
        }
    }
}

impl AttentionBackend for CpuAttention {
    fn name(&self) -> &str {
        "cpu-paged"
    }

    fn prepare(&self, layout: Arc<BatchLayout>) -> Result<AttentionBatch> {
        Ok(AttentionBatch {
            layout,
            device: Vec::new(),
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
        let layout = &*batch.layout;
        let tokens = layout.num_tokens();
        let (hd, nh, nkv) = (p.head_dim, p.num_heads, p.num_kv_heads);
        let qw = nh * hd;
        let kw = nkv * hd;
        let qp = self.f32_view(q, tokens, qw, "q")?;
        let kp = self.f32_view(k, tokens, kw, "k")?;
        let vp = self.f32_view(v, tokens, kw, "v")?;
        let op = self.f32_view(out, tokens, qw, "out")?;
        crate::no_overlap(out, &[q, k, v, &kv.k, &kv.v])?;
        for c in [&kv.k, &kv.v] {
            if c.numel() % kw != 0
                || !matches!(c.dtype(), DType::F32 | DType::F16 | DType::BF16)
                || c.row_len() != hd
            {
                return Err(CoreError::invalid(format!(
                    "KV cache tensor {c:?} for {nkv} heads of {hd}"
                )));
            }
        }
        let slots = kv.k.numel() / kw;
        layout.validate(slots)?;
        let kc = KvPtr {
            ptr: SendPtr(self.mem.resolve(&kv.k, 4)?.ptr),
            dtype: kv.k.dtype(),
        };
        let vc = KvPtr {
            ptr: SendPtr(self.mem.resolve(&kv.v, 4)?.ptr),
            dtype: kv.v.dtype(),
        };

        // 1. Write the new K and V rows into their slots.
        let slot_map = &layout.slot_mapping;
        let write = |t: usize, n: usize| {
            let (r0, r1) = share(tokens, t, n, 1);
            for (i, &slot) in slot_map.iter().enumerate().take(r1).skip(r0) {
                // SAFETY: row i of k and v is inside their views; slot < slots
                // (validated) and slots of new tokens are distinct per batch.
                unsafe {
                    let kr = std::slice::from_raw_parts(kp.get().add(i * kw), kw);
                    let vr = std::slice::from_raw_parts(vp.get().add(i * kw), kw);
                    kc.write(slot as usize, kr);
                    vc.write(slot as usize, vr);
                }
            }
        };
        if tokens * kw < 16 * 1024 {
            write(0, 1);
        } else if !self.pool.run(&write) {
            return Err(CoreError::Internal("KV write panicked".into()));
        }

        // 2. Attention, one task per (sequence, KV head, query block).
        let mut tasks: Vec<(usize, usize, usize)> = Vec::new();
        for (si, s) in layout.seqs.iter().enumerate() {
            for g in 0..nkv {
                let mut j = 0;
                while j < s.q_len {
                    tasks.push((si, g, j));
                    j += Q_BLOCK;
                }
            }
        }
        let next = AtomicUsize::new(0);
        let group = nh / nkv;
        let ps = layout.page_size;
        let scale = p.scale;
        let window = p.sliding_window;
        let ok = self.pool.run(&|_, _| {
            SCRATCH.with(|cell| {
                let mut sc = cell.borrow_mut();
                loop {
                    let ti = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&(si, g, j0)) = tasks.get(ti) else {
                        break;
                    };
                    let s = &layout.seqs[si];
                    let pages = &layout.page_table[s.pages.clone()];
                    let j1 = (j0 + Q_BLOCK).min(s.q_len);
                    let p_last = s.prefix_len + j1 - 1;
                    let lo_first = window.map_or(0, |w| (s.prefix_len + j0 + 1).saturating_sub(w));
                    let span = p_last + 1 - lo_first;
                    let nq = (j1 - j0) * group;
                    let Scratch {
                        k: kbuf,
                        v: vbuf,
                        q: qbuf,
                        s: scores,
                        o: obuf,
                    } = &mut *sc;
                    kbuf.resize(span * hd, 0.0);
                    vbuf.resize(span * hd, 0.0);
                    qbuf.resize(nq * hd, 0.0);
                    scores.resize(nq * span, 0.0);
                    obuf.resize(nq * hd, 0.0);
                    // Gather this KV head's keys and values, contiguous and in f32.
                    for t in lo_first..=p_last {
                        let row = (pages[t / ps] as usize * ps + t % ps) * nkv + g;
                        let o = (t - lo_first) * hd;
                        // SAFETY: the slot is inside the cache (validated page table).
                        unsafe {
                            kc.read(row, hd, &mut kbuf[o..o + hd]);
                            vc.read(row, hd, &mut vbuf[o..o + hd]);
                        }
                    }
                    // Queries of the block, every head of the group stacked: row (j, h).
                    for j in j0..j1 {
                        let row = s.q_start + j;
                        for (hi, h) in (g * group..(g + 1) * group).enumerate() {
                            let r = (j - j0) * group + hi;
                            // SAFETY: row `row`, head h of q is inside its view.
                            let qh = unsafe {
                                std::slice::from_raw_parts(qp.get().add(row * qw + h * hd), hd)
                            };
                            qbuf[r * hd..(r + 1) * hd].copy_from_slice(qh);
                        }
                    }
                    // scores[nq, span] = Q · Kᵀ
                    // SAFETY: all three matrices are scratch buffers of the sizes set above.
                    unsafe {
                        gemm::gemm(
                            nq,
                            span,
                            hd,
                            scores.as_mut_ptr(),
                            1,
                            span as isize,
                            false,
                            qbuf.as_ptr(),
                            1,
                            hd as isize,
                            kbuf.as_ptr(),
                            hd as isize,
                            1,
                            0.0f32,
                            scale,
                            false,
                            false,
                            false,
                            gemm::Parallelism::None,
                        );
                    }
                    // Causal (and window) mask, then row softmax.
                    for r in 0..nq {
                        let pos = s.prefix_len + j0 + r / group;
                        let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w)) - lo_first;
                        let hi = pos - lo_first;
                        let row = &mut scores[r * span..(r + 1) * span];
                        let max = row[lo..=hi]
                            .iter()
                            .copied()
                            .fold(f32::NEG_INFINITY, f32::max);
                        let mut sum = 0.0;
                        for (t, x) in row.iter_mut().enumerate() {
                            if t < lo || t > hi {
                                *x = 0.0;
                            } else {
                                *x = (*x - max).exp();
                                sum += *x;
                            }
                        }
                        let inv = 1.0 / sum;
                        row.iter_mut().for_each(|x| *x *= inv);
                    }
                    // out[nq, hd] = P · V
                    // SAFETY: scratch buffers of the sizes set above.
                    unsafe {
                        gemm::gemm(
                            nq,
                            hd,
                            span,
                            obuf.as_mut_ptr(),
                            1,
                            hd as isize,
                            false,
                            scores.as_ptr(),
                            1,
                            span as isize,
                            vbuf.as_ptr(),
                            1,
                            hd as isize,
                            0.0f32,
                            1.0f32,
                            false,
                            false,
                            false,
                            gemm::Parallelism::None,
                        );
                    }
                    for j in j0..j1 {
                        let row = s.q_start + j;
                        for (hi, h) in (g * group..(g + 1) * group).enumerate() {
                            let r = (j - j0) * group + hi;
                            // SAFETY: this task is the only writer of out[row, h].
                            let oh = unsafe {
                                std::slice::from_raw_parts_mut(op.get().add(row * qw + h * hd), hd)
                            };
                            oh.copy_from_slice(&obuf[r * hd..(r + 1) * hd]);
                        }
                    }
                }
            });
        });
        if !ok {
            return Err(CoreError::Internal("attention kernel panicked".into()));
        }
        Ok(())
    }
}
