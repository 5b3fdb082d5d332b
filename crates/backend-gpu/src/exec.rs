//! Queuing work on the stream: recorded operations, decode steps, graphs
//! (CUDA graphs, HIP graphs).
//!
//! Every device operation becomes an [`Op`] (a kernel launch with its packed
//! arguments, a BLAS GEMM, a copy or a memset), run through the [`Driver`]. Outside a step an op runs at
//! once. Between [`Device::begin_step`] (called by the attention backend when
//! it prepares a decode batch that fits a graph bucket) and the next sync point
//! ([`Device::flush`]: a download, `synchronize`, or the next prepare) ops are
//! recorded instead. At the flush the step's op list is compared with the list
//! captured for its bucket: equal lists (same kernels, sizes and addresses)
//! replay the instantiated graph with one launch; otherwise the ops are
//! captured into a new graph for the bucket (and launched), or, when the step
//! cannot be a graph, run one by one. Replaying is exactly re-running the
//! recorded ops, so a graph can never compute something different from eager
//! execution.
//!
//! Padding: a step of `b` sequences runs at its bucket size `B >= b`. Buffers
//! allocated during the step are step buffers with room for `B / b` times
//! their size ([`crate::memory`]), and an op whose row tensors are all whole
//! step buffers runs over `n / b * B` rows ([`State::rows`]). Rows past the
//! real ones compute on zeros or leftovers and are never read back. An op
//! that cannot be padded (a view of part of a buffer) runs unpadded; one that
//! mixes step buffers with other row tensors also gives up the graph. Steps
//! of every `b` in a bucket record identical op lists, so one graph per
//! bucket serves them all; when they do not, the lists differ and the bucket
//! is captured again, never replayed wrongly.
//!
//! Invariants: recorded ops execute in recording order, on the one stream;
//! staging (the host side of recorded uploads) is rewritten only after the
//! stream drained; graphs are dropped whenever the arena or staging moves.

#![allow(unsafe_code)]

use crate::device::Device;
use crate::driver::{Driver, Gemm, Graph};
use crate::kernels::K;
use crate::memory::{Kind, Memory};
use arbor_engine_core::{CoreError, Result, Tensor};
use std::collections::{HashMap, HashSet};
use std::ffi::c_void;

/// Packed kernel arguments: one 8-byte slot per parameter (32-bit values in
/// the low half, which is what the kernel reads on little-endian hosts).
#[derive(Clone, Debug, Default)]
pub(crate) struct Args {
    vals: Vec<u64>,
    sig: String,
    overflow: bool,
}

impl Args {
    pub fn new() -> Self {
        Self::default()
    }
    /// A device pointer.
    pub fn p(mut self, ptr: u64) -> Self {
        self.vals.push(ptr);
        self.sig.push('p');
        self
    }
    /// A 32-bit integer (must fit in i32).
    pub fn i(mut self, v: usize) -> Self {
        self.overflow |= v > i32::MAX as usize;
        self.vals.push(v as u32 as u64);
        self.sig.push('i');
        self
    }
    /// A u64.
    pub fn l(mut self, v: u64) -> Self {
        self.vals.push(v);
        self.sig.push('l');
        self
    }
    /// An f32.
    pub fn f(mut self, v: f32) -> Self {
        self.vals.push(v.to_bits() as u64);
        self.sig.push('f');
        self
    }
}

/// One unit of queued work.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Op {
    Kernel {
        k: K,
        grid: [u32; 3],
        block: u32,
        smem: u32,
        args: Vec<u64>,
    },
    Gemm(Gemm),
    /// From pinned staging (capturable).
    HtoD {
        dst: u64,
        src: usize,
        bytes: usize,
    },
    /// From a host copy owned by the op (not capturable).
    HtoDOwned {
        dst: u64,
        data: Vec<u8>,
    },
    DtoD {
        dst: u64,
        src: u64,
        bytes: usize,
    },
    Memset {
        dst: u64,
        bytes: usize,
    },
}

/// A decode step being recorded.
#[derive(Debug)]
pub(crate) struct Step {
    /// Sequences in the batch.
    pub b: usize,
    /// The bucket it runs at.
    pub bucket: usize,
    ops: Vec<Op>,
    graphable: bool,
    why: &'static str,
}

/// Counters of graph use, for tests and benchmarks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphStats {
    /// Graphs captured (a new bucket, or a bucket whose ops changed).
    pub captures: u64,
    /// Steps run by replaying a captured graph.
    pub replays: u64,
    /// Recorded steps run op by op (not eligible for a graph).
    pub eager_steps: u64,
    /// Captures that failed (the bucket then runs op by op).
    pub failures: u64,
}

/// A bucket's captured graph and the ops it replays.
struct Captured {
    graph: Box<dyn Graph>,
    ops: Vec<Op>,
}

/// Everything behind the device's lock.
#[derive(Default)]
pub(crate) struct State {
    pub mem: Memory,
    pub step: Option<Step>,
    graphs: HashMap<usize, Captured>,
    broken: HashSet<usize>,
    /// Buckets whose first step ran eagerly (warming cuBLAS up before capture).
    warm: HashSet<usize>,
    pub stats: GraphStats,
    staging_busy: bool,
}

impl State {
    /// Marks the open step as not eligible for a graph.
    pub fn no_graph(&mut self, why: &'static str) {
        if let Some(s) = self.step.as_mut()
            && s.graphable
        {
            s.graphable = false;
            s.why = why;
        }
    }

    fn is_step_whole(&self, t: &Tensor) -> bool {
        let Some(b) = self.mem.block(t.buffer_id().slot) else {
            return false;
        };
        b.kind == Kind::Arena(self.mem.arena.epoch)
            && t.offset() == 0
            && t.byte_len().ok() == Some(t.buffer().bytes())
    }

    /// Rows an op over `n` rows of the tensors `ts` runs with: `n / b * B` in a
    /// padded step when every tensor is a whole step buffer, else `n` (and the
    /// step loses its graph if some of them were step buffers).
    pub fn rows(&mut self, n: usize, ts: &[&Tensor]) -> usize {
        let Some(step) = &self.step else { return n };
        if step.bucket == step.b || ts.is_empty() {
            return n;
        }
        let (b, bucket) = (step.b, step.bucket);
        let whole = ts.iter().filter(|t| self.is_step_whole(t)).count();
        if whole == ts.len() && n.is_multiple_of(b) {
            n / b * bucket
        } else {
            if whole > 0 {
                self.no_graph("an op mixes step buffers with other tensors");
            }
            n
        }
    }

    /// Byte capacity to reserve for a new buffer of `bytes` (scaled in a padded step).
    pub fn padded_bytes(&self, bytes: usize) -> usize {
        match &self.step {
            Some(s) if s.bucket > s.b => (bytes * s.bucket).div_ceil(s.b),
            _ => bytes,
        }
    }

    /// The open step's (b, bucket).
    pub fn step_shape(&self) -> Option<(usize, usize)> {
        self.step.as_ref().map(|s| (s.b, s.bucket))
    }

    /// Frees everything at device teardown.
    pub fn teardown(&mut self, drv: &dyn Driver) {
        self.step = None;
        self.graphs.clear();
        self.mem.teardown(drv);
    }
}

impl Device {
    /// Device address of a tensor of this device, checked for alignment to `align`.
    pub fn ptr(&self, st: &State, t: &Tensor, align: usize) -> Result<u64> {
        let id = t.buffer_id();
        if id.device != self.tag {
            return Err(CoreError::invalid(format!(
                "tensor {t:?} belongs to another device"
            )));
        }
        let b = st
            .mem
            .block(id.slot)
            .ok_or_else(|| CoreError::Internal(format!("buffer {id:?} is not allocated")))?;
        self.await_load(id.slot)?;
        let p = b.ptr + t.offset() as u64;
        if !p.is_multiple_of(align.max(1) as u64) {
            return Err(CoreError::invalid(format!(
                "tensor {t:?} is not aligned to {align} bytes"
            )));
        }
        Ok(p)
    }

    /// A new block of `cap` bytes: from the arena in a step, else the pool.
    /// Returns its slot.
    pub fn alloc_block(&self, st: &mut State, cap: usize) -> Result<u64> {
        if st.step.is_some() {
            if let Some(s) = st.mem.arena_alloc(cap) {
                return Ok(s);
            }
            st.no_graph("the step arena is growing");
        }
        if let Some(s) = st.mem.pool_alloc(self.drv.as_ref(), cap) {
            return Ok(s);
        }
        // Out of memory: run what is recorded, drain, return cached blocks, retry.
        if let Some(step) = st.step.as_mut() {
            let ops = std::mem::take(&mut step.ops);
            step.graphable = false;
            step.why = "out of memory";
            for op in &ops {
                self.exec(op)?;
            }
        }
        self.drv.sync()?;
        st.staging_busy = false;
        st.mem.trim(self.drv.as_ref());
        st.mem.pool_alloc(self.drv.as_ref(), cap).ok_or_else(|| {
            CoreError::OutOfMemory(format!(
                "{} allocation of {cap} bytes failed ({} MiB allocated)",
                self.drv.backend_name(),
                st.mem.pool_bytes >> 20
            ))
        })
    }

    /// Queues `op`: recorded in a step, else run now.
    pub fn submit(&self, st: &mut State, op: Op) -> Result<()> {
        match st.step.as_mut() {
            Some(s) => {
                s.ops.push(op);
                Ok(())
            }
            None => self.exec(&op),
        }
    }

    /// Queues kernel `k` over `grid` blocks of `block` threads.
    pub fn launch(
        &self,
        st: &mut State,
        k: K,
        grid: [usize; 3],
        block: u32,
        smem: u32,
        args: Args,
    ) -> Result<()> {
        if args.sig != k.signature() {
            return Err(CoreError::Internal(format!(
                "kernel {} takes ({}), launched with ({})",
                k.name(),
                k.signature(),
                args.sig
            )));
        }
        if args.overflow || grid[0] > i32::MAX as usize || grid[1] > 65535 || grid[2] > 65535 {
            return Err(CoreError::unsupported(format!(
                "kernel {} launch of {grid:?} blocks exceeds the grid limits",
                k.name()
            )));
        }
        if grid.contains(&0) {
            return Ok(());
        }
        self.submit(
            st,
            Op::Kernel {
                k,
                grid: [grid[0] as u32, grid[1] as u32, grid[2] as u32],
                block,
                smem,
                args: args.vals,
            },
        )
    }

    /// Queues a copy of `data` (padded with zeros to `padded` bytes) to `dst`.
    pub fn upload_to(&self, st: &mut State, dst: u64, data: &[u8], padded: usize) -> Result<()> {
        let padded = padded.max(data.len());
        if padded == 0 {
            return Ok(());
        }
        if st.step.is_some() {
            if let Some(src) = st.mem.stage(data, padded) {
                return self.submit(
                    st,
                    Op::HtoD {
                        dst,
                        src: src as usize,
                        bytes: padded,
                    },
                );
            }
            st.no_graph("the step staging is growing");
            let mut owned = data.to_vec();
            owned.resize(padded, 0);
            return self.submit(st, Op::HtoDOwned { dst, data: owned });
        }
        if padded > data.len() {
            let mut owned = data.to_vec();
            owned.resize(padded, 0);
            return self.exec(&Op::HtoDOwned { dst, data: owned });
        }
        // SAFETY: `dst` covers `data.len()` bytes (checked by the caller); for
        // pageable memory the runtime has staged the data when this returns.
        unsafe { self.drv.htod(dst, data.as_ptr(), data.len()) }
    }

    /// Runs one op on the stream now.
    pub fn exec(&self, op: &Op) -> Result<()> {
        let drv = self.drv.as_ref();
        match op {
            Op::Kernel {
                k,
                grid,
                block,
                smem,
                args,
            } => {
                let mut vals = args.clone();
                let mut ptrs: Vec<*mut c_void> = vals
                    .iter_mut()
                    .map(|v| v as *mut u64 as *mut c_void)
                    .collect();
                // SAFETY: the argument list matches the kernel's signature
                // (checked in `launch`, and against the compiled kernels by the
                // NVRTC and hiprtc tests); every pointer argument was resolved
                // from a live buffer whose capacity covers the launch's range.
                unsafe { drv.launch(*k, *grid, *block, *smem, &mut ptrs) }
            }
            // SAFETY: the addresses were resolved from live buffers of the
            // GEMM's shapes when the op was built.
            Op::Gemm(g) => unsafe { drv.gemm(g) },
            // SAFETY: `src` points into live pinned staging holding `bytes`
            // bytes that stay unchanged until the stream drains.
            Op::HtoD { dst, src, bytes } => unsafe { drv.htod(*dst, *src as *const u8, *bytes) },
            // SAFETY: pageable source: the runtime stages it before returning.
            Op::HtoDOwned { dst, data } => unsafe { drv.htod(*dst, data.as_ptr(), data.len()) },
            // SAFETY: both ranges lie in live buffers (checked by the caller).
            Op::DtoD { dst, src, bytes } => unsafe { drv.dtod(*dst, *src, *bytes) },
            // SAFETY: the range lies in a live buffer.
            Op::Memset { dst, bytes } => unsafe { drv.memset(*dst, *bytes) },
        }
    }

    /// Starts recording a decode step of `b` sequences at `bucket`. Returns
    /// false (and records nothing) when buffers of the previous step are alive.
    pub fn begin_step(&self, st: &mut State, b: usize, bucket: usize) -> Result<bool> {
        self.flush(st)?;
        if st.mem.arena.live > 0 {
            return Ok(false);
        }
        if st.staging_busy || st.mem.needs_grow() {
            self.drv.sync()?;
            st.staging_busy = false;
        }
        if st.mem.begin_step(self.drv.as_ref())? {
            st.graphs.clear();
        }
        st.step = Some(Step {
            b,
            bucket,
            ops: Vec::new(),
            graphable: true,
            why: "",
        });
        Ok(true)
    }

    /// Ends an open step: replays its bucket's graph, captures a new one, or
    /// runs the ops one by one.
    pub fn flush(&self, st: &mut State) -> Result<()> {
        let Some(step) = st.step.take() else {
            return Ok(());
        };
        if step.ops.is_empty() {
            return Ok(());
        }
        st.staging_busy |= step.ops.iter().any(|o| matches!(o, Op::HtoD { .. }));
        if !step.graphable || st.broken.contains(&step.bucket) {
            if !step.graphable {
                tracing::debug!(
                    "decode step of {} runs without a graph: {}",
                    step.b,
                    step.why
                );
            }
            st.stats.eager_steps += 1;
            return step.ops.iter().try_for_each(|op| self.exec(op));
        }
        if st.warm.insert(step.bucket) {
            // The first step of a bucket runs eagerly: the BLAS library picks and loads
            // its kernels for the new shapes outside of a capture.
            st.stats.eager_steps += 1;
            return step.ops.iter().try_for_each(|op| self.exec(op));
        }
        if let Some(g) = st.graphs.get(&step.bucket)
            && g.ops == step.ops
        {
            st.stats.replays += 1;
            // Every address the graph uses is the same as in the ops just
            // recorded, which are live.
            return g.graph.launch();
        }
        let ops = step.ops;
        match self
            .drv
            .capture(&mut || ops.iter().try_for_each(|op| self.exec(op)))
        {
            Ok(graph) => {
                graph.launch()?;
                st.stats.captures += 1;
                st.graphs.insert(step.bucket, Captured { graph, ops });
                Ok(())
            }
            Err(e) => {
                tracing::warn!(
                    "capturing a {} graph for decode batches of {} failed ({e}); \
                     they run without one",
                    self.drv.backend_name(),
                    step.bucket
                );
                st.broken.insert(step.bucket);
                st.stats.failures += 1;
                ops.iter().try_for_each(|op| self.exec(op))
            }
        }
    }

    /// Flushes and waits for the stream to drain, and for every copy on
    /// the copy stream.
    pub fn sync(&self, st: &mut State) -> Result<()> {
        self.flush(st)?;
        self.settle_loads()?;
        self.drv.sync()?;
        st.staging_busy = false;
        self.loads().drained(self.drv.as_ref());
        Ok(())
    }

    /// Waits for queued work, then copies `dst.len()` bytes from `src`.
    pub fn download_from(&self, st: &mut State, src: u64, dst: &mut [u8]) -> Result<()> {
        self.sync(st)?;
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: `src` covers `dst.len()` bytes (checked by the caller); the
        // copy completes before the synchronize below returns.
        unsafe { self.drv.dtoh(src, dst)? };
        self.drv.sync()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arbor_engine_core::DType;

    #[test]
    fn args_pack_and_sign() {
        let a = Args::new().p(0x1000).i(7).f(1.5).l(u64::MAX);
        assert_eq!(a.sig, "pifl");
        assert_eq!(a.vals, vec![0x1000, 7, 1.5f32.to_bits() as u64, u64::MAX]);
        assert!(!a.overflow);
        assert!(Args::new().i(1 << 40).overflow);
    }

    struct NoOwner;
    impl arbor_engine_core::BufferOwner for NoOwner {
        fn release(&self, _: arbor_engine_core::BufferId) {}
    }

    fn step_state(b: usize, bucket: usize) -> State {
        let mut st = State::default();
        // A fake arena: nothing here dereferences it.
        st.mem.arena.base = 1 << 30;
        st.mem.arena.cap = 1 << 20;
        st.mem.arena.epoch = 1;
        st.step = Some(Step {
            b,
            bucket,
            ops: Vec::new(),
            graphable: true,
            why: "",
        });
        st
    }

    fn step_tensor(st: &mut State, shape: &[usize]) -> Tensor {
        let bytes = 4 * shape.iter().product::<usize>();
        let slot = st.mem.arena_alloc(st.padded_bytes(bytes)).unwrap();
        let buf = arbor_engine_core::DeviceBuffer::new(
            arbor_engine_core::BufferId { device: 1, slot },
            bytes,
            std::sync::Arc::new(NoOwner),
        );
        Tensor::new(std::sync::Arc::new(buf), DType::F32, shape).unwrap()
    }

    #[test]
    fn rows_are_padded_only_for_whole_step_buffers() {
        let mut st = step_state(3, 4);
        let x = step_tensor(&mut st, &[3, 8]);
        let y = step_tensor(&mut st, &[3, 8]);
        assert_eq!(st.rows(3, &[&x, &y]), 4);
        // A reshape is still the whole buffer: rows scale with it.
        assert_eq!(st.rows(6, &[&x.reshape(&[6, 4]).unwrap()]), 8);
        assert!(st.step.as_ref().unwrap().graphable);
        // A view of part of a step buffer runs unpadded.
        assert_eq!(st.rows(2, &[&x.narrow(0, 2).unwrap()]), 2);
        assert!(st.step.as_ref().unwrap().graphable);
        // Mixing it with a whole step buffer runs unpadded and gives up the graph.
        assert_eq!(st.rows(2, &[&x.narrow(0, 2).unwrap(), &y]), 2);
        assert!(!st.step.as_ref().unwrap().graphable);
        // Without padding (b == bucket) nothing changes.
        let mut st = step_state(4, 4);
        let z = step_tensor(&mut st, &[4, 8]);
        assert_eq!(st.rows(4, &[&z]), 4);
        assert!(st.step.as_ref().unwrap().graphable);
        // A buffer of an earlier step is not a step buffer.
        let mut st2 = step_state(3, 4);
        st2.mem.arena.epoch = 2;
        let old = step_tensor(&mut st2, &[3, 8]);
        st2.mem.arena.epoch = 3;
        assert_eq!(st2.rows(3, &[&old]), 3);
    }

    #[test]
    fn padded_sizes() {
        let mut st = State {
            step: Some(Step {
                b: 3,
                bucket: 4,
                ops: Vec::new(),
                graphable: true,
                why: "",
            }),
            ..Default::default()
        };
        assert_eq!(st.padded_bytes(12), 16);
        assert_eq!(st.padded_bytes(10), 14);
        st.no_graph("test");
        assert_eq!(st.step.as_ref().map(|s| s.why), Some("test"));
        st.step = None;
        assert_eq!(st.padded_bytes(10), 10);
    }
}
