//! [`HipDriver`]: the [`Driver`] of the shared GPU backend over the HIP
//! runtime, rocBLAS and hiprtc, all opened at run time.
//!
//! [`probe`] says why a machine has no usable AMD GPU without panicking (a
//! missing library, `hipErrorNoDevice`, no rocBLAS, no hiprtc), and
//! [`HipDriver::open`] errors with "no ROCm device: ..." in every such case.
//!
//! Invariants: one device (made current by `bind` on every locked call), one
//! non-blocking stream (and a second for the copies that may overlap it,
//! ordered against it by events only), one rocBLAS handle bound to it with a workspace this
//! driver owns (so GEMMs never allocate inside a graph capture); the kernels
//! are one module compiled for the device's `gcnArchName`. Dynamic shared
//! memory needs no opt-in on AMD: launches pass it, up to the device's LDS
//! per block (`max_shared_per_block`, which the shared backend's kernel
//! choice respects).

#![allow(unsafe_code)]

use crate::hip::{self, Event, Function, GraphExec, GraphT, Hip, Module, PROPS_BUFFER, Stream};
use crate::hiprtc::{self, Hiprtc};
use crate::rocblas::{self, Blas, RocBlas};
use arbor_backend_gpu::driver::Fence;
use arbor_backend_gpu::kernels::{self, K, KERNELS};
use arbor_backend_gpu::{DeviceProps, Driver, Gemm, Graph};
use arbor_engine_core::{CoreError, Result};
use std::ffi::{CString, c_int, c_void};

const BLAS_WORKSPACE: usize = 32 << 20;

/// Why this machine has no usable ROCm device, or `Ok` with the device count.
pub fn probe() -> std::result::Result<usize, String> {
    let hip = Hip::get()?;
    let mut n: c_int = 0;
    let e = {
        let _init = hip::INIT_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: a valid out-pointer; hipGetDeviceCount initializes the runtime.
        unsafe { (hip.get_device_count)(&mut n) }
    };
    if e == hip::HIP_ERROR_NO_DEVICE || (e == hip::HIP_SUCCESS && n <= 0) {
        return Err(format!(
            "the HIP runtime ({}) reports no devices (no /dev/kfd or no AMD GPU)",
            hip.path
        ));
    }
    if e != hip::HIP_SUCCESS {
        return Err(format!("hipGetDeviceCount: {}", hip.error_name(e)));
    }
    RocBlas::get()?;
    hiprtc::available()?;
    Ok(n as usize)
}

/// One AMD GPU: its stream, rocBLAS and loaded kernels.
pub struct HipDriver {
    hip: &'static Hip,
    ordinal: c_int,
    props: DeviceProps,
    stream: Stream,
    /// The copy stream, and the event that orders it after the main stream.
    copy_stream: Stream,
    main_mark: Event,
    blas: Option<Blas>,
    workspace: *mut c_void,
    module: Module,
    funcs: Vec<Function>,
}

// SAFETY: HIP handles are used only under the shared backend's state lock,
// with the device made current on the calling thread.
unsafe impl Send for HipDriver {}
// SAFETY: as above.
unsafe impl Sync for HipDriver {}

fn c_str(buf: &[u8]) -> String {
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

impl HipDriver {
    /// Opens device `ordinal`; errors (never panics) when there is none.
    pub fn open(ordinal: usize) -> Result<Self> {
        let no_dev = |why: String| CoreError::Device(format!("no ROCm device: {why}"));
        let count = probe().map_err(no_dev)?;
        if ordinal >= count {
            return Err(no_dev(format!(
                "device {ordinal} requested, {count} present"
            )));
        }
        let hip = Hip::get().map_err(no_dev)?;
        let ordinal = ordinal as c_int;
        // SAFETY: a valid device index.
        hip.check(unsafe { (hip.set_device)(ordinal) }, "hipSetDevice")?;
        let props = Self::read_props(hip, ordinal)?;
        let mut d = Self {
            hip,
            ordinal,
            props,
            stream: std::ptr::null_mut(),
            copy_stream: std::ptr::null_mut(),
            main_mark: std::ptr::null_mut(),
            blas: None,
            workspace: std::ptr::null_mut(),
            module: std::ptr::null_mut(),
            funcs: Vec::new(),
        };
        // SAFETY: valid out-pointers; everything made here is freed in Drop.
        unsafe {
            hip.check(
                (hip.stream_create_with_flags)(&mut d.stream, hip::STREAM_NON_BLOCKING),
                "hipStreamCreateWithFlags",
            )?;
            hip.check(
                (hip.stream_create_with_flags)(&mut d.copy_stream, hip::STREAM_NON_BLOCKING),
                "hipStreamCreateWithFlags",
            )?;
            hip.check(
                (hip.event_create_with_flags)(&mut d.main_mark, hip::EVENT_DISABLE_TIMING),
                "hipEventCreateWithFlags",
            )?;
            hip.check(
                (hip.malloc)(&mut d.workspace, BLAS_WORKSPACE),
                "hipMalloc (rocBLAS workspace)",
            )?;
        }
        d.blas = Some(Blas::new(d.stream, d.workspace, BLAS_WORKSPACE)?);
        d.load_kernels()?;
        tracing::info!(
            "ROCm device {ordinal}: {} ({}, {} CUs, {:.1} GiB, {} KiB LDS per block)",
            d.props.name,
            d.props.arch,
            d.props.compute_units,
            d.props.total_memory as f64 / (1u64 << 30) as f64,
            d.props.max_shared_per_block / 1024
        );
        Ok(d)
    }

    fn read_props(hip: &Hip, ordinal: c_int) -> Result<DeviceProps> {
        let mut name = [0u8; 256];
        let mut total = 0usize;
        let attr = |a: c_int, what: &str| -> Result<u32> {
            let mut v: c_int = 0;
            // SAFETY: a valid out-pointer and device.
            hip.check(
                unsafe { (hip.device_get_attribute)(&mut v, a, ordinal) },
                what,
            )?;
            Ok(v.max(0) as u32)
        };
        // SAFETY: `name` holds 256 bytes; `total` is a valid out-pointer.
        unsafe {
            hip.check(
                (hip.device_get_name)(name.as_mut_ptr() as *mut _, 256, ordinal),
                "hipDeviceGetName",
            )?;
            hip.check(
                (hip.device_total_mem)(&mut total, ordinal),
                "hipDeviceTotalMem",
            )?;
        }
        // The struct's layout depends on the ROCm version (see hip.rs); only
        // gcnArchName is read from it, at the offset of the symbol found.
        let mut raw = vec![0u64; PROPS_BUFFER / 8];
        // SAFETY: the buffer is larger than either layout and 8-byte aligned.
        hip.check(
            unsafe { (hip.get_device_properties)(raw.as_mut_ptr() as *mut c_void, ordinal) },
            "hipGetDeviceProperties",
        )?;
        let bytes: Vec<u8> = raw.iter().flat_map(|w| w.to_le_bytes()).collect();
        let off = hip.props_layout.arch_name_offset;
        let arch = c_str(&bytes[off..off + 256]);
        if !arch.starts_with("gfx") {
            return Err(CoreError::Device(format!(
                "ROCm device {ordinal}: unreadable gcnArchName {arch:?}"
            )));
        }
        Ok(DeviceProps {
            name: c_str(&name),
            arch,
            compute_units: attr(hip::ATTR_MULTIPROCESSOR_COUNT, "hipDeviceGetAttribute(CUs)")?,
            max_shared_per_block: attr(
                hip::ATTR_MAX_SHARED_MEMORY_PER_BLOCK,
                "hipDeviceGetAttribute(LDS)",
            )?,
            total_memory: total as u64,
        })
    }

    fn load_kernels(&mut self) -> Result<()> {
        let img = kernels::compile_cached(&Hiprtc, &self.props.arch)
            .map_err(|e| CoreError::Device(format!("compiling the ROCm kernels failed:\n{e}")))?;
        let hip = self.hip;
        // SAFETY: a code object image for this device's architecture.
        hip.check(
            unsafe {
                (hip.module_load_data)(&mut self.module, img.bytes.as_ptr() as *const c_void)
            },
            "hipModuleLoadData",
        )?;
        for (_, name, _) in KERNELS {
            let cname = CString::new(*name).map_err(|e| CoreError::Internal(e.to_string()))?;
            let mut f: Function = std::ptr::null_mut();
            // SAFETY: a loaded module and a NUL-terminated name.
            hip.check(
                unsafe { (hip.module_get_function)(&mut f, self.module, cname.as_ptr()) },
                name,
            )?;
            self.funcs.push(f);
        }
        Ok(())
    }
}

impl Drop for HipDriver {
    fn drop(&mut self) {
        let h = self.hip;
        // SAFETY: teardown of what `open` made, once; errors are ignored.
        unsafe {
            (h.set_device)(self.ordinal);
            if !self.stream.is_null() {
                (h.stream_synchronize)(self.stream);
            }
            self.blas = None;
            if !self.module.is_null() {
                (h.module_unload)(self.module);
            }
            if !self.workspace.is_null() {
                (h.free)(self.workspace);
            }
            if !self.stream.is_null() {
                (h.stream_destroy)(self.stream);
            }
            if !self.copy_stream.is_null() {
                (h.stream_synchronize)(self.copy_stream);
                (h.stream_destroy)(self.copy_stream);
            }
            if !self.main_mark.is_null() {
                (h.event_destroy)(self.main_mark);
            }
        }
    }
}

/// A fence: an event recorded on the copy stream, and the main stream.
struct HipFence {
    hip: &'static Hip,
    ordinal: c_int,
    event: Event,
    main: Stream,
}

// SAFETY: used only under the backend's state lock; the streams outlive
// the fences (the backend drops them before its driver).
unsafe impl Send for HipFence {}
// SAFETY: as above.
unsafe impl Sync for HipFence {}

impl Fence for HipFence {
    fn main_waits(&self) -> Result<()> {
        // SAFETY: a live event and stream of this device.
        self.hip.check(
            unsafe { (self.hip.stream_wait_event)(self.main, self.event, 0) },
            "hipStreamWaitEvent",
        )
    }
}

impl Drop for HipFence {
    fn drop(&mut self) {
        // SAFETY: created by `copy_fence`, destroyed once; HIP releases a
        // recorded event only after the waits on it ran.
        unsafe {
            (self.hip.set_device)(self.ordinal);
            (self.hip.event_destroy)(self.event);
        }
    }
}

/// An instantiated HIP graph and the stream it replays on.
struct HipGraph {
    hip: &'static Hip,
    graph: GraphT,
    exec: GraphExec,
    stream: Stream,
}

// SAFETY: used only under the backend's state lock.
unsafe impl Send for HipGraph {}

impl Graph for HipGraph {
    fn launch(&self) -> Result<()> {
        // SAFETY: an instantiated graph of this device; the caller checked
        // that every address it uses is live.
        self.hip.check(
            unsafe { (self.hip.graph_launch)(self.exec, self.stream) },
            "hipGraphLaunch",
        )
    }
}

impl Drop for HipGraph {
    fn drop(&mut self) {
        // SAFETY: created by a successful capture and instantiation; destroyed once.
        unsafe {
            (self.hip.graph_exec_destroy)(self.exec);
            (self.hip.graph_destroy)(self.graph);
        }
    }
}

impl Driver for HipDriver {
    fn backend_name(&self) -> &'static str {
        "rocm"
    }

    fn props(&self) -> &DeviceProps {
        &self.props
    }

    fn bind(&self) -> Result<()> {
        // SAFETY: a valid device index.
        self.hip.check(
            unsafe { (self.hip.set_device)(self.ordinal) },
            "hipSetDevice",
        )
    }

    fn mem_info(&self) -> Option<(u64, u64)> {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid out-pointers.
        let e = unsafe { (self.hip.mem_get_info)(&mut free, &mut total) };
        (e == hip::HIP_SUCCESS).then_some((free as u64, total as u64))
    }

    fn malloc(&self, bytes: usize) -> Option<u64> {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        let e = unsafe { (self.hip.malloc)(&mut p, bytes) };
        (e == hip::HIP_SUCCESS && !p.is_null()).then_some(p as u64)
    }

    unsafe fn free(&self, ptr: u64) {
        // SAFETY: the caller's contract.
        unsafe { (self.hip.free)(ptr as *mut c_void) };
    }

    fn malloc_host(&self, bytes: usize) -> Result<*mut u8> {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; pinned for every device (the host KV
        // tier of a tensor-parallel group is one pool for all of them).
        self.hip.check(
            unsafe { (self.hip.host_malloc)(&mut p, bytes, hip::HOST_MALLOC_PORTABLE) },
            "hipHostMalloc",
        )?;
        Ok(p as *mut u8)
    }

    unsafe fn free_host(&self, ptr: *mut u8) {
        // SAFETY: the caller's contract.
        unsafe { (self.hip.host_free)(ptr as *mut c_void) };
    }

    unsafe fn launch(
        &self,
        k: K,
        grid: [u32; 3],
        block: u32,
        smem: u32,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        // SAFETY: the caller's contract; the function belongs to this device.
        let e = unsafe {
            (self.hip.module_launch_kernel)(
                self.funcs[k as usize],
                grid[0],
                grid[1],
                grid[2],
                block,
                1,
                1,
                smem,
                self.stream,
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        self.hip.check(e, k.name())
    }

    unsafe fn htod(&self, dst: u64, src: *const u8, bytes: usize) -> Result<()> {
        // SAFETY: the caller's contract (HIP's prototype takes a mutable source).
        let e = unsafe {
            (self.hip.memcpy_htod_async)(dst as *mut c_void, src as *mut c_void, bytes, self.stream)
        };
        self.hip.check(e, "hipMemcpyHtoDAsync")
    }

    unsafe fn dtoh(&self, src: u64, dst: &mut [u8]) -> Result<()> {
        // SAFETY: the caller's contract.
        let e = unsafe {
            (self.hip.memcpy_dtoh_async)(
                dst.as_mut_ptr() as *mut c_void,
                src as *mut c_void,
                dst.len(),
                self.stream,
            )
        };
        self.hip.check(e, "hipMemcpyDtoHAsync")
    }

    unsafe fn dtod(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        // SAFETY: the caller's contract.
        let e = unsafe {
            (self.hip.memcpy_dtod_async)(dst as *mut c_void, src as *mut c_void, bytes, self.stream)
        };
        self.hip.check(e, "hipMemcpyDtoDAsync")
    }

    unsafe fn memset(&self, dst: u64, bytes: usize) -> Result<()> {
        // SAFETY: the caller's contract.
        let e = unsafe { (self.hip.memset_d8_async)(dst as *mut c_void, 0, bytes, self.stream) };
        self.hip.check(e, "hipMemsetD8Async")
    }

    unsafe fn gemm(&self, g: &Gemm) -> Result<()> {
        let ty = rocblas::datatype(g.dtype)?;
        let dim = |v: usize| {
            c_int::try_from(v).map_err(|_| CoreError::unsupported(format!("GEMM dimension {v}")))
        };
        let blas = self
            .blas
            .as_ref()
            .ok_or_else(|| CoreError::Internal("rocBLAS handle missing".into()))?;
        if g.heads > 1 {
            let dims = [dim(g.m)?, dim(g.n)?, dim(g.k)?, dim(g.heads)?];
            // SAFETY: the caller's contract.
            return unsafe { blas.gemm_heads(ty, dims, g.w, g.x, g.out) };
        }
        // SAFETY: the caller's contract.
        unsafe { blas.gemm(ty, dim(g.m)?, dim(g.n)?, dim(g.k)?, g.w, g.x, g.out) }
    }

    fn copies_after_main(&self) -> Result<()> {
        let h = self.hip;
        // SAFETY: a live event and streams of this device.
        unsafe {
            h.check(
                (h.event_record)(self.main_mark, self.stream),
                "hipEventRecord",
            )?;
            h.check(
                (h.stream_wait_event)(self.copy_stream, self.main_mark, 0),
                "hipStreamWaitEvent",
            )
        }
    }

    unsafe fn htod_on_copy_stream(&self, dst: u64, src: *const u8, bytes: usize) -> Result<()> {
        // SAFETY: the caller's contract (pinned source, live destination).
        let e = unsafe {
            (self.hip.memcpy_htod_async)(
                dst as *mut c_void,
                src as *mut c_void,
                bytes,
                self.copy_stream,
            )
        };
        self.hip.check(e, "hipMemcpyHtoDAsync")
    }

    unsafe fn htod_rows_on_copy_stream(
        &self,
        dst: u64,
        src: *const u8,
        row: usize,
        pitch: usize,
        rows: usize,
    ) -> Result<()> {
        // SAFETY: the caller's contract (pinned source rows, live destination).
        let e = unsafe {
            (self.hip.memcpy_2d_async)(
                dst as *mut c_void,
                row,
                src as *const c_void,
                pitch,
                row,
                rows,
                hip::MEMCPY_HOST_TO_DEVICE,
                self.copy_stream,
            )
        };
        self.hip.check(e, "hipMemcpy2DAsync")
    }

    fn copy_fence(&self) -> Result<Box<dyn Fence>> {
        let h = self.hip;
        let mut event: Event = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; the event is destroyed by the fence,
        // or here when recording fails.
        unsafe {
            h.check(
                (h.event_create_with_flags)(&mut event, hip::EVENT_DISABLE_TIMING),
                "hipEventCreateWithFlags",
            )?;
            if let Err(e) = h.check((h.event_record)(event, self.copy_stream), "hipEventRecord") {
                (h.event_destroy)(event);
                return Err(e);
            }
        }
        Ok(Box::new(HipFence {
            hip: h,
            ordinal: self.ordinal,
            event,
            main: self.stream,
        }))
    }

    fn sync(&self) -> Result<()> {
        // SAFETY: a live stream.
        self.hip.check(
            unsafe { (self.hip.stream_synchronize)(self.stream) },
            "hipStreamSynchronize",
        )
    }

    fn native_stream(&self) -> u64 {
        self.stream as u64
    }

    fn capture(&self, record: &mut dyn FnMut() -> Result<()>) -> Result<Box<dyn Graph>> {
        let h = self.hip;
        // SAFETY: a live stream, not already capturing.
        h.check(
            unsafe { (h.stream_begin_capture)(self.stream, hip::CAPTURE_MODE_THREAD_LOCAL) },
            "hipStreamBeginCapture",
        )?;
        let recorded = record();
        let mut graph: GraphT = std::ptr::null_mut();
        // SAFETY: ends the capture begun above, whatever happened in between.
        let ended = h.check(
            unsafe { (h.stream_end_capture)(self.stream, &mut graph) },
            "hipStreamEndCapture",
        );
        recorded?;
        ended?;
        if graph.is_null() {
            return Err(CoreError::Device("stream capture produced no graph".into()));
        }
        let mut exec: GraphExec = std::ptr::null_mut();
        // SAFETY: a graph just captured; destroyed if instantiation fails.
        let e = unsafe {
            (h.graph_instantiate)(
                &mut exec,
                graph,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
            )
        };
        if let Err(err) = h.check(e, "hipGraphInstantiate") {
            // SAFETY: as above.
            unsafe { (h.graph_destroy)(graph) };
            return Err(err);
        }
        Ok(Box::new(HipGraph {
            hip: h,
            graph,
            exec,
            stream: self.stream,
        }))
    }
}
