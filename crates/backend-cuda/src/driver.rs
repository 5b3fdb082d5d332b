//! [`CudaDriver`]: the [`Driver`] of the shared GPU backend over the CUDA
//! driver API, cuBLAS and NVRTC, all through cudarc's dynamically loaded
//! libraries.
//!
//! [`probe`] decides whether a device can be used without touching any API
//! that panics when a library is absent (cudarc's loaders panic; its
//! `is_culib_present` checks do not), and [`CudaDriver::open`] runs inside
//! `catch_unwind`, so creation on a machine without a driver is an error that
//! starts with "no CUDA device".
//!
//! Invariants: one context, one stream, one cuBLAS handle bound to that
//! stream with its own workspace (so GEMMs can be captured into graphs), a
//! second stream for the copies that may overlap it, ordered against it by
//! events only (`copies_after_main`, fences); the
//! kernels of `arbor_backend_gpu::kernels` are loaded once, as one module.

#![allow(unsafe_code)]

use crate::nvrtc;
use arbor_backend_gpu::driver::Fence;
use arbor_backend_gpu::kernels::{self, K, KERNELS};
use arbor_backend_gpu::{DeviceProps, Driver, Gemm, Graph};
use arbor_engine_core::{CoreError, DType, Result};
use cudarc::cublas::sys as cb;
use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream, result as drv, sys};
use std::ffi::c_void;
use std::sync::Arc;

/// Largest dynamic shared memory the prefill kernels request (the shared
/// backend never asks for more).
const PREFILL_SMEM_MAX: u32 = 120 * 1024;

/// Maps a driver error to a device error naming the call.
pub(crate) fn dev_err(what: &str) -> impl FnOnce(drv::DriverError) -> CoreError + '_ {
    move |e| {
        let name = e
            .error_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|_| format!("{:?}", e.0));
        if name.contains("OUT_OF_MEMORY") {
            CoreError::OutOfMemory(format!("{what}: {name}"))
        } else {
            CoreError::Device(format!("{what}: {name}"))
        }
    }
}

/// Why this machine has no usable CUDA device, or `Ok`.
pub fn probe() -> std::result::Result<(), String> {
    // SAFETY: only tries to open the driver library by its candidate names.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err("the NVIDIA driver library (libcuda.so.1) is not installed".into());
    }
    drv::init().map_err(|e| format!("cuInit failed: {e}"))?;
    let n = drv::device::get_count().map_err(|e| format!("cuDeviceGetCount failed: {e}"))?;
    if n <= 0 {
        return Err("the driver reports no devices".into());
    }
    // SAFETY: as above, for cuBLAS.
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        return Err("cuBLAS (libcublas.so.12) not found: add its folder to LD_LIBRARY_PATH".into());
    }
    nvrtc::available()
}

/// A cuBLAS handle bound to the stream, with its own workspace (needed for capture).
struct Blas {
    handle: cb::cublasHandle_t,
    workspace: u64,
}

const BLAS_WORKSPACE: usize = 32 << 20;

impl Blas {
    fn new(stream: &CudaStream) -> Result<Self> {
        let handle = cudarc::cublas::result::create_handle()
            .map_err(|e| CoreError::Device(format!("cublasCreate: {e}")))?;
        let mut b = Blas {
            handle,
            workspace: 0,
        };
        // SAFETY: a live handle and stream of the current context.
        unsafe { cudarc::cublas::result::set_stream(handle, stream.cu_stream() as _) }
            .map_err(|e| CoreError::Device(format!("cublasSetStream: {e}")))?;
        // SAFETY: allocates device memory in the current context.
        b.workspace = unsafe { drv::malloc_sync(BLAS_WORKSPACE) }.map_err(dev_err("cuMemAlloc"))?;
        // SAFETY: the workspace is live for the handle's lifetime (freed in Drop after it).
        unsafe { cb::cublasSetWorkspace_v2(handle, b.workspace as _, BLAS_WORKSPACE).result() }
            .map_err(|e| CoreError::Device(format!("cublasSetWorkspace: {e}")))?;
        Ok(b)
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once; errors at teardown are ignored.
        unsafe {
            let _ = cudarc::cublas::result::destroy_handle(self.handle);
            if self.workspace != 0 {
                let _ = drv::free_sync(self.workspace);
            }
        }
    }
}

/// One CUDA device: context, stream, cuBLAS and the loaded kernels.
pub struct CudaDriver {
    props: DeviceProps,
    blas: Blas,
    funcs: Vec<CudaFunction>,
    _module: Arc<CudaModule>,
    stream: Arc<CudaStream>,
    /// The copy stream, and the event that orders it after the main stream.
    copy_stream: Arc<CudaStream>,
    main_mark: Event,
    ctx: Arc<CudaContext>,
}

/// A CUDA event without timing, destroyed on drop with its context bound.
struct Event {
    event: sys::CUevent,
    ctx: Arc<CudaContext>,
}

impl Event {
    fn new(ctx: &Arc<CudaContext>) -> Result<Self> {
        let event = drv::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(dev_err("cuEventCreate"))?;
        Ok(Self {
            event,
            ctx: ctx.clone(),
        })
    }

    /// Records the event on `record_on`; `waiter` waits for it.
    fn order(&self, record_on: sys::CUstream, waiter: Option<sys::CUstream>) -> Result<()> {
        // SAFETY: a live event and streams of the bound context.
        unsafe { drv::event::record(self.event, record_on) }.map_err(dev_err("cuEventRecord"))?;
        match waiter {
            Some(w) => self.wait_on(w),
            None => Ok(()),
        }
    }

    fn wait_on(&self, stream: sys::CUstream) -> Result<()> {
        // SAFETY: as above; the wait uses the event's state at this call.
        unsafe {
            drv::stream::wait_event(
                stream,
                self.event,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(dev_err("cuStreamWaitEvent"))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: created by `Event::new`, destroyed once; CUDA releases a
        // recorded event only after the waits on it ran.
        if self.ctx.bind_to_thread().is_ok() {
            let _ = unsafe { drv::event::destroy(self.event) };
        }
    }
}

// SAFETY: an event handle is used under the backend's lock with its context bound.
unsafe impl Send for Event {}
// SAFETY: as above.
unsafe impl Sync for Event {}

/// A fence: an event recorded on the copy stream, and the main stream.
struct CudaFence {
    event: Event,
    main: sys::CUstream,
}

// SAFETY: as for Event; the stream handle outlives the fences (the backend
// drops them before its driver).
unsafe impl Send for CudaFence {}
// SAFETY: as above.
unsafe impl Sync for CudaFence {}

impl Fence for CudaFence {
    fn main_waits(&self) -> Result<()> {
        self.event.wait_on(self.main)
    }
}

// SAFETY: the cuBLAS handle and every CUDA object are used only under the
// shared backend's state lock, with the context bound to the calling thread.
unsafe impl Send for CudaDriver {}
// SAFETY: as above.
unsafe impl Sync for CudaDriver {}

impl CudaDriver {
    /// Opens device `ordinal`; errors (never panics) when there is none.
    pub fn open(ordinal: usize) -> Result<Self> {
        let no_dev = |why: String| CoreError::Device(format!("no CUDA device: {why}"));
        probe().map_err(no_dev)?;
        match std::panic::catch_unwind(|| Self::open_unchecked(ordinal)) {
            Ok(r) => r,
            Err(p) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "a CUDA library panicked".into());
                Err(no_dev(msg))
            }
        }
    }

    fn open_unchecked(ordinal: usize) -> Result<Self> {
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| CoreError::Device(format!("no CUDA device: device {ordinal}: {e}")))?;
        // SAFETY: this backend never uses cudarc's CudaSlice, whose cross-stream
        // synchronization is what event tracking provides.
        unsafe { ctx.disable_event_tracking() };
        let attr = |a| ctx.attribute(a).map_err(dev_err("cuDeviceGetAttribute"));
        let arch = ctx
            .compute_capability()
            .map_err(dev_err("cuDeviceGetAttribute"))?;
        if arch.0 < 8 {
            return Err(CoreError::unsupported(format!(
                "CUDA device {ordinal} has compute capability {}.{}; Arbor needs 8.0 (Ampere) or newer",
                arch.0, arch.1
            )));
        }
        let smem_optin =
            attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)? as u32;
        let stream = ctx.new_stream().map_err(dev_err("cuStreamCreate"))?;
        let copy_stream = ctx.new_stream().map_err(dev_err("cuStreamCreate"))?;
        let main_mark = Event::new(&ctx)?;
        let blas = Blas::new(&stream)?;
        let (module, kernel_target) = load_kernels(&ctx, arch)?;
        let mut funcs = Vec::with_capacity(KERNELS.len());
        for (_, name, _) in KERNELS {
            funcs.push(
                module
                    .load_function(name)
                    .map_err(dev_err("cuModuleGetFunction"))?,
            );
        }
        let smem = smem_optin.min(PREFILL_SMEM_MAX) as i32;
        for (k, name, _) in KERNELS {
            if name.starts_with("prefill_") {
                funcs[*k as usize]
                    .set_attribute(
                        CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        smem,
                    )
                    .map_err(dev_err("cuFuncSetAttribute"))?;
            }
        }
        let props = DeviceProps {
            name: ctx.name().map_err(dev_err("cuDeviceGetName"))?,
            arch: kernel_target,
            compute_units: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?
                as u32,
            max_shared_per_block: smem_optin,
            total_memory: ctx.total_mem().map_err(dev_err("cuDeviceTotalMem"))? as u64,
        };
        tracing::info!(
            "CUDA device {ordinal}: {} (sm_{}{}, {} SMs, {:.1} GiB), kernels for {}",
            props.name,
            arch.0,
            arch.1,
            props.compute_units,
            props.total_memory as f64 / (1u64 << 30) as f64,
            props.arch
        );
        Ok(Self {
            props,
            blas,
            funcs,
            _module: module,
            stream,
            copy_stream,
            main_mark,
            ctx,
        })
    }
}

fn load_kernels(ctx: &Arc<CudaContext>, arch: (i32, i32)) -> Result<(Arc<CudaModule>, String)> {
    let mut errors = Vec::new();
    for target in [
        format!("sm_{}{}", arch.0, arch.1),
        format!("compute_{}{}", arch.0, arch.1),
    ] {
        let img = match kernels::compile_cached(&nvrtc::Nvrtc, &target) {
            Ok(i) => i,
            Err(e) => {
                errors.push(e);
                continue;
            }
        };
        match ctx.load_module(cudarc::nvrtc::Ptx::from_binary(img.bytes)) {
            Ok(m) => return Ok((m, target)),
            Err(e) => errors.push(format!("loading the {target} kernels: {e}")),
        }
    }
    Err(CoreError::Device(format!(
        "compiling the CUDA kernels failed:\n{}",
        errors.join("\n")
    )))
}

fn cuda_type(d: DType) -> Result<cb::cudaDataType> {
    Ok(match d {
        DType::F32 => cb::cudaDataType::CUDA_R_32F,
        DType::F16 => cb::cudaDataType::CUDA_R_16F,
        DType::BF16 => cb::cudaDataType::CUDA_R_16BF,
        other => {
            return Err(CoreError::unsupported(format!(
                "CUDA GEMM with {other} inputs"
            )));
        }
    })
}

/// An instantiated CUDA graph and the stream it replays on.
struct CudaGraph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    stream: sys::CUstream,
}

// SAFETY: the handles are used only under the backend's state lock with the context bound.
unsafe impl Send for CudaGraph {}

impl Graph for CudaGraph {
    fn launch(&self) -> Result<()> {
        // SAFETY: an instantiated graph of this context; the caller checked
        // that every address it uses is live.
        unsafe { drv::graph::launch(self.exec, self.stream) }.map_err(dev_err("cuGraphLaunch"))
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        // SAFETY: created by a successful capture and instantiation; destroyed once.
        unsafe {
            let _ = drv::graph::exec_destroy(self.exec);
            let _ = drv::graph::destroy(self.graph);
        }
    }
}

impl Driver for CudaDriver {
    fn backend_name(&self) -> &'static str {
        "cuda"
    }

    fn props(&self) -> &DeviceProps {
        &self.props
    }

    fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(dev_err("binding the CUDA context"))
    }

    fn mem_info(&self) -> Option<(u64, u64)> {
        drv::mem_get_info()
            .ok()
            .map(|(free, total)| (free as u64, total as u64))
    }

    fn malloc(&self, bytes: usize) -> Option<u64> {
        // SAFETY: allocates in the bound context.
        unsafe { drv::malloc_sync(bytes) }.ok()
    }

    unsafe fn free(&self, ptr: u64) {
        // SAFETY: the caller's contract.
        let _ = unsafe { drv::free_sync(ptr) };
    }

    fn malloc_host(&self, bytes: usize) -> Result<*mut u8> {
        // SAFETY: allocates pinned host memory in the bound context, pinned
        // for every context (the host KV tier of a tensor-parallel group is
        // one pool for all its devices).
        let p = unsafe { drv::malloc_host(bytes, sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(dev_err("cuMemHostAlloc"))?;
        Ok(p as *mut u8)
    }

    unsafe fn free_host(&self, ptr: *mut u8) {
        // SAFETY: the caller's contract.
        let _ = unsafe { drv::free_host(ptr as *mut c_void) };
    }

    unsafe fn launch(
        &self,
        k: K,
        grid: [u32; 3],
        block: u32,
        smem: u32,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        let mut args = args.to_vec();
        // SAFETY: the caller's contract; the function belongs to this context.
        unsafe {
            drv::launch_kernel(
                self.funcs[k as usize].cu_function(),
                (grid[0], grid[1], grid[2]),
                (block, 1, 1),
                smem,
                self.stream.cu_stream(),
                &mut args,
            )
        }
        .map_err(dev_err(k.name()))
    }

    unsafe fn htod(&self, dst: u64, src: *const u8, bytes: usize) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe {
            let data = std::slice::from_raw_parts(src, bytes);
            drv::memcpy_htod_async(dst, data, self.stream.cu_stream())
        }
        .map_err(dev_err("cuMemcpyHtoDAsync"))
    }

    unsafe fn dtoh(&self, src: u64, dst: &mut [u8]) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe {
            sys::cuMemcpyDtoHAsync_v2(
                dst.as_mut_ptr() as *mut c_void,
                src,
                dst.len(),
                self.stream.cu_stream(),
            )
            .result()
        }
        .map_err(dev_err("cuMemcpyDtoHAsync"))
    }

    unsafe fn dtod(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { drv::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }
            .map_err(dev_err("cuMemcpyDtoDAsync"))
    }

    unsafe fn memset(&self, dst: u64, bytes: usize) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { drv::memset_d8_async(dst, 0, bytes, self.stream.cu_stream()) }
            .map_err(dev_err("cuMemsetD8Async"))
    }

    unsafe fn gemm(&self, g: &Gemm) -> Result<()> {
        let ty = cuda_type(g.dtype)?;
        let dim = |v: usize| {
            i32::try_from(v).map_err(|_| CoreError::unsupported(format!("GEMM dimension {v}")))
        };
        let (m, n, k) = (dim(g.m)?, dim(g.n)?, dim(g.k)?);
        let (alpha, beta) = (1.0f32, 0.0f32);
        // Row-major out[m, n] = x[m, k] · w[n, k]ᵀ is column-major
        // outᵀ (n × m) = wᵀ (n × k, w stored k × n) · xᵀ (k × m).
        if g.heads > 1 {
            let (heads, ldx, ldo) = (dim(g.heads)?, dim(g.heads * g.k)?, dim(g.heads * g.n)?);
            let long = |v: usize| v as std::ffi::c_longlong;
            // Head h: w + h·n·k (ld k), x + h·k (ld heads·k), out + h·n (ld heads·n).
            // SAFETY: the caller's contract; alpha and beta are host scalars
            // read during the call.
            return unsafe {
                cb::cublasGemmStridedBatchedEx(
                    self.blas.handle,
                    cb::cublasOperation_t::CUBLAS_OP_T,
                    cb::cublasOperation_t::CUBLAS_OP_N,
                    n,
                    m,
                    k,
                    &alpha as *const f32 as *const c_void,
                    g.w as *const c_void,
                    ty,
                    k,
                    long(g.n * g.k),
                    g.x as *const c_void,
                    ty,
                    ldx,
                    long(g.k),
                    &beta as *const f32 as *const c_void,
                    g.out as *mut c_void,
                    cb::cudaDataType::CUDA_R_32F,
                    ldo,
                    long(g.n),
                    heads,
                    cb::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cb::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
                .result()
            }
            .map_err(|e| {
                CoreError::Device(format!(
                    "cublasGemmStridedBatchedEx {heads} x {m}x{n}x{k}: {e}"
                ))
            });
        }
        // SAFETY: the caller's contract; alpha and beta are host scalars read
        // during the call.
        unsafe {
            cb::cublasGemmEx(
                self.blas.handle,
                cb::cublasOperation_t::CUBLAS_OP_T,
                cb::cublasOperation_t::CUBLAS_OP_N,
                n,
                m,
                k,
                &alpha as *const f32 as *const c_void,
                g.w as *const c_void,
                ty,
                k,
                g.x as *const c_void,
                ty,
                k,
                &beta as *const f32 as *const c_void,
                g.out as *mut c_void,
                cb::cudaDataType::CUDA_R_32F,
                n,
                cb::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cb::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
            .result()
        }
        .map_err(|e| CoreError::Device(format!("cublasGemmEx {m}x{n}x{k}: {e}")))
    }

    fn copies_after_main(&self) -> Result<()> {
        self.main_mark
            .order(self.stream.cu_stream(), Some(self.copy_stream.cu_stream()))
    }

    unsafe fn htod_on_copy_stream(&self, dst: u64, src: *const u8, bytes: usize) -> Result<()> {
        // SAFETY: the caller's contract (pinned source, live destination).
        unsafe {
            let data = std::slice::from_raw_parts(src, bytes);
            drv::memcpy_htod_async(dst, data, self.copy_stream.cu_stream())
        }
        .map_err(dev_err("cuMemcpyHtoDAsync"))
    }

    unsafe fn htod_rows_on_copy_stream(
        &self,
        dst: u64,
        src: *const u8,
        row: usize,
        pitch: usize,
        rows: usize,
    ) -> Result<()> {
        let copy = sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_HOST,
            srcHost: src as *const c_void,
            srcDevice: 0,
            srcArray: std::ptr::null_mut(),
            srcPitch: pitch,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            dstHost: std::ptr::null_mut(),
            dstDevice: dst,
            dstArray: std::ptr::null_mut(),
            dstPitch: row,
            WidthInBytes: row,
            Height: rows,
        };
        // SAFETY: the caller's contract (pinned source rows, live
        // destination); the descriptor is read during the call.
        unsafe { sys::cuMemcpy2DAsync_v2(&copy, self.copy_stream.cu_stream()).result() }
            .map_err(dev_err("cuMemcpy2DAsync"))
    }

    fn copy_fence(&self) -> Result<Box<dyn Fence>> {
        let event = Event::new(&self.ctx)?;
        event.order(self.copy_stream.cu_stream(), None)?;
        Ok(Box::new(CudaFence {
            event,
            main: self.stream.cu_stream(),
        }))
    }

    fn sync(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(dev_err("cuStreamSynchronize"))
    }

    fn native_stream(&self) -> u64 {
        self.stream.cu_stream() as u64
    }

    fn capture(&self, record: &mut dyn FnMut() -> Result<()>) -> Result<Box<dyn Graph>> {
        let s = self.stream.cu_stream();
        // SAFETY: a live stream of the bound context, not already capturing.
        unsafe {
            drv::stream::begin_capture(
                s,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        }
        .map_err(dev_err("cuStreamBeginCapture"))?;
        let recorded = record();
        // SAFETY: ends the capture begun above, whatever happened in between.
        let ended = unsafe { drv::stream::end_capture(s) }.map_err(dev_err("cuStreamEndCapture"));
        recorded?;
        let graph = ended?;
        if graph.is_null() {
            return Err(CoreError::Device("stream capture produced no graph".into()));
        }
        // SAFETY: a graph just captured; destroyed if instantiation fails.
        match unsafe { drv::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) } {
            Ok(exec) => Ok(Box::new(CudaGraph {
                graph,
                exec,
                stream: s,
            })),
            Err(e) => {
                // SAFETY: as above.
                let _ = unsafe { drv::graph::destroy(graph) };
                Err(dev_err("cuGraphInstantiate")(e))
            }
        }
    }
}
