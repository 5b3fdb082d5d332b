//! Shared helpers of the wgpu tests: opening the device (or explaining why a
//! test skips), a seeded RNG, and comparisons with the CPU backend.
#![allow(dead_code, clippy::unwrap_used)]

use arbor_backend_cpu::CpuBackend;
use arbor_backend_wgpu::WgpuBackend;
use arbor_engine_core::{Backend, BackendOptions, DType, HostTensor, Tensor};
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

/// A CPU backend to compare against.
pub fn cpu() -> Arc<dyn Backend> {
    static CPU: OnceLock<Arc<CpuBackend>> = OnceLock::new();
    CPU.get_or_init(|| Arc::new(CpuBackend::new(2).unwrap()))
        .clone()
}

/// xorshift64*: reproducible test data without a dependency.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in [-1, 1).
    pub fn f(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.f() * scale).collect()
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

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

pub fn upload_f32(b: &dyn Backend, shape: &[usize], v: &[f32]) -> Tensor {
    b.upload(&HostTensor::from_f32(shape, v)).unwrap()
}

pub fn upload_u32(b: &dyn Backend, v: &[u32]) -> Tensor {
    let data: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    b.upload(&HostTensor {
        dtype: DType::U32,
        shape: vec![v.len()],
        data: data.into(),
    })
    .unwrap()
}

pub fn download_f32(b: &dyn Backend, t: &Tensor) -> Vec<f32> {
    let mut bytes = vec![0u8; t.byte_len().unwrap()];
    b.download(t, &mut bytes).unwrap();
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

pub fn download_u32(b: &dyn Backend, t: &Tensor) -> Vec<u32> {
    let mut bytes = vec![0u8; t.byte_len().unwrap()];
    b.download(t, &mut bytes).unwrap();
    bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Largest |a - b| relative to the largest |b| (at least 1e-6).
pub fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// Asserts `rel_err(got, want) <= tol` with a message naming the case.
pub fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    let e = rel_err(got, want);
    assert!(
        e <= tol && got.iter().all(|v| v.is_finite()),
        "{what}: relative error {e:e} > {tol:e}"
    );
}
