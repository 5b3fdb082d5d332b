//! [`SimtDriver`]: the GPU backend's `Driver` over host memory and the
//! emulated kernels of [`crate::library`].
//!
//! "Device" memory is host memory (256-byte aligned, zeroed), so a device
//! address is a host pointer. Every operation queued on the main stream runs
//! at once, in call order, which is the stream's order; `sync` has nothing to
//! wait for. The copy stream is a thread of its own ([`CopyStream`]) that
//! runs its copies in order, after an optional delay each
//! ([`SimtDriver::with_copy_delay`]), so work that reads a buffer before
//! waiting for its fence reads stale bytes; a fence's `main_waits` blocks
//! until its copies ran (the main stream is the calling thread) and is
//! logged ([`CopyLog`]) for tests that check what waited for what.
//! The GEMM is a product over f32, f16 or bf16 operands with f32 outputs (as
//! cuBLAS with f32 accumulation), each output summed in input order in f64
//! and rounded once: cuBLAS's and rocBLAS's blocked FMA sums err far less
//! than a sequential f32 sum, whose error grows with `k` and would make
//! tie-sensitive comparisons with the CPU (inputs rounded to E4M3) test the
//! stand-in's rounding rather than the kernels. A capture records
//! the operations with their argument values (as a CUDA graph copies kernel
//! parameters) and a replay runs them again; nothing runs during a capture.

#![allow(unsafe_code)]

use crate::library::Library;
use arbor_backend_gpu::driver::{DeviceProps, Driver, Fence, Gemm, Graph};
use arbor_backend_gpu::kernels::K;
use arbor_engine_core::{CoreError, DType, Result};
use std::alloc::Layout;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

/// Alignment of every allocation (cudaMalloc gives at least 256).
const ALIGN: usize = 256;

/// An operation as queued.
#[derive(Clone, Debug)]
enum Op {
    Launch {
        k: K,
        grid: [u32; 3],
        block: u32,
        smem: u32,
        args: Vec<u64>,
    },
    Copy {
        dst: u64,
        src: u64,
        bytes: usize,
    },
    Memset {
        dst: u64,
        bytes: usize,
    },
    Gemm(Gemm),
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The state shared with the graphs a driver captured.
#[derive(Debug)]
struct Inner {
    lib: Library,
    /// Operations recorded by a capture in progress.
    capture: Mutex<Option<Vec<Op>>>,
    /// Counts kernel launches for the copy stream's log.
    log: Arc<CopyLog>,
}

impl Inner {
    /// Runs `op` now.
    fn run(&self, op: &Op) -> Result<()> {
        match op {
            Op::Launch {
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
                self.log.launches.fetch_add(1, Ordering::Relaxed);
                // SAFETY: the backend checked the arguments against the
                // kernel's signature and the addresses against its buffers
                // (Driver::launch's contract); `ptrs` point into `vals`.
                unsafe { self.lib.launch(k.name(), *grid, *block, *smem, &mut ptrs) }
                    .map_err(|e| CoreError::Device(format!("simt launch of {}: {e}", k.name())))
            }
            Op::Copy { dst, src, bytes } => {
                // SAFETY: both ranges lie in live allocations (the Driver
                // methods' contracts); they may overlap only as memmove allows.
                unsafe { std::ptr::copy(*src as *const u8, *dst as *mut u8, *bytes) };
                Ok(())
            }
            Op::Memset { dst, bytes } => {
                // SAFETY: the range lies in a live allocation.
                unsafe { std::ptr::write_bytes(*dst as *mut u8, 0, *bytes) };
                Ok(())
            }
            Op::Gemm(g) => {
                // SAFETY: the addresses cover the operands (Driver::gemm's contract).
                unsafe { gemm(g) }
            }
        }
    }

    /// Records `op` during a capture, else runs it.
    fn queue(&self, op: Op) -> Result<()> {
        if let Some(ops) = lock(&self.capture).as_mut() {
            ops.push(op);
            return Ok(());
        }
        self.run(&op)
    }
}

/// Reads element `i` of a `dtype` operand as f32.
///
/// # Safety
/// `base` holds at least `i + 1` elements of `dtype`.
unsafe fn element(dtype: DType, base: u64, i: usize) -> f32 {
    // SAFETY: per the contract.
    unsafe {
        match dtype {
            DType::F16 => half::f16::from_bits(*(base as *const u16).add(i)).to_f32(),
            DType::BF16 => half::bf16::from_bits(*(base as *const u16).add(i)).to_f32(),
            _ => *(base as *const f32).add(i),
        }
    }
}

/// `out[m, n] = x[m, k] · w[n, k]ᵀ` for each of `heads` side by side (the
/// strided-batched layout of [`Gemm`]), summed in f64, stored as f32.
///
/// # Safety
/// As [`Driver::gemm`].
unsafe fn gemm(g: &Gemm) -> Result<()> {
    if !matches!(g.dtype, DType::F32 | DType::F16 | DType::BF16) || g.heads == 0 {
        return Err(CoreError::unsupported(format!(
            "simt GEMM of {} ({} heads)",
            g.dtype, g.heads
        )));
    }
    let (xw, ow) = (g.heads * g.k, g.heads * g.n);
    for h in 0..g.heads {
        for r in 0..g.m {
            for c in 0..g.n {
                let mut acc = 0f64;
                for i in 0..g.k {
                    // SAFETY: h < heads, r < m, c < n, i < k index inside the operands.
                    let (x, w) = unsafe {
                        (
                            element(g.dtype, g.x, r * xw + h * g.k + i),
                            element(g.dtype, g.w, (h * g.n + c) * g.k + i),
                        )
                    };
                    acc += x as f64 * w as f64;
                }
                // SAFETY: out holds m x heads·n f32.
                unsafe { *(g.out as *mut f32).add(r * ow + h * g.n + c) = acc as f32 };
            }
        }
    }
    Ok(())
}

/// A captured sequence of operations.
struct SimtGraph {
    inner: Arc<Inner>,
    ops: Vec<Op>,
}

impl Graph for SimtGraph {
    fn launch(&self) -> Result<()> {
        self.ops
            .iter()
            .try_for_each(|op| self.inner.queue(op.clone()))
    }
}

/// One fence's wait on the main stream, as logged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FenceWait {
    /// The fence (numbered from 1 in the order they were made).
    pub fence: u64,
    /// Fences passed by the copy stream when the wait returned.
    pub passed: u64,
    /// Kernels the main stream had run when the wait returned.
    pub launches: u64,
}

/// What the copy stream did: fences passed, and the main stream's waits.
#[derive(Debug, Default)]
pub struct CopyLog {
    state: Mutex<(u64, Vec<FenceWait>)>,
    passed: Condvar,
    launches: AtomicU64,
}

impl CopyLog {
    /// Fences the copy stream has passed.
    pub fn fences_passed(&self) -> u64 {
        lock(&self.state).0
    }

    /// The main stream's waits, in order.
    pub fn waits(&self) -> Vec<FenceWait> {
        lock(&self.state).1.clone()
    }

    fn pass(&self, fence: u64) {
        lock(&self.state).0 = fence;
        self.passed.notify_all();
    }

    fn wait(&self, fence: u64) {
        let mut st = lock(&self.state);
        while st.0 < fence {
            st = match self.passed.wait(st) {
                Ok(g) => g,
                Err(e) => e.into_inner(),
            };
        }
        let passed = st.0;
        let launches = self.launches.load(Ordering::Relaxed);
        st.1.push(FenceWait {
            fence,
            passed,
            launches,
        });
    }
}

enum CopyJob {
    Copy { dst: u64, src: u64, bytes: usize },
    Fence(u64),
}

/// The copy stream: a thread running its copies in order.
#[derive(Debug, Default)]
struct CopyStream {
    tx: Mutex<Option<Sender<CopyJob>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    fences: AtomicU64,
    delay: Duration,
    log: Arc<CopyLog>,
}

impl CopyStream {
    fn send(&self, job: CopyJob) -> Result<()> {
        let mut tx = lock(&self.tx);
        if tx.is_none() {
            let (send, recv) = channel::<CopyJob>();
            let (delay, log) = (self.delay, self.log.clone());
            let thread = std::thread::Builder::new()
                .name("simt-copy-stream".into())
                .spawn(move || {
                    for job in recv {
                        match job {
                            CopyJob::Copy { dst, src, bytes } => {
                                std::thread::sleep(delay);
                                // SAFETY: Driver::htod_on_copy_stream's
                                // contract: live pinned source and device
                                // destination, nothing else touching it.
                                unsafe {
                                    std::ptr::copy_nonoverlapping(
                                        src as *const u8,
                                        dst as *mut u8,
                                        bytes,
                                    )
                                };
                            }
                            CopyJob::Fence(n) => log.pass(n),
                        }
                    }
                })
                .map_err(|e| CoreError::Device(format!("simt copy stream: {e}")))?;
            *lock(&self.thread) = Some(thread);
            *tx = Some(send);
        }
        tx.as_ref()
            .and_then(|t| t.send(job).ok())
            .ok_or_else(|| CoreError::Device("simt copy stream ended".into()))
    }

    /// Ends the thread once its queued copies ran.
    fn join(&self) {
        lock(&self.tx).take();
        if let Some(t) = lock(&self.thread).take() {
            let _ = t.join();
        }
    }
}

struct SimtFence {
    fence: u64,
    log: Arc<CopyLog>,
}

impl Fence for SimtFence {
    fn main_waits(&self) -> Result<()> {
        self.log.wait(self.fence);
        Ok(())
    }
}

/// What the emulated device reports, and so which kernels the backend picks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Profile {
    /// `sm_90` with 227 KiB of shared memory per block: the tensor-core
    /// prefill, the tensor-core GEMMs of scaled blocks, W8A8 when asked.
    Hopper,
    /// `gfx90a` (an AMD MI200) with 64 KiB of LDS per block: the f32-math
    /// prefill in the tiles that fit, the dequantizing GEMM.
    Cdna,
}

/// The emulated device (see the module doc).
#[derive(Debug)]
pub struct SimtDriver {
    inner: Arc<Inner>,
    props: DeviceProps,
    /// Live allocations and their layouts.
    allocs: Mutex<HashMap<u64, Layout>>,
    copies: CopyStream,
}

impl SimtDriver {
    /// Builds (or loads) the kernel library; the device reports itself as
    /// `profile` says, which decides the kernels the backend picks.
    pub fn open(profile: Profile) -> std::result::Result<Self, String> {
        let lib = Library::open()?;
        let log = Arc::new(CopyLog::default());
        let (name, arch, max_shared) = match profile {
            Profile::Hopper => ("CUDA host emulator (as sm_90)", "sm_90", 227 * 1024),
            Profile::Cdna => ("CUDA host emulator (as gfx90a)", "gfx90a", 64 * 1024),
        };
        Ok(Self {
            inner: Arc::new(Inner {
                lib,
                capture: Mutex::new(None),
                log: log.clone(),
            }),
            props: DeviceProps {
                name: name.into(),
                arch: arch.into(),
                compute_units: 4,
                max_shared_per_block: max_shared,
                total_memory: 4 << 30,
            },
            allocs: Mutex::new(HashMap::new()),
            copies: CopyStream {
                log,
                ..Default::default()
            },
        })
    }

    /// The copy stream sleeps `delay` before each copy (for tests of what
    /// waits for it).
    pub fn with_copy_delay(mut self, delay: Duration) -> Self {
        self.copies.delay = delay;
        self
    }

    /// The copy stream's log.
    pub fn copy_log(&self) -> Arc<CopyLog> {
        self.copies.log.clone()
    }

    fn alloc(&self, bytes: usize) -> Option<u64> {
        let layout = Layout::from_size_align(bytes.max(1), ALIGN).ok()?;
        // SAFETY: the layout's size is non-zero.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        if p.is_null() {
            return None;
        }
        lock(&self.allocs).insert(p as u64, layout);
        Some(p as u64)
    }

    /// # Safety
    /// `ptr` came from `alloc` and is freed once.
    unsafe fn dealloc(&self, ptr: u64) {
        if let Some(layout) = lock(&self.allocs).remove(&ptr) {
            // SAFETY: allocated by `alloc` with this layout.
            unsafe { std::alloc::dealloc(ptr as *mut u8, layout) };
        }
    }
}

impl Drop for SimtDriver {
    fn drop(&mut self) {
        self.copies.join();
        for (ptr, layout) in lock(&self.allocs).drain() {
            // SAFETY: each was allocated by `alloc` with its layout, and the
            // backend no longer uses the driver.
            unsafe { std::alloc::dealloc(ptr as *mut u8, layout) };
        }
    }
}

impl Driver for SimtDriver {
    fn backend_name(&self) -> &'static str {
        crate::NAME
    }

    fn props(&self) -> &DeviceProps {
        &self.props
    }

    fn bind(&self) -> Result<()> {
        Ok(())
    }

    fn mem_info(&self) -> Option<(u64, u64)> {
        None
    }

    fn malloc(&self, bytes: usize) -> Option<u64> {
        self.alloc(bytes)
    }

    unsafe fn free(&self, ptr: u64) {
        // SAFETY: per the trait's contract.
        unsafe { self.dealloc(ptr) }
    }

    fn malloc_host(&self, bytes: usize) -> Result<*mut u8> {
        self.alloc(bytes)
            .map(|p| p as *mut u8)
            .ok_or_else(|| CoreError::Device(format!("simt: no {bytes} bytes of host memory")))
    }

    unsafe fn free_host(&self, ptr: *mut u8) {
        // SAFETY: per the trait's contract.
        unsafe { self.dealloc(ptr as u64) }
    }

    unsafe fn launch(
        &self,
        k: K,
        grid: [u32; 3],
        block: u32,
        smem: u32,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        // SAFETY: each argument points at an 8-byte slot (the trait's contract).
        let args = args
            .iter()
            .map(|&p| unsafe { *(p as *const u64) })
            .collect();
        self.inner.queue(Op::Launch {
            k,
            grid,
            block,
            smem,
            args,
        })
    }

    unsafe fn htod(&self, dst: u64, src: *const u8, bytes: usize) -> Result<()> {
        if lock(&self.inner.capture).is_none() {
            // Pageable memory may change once this returns: copy it now.
            // SAFETY: `src` holds `bytes` bytes and `dst` covers them.
            unsafe { std::ptr::copy(src, dst as *mut u8, bytes) };
            return Ok(());
        }
        self.inner.queue(Op::Copy {
            dst,
            src: src as u64,
            bytes,
        })
    }

    unsafe fn dtoh(&self, src: u64, dst: &mut [u8]) -> Result<()> {
        // SAFETY: `src` covers `dst.len()` bytes.
        unsafe { std::ptr::copy(src as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    unsafe fn dtod(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        self.inner.queue(Op::Copy { dst, src, bytes })
    }

    unsafe fn memset(&self, dst: u64, bytes: usize) -> Result<()> {
        self.inner.queue(Op::Memset { dst, bytes })
    }

    unsafe fn gemm(&self, g: &Gemm) -> Result<()> {
        self.inner.queue(Op::Gemm(*g))
    }

    fn copies_after_main(&self) -> Result<()> {
        // The main stream's work has run by the time it is queued.
        Ok(())
    }

    unsafe fn htod_on_copy_stream(&self, dst: u64, src: *const u8, bytes: usize) -> Result<()> {
        self.copies.send(CopyJob::Copy {
            dst,
            src: src as u64,
            bytes,
        })
    }

    fn copy_fence(&self) -> Result<Box<dyn Fence>> {
        let fence = self.copies.fences.fetch_add(1, Ordering::Relaxed) + 1;
        self.copies.send(CopyJob::Fence(fence))?;
        Ok(Box::new(SimtFence {
            fence,
            log: self.copies.log.clone(),
        }))
    }

    fn sync(&self) -> Result<()> {
        Ok(())
    }

    fn native_stream(&self) -> u64 {
        0
    }

    fn capture(&self, record: &mut dyn FnMut() -> Result<()>) -> Result<Box<dyn Graph>> {
        *lock(&self.inner.capture) = Some(Vec::new());
        let recorded = record();
        let ops = lock(&self.inner.capture).take().unwrap_or_default();
        recorded?;
        Ok(Box::new(SimtGraph {
            inner: self.inner.clone(),
            ops,
        }))
    }
}
