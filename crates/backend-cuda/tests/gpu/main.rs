//! The GPU tests of the CUDA backend, as one test binary (one device context,
//! one kernel build): the device suite shared with the ROCm and wgpu backends
//! (`crates/backend-gpu/tests/suite`, the same bodies for every vendor of the
//! GPU backend), bound here to CUDA. Each test prints "skipped: ... no CUDA
//! device ..." and passes on a machine without a device, unless
//! `ARBOR_REQUIRE_CUDA=1`. `scripts/gpu-check.sh` runs them on a GPU.
#![allow(clippy::unwrap_used)]

/// What the shared suite needs of its vendor.
mod vendor {
    pub use arbor_backend_cuda::{GpuBackend, kernels, open, probe};
    /// The backend's registry name (and `BackendInfo::backend`).
    pub const NAME: &str = "cuda";
    /// How the error of a machine without a device starts.
    pub const NO_DEVICE: &str = "no CUDA device";
    /// Set to 1, a missing device fails the tests instead of skipping them.
    pub const REQUIRE: &str = "ARBOR_REQUIRE_CUDA";
}

#[path = "../../../backend-gpu/tests/suite/attention.rs"]
mod attention;
#[path = "../../../backend-gpu/tests/suite/common.rs"]
mod common;
#[path = "../../../backend-gpu/tests/suite/device.rs"]
mod device;
#[path = "../../../backend-gpu/tests/suite/graphs.rs"]
mod graphs;
#[path = "../../../backend-gpu/tests/suite/logit_edits.rs"]
mod logit_edits;
/// CUDA's own: NCCL between ranks.
mod nccl;
#[path = "../../../backend-gpu/tests/suite/ops.rs"]
mod ops;
#[path = "../../../backend-gpu/tests/suite/parity.rs"]
mod parity;
#[path = "../../../backend-gpu/tests/suite/recurrent.rs"]
mod recurrent;
#[path = "../../../backend-gpu/tests/suite/sampling.rs"]
mod sampling;
/// CUDA's own: the tensor-core GEMM of scaled-block weights.
mod scaled_gemm;
#[path = "../../../backend-gpu/tests/suite/tensor_parallel.rs"]
mod tensor_parallel;
#[path = "../../../backend-gpu/tests/suite/verify.rs"]
mod verify;
