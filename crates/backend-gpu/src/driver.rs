//! The narrow interface a GPU runtime gives the shared backend: device and
//! pinned host memory, copies and memsets on the backend's one stream, kernel
//! launches by [`K`], a GEMM, stream capture into a replayable graph, and the
//! device's properties.
//!
//! `backend-cuda` implements it over the CUDA driver, cuBLAS and NVRTC
//! (through cudarc), `backend-rocm` over the HIP runtime, rocBLAS and hiprtc
//! (through libloading). Everything above it (op recording, graphs per
//! decode bucket, the memory pool, argument checks, kernel selection) is
//! written once, in this crate.
//!
//! Beside that main stream, a copy stream takes host-to-device copies that
//! may overlap the main stream's work (HiCache's load-back, layer by layer):
//! [`Driver::copies_after_main`] orders it after the main stream's queued
//! work, [`Driver::copy_fence`] marks a point in it and
//! [`Fence::main_waits`] makes the main stream's later work wait for that
//! point.
//!
//! Invariants a driver keeps: every operation except the copy stream's goes
//! to one stream, in call order; `bind` makes the driver's context current
//! on the calling thread and is called (under the backend's lock) before
//! any other method; a [`Graph`] replays exactly the operations queued
//! during its capture (nothing is queued on the copy stream during one).

#![allow(unsafe_code)]

use crate::kernels::K;
use arbor_engine_core::{DType, Result};
use std::ffi::c_void;

/// What the shared code needs to know about a device, read once when it opens.
#[derive(Clone, Debug)]
pub struct DeviceProps {
    /// The device's product name.
    pub name: String,
    /// The architecture the kernels were compiled for (`sm_90`, `gfx90a`).
    pub arch: String,
    /// Streaming multiprocessors (NVIDIA) or compute units (AMD).
    pub compute_units: u32,
    /// Largest dynamic shared memory (LDS on AMD) one block may use, in bytes.
    pub max_shared_per_block: u32,
    /// Device memory in bytes.
    pub total_memory: u64,
}

/// A GEMM `out[m, n] = x[m, k] · w[n, k]ᵀ` with f32 output and
/// accumulation, or with `heads > 1` that many of them side by side (one
/// strided-batched call): `x` `[m, heads·k]`, `w` `[heads·n, k]`, `out`
/// `[m, heads·n]`, and `out[:, h·n..(h+1)·n] = x[:, h·k..(h+1)·k] ·
/// w[h·n..(h+1)·n]ᵀ` for each head `h`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gemm {
    /// Type of `w` and `x`.
    pub dtype: DType,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    /// Products side by side (1: one plain GEMM).
    pub heads: usize,
    pub w: u64,
    pub x: u64,
    pub out: u64,
}

/// A captured, instantiated graph. Dropping it frees the driver's objects.
pub trait Graph: Send {
    /// Queues one replay on the driver's stream.
    fn launch(&self) -> Result<()>;
}

/// A point in the copy stream: the copies queued on it before the fence.
/// Dropping it frees the driver's event (the runtime keeps it alive until
/// the waits queued on it have run).
pub trait Fence: Send + Sync {
    /// Makes work queued on the main stream after this call wait until the
    /// copies before the fence are done (the host does not wait).
    fn main_waits(&self) -> Result<()>;
}

/// A GPU runtime bound to one device and one stream.
pub trait Driver: Send + Sync + 'static {
    /// The backend's name (`cuda`, `rocm`), used in messages and `info`.
    fn backend_name(&self) -> &'static str;

    /// Properties read when the device opened.
    fn props(&self) -> &DeviceProps;

    /// Makes this driver's context current on the calling thread.
    fn bind(&self) -> Result<()>;

    /// Device memory: `(free, total)` bytes, if the runtime says.
    fn mem_info(&self) -> Option<(u64, u64)>;

    /// `bytes` of device memory, or `None` when the device is out of memory.
    fn malloc(&self, bytes: usize) -> Option<u64>;

    /// Returns device memory from [`Driver::malloc`].
    ///
    /// # Safety
    /// `ptr` came from `malloc` of this driver, is freed once, and no queued
    /// work still uses it (the stream has drained).
    unsafe fn free(&self, ptr: u64);

    /// `bytes` of pinned host memory.
    fn malloc_host(&self, bytes: usize) -> Result<*mut u8>;

    /// Returns pinned host memory from [`Driver::malloc_host`].
    ///
    /// # Safety
    /// As for [`Driver::free`].
    unsafe fn free_host(&self, ptr: *mut u8);

    /// Queues kernel `k` over `grid` blocks of `block` threads with `smem`
    /// bytes of dynamic shared memory; `args` point at one 8-byte slot per
    /// parameter.
    ///
    /// # Safety
    /// `args` matches the kernel's signature, and every device address among
    /// them covers the range the launch touches.
    unsafe fn launch(
        &self,
        k: K,
        grid: [u32; 3],
        block: u32,
        smem: u32,
        args: &mut [*mut c_void],
    ) -> Result<()>;

    /// Queues a copy of `bytes` bytes from host `src` to device `dst`.
    ///
    /// # Safety
    /// `dst` covers `bytes`; `src` holds `bytes` readable bytes that stay
    /// unchanged until the copy ran (pinned staging) or are pageable memory,
    /// which the runtime stages before returning.
    unsafe fn htod(&self, dst: u64, src: *const u8, bytes: usize) -> Result<()>;

    /// Queues a copy from device `src` into `dst` (call [`Driver::sync`]
    /// before reading `dst`).
    ///
    /// # Safety
    /// `src` covers `dst.len()` bytes and `dst` outlives the copy.
    unsafe fn dtoh(&self, src: u64, dst: &mut [u8]) -> Result<()>;

    /// Queues a device-to-device copy.
    ///
    /// # Safety
    /// Both ranges lie in live device buffers.
    unsafe fn dtod(&self, dst: u64, src: u64, bytes: usize) -> Result<()>;

    /// Queues zeroing `bytes` bytes at `dst`.
    ///
    /// # Safety
    /// The range lies in a live device buffer.
    unsafe fn memset(&self, dst: u64, bytes: usize) -> Result<()>;

    /// Queues a GEMM (`g.heads` of them side by side as one batched call).
    ///
    /// # Safety
    /// The addresses cover `w [heads·n, k]`, `x [m, heads·k]` (of
    /// `g.dtype`) and `out [m, heads·n]` (f32).
    unsafe fn gemm(&self, g: &Gemm) -> Result<()>;

    /// Makes the copy stream's later copies start after everything queued
    /// on the main stream so far (the host does not wait).
    fn copies_after_main(&self) -> Result<()>;

    /// Queues a copy of `bytes` bytes from pinned host `src` to device
    /// `dst` on the copy stream.
    ///
    /// # Safety
    /// `dst` covers `bytes`; `src` is memory from [`Driver::malloc_host`]
    /// holding `bytes` bytes that stay unchanged until the copy ran (a
    /// fence after it was waited for by the main stream and the main stream
    /// synchronized); nothing else touches `dst` meanwhile except work
    /// ordered after such a fence.
    unsafe fn htod_on_copy_stream(&self, dst: u64, src: *const u8, bytes: usize) -> Result<()>;

    /// Queues a copy of `rows` rows of `row` bytes, `pitch` bytes apart in
    /// pinned host `src`, to device `dst` (packed one after another) on the
    /// copy stream. This default queues one copy per row; a runtime with
    /// 2-D copies makes it one.
    ///
    /// # Safety
    /// As [`Driver::htod_on_copy_stream`], with `src` covering `(rows - 1) ·
    /// pitch + row` bytes and `dst` `rows · row`.
    unsafe fn htod_rows_on_copy_stream(
        &self,
        dst: u64,
        src: *const u8,
        row: usize,
        pitch: usize,
        rows: usize,
    ) -> Result<()> {
        for i in 0..rows {
            // SAFETY: row i lies in `src` and its destination in `dst`
            // (the caller's contract).
            unsafe { self.htod_on_copy_stream(dst + (i * row) as u64, src.add(i * pitch), row)? };
        }
        Ok(())
    }

    /// A fence after the copies queued on the copy stream so far.
    fn copy_fence(&self) -> Result<Box<dyn Fence>>;

    /// Waits until everything queued on the main stream has run.
    fn sync(&self) -> Result<()>;

    /// The runtime's handle of the one stream (a `CUstream`, a
    /// `hipStream_t`), for vendor libraries that queue their own work on it
    /// (NCCL's collectives), so that it runs in order with everything else.
    fn native_stream(&self) -> u64;

    /// Captures what `record` queues into a graph (nothing runs during the
    /// capture). The capture is ended whatever `record` returns.
    fn capture(&self, record: &mut dyn FnMut() -> Result<()>) -> Result<Box<dyn Graph>>;
}
