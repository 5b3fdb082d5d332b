//! Shared pieces of the device suite: one device backend per test binary
//! (CUDA, ROCm or wgpu, per its `vendor` module; or a printed skip saying why
//! none opened, which [`crate::vendor::REQUIRE`] set to 1 turns into a
//! failure); the CPU reference, seeded inputs and comparisons come from
//! `engine-core/tests/support/device_data.rs`.
#![allow(dead_code)]

use crate::vendor::GpuBackend;
use arbor_engine_core::BackendOptions;
use std::sync::{Arc, OnceLock};

fn open(opts: BackendOptions) -> Result<Arc<GpuBackend>, String> {
    crate::vendor::open(&opts)
        .map(Arc::new)
        .map_err(|e| e.to_string())
}

fn report(d: &Result<Arc<GpuBackend>, String>) -> Option<Arc<GpuBackend>> {
    match d {
        Ok(b) => Some(b.clone()),
        Err(e) => {
            let require = crate::vendor::REQUIRE;
            if std::env::var(require).is_ok_and(|v| v == "1") {
                panic!(
                    "{require}=1 but the {} backend is unavailable: {e}",
                    crate::vendor::NAME
                );
            }
            println!("skipped: {e}");
            None
        }
    }
}

/// The device (graphs on), or `None` with the reason printed.
pub fn gpu() -> Option<Arc<GpuBackend>> {
    static DEV: OnceLock<Result<Arc<GpuBackend>, String>> = OnceLock::new();
    report(DEV.get_or_init(|| open(BackendOptions::default())))
}

/// A new instance of its own, with graphs (CUDA or HIP) on or off.
pub fn gpu_with(disable_cuda_graph: bool) -> Option<Arc<GpuBackend>> {
    report(&open(BackendOptions {
        disable_cuda_graph,
        ..Default::default()
    }))
}

#[path = "../../../engine-core/tests/support/device_data.rs"]
mod data;
pub use data::*;
