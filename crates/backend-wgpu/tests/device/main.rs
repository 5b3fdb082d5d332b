//! The device suite shared with the CUDA and ROCm backends
//! (`crates/backend-gpu/tests/suite`: the same bodies for every GPU backend)
//! bound to wgpu, as one test binary (one adapter, one pipeline cache).
//! CI runs it on lavapipe with `ARBOR_REQUIRE_WGPU=1`, so a missing adapter
//! fails there; elsewhere each test prints "skipped: ..." and passes.
//! `ARBOR_WGPU_ADAPTER` picks the adapter by name. The vendor-only parts of
//! the suite (CUDA/HIP graphs, device probing) are not bound here.
#![allow(clippy::unwrap_used)]

/// What the shared suite needs of its vendor.
mod vendor {
    pub use arbor_backend_wgpu::WgpuBackend as GpuBackend;
    use arbor_engine_core::BackendOptions;

    /// Opens the adapter `ARBOR_WGPU_ADAPTER` names (else the default one).
    pub fn open(opts: &BackendOptions) -> arbor_engine_core::Result<GpuBackend> {
        let opts = BackendOptions {
            adapter: std::env::var("ARBOR_WGPU_ADAPTER").ok(),
            ..opts.clone()
        };
        GpuBackend::new(&opts)
    }
    /// The backend's registry name (and `BackendInfo::backend`).
    pub const NAME: &str = "wgpu";
    /// Set to 1, a missing adapter fails the tests instead of skipping them.
    pub const REQUIRE: &str = "ARBOR_REQUIRE_WGPU";
}

#[path = "../../../backend-gpu/tests/suite/attention.rs"]
mod attention;
#[path = "../../../backend-gpu/tests/suite/common.rs"]
mod common;
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
