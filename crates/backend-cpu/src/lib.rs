//! Arbor's CPU backend: the default device, always built.
//!
//! [`CpuBackend`] implements engine-core's [`Backend`] over host memory
//! ([`memory::HostMemory`]) with a spin-then-sleep fork-join pool
//! ([`pool::ThreadPool`]). Linear layers use the quant crate's `dot_rows`
//! kernels for every weight dtype and batch size (the tiled GEMM for the
//! 32-element formats, row kernels for the K-quants, tiled dot kernels for
//! float weights; the scaled block formats of HF-quantized checkpoints with
//! f32 activations, or bf16 ones in AMX tiles under
//! [`QuantMatmul::AmxBf16`], chosen when the backend is created). [`attention::CpuAttention`] is the paged attention, with
//! draft-tree masks.
//!
//! Batch invariance: every kernel computes a row's result with a sequence of
//! operations that does not depend on the other rows, on how many there are,
//! on how the work is split across threads, or (attention) on whether the
//! position is a decode, part of a prefill chunk, after a cached prefix or a
//! draft-tree token. A position's logits are therefore bit-identical however
//! the scheduler shapes the step, so batching, chunked prefill, prefix caching
//! and speculative verification never change greedy output. See `linear`,
//! `attention` and `arbor_quant` for how each kernel keeps its order fixed;
//! the row-wise ops (`ops`: RMSNorm, RoPE, SiLU, embedding, gathers) are
//! per row or per element by construction.
//!
//! Every operation validates dtypes, shapes, device ownership and overlap of
//! outputs with inputs before touching memory, so a wrong call is an error,
//! never undefined behaviour.
#![allow(unsafe_code)]

pub mod attention;
pub mod bandwidth;
mod convert;
mod linear;
mod lora;
pub mod memory;
mod ops;
pub mod pool;
mod recurrent;
pub mod simd;

use arbor_engine_core::registry::BackendEntry;
use arbor_engine_core::{
    AttentionBackend, Backend, BackendCapabilities, BackendOptions, CoreError, DType, DeviceInfo,
    HostTensor, LinearRef, QuantMatmul, Result, RopeStyle, Tensor, tensor::next_device_tag,
};
use memory::{HostMemory, RawView};
use pool::ThreadPool;
use std::sync::Arc;

/// The CPU device.
pub struct CpuBackend {
    mem: Arc<HostMemory>,
    pool: Arc<ThreadPool>,
    caps: BackendCapabilities,
    /// How linear layers multiply the scaled block formats (fixed for the
    /// backend's life, so no batch changes a row's arithmetic).
    quant_matmul: QuantMatmul,
}

impl CpuBackend {
    /// A backend with `threads` worker threads (0: one per available core).
    pub fn new(threads: usize) -> Result<Self> {
        let threads = if threads == 0 {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        } else {
            threads
        };
        let pool = ThreadPool::new(threads)
            .map_err(|e| CoreError::Device(format!("starting {threads} CPU threads: {e}")))?;
        let weight_dtypes = arbor_quant::DOT_WEIGHT_DTYPES.to_vec();
        Ok(Self {
            mem: Arc::new(HostMemory::new(next_device_tag())),
            pool: Arc::new(pool),
            caps: BackendCapabilities {
                weight_dtypes,
                kv_dtypes: vec![
                    DType::F32,
                    DType::F16,
                    DType::BF16,
                    DType::F8E4M3,
                    DType::F8E5M2,
                ],
                asynchronous: false,
                attention: vec!["cpu-paged"],
            },
            quant_matmul: QuantMatmul::F32,
        })
    }

    /// This backend multiplying the scaled block formats as `matmul` says
    /// where the CPU can ([`QuantMatmul::AmxBf16`] needs AMX-BF16; without
    /// it the backend keeps [`QuantMatmul::F32`], which
    /// [`CpuBackend::quant_matmul`] then reports). Set it before loading a
    /// model: it is not meant to change while one runs.
    pub fn with_quant_matmul(mut self, matmul: QuantMatmul) -> Self {
        self.quant_matmul = arbor_quant::quant_matmul_here(matmul);
        self
    }

    /// How linear layers multiply the scaled block formats.
    pub fn quant_matmul(&self) -> QuantMatmul {
        self.quant_matmul
    }

    /// Threads per operation.
    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    pub(crate) fn view(&self, t: &Tensor, dtype: DType) -> Result<RawView> {
        if t.dtype() != dtype {
            return Err(CoreError::invalid(format!(
                "expected a {dtype} tensor, got {t:?}"
            )));
        }
        self.mem.resolve(t, dtype.block_bytes().min(4))
    }

    pub(crate) fn bytes_of(&self, t: &Tensor) -> Result<RawView> {
        self.mem.resolve(t, 1)
    }

    /// Runs `f(thread, threads)` on the pool; a panic becomes an error.
    pub(crate) fn parallel(&self, f: &(dyn Fn(usize, usize) + Sync)) -> Result<()> {
        if self.pool.run(f) {
            Ok(())
        } else {
            Err(CoreError::Internal("a CPU kernel panicked".into()))
        }
    }
}

impl Backend for CpuBackend {
    fn info(&self) -> DeviceInfo {
        DeviceInfo {
            backend: "cpu".into(),
            name: cpu_name(),
            total_memory: None,
            free_memory: None,
            parallelism: Some(self.pool.threads()),
        }
    }

    fn capabilities(&self) -> &BackendCapabilities {
        &self.caps
    }

    fn alloc(&self, dtype: DType, shape: &[usize]) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let bytes = dtype.bytes_for(n)?;
        Tensor::new(self.mem.allocate(bytes)?, dtype, shape)
    }

    fn upload(&self, host: &HostTensor<'_>) -> Result<Tensor> {
        host.validate("upload")?;
        let t = self.alloc(host.dtype, &host.shape)?;
        self.write(&t, &host.data)?;
        Ok(t)
    }

    fn write(&self, dst: &Tensor, data: &[u8]) -> Result<()> {
        let v = self.bytes_of(dst)?;
        if v.bytes != data.len() {
            return Err(CoreError::invalid(format!(
                "write of {} bytes into {dst:?} of {} bytes",
                data.len(),
                v.bytes
            )));
        }
        // SAFETY: `v` covers exactly `data.len()` bytes of a live allocation,
        // and host data cannot alias device memory.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), v.ptr, data.len()) };
        Ok(())
    }

    fn download(&self, src: &Tensor, dst: &mut [u8]) -> Result<()> {
        let v = self.bytes_of(src)?;
        if v.bytes != dst.len() {
            return Err(CoreError::invalid(format!(
                "download of {src:?} ({} bytes) into {} bytes",
                v.bytes,
                dst.len()
            )));
        }
        // SAFETY: as in `write`.
        unsafe { std::ptr::copy_nonoverlapping(v.ptr, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    fn copy(&self, src: &Tensor, dst: &Tensor) -> Result<()> {
        if src.dtype() != dst.dtype() || src.numel() != dst.numel() {
            return Err(CoreError::invalid(format!("copy {src:?} into {dst:?}")));
        }
        dst.check_no_overlap(&[src])?;
        let s = self.bytes_of(src)?;
        let d = self.bytes_of(dst)?;
        // SAFETY: equal sizes, checked non-overlapping live ranges.
        unsafe { std::ptr::copy_nonoverlapping(s.ptr, d.ptr, s.bytes) };
        Ok(())
    }

    fn embedding(&self, table: &Tensor, ids: &Tensor, out: &Tensor) -> Result<()> {
        ops::embedding(self, table, ids, out)
    }

    fn linear(&self, x: &Tensor, w: &Tensor, bias: Option<&Tensor>, out: &Tensor) -> Result<()> {
        linear::linear(self, x, w, bias, out)
    }

    fn lora_add(
        &self,
        x: &Tensor,
        out: &Tensor,
        entries: &[arbor_engine_core::LoraRows<'_>],
    ) -> Result<()> {
        lora::lora_add(self, x, out, entries)
    }

    fn linear_many(&self, x: &Tensor, layers: &[LinearRef<'_>]) -> Result<()> {
        linear::linear_many(self, x, layers)
    }

    fn rms_norm(&self, x: &Tensor, w: &Tensor, eps: f32, out: &Tensor) -> Result<()> {
        ops::rms_norm(self, x, w, eps, out)
    }

    fn add_rms_norm(
        &self,
        residual: &Tensor,
        x: &Tensor,
        w: &Tensor,
        eps: f32,
        out: &Tensor,
    ) -> Result<()> {
        ops::add_rms_norm(self, residual, x, w, eps, out)
    }

    fn rope(
        &self,
        x: &Tensor,
        positions: &Tensor,
        inv_freq: &Tensor,
        head_dim: usize,
        style: RopeStyle,
    ) -> Result<()> {
        ops::rope(self, x, positions, inv_freq, head_dim, style)
    }

    fn silu_mul(&self, gate: &Tensor, up: &Tensor, out: &Tensor) -> Result<()> {
        ops::silu_mul(self, gate, up, out)
    }

    fn add_assign(&self, dst: &Tensor, src: &Tensor) -> Result<()> {
        ops::add_assign(self, dst, src)
    }

    fn gated_delta_net(&self, call: &arbor_engine_core::state::GatedDeltaNet<'_>) -> Result<()> {
        recurrent::gated_delta_net(self, call)
    }

    fn sigmoid_mul(&self, gate: &Tensor, x: &Tensor, out: &Tensor) -> Result<()> {
        recurrent::sigmoid_mul(self, gate, x, out)
    }

    fn sample(
        &self,
        logits: &Tensor,
        rows: &[arbor_engine_core::backend::SampleRow],
        out: &Tensor,
    ) -> Result<()> {
        ops::sample(self, logits, rows, out)
    }

    fn edit_logits(&self, logits: &Tensor, edits: &arbor_engine_core::LogitEdits) -> Result<()> {
        ops::edit_logits(self, logits, edits)
    }

    fn scatter_add_rows(
        &self,
        out: &Tensor,
        rows: &Tensor,
        scales: &Tensor,
        x: &Tensor,
    ) -> Result<()> {
        ops::scatter_add_rows(self, out, rows, scales, x)
    }

    fn gather_rows(&self, x: &Tensor, rows: &Tensor, out: &Tensor) -> Result<()> {
        ops::gather_rows(self, x, rows, out)
    }

    fn concat_cols(&self, parts: &[&Tensor], out: &Tensor) -> Result<()> {
        ops::concat_cols(self, parts, out)
    }

    fn create_attention(&self, name: &str) -> Result<Arc<dyn AttentionBackend>> {
        match name {
            "cpu-paged" => Ok(Arc::new(attention::CpuAttention::new(
                self.mem.clone(),
                self.pool.clone(),
            ))),
            other => Err(CoreError::NotRegistered {
                kind: "attention backend",
                name: other.to_string(),
                available: self.caps.attention.join(", "),
            }),
        }
    }
}

fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

inventory::submit! {
    BackendEntry {
        name: "cpu",
        about: "multi-threaded CPU kernels (AVX-512/AVX2 with a portable fallback)",
        create: |opts: &BackendOptions| {
            let cpu = CpuBackend::new(opts.threads)?.with_quant_matmul(opts.cpu_quant_matmul);
            Ok(Arc::new(cpu) as Arc<dyn Backend>)
        },
    }
}

use arbor_engine_core::inventory;
