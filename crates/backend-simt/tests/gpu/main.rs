//! The device suite shared with the CUDA, ROCm and wgpu backends
//! (`crates/backend-gpu/tests/suite`) on the CUDA host emulator: the GPU
//! backend's own code and kernels, checked against the CPU backend in CI
//! without a GPU. Skips, printing why, without a C++ compiler, unless
//! `ARBOR_REQUIRE_CXX=1`. The suite's device-creation test (registry names)
//! is CUDA's and ROCm's: the emulator is not a registered device.
#![allow(clippy::unwrap_used)]

/// What the shared suite needs of its vendor.
mod vendor {
    pub use arbor_backend_simt::{GpuBackend, kernels, open};
    /// The backend's name (and `BackendInfo::backend`).
    pub const NAME: &str = "simt";
    /// Set to 1, a missing C++ compiler fails the tests instead of skipping them.
    pub const REQUIRE: &str = "ARBOR_REQUIRE_CXX";
}

#[path = "../../../backend-gpu/tests/suite/attention.rs"]
mod attention;
#[path = "../../../backend-gpu/tests/suite/common.rs"]
mod common;
/// The emulator's own: the copy stream's fences against the forward.
mod copy_stream;
#[path = "../../../backend-gpu/tests/suite/graphs.rs"]
mod graphs;
#[path = "../../../backend-gpu/tests/suite/logit_edits.rs"]
mod logit_edits;
#[path = "../../../backend-gpu/tests/suite/ops.rs"]
mod ops;
#[path = "../../../backend-gpu/tests/suite/parity.rs"]
mod parity;
#[path = "../../../backend-gpu/tests/suite/recurrent.rs"]
mod recurrent;
#[path = "../../../backend-gpu/tests/suite/sampling.rs"]
mod sampling;
/// CUDA's own: the tensor-core GEMMs of scaled-block weights (and W8A8).
#[path = "../../../backend-cuda/tests/gpu/scaled_gemm.rs"]
mod scaled_gemm;
#[path = "../../../backend-gpu/tests/suite/tensor_parallel.rs"]
mod tensor_parallel;
#[path = "../../../backend-gpu/tests/suite/verify.rs"]
mod verify;
