//! Paged attention on the CPU: causal prefill over a cached prefix, decode and
//! draft trees, with grouped-query attention and an optional sliding window.
//!
//! `forward` first writes the batch's new K and V rows into their KV slots
//! (converting to the cache dtype: f32, f16, bf16, or FP8 E4M3/E5M2 divided
//! by the layer's `KvScales`, rounding to nearest even and saturating; FP8
//! rows are multiplied by them when read back), then runs one task per
//! (sequence, block of queries, KV heads): every KV head of a block of at
//! most `SHORT_BLOCK` queries when there are at least two blocks per thread
//! (a slot's heads are adjacent in the cache, so the task streams whole
//! slot records), else one head. It
//! gathers each of its heads' keys (transposed) and values from their pages
//! into contiguous f32 scratch, stacks the block's queries
//! of every head of the GQA group, computes all their scores over the
//! block's key span, and then, query by query, the softmax over exactly the
//! keys it sees and the weighted sum of their values. A single-query block
//! (a decode) over an f16, bf16 or FP8 cache skips gathering the values:
//! its weighted sum reads them from the cache in place, widened as they are
//! read (the same values, so the same bits). Tasks are handed out
//! through an atomic counter, so long and short sequences balance across
//! threads. Each task writes only its own (token, head) slices of the output.
//!
//! Visibility: query `j` of a sequence sees the cached prefix and, among the
//! new tokens, `0..=j` for a chain or its ancestors and itself for a draft
//! tree (`BatchLayout::parents`); new tokens sit at slots `prefix_len + j`.
//! A sliding window keeps the keys whose *position* is within the window of
//! the query's; a tree token's position is `prefix_len + depth`.
//!
//! Batch invariance: a query's output is bit-identical whether it is a
//! decode, anywhere in a prefill chunk of any length, after any prefix split,
//! or a draft-tree token (then equal to the same token computed in a chain of
//! only its ancestors). Each score is one fused multiply-add chain over the
//! head dimension in order (keys in vector lanes, `simd::scores`), whatever
//! the span it is computed in; the softmax takes the maximum over exactly the
//! visible keys, their `exp` (`simd::exp`, the same bits in a vector lane or
//! alone) and their sum as one sequence in position order (`simd::sum`, whose
//! order depends only on the number of visible keys); and the output
//! is one fused multiply-add chain per element over the visible keys in
//! position order (`simd::weighted_sum`), scaled by `1 / sum`. Keys computed
//! for other queries of the block are never read.

use crate::convert::Narrow;
use crate::memory::{HostMemory, SendPtr};
use crate::pool::{ThreadPool, share};
use arbor_engine_core::{
    AttentionBackend, AttentionBatch, AttentionCapabilities, AttentionParams, BatchLayout,
    CoreError, DType, KvLayer, Result, SeqLayout, Tensor,
};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Queries per task (the task gathers the block's keys once; its rows
/// compute scores over the whole block span, so a larger block wastes up to
/// `Q_BLOCK` scores per row and balances worse across threads).
const Q_BLOCK: usize = 64;

/// Query blocks of at most this many tokens take all their KV heads in one
/// task (see `forward`).
const SHORT_BLOCK: usize = 16;

/// Per-thread scratch of one attention task, reused across calls.
#[derive(Default)]
struct Scratch {
    /// Keys transposed: `hd` rows of the span rounded up to 16.
    k: Vec<f32>,
    /// Values: span rows of `hd`.
    v: Vec<f32>,
    /// The block's queries: (token, head) rows of `hd`.
    q: Vec<f32>,
    /// Scores, then exponentials: one row of the padded span per query.
    s: Vec<f32>,
    /// Eight key rows before their transposition.
    o: Vec<f32>,
    /// Tree ancestors a query sees, as span offsets.
    extra: Vec<u32>,
    /// `1 / Σ exp` of each head of one query.
    inv: Vec<f32>,
    /// A tree query's exponentials, contiguous, for their sum.
    ev: Vec<f32>,
    /// The cache row (slot times KV heads, plus the head) of each span position.
    slots: Vec<usize>,
    /// The value rows of one head read in place (f16 caches).
    vrows: Vec<usize>,
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
    /// The cache's scale (1 unless FP8 with checkpoint scales): rows are
    /// stored divided by it and read back multiplied by it.
    scale: f32,
}

impl KvPtr {
    /// Asks for the `count` elements from element `first` to be brought into
    /// the cache ahead of their [`Self::read`]: the gather walks records
    /// scattered over pages, which the hardware prefetchers do not follow
    /// from one page to the next.
    #[inline(always)]
    fn prefetch(&self, first: usize, count: usize) {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
            let elem = self.dtype.block_bytes();
            let bytes = count * elem;
            let start = self.ptr.get().wrapping_add(first * elem);
            let mut off = 0;
            while off < bytes {
                // SAFETY: a prefetch never faults, whatever the address
                // (computed with wrapping arithmetic).
                unsafe { _mm_prefetch::<_MM_HINT_T0>(start.wrapping_add(off) as *const i8) };
                off += 64;
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (first, count);
    }

    /// The cache's element format, for a half-precision or FP8 cache.
    #[inline(always)]
    fn narrow(&self) -> Option<Narrow> {
        match self.dtype {
            DType::F16 => Some(Narrow::F16),
            DType::BF16 => Some(Narrow::BF16),
            DType::F8E4M3 | DType::F8E5M2 => Some(Narrow::Fp8 {
                e4m3: self.dtype == DType::F8E4M3,
                scale: self.scale,
            }),
            _ => None,
        }
    }

    /// Reads the element rows `slots[..8]` (of `width` values) widened and
    /// transposed into `dst` (`dst[d * stride + l]` = value `d` of row `l`)
    /// in one pass, for a half-precision or FP8 cache where the CPU can;
    /// returns false, writing nothing, otherwise.
    ///
    /// # Safety
    /// The rows must be inside the cache tensor this pointer was resolved from.
    #[inline(always)]
    unsafe fn read8_transposed(
        &self,
        slots: &[usize],
        width: usize,
        dst: &mut [f32],
        stride: usize,
    ) -> bool {
        let Some(format) = self.narrow() else {
            return false;
        };
        let bytes = width * format.bytes();
        let base = self.ptr.get() as *const u8;
        let rows: [*const u8; 8] = std::array::from_fn(|l| base.wrapping_add(slots[l] * bytes));
        // SAFETY: the rows are in bounds (the caller's contract).
        unsafe { crate::convert::rows_transposed(&rows, format, width, dst, stride) }
    }

    /// Reads element row `row` (of `width` values) into `dst` as f32.
    ///
    /// # Safety
    /// `row` must be inside the cache tensor this pointer was resolved from.
    #[inline(always)]
    unsafe fn read(&self, row: usize, width: usize, dst: &mut [f32]) {
        // SAFETY: the caller guarantees the row is in bounds.
        unsafe {
            match self.dtype {
                DType::F16 => {
                    let s = std::slice::from_raw_parts(
                        (self.ptr.get() as *const f16).add(row * width),
                        width,
                    );
                    crate::convert::f16_to_f32(s, &mut dst[..width]);
                }
                DType::BF16 => {
                    let s = std::slice::from_raw_parts(
                        (self.ptr.get() as *const bf16).add(row * width),
                        width,
                    );
                    crate::convert::bf16_to_f32(s, &mut dst[..width]);
                }
                DType::F8E4M3 | DType::F8E5M2 => {
                    let s = std::slice::from_raw_parts(self.ptr.get().add(row * width), width);
                    let e4m3 = self.dtype == DType::F8E4M3;
                    crate::convert::fp8_to_f32(s, e4m3, self.scale, &mut dst[..width]);
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
                DType::F8E4M3 | DType::F8E5M2 => {
                    let d = std::slice::from_raw_parts_mut(self.ptr.get().add(row * width), width);
                    let e4m3 = self.dtype == DType::F8E4M3;
                    crate::convert::f32_to_fp8(src, e4m3, self.scale, d);
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

    fn capabilities(&self) -> AttentionCapabilities {
        AttentionCapabilities {
            tree: true,
            max_head_dim: None,
        }
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
        out.check_no_overlap(&[q, k, v, &kv.k, &kv.v])?;
        for c in [&kv.k, &kv.v] {
            if c.numel() % kw != 0
                || !matches!(
                    c.dtype(),
                    DType::F32 | DType::F16 | DType::BF16 | DType::F8E4M3 | DType::F8E5M2
                )
                || c.row_len() != hd
            {
                return Err(CoreError::invalid(format!(
                    "KV cache tensor {c:?} for {nkv} heads of {hd}"
                )));
            }
        }
        let slots = kv.k.numel() / kw;
        layout.validate(slots)?;
        let scales = p.kv_scales.for_cache(kv.k.dtype());
        let kc = KvPtr {
            ptr: SendPtr(self.mem.resolve(&kv.k, 4)?.ptr),
            dtype: kv.k.dtype(),
            scale: scales.k,
        };
        let vc = KvPtr {
            ptr: SendPtr(self.mem.resolve(&kv.v, 4)?.ptr),
            dtype: kv.v.dtype(),
            scale: scales.v,
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

        // 2. Attention, one task per (sequence, query block, KV heads).
        let step = Step {
            layout,
            depths: layout
                .seqs
                .iter()
                .map(|s| tree_depths(layout.parents(s)))
                .collect(),
            kc,
            vc,
            q: qp,
            out: op,
            hd,
            nkv,
            group: nh / nkv,
            scale: p.scale,
            window: p.sliding_window,
            all_heads: false,
            v_narrow: vc.narrow().filter(|_| crate::simd::reads_narrow_values(hd)),
        };
        let (step, tasks) = step.plan(self.pool.threads());
        let next = AtomicUsize::new(0);
        let ok = self.pool.run(&|_, _| {
            SCRATCH.with(|cell| {
                let mut sc = cell.borrow_mut();
                while let Some(&task) = tasks.get(next.fetch_add(1, Ordering::Relaxed)) {
                    step.run_task(&mut sc, task);
                }
            });
        });
        if !ok {
            return Err(CoreError::Internal("attention kernel panicked".into()));
        }
        Ok(())
    }
}

/// Depth of every new token of a tree sequence (`parents` validated:
/// parents come before their children); empty for a chain.
fn tree_depths(parents: Option<&[i32]>) -> Vec<usize> {
    let Some(par) = parents else {
        return Vec::new();
    };
    let mut d = vec![0usize; par.len()];
    for j in 1..par.len() {
        d[j] = d[par[j] as usize] + 1;
    }
    d
}

/// One `forward`'s attention, shared read-only by its tasks. A task is
/// (sequence, KV head `g0`, first query `j0`): the block of up to `Q_BLOCK`
/// queries from `j0`, for [`Step::heads_of`] KV heads from `g0`.
struct Step<'a> {
    layout: &'a BatchLayout,
    /// Depth of every new token of a tree sequence (empty for chains).
    depths: Vec<Vec<usize>>,
    kc: KvPtr,
    vc: KvPtr,
    /// The queries, `[tokens, heads * hd]`.
    q: SendPtr<f32>,
    /// The output, `[tokens, heads * hd]`.
    out: SendPtr<f32>,
    hd: usize,
    nkv: usize,
    /// Query heads per KV head.
    group: usize,
    scale: f32,
    window: Option<usize>,
    /// Whether short blocks take all their KV heads in one task.
    all_heads: bool,
    /// The cache's value format where it can be read in place (a narrow
    /// format, and a CPU path for it): single-query blocks then skip
    /// gathering the values (see [`Step::values_in_place`]).
    v_narrow: Option<Narrow>,
}

/// A task's query block and the key span it reads.
struct Block<'a> {
    seq: &'a SeqLayout,
    parents: Option<&'a [i32]>,
    depth: &'a [usize],
    /// The block's queries: new tokens `j0..j1`.
    j0: usize,
    j1: usize,
    /// The first KV heads and how many.
    g0: usize,
    heads: usize,
    /// The key span: positions `t0..t0 + span`, `sp` rounded up to 16.
    t0: usize,
    span: usize,
    sp: usize,
}

impl Block<'_> {
    /// Position of new token `j`.
    fn pos(&self, j: usize) -> usize {
        self.seq.prefix_len
            + if self.parents.is_some() {
                self.depth[j]
            } else {
                j
            }
    }

    /// The first position new token `j` sees.
    fn lo(&self, j: usize, window: Option<usize>) -> usize {
        window.map_or(0, |w| (self.pos(j) + 1).saturating_sub(w))
    }
}

impl<'a> Step<'a> {
    /// The tasks, and whether short blocks take all their KV heads: every
    /// KV head of a short block (a decode, a few draft or chunk tokens) in
    /// one task when the blocks alone keep the threads busy. The task then
    /// reads each slot's K and V records whole (the heads of a slot are
    /// adjacent), one stream the hardware prefetchers follow. Otherwise a
    /// task per head: to spread the work, and for long blocks, whose scores
    /// and scratch per head fill the cache.
    fn plan(mut self, threads: usize) -> (Self, Vec<(usize, usize, usize)>) {
        let blocks: Vec<(usize, usize)> = (self.layout.seqs.iter().enumerate())
            .flat_map(|(si, s)| (0..s.q_len).step_by(Q_BLOCK).map(move |j| (si, j)))
            .collect();
        self.all_heads = blocks.len() >= 2 * threads;
        let tasks = blocks
            .iter()
            .flat_map(|&(si, j)| {
                (0..self.nkv)
                    .step_by(self.heads_of(si, j))
                    .map(move |g| (si, g, j))
            })
            .collect();
        (self, tasks)
    }

    /// KV heads per task for the block of sequence `si` from query `j`.
    fn heads_of(&self, si: usize, j: usize) -> usize {
        if self.all_heads && self.layout.seqs[si].q_len - j <= SHORT_BLOCK {
            self.nkv
        } else {
            1
        }
    }

    /// The block and key span of task `(si, g0, j0)`.
    fn block(&self, (si, g0, j0): (usize, usize, usize)) -> Block<'_> {
        let seq = &self.layout.seqs[si];
        let mut b = Block {
            seq,
            parents: self.layout.parents(seq),
            depth: &self.depths[si],
            j0,
            j1: (j0 + Q_BLOCK).min(seq.q_len),
            g0,
            heads: self.heads_of(si, j0).min(self.nkv - g0),
            t0: 0,
            span: 0,
            sp: 0,
        };
        let lo_min = (b.j0..b.j1)
            .map(|j| b.lo(j, self.window))
            .min()
            .unwrap_or(0);
        let pre = seq.prefix_len;
        b.t0 = if b.parents.is_some() {
            lo_min.min(pre)
        } else {
            lo_min
        };
        b.span = pre + b.j1 - b.t0;
        b.sp = b.span.div_ceil(16) * 16;
        b
    }

    /// Whether block `b`'s weighted sums read the values from the cache in
    /// place (widened as they are read) instead of gathering them into f32
    /// scratch first: for a single query (a decode), which reads each value
    /// once either way. A longer block's queries each read every value, so
    /// they read them widened once.
    fn values_in_place(&self, b: &Block<'_>) -> bool {
        self.v_narrow.is_some() && b.j1 - b.j0 == 1
    }

    /// Runs one task: gathers its heads' keys and values, then attends
    /// each of its heads' query groups.
    fn run_task(&self, sc: &mut Scratch, task: (usize, usize, usize)) {
        let b = self.block(task);
        let hd = self.hd;
        let nq = (b.j1 - b.j0) * self.group;
        sc.k.resize(b.heads * hd * b.sp, 0.0);
        sc.v.resize(b.heads * b.span * hd, 0.0);
        sc.q.resize(nq * hd, 0.0);
        sc.s.resize(nq * b.sp, 0.0);
        sc.o.resize(8 * hd, 0.0);
        sc.inv.resize(self.group, 0.0);
        self.gather(sc, &b);
        for hi in 0..b.heads {
            self.attend(sc, &b, hi);
        }
    }

    /// Gathers the task's heads' keys (transposed, 8 at a time) and values
    /// in f32 into the scratch: head `hi`'s keys at `hi * hd * sp`, its
    /// values at `hi * span * hd`. Lanes past the span hold stale values
    /// whose scores are never read.
    fn gather(&self, sc: &mut Scratch, b: &Block<'_>) {
        let (hd, nkv, ps) = (self.hd, self.nkv, self.layout.page_size);
        let (span, sp, heads) = (b.span, b.sp, b.heads);
        let pages = &self.layout.page_table[b.seq.pages.clone()];
        // The cache row of head g0 at each span position, walking the
        // pages (no division per key).
        let slots = &mut sc.slots;
        slots.clear();
        let (mut page, mut off) = (b.t0 / ps, b.t0 % ps);
        while slots.len() < span {
            let base = pages[page] as usize * ps;
            let n = (ps - off).min(span - slots.len());
            slots.extend((base + off..base + off + n).map(|slot| slot * nkv + b.g0));
            page += 1;
            off = 0;
        }
        let (kc, vc) = (&self.kc, &self.vc);
        let in_place = self.values_in_place(b);
        let mut o0 = 0;
        while o0 < span {
            let n = (span - o0).min(8);
            // The records of the group after next, so that their loads
            // overlap this group's conversion.
            for &row in slots.iter().take(o0 + 24).skip(o0 + 16) {
                kc.prefetch(row * hd, heads * hd);
                vc.prefetch(row * hd, heads * hd);
            }
            for hi in 0..heads {
                let (kh, vh) = (&mut sc.k[hi * hd * sp..], &mut sc.v[hi * span * hd..]);
                for o in (o0..o0 + n).filter(|_| !in_place) {
                    // SAFETY: the slot is inside the cache (validated page table).
                    unsafe { vc.read(slots[o] + hi, hd, &mut vh[o * hd..(o + 1) * hd]) };
                }
                // Half-precision and FP8 keys: widened and transposed in
                // one pass where the CPU can (the same values).
                let rows: [usize; 8] = std::array::from_fn(|l| slots[o0 + l.min(n - 1)] + hi);
                // SAFETY: the slots are inside the cache (validated page table).
                let fused = n == 8 && unsafe { kc.read8_transposed(&rows, hd, &mut kh[o0..], sp) };
                if !fused {
                    let row = &mut sc.o;
                    for (l, &r) in rows.iter().enumerate().take(n) {
                        // SAFETY: the slot is inside the cache (validated page table).
                        unsafe { kc.read(r, hd, &mut row[l * hd..(l + 1) * hd]) };
                    }
                    crate::simd::transpose8(row, hd, &mut kh[o0..], sp);
                }
            }
            o0 += 8;
        }
    }

    /// Attends the query group of the task's head `hi` (KV head `g0 + hi`)
    /// over the gathered keys and values, writing its outputs.
    fn attend(&self, sc: &mut Scratch, b: &Block<'_>, hi: usize) {
        let (hd, group, sp, span) = (self.hd, self.group, b.sp, b.span);
        let g = b.g0 + hi;
        let qw = self.num_heads() * hd;
        let Scratch {
            k,
            v,
            q: qbuf,
            s: scores,
            extra,
            inv,
            ev,
            slots,
            vrows,
            ..
        } = sc;
        let kh = &k[hi * hd * sp..(hi + 1) * hd * sp];
        let vh = &v[hi * span * hd..(hi + 1) * span * hd];
        let in_place = self.values_in_place(b);
        if in_place {
            vrows.clear();
            vrows.extend(slots.iter().map(|&r| r + hi));
        }
        // Queries of the block, every head of the group stacked: row (j, h).
        for j in b.j0..b.j1 {
            let qrow = b.seq.q_start + j;
            for (r, h) in ((j - b.j0) * group..).zip(g * group..(g + 1) * group) {
                // SAFETY: row `qrow`, head h of q is inside its view.
                let qh =
                    unsafe { std::slice::from_raw_parts(self.q.get().add(qrow * qw + h * hd), hd) };
                qbuf[r * hd..(r + 1) * hd].copy_from_slice(qh);
            }
        }
        let nq = (b.j1 - b.j0) * group;
        crate::simd::scores(qbuf, kh, nq, hd, sp, self.scale, scores);
        let (pre, t0) = (b.seq.prefix_len, b.t0);
        for j in b.j0..b.j1 {
            let lo = b.lo(j, self.window);
            // The keys query j sees, as span offsets in position order.
            extra.clear();
            let range = match b.parents {
                None => lo - t0..pre + j + 1 - t0,
                Some(par) => {
                    let mut a = j as i32;
                    while a >= 0 {
                        if b.pos(a as usize) >= lo {
                            extra.push((pre + a as usize - t0) as u32);
                        }
                        a = par[a as usize];
                    }
                    extra.reverse();
                    lo.min(pre) - t0..pre - t0
                }
            };
            let r0 = (j - b.j0) * group;
            for (qh, iv) in inv.iter_mut().enumerate() {
                let sr = &mut scores[(r0 + qh) * sp..(r0 + qh) * sp + span];
                *iv = 1.0 / softmax_numerators(sr, range.clone(), extra, ev);
            }
            let vis = crate::simd::Visible {
                start: range.start,
                end: range.end,
                extra,
            };
            let qrow = b.seq.q_start + j;
            // SAFETY: this task is the only writer of out[qrow, heads of
            // group g], which are contiguous.
            let oh = unsafe {
                std::slice::from_raw_parts_mut(
                    self.out.get().add(qrow * qw + g * group * hd),
                    group * hd,
                )
            };
            let e = &scores[r0 * sp..];
            if let (true, Some(format)) = (in_place, self.v_narrow) {
                let vbase = self.vc.ptr.get() as *const u8;
                // SAFETY: every row is a cache row of this head (validated
                // page table).
                let ran = unsafe {
                    crate::simd::weighted_sum_narrow(
                        e, sp, group, vbase, format, vrows, hd, vis, inv, oh,
                    )
                };
                debug_assert!(ran, "reads_narrow_values said the path runs");
            } else {
                crate::simd::weighted_sum(e, sp, group, vh, hd, vis, inv, oh);
            }
        }
    }

    /// Query heads.
    fn num_heads(&self) -> usize {
        self.nkv * self.group
    }
}

/// Turns the visible scores of one query row (`run` and the tree offsets
/// `extra`) into `exp(score - max)` in place and returns their sum, taken
/// as one sequence in position order (`ev` is scratch for a tree's).
fn softmax_numerators(
    sr: &mut [f32],
    run: std::ops::Range<usize>,
    extra: &[u32],
    ev: &mut Vec<f32>,
) -> f32 {
    let max = extra
        .iter()
        .fold(crate::simd::max(&sr[run.clone()]), |m, &t| {
            m.max(sr[t as usize])
        });
    for x in &mut sr[run.clone()] {
        *x -= max;
    }
    crate::simd::exp_slice(&mut sr[run.clone()]);
    for &t in extra {
        sr[t as usize] = crate::simd::exp(sr[t as usize] - max);
    }
    if extra.is_empty() {
        crate::simd::sum(&sr[run])
    } else {
        ev.clear();
        ev.extend_from_slice(&sr[run]);
        ev.extend(extra.iter().map(|&t| sr[t as usize]));
        crate::simd::sum(ev)
    }
}
