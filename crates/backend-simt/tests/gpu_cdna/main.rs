//! The device suite's kernel and model tests on the CUDA host emulator
//! reporting itself as an AMD gfx90a (64 KiB of LDS): the launcher's other
//! choices, which CUDA before sm_80 and ROCm take (the f32-math prefill in
//! the tiles that fit, the dequantizing GEMM of scaled blocks), checked
//! against the CPU backend in CI. Skips without a C++ compiler, unless
//! `ARBOR_REQUIRE_CXX=1`.
#![allow(clippy::unwrap_used)]

/// What the shared suite needs of its vendor.
mod vendor {
    pub use arbor_backend_simt::{GpuBackend, kernels};
    use arbor_engine_core::{BackendOptions, Result};
    /// The backend's name (and `BackendInfo::backend`).
    pub const NAME: &str = "simt";
    /// Set to 1, a missing C++ compiler fails the tests instead of skipping them.
    pub const REQUIRE: &str = "ARBOR_REQUIRE_CXX";

    pub fn open(opts: &BackendOptions) -> Result<GpuBackend> {
        arbor_backend_simt::open_as(arbor_backend_simt::Profile::Cdna, opts)
    }
}

#[path = "../../../backend-gpu/tests/suite/attention.rs"]
mod attention;
#[path = "../../../backend-gpu/tests/suite/common.rs"]
mod common;
#[path = "../../../backend-gpu/tests/suite/ops.rs"]
mod ops;
#[path = "../../../backend-gpu/tests/suite/parity.rs"]
mod parity;
#[path = "../../../backend-gpu/tests/suite/recurrent.rs"]
mod recurrent;
/// The scaled-block GEMMs: on this profile, W8A8 FP8 through the rounded
/// input (the tensor-core GEMMs are NVIDIA's and skip).
#[path = "../../../backend-cuda/tests/gpu/scaled_gemm.rs"]
mod scaled_gemm;
