//! Arbor's NVIDIA GPU backend: the shared GPU backend (`arbor-backend-gpu`)
//! over [`CudaDriver`], which drives the CUDA driver API, cuBLAS and NVRTC
//! through cudarc with dynamically loaded libraries. It builds without a CUDA
//! toolkit and, on a machine without a driver or device, [`open`] returns
//! `CoreError::Device("no CUDA device: ...")` instead of panicking.
//!
//! Linear layers go through cuBLAS (`cublasGemmEx`), the kernels of the
//! shared CUDA C source are compiled by NVRTC for the device's `sm_XY` (PTX
//! for `compute_XY` as a fallback) and cached on disk (`$ARBOR_CUDA_CACHE`),
//! and decode batches run as CUDA graphs per batch-size bucket unless
//! `BackendOptions::disable_cuda_graph`. Tensor-parallel ranks on distinct
//! GPUs communicate through NCCL ([`nccl`], the registry's `cuda` device
//! group), loaded at run time as well.
#![allow(unsafe_code)]

mod driver;
pub mod nccl;
pub mod nvrtc;

pub use arbor_backend_gpu::{DEFAULT_CUDA_GRAPH_MAX_BS, GpuBackend, GraphStats, kernels};
pub use driver::{CudaDriver, probe};

use arbor_engine_core::registry::{BackendEntry, DeviceGroupEntry};
use arbor_engine_core::{Backend, BackendOptions, Result, inventory};
use std::sync::Arc;

/// The name of the CUDA paged attention.
pub const ATTENTION: &str = "cuda-paged";

/// Opens CUDA device `opts.device_index` as a backend, with CUDA graphs for
/// decode batches up to `opts.cuda_graph_max_bs` (default 256) unless
/// `opts.disable_cuda_graph`.
pub fn open(opts: &BackendOptions) -> Result<GpuBackend> {
    let drv = CudaDriver::open(opts.device_index)?;
    Ok(GpuBackend::new(Box::new(drv), opts, ATTENTION))
}

inventory::submit! {
    BackendEntry {
        name: "cuda",
        about: "NVIDIA GPUs (sm_80+): cuBLAS GEMMs, NVRTC kernels, paged attention, CUDA graphs",
        create: |opts: &BackendOptions| Ok(Arc::new(open(opts)?) as Arc<dyn Backend>),
    }
}

inventory::submit! {
    DeviceGroupEntry {
        name: "cuda",
        about: "NCCL between the GPUs of tensor-parallel ranks (ranks sharing a GPU: host-staged)",
        create: nccl::open_group,
    }
}
