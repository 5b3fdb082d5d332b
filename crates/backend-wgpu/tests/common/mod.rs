//! Shared helpers of the wgpu tests: opening the device (or explaining why a
//! test skips) and quantized host data; the seeded RNG and the comparisons
//! with the CPU backend are shared with the device suite
//! (`engine-core/tests/support/device_data.rs`).
#![allow(dead_code, clippy::unwrap_used)]

use arbor_backend_wgpu::WgpuBackend;
use arbor_engine_core::{Backend, BackendOptions, DType, HostTensor};
use std::sync::{Arc, OnceLock};

/// The wgpu device shared by a test binary, or `None` (with the reason
/// printed) when this machine has no adapter; a panic instead when
/// `ARBOR_REQUIRE_WGPU=1`.
pub fn gpu() -> Option<Arc<dyn Backend>> {
    static DEV: OnceLock<Result<Arc<WgpuBackend>, String>> = OnceLock::new();
    let d = DEV.get_or_init(|| {
        let opts = BackendOptions {
            adapter: std::env::var("ARBOR_WGPU_ADAPTER").ok(),
            ..Default::default()
        };
        WgpuBackend::new(&opts)
            .map(Arc::new)
            .map_err(|e| e.to_string())
    });
    match d {
        Ok(b) => {
            static ONCE: OnceLock<()> = OnceLock::new();
            ONCE.get_or_init(|| eprintln!("wgpu adapter: {}", b.info().name));
            Some(b.clone() as Arc<dyn Backend>)
        }
        Err(e) => {
            // CI installs lavapipe and sets this, so a missing adapter fails
            // there instead of skipping every test.
            if std::env::var("ARBOR_REQUIRE_WGPU").is_ok_and(|v| v == "1") {
                panic!("ARBOR_REQUIRE_WGPU=1 but no wgpu adapter: {e}");
            }
            eprintln!("skipping: {e}");
            None
        }
    }
}

#[path = "../../../engine-core/tests/support/device_data.rs"]
mod data;
// Some test binaries open the device only.
#[allow(unused_imports)]
pub use data::*;

/// Host bytes of `values` stored as `dtype` (float casts or GGUF quantization).
pub fn host(dtype: DType, shape: &[usize], values: &[f32]) -> HostTensor<'static> {
    let f = HostTensor::from_f32(shape, values);
    if dtype.is_quantized() {
        let mut data = vec![0u8; dtype.bytes_for(values.len()).unwrap()];
        arbor_quant::quantize(dtype, values, &mut data).unwrap();
        HostTensor {
            dtype,
            shape: shape.to_vec(),
            data: data.into(),
        }
    } else {
        f.cast(dtype).unwrap()
    }
}
