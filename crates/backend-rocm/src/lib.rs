//! Arbor's AMD GPU backend: the shared GPU backend (`arbor-backend-gpu`)
//! over [`HipDriver`], which drives the HIP runtime, rocBLAS and hiprtc, all
//! loaded with libloading at run time. It builds with no ROCm installed and,
//! on a machine without an AMD GPU, [`open`] returns
//! `CoreError::Device("no ROCm device: ...")` instead of panicking.
//!
//! The kernels are the CUDA backend's own source (`crates/backend-gpu/kernels`)
//! compiled by hiprtc for the device's `gcnArchName` and cached on disk
//! (`$ARBOR_ROCM_CACHE`, else `~/.cache/arbor/rocm`); warps of 32 lanes run
//! as halves of CDNA's 64-wide wavefronts (see `kernels/common.cuh`). Linear
//! layers go through rocBLAS (`rocblas_gemm_ex`, f32 accumulation), and
//! decode batches run as HIP graphs per batch-size bucket unless
//! `--disable-cuda-graph` (`--cuda-graph-max-bs` caps them), as in SGLang on
//! ROCm.
#![allow(unsafe_code)]

pub mod codeobj;
mod driver;
pub mod hip;
pub mod hiprtc;
mod rocblas;

pub use arbor_backend_gpu::{GpuBackend, GraphStats, kernels};
pub use driver::{HipDriver, probe};

use arbor_engine_core::registry::BackendEntry;
use arbor_engine_core::{Backend, BackendOptions, Result, inventory};
use std::sync::Arc;

/// The name of the ROCm paged attention.
pub const ATTENTION: &str = "rocm-paged";

/// Opens ROCm device `opts.device_index` as a backend.
pub fn open(opts: &BackendOptions) -> Result<GpuBackend> {
    let drv = HipDriver::open(opts.device_index)?;
    Ok(GpuBackend::new(Box::new(drv), opts, ATTENTION))
}

inventory::submit! {
    BackendEntry {
        name: "rocm",
        about: "AMD GPUs (CDNA, RDNA) through HIP: rocBLAS GEMMs, hiprtc kernels, paged attention, HIP graphs",
        create: |opts: &BackendOptions| Ok(Arc::new(open(opts)?) as Arc<dyn Backend>),
    }
}
