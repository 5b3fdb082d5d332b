//! Test data and comparisons shared by the device suites (wgpu's in
//! `crates/backend-wgpu/tests`, the CUDA/ROCm one in
//! `crates/backend-gpu/tests/suite`): the CPU reference backend, a seeded
//! generator, upload/download of f32 and u32 tensors, and the closeness check
//! every kernel comparison uses. Included by `#[path]`; each suite keeps only
//! how it opens its own device.
#![allow(dead_code, clippy::unwrap_used)]

use arbor_backend_cpu::CpuBackend;
use arbor_engine_core::{Backend, DType, HostTensor, Tensor};
use std::sync::{Arc, OnceLock};

/// The CPU backend the devices are compared with (two threads, shared).
pub fn cpu() -> Arc<dyn Backend> {
    static CPU: OnceLock<Arc<CpuBackend>> = OnceLock::new();
    CPU.get_or_init(|| Arc::new(CpuBackend::new(2).unwrap()))
        .clone()
}

/// xorshift64*: reproducible test data without a dependency.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in [-scale, scale).
    pub fn f32(&mut self, scale: f32) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
    }
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.f32(scale)).collect()
    }
    /// Uniform in 0..n.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

pub fn upload_f32(b: &dyn Backend, shape: &[usize], v: &[f32]) -> Tensor {
    b.upload(&HostTensor::from_f32(shape, v)).unwrap()
}

/// Uploads f32 values stored as `dtype` (rounded on the host).
pub fn upload_as(b: &dyn Backend, shape: &[usize], v: &[f32], dtype: DType) -> Tensor {
    b.upload(&HostTensor::from_f32(shape, v).cast(dtype).unwrap())
        .unwrap()
}

pub fn upload_u32(b: &dyn Backend, shape: &[usize], v: &[u32]) -> Tensor {
    let data: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    b.upload(&HostTensor {
        dtype: DType::U32,
        shape: shape.to_vec(),
        data: data.into(),
    })
    .unwrap()
}

pub fn download_f32(b: &dyn Backend, t: &Tensor) -> Vec<f32> {
    b.download_f32(t).unwrap()
}

pub fn download_u32(b: &dyn Backend, t: &Tensor) -> Vec<u32> {
    b.download_u32(t).unwrap()
}

/// Largest |a - b| and largest |b|.
pub fn max_err(a: &[f32], b: &[f32]) -> (f32, f32) {
    assert_eq!(a.len(), b.len(), "lengths differ");
    let e = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    let s = b.iter().fold(0f32, |m, y| m.max(y.abs()));
    (e, s)
}

/// Asserts `got` is finite and within `rel` of the scale of `want` (plus a
/// tiny absolute floor, for outputs near zero).
pub fn assert_close(what: &str, got: &[f32], want: &[f32], rel: f32) {
    assert!(
        got.iter().all(|x| x.is_finite()),
        "{what}: non-finite output"
    );
    let (e, s) = max_err(got, want);
    println!("{what}: max abs error {e:.3e} (scale {s:.3e})");
    assert!(e <= rel * s + 1e-6, "{what}: error {e} > {rel} * {s}");
}
