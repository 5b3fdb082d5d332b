//! The GPU tests of the ROCm backend, as one test binary (one device context,
//! one kernel build): the device suite shared with the CUDA and wgpu backends
//! (`crates/backend-gpu/tests/suite`, the same bodies for every vendor of the
//! GPU backend), bound here to ROCm (HIP). Each test prints "skipped: ... no ROCm
//! device ..." and passes on a machine without a device, unless
//! `ARBOR_REQUIRE_ROCM=1`. `scripts/gpu-check.sh --rocm` runs them on an AMD GPU.
#![allow(clippy::unwrap_used)]

/// What the shared suite needs of its vendor.
mod vendor {
    pub use arbor_backend_rocm::{GpuBackend, open, probe};
    /// The backend's registry name (and `BackendInfo::backend`).
    pub const NAME: &str = "rocm";
    /// How the error of a machine without a device starts.
    pub const NO_DEVICE: &str = "no ROCm device";
    /// Set to 1, a missing device fails the tests instead of skipping them.
    pub const REQUIRE: &str = "ARBOR_REQUIRE_ROCM";
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
#[path = "../../../backend-gpu/tests/suite/ops.rs"]
mod ops;
#[path = "../../../backend-gpu/tests/suite/parity.rs"]
mod parity;
#[path = "../../../backend-gpu/tests/suite/recurrent.rs"]
mod recurrent;
#[path = "../../../backend-gpu/tests/suite/sampling.rs"]
mod sampling;
#[path = "../../../backend-gpu/tests/suite/tensor_parallel.rs"]
mod tensor_parallel;
#[path = "../../../backend-gpu/tests/suite/verify.rs"]
mod verify;
