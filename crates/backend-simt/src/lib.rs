//! The shared GPU backend (`arbor-backend-gpu`) over a host emulator of the
//! CUDA execution model, for testing GPU code on machines without a GPU.
//!
//! [`SimtDriver`] compiles the backend's one kernel source, with the emulator
//! (`arbor_backend_gpu::kernels::SIMT_HEADER`: each thread a fiber, shared
//! memory, barriers, shuffles, `mma` from the PTX fragment layouts), into a
//! shared library with the system's C++ compiler, and implements the
//! backend's `Driver` over host memory. Everything above the driver is the
//! CUDA backend's own code: op recording, the memory pool and step arenas,
//! CUDA-graph capture and replay per decode bucket, kernel selection (as on
//! an sm_90 device: the tensor-core kernels), argument checks and launch
//! geometry. Its test binaries run the device suite shared with CUDA, ROCm
//! and wgpu (`crates/backend-gpu/tests/suite`) on it as an sm_90 GPU (`gpu`:
//! the tensor-core kernels) and as an AMD gfx90a (`gpu_cdna`: the f32-math
//! prefill in 64 KiB of LDS, the dequantizing GEMM) ([`Profile`]).
//!
//! It is slow (a few thousand emulated threads per millisecond) and is not
//! registered as a device: it exists for tests.

mod driver;
mod library;

pub use arbor_backend_gpu::{GpuBackend, kernels};
pub use driver::{CopyLog, FenceWait, Profile, SimtDriver};

use arbor_engine_core::{BackendOptions, CoreError, Result};

/// The backend's name in messages and `info`.
pub const NAME: &str = "simt";

/// The name of its paged attention.
pub const ATTENTION: &str = "simt-paged";

/// Whether the emulator can be built here: a C++ compiler runs.
pub fn probe() -> std::result::Result<(), String> {
    library::compiler().map(|_| ())
}

/// Opens the emulated device as an sm_90 GPU (graphs as `opts` says).
pub fn open(opts: &BackendOptions) -> Result<GpuBackend> {
    open_as(Profile::Hopper, opts)
}

/// Opens the emulated device as `profile` describes.
pub fn open_as(profile: Profile, opts: &BackendOptions) -> Result<GpuBackend> {
    let drv =
        SimtDriver::open(profile).map_err(|e| CoreError::Device(format!("no simt device: {e}")))?;
    Ok(GpuBackend::new(Box::new(drv), opts, ATTENTION))
}
