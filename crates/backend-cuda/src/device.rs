//! One CUDA device: libraries, context, stream, cuBLAS, loaded kernels, and
//! the locked state (memory, the recorded step, captured graphs).
//!
//! [`probe`] decides whether a device can be used without touching any API
//! that panics when a library is absent (cudarc's loaders panic; its
//! `is_culib_present` checks do not), and [`Device::new`] runs inside
//! `catch_unwind`, so creation on a machine without a driver is an error that
//! starts with "no CUDA device".
//!
//! Invariants: every operation binds the context to the calling thread before
//! any driver call; all work goes to the one stream `stream`, in call order
//! (deferred steps keep that order, see [`crate::exec`]); the state lock is
//! never held while a tensor is dropped, because buffer releases only push
//! ids onto `releases`, which the next locked operation drains.

#![allow(unsafe_code)]

use crate::exec::State;
use crate::kernels::{self, K, KERNELS};
use crate::nvrtc;
use arbor_engine_core::{BufferId, BufferOwner, CoreError, Result};
use cudarc::cublas::sys as cublas_sys;
use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream, result as drv};
use std::sync::{Arc, Mutex, MutexGuard};

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

/// Properties read once at creation.
#[derive(Clone, Debug)]
pub(crate) struct Props {
    pub name: String,
    pub sm_count: u32,
    pub smem_optin: u32,
    pub total_mem: u64,
    pub arch: (i32, i32),
}

/// How decode steps use CUDA graphs.
#[derive(Clone, Debug)]
pub(crate) struct GraphConfig {
    pub enabled: bool,
    /// Bucket sizes, ascending; a decode batch runs padded to the first one that fits.
    pub buckets: Vec<usize>,
}

impl GraphConfig {
    pub fn new(enabled: bool, max_bs: usize) -> Self {
        let max_bs = max_bs.max(1);
        let mut buckets = vec![1, 2, 4, 8];
        let mut b = 16;
        while b < max_bs {
            buckets.push(b);
            b += 8;
        }
        buckets.retain(|&x| x < max_bs);
        buckets.push(max_bs);
        Self { enabled, buckets }
    }
    /// The bucket a decode batch of `n` sequences runs in, if any.
    pub fn bucket(&self, n: usize) -> Option<usize> {
        if !self.enabled || n == 0 {
            return None;
        }
        self.buckets.iter().copied().find(|&b| b >= n)
    }
}

/// A cuBLAS handle bound to the stream, with its own workspace (needed for capture).
pub(crate) struct Blas {
    pub handle: cublas_sys::cublasHandle_t,
    workspace: u64,
}

// SAFETY: the handle is used only under the state lock, on the device's stream.
unsafe impl Send for Blas {}
// SAFETY: as above.
unsafe impl Sync for Blas {}

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
        unsafe {
            cublas_sys::cublasSetWorkspace_v2(handle, b.workspace as _, BLAS_WORKSPACE).result()
        }
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

/// A device with its stream, kernels and state.
pub(crate) struct Device {
    pub tag: u32,
    pub props: Props,
    pub graphs: GraphConfig,
    pub blas: Blas,
    funcs: Vec<CudaFunction>,
    pub kernel_target: String,
    state: Mutex<State>,
    releases: Mutex<Vec<BufferId>>,
    _module: Arc<CudaModule>,
    pub stream: Arc<CudaStream>,
    pub ctx: Arc<CudaContext>,
}

/// Largest dynamic shared memory the prefill kernels request (see attention.rs).
pub(crate) const PREFILL_SMEM_MAX: u32 = 120 * 1024;

impl Device {
    /// Opens device `ordinal`; errors (never panics) when there is none.
    pub fn new(tag: u32, ordinal: usize, graphs: GraphConfig) -> Result<Self> {
        let no_dev = |why: String| CoreError::Device(format!("no CUDA device: {why}"));
        probe().map_err(no_dev)?;
        match std::panic::catch_unwind(|| Self::open(tag, ordinal, graphs)) {
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

    fn open(tag: u32, ordinal: usize, graphs: GraphConfig) -> Result<Self> {
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
        let props = Props {
            name: ctx.name().map_err(dev_err("cuDeviceGetName"))?,
            sm_count: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32,
            smem_optin: attr(
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )? as u32,
            total_mem: ctx.total_mem().map_err(dev_err("cuDeviceTotalMem"))? as u64,
            arch,
        };
        let stream = ctx.new_stream().map_err(dev_err("cuStreamCreate"))?;
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
        let smem = props.smem_optin.min(PREFILL_SMEM_MAX) as i32;
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
        tracing::info!(
            "CUDA device {ordinal}: {} (sm_{}{}, {} SMs, {:.1} GiB), kernels for {kernel_target}",
            props.name,
            arch.0,
            arch.1,
            props.sm_count,
            props.total_mem as f64 / (1u64 << 30) as f64
        );
        Ok(Self {
            tag,
            props,
            graphs,
            blas,
            funcs,
            kernel_target,
            state: Mutex::new(State::default()),
            releases: Mutex::new(Vec::new()),
            _module: module,
            stream,
            ctx,
        })
    }

    /// The loaded function of kernel `k`.
    pub fn func(&self, k: K) -> &CudaFunction {
        &self.funcs[k as usize]
    }

    /// Binds the context and locks the state, applying pending buffer releases.
    pub fn lock(&self) -> Result<MutexGuard<'_, State>> {
        self.ctx
            .bind_to_thread()
            .map_err(dev_err("binding the CUDA context"))?;
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let released =
            std::mem::take(&mut *self.releases.lock().unwrap_or_else(|e| e.into_inner()));
        for id in released {
            st.mem.release(id.slot);
        }
        Ok(st)
    }
}

fn load_kernels(ctx: &Arc<CudaContext>, arch: (i32, i32)) -> Result<(Arc<CudaModule>, String)> {
    let mut errors = Vec::new();
    for target in [
        format!("sm_{}{}", arch.0, arch.1),
        format!("compute_{}{}", arch.0, arch.1),
    ] {
        let img = match kernels::compile_cached(&target) {
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

impl BufferOwner for Device {
    fn release(&self, id: BufferId) {
        if id.device == self.tag {
            self.releases
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(id);
        }
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_err() {
            return;
        }
        let _ = self.stream.synchronize();
        let st = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        st.teardown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets() {
        let g = GraphConfig::new(true, 64);
        assert_eq!(g.buckets, vec![1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]);
        assert_eq!(g.bucket(3), Some(4));
        assert_eq!(g.bucket(17), Some(24));
        assert_eq!(g.bucket(64), Some(64));
        assert_eq!(g.bucket(65), None);
        let g = GraphConfig::new(true, 20);
        assert_eq!(g.buckets, vec![1, 2, 4, 8, 16, 20]);
        let g = GraphConfig::new(true, 3);
        assert_eq!(g.buckets, vec![1, 2, 3]);
        assert_eq!(GraphConfig::new(false, 8).bucket(1), None);
    }
}
