//! The half of Arbor's GPU backends that does not depend on the vendor:
//! [`GpuBackend`] implements engine-core's [`Backend`] over a [`Driver`]
//! (`backend-cuda` gives one over CUDA, `backend-rocm` one over HIP): device
//! memory with a caching pool ([`memory`]), linear layers through the
//! driver's BLAS GEMM ([`linear`]), the kernels of one CUDA C source compiled
//! at run time by the driver's compiler and cached ([`kernels`]) for RMSNorm
//! (with the fused residual add), RoPE, SiLU-and-mul, embedding lookup, row
//! gathering and device sampling, and [`attention::GpuAttention`] for paged
//! attention. All work is queued on the driver's one stream, asynchronously
//! to the host; `download` and `synchronize` wait. `write_async` (HiCache's
//! load-back) goes on a second, copy stream, which work on its buffers
//! waits for (`loads`), from pinned host memory ([`pinned`], also the host
//! KV tier's). Decode batches run as graphs per batch-size bucket ([`exec`])
//! unless `BackendOptions::disable_cuda_graph`.
//!
//! Every operation validates dtypes, shapes, device ownership and overlap on
//! the host, as the CPU backend does, before anything is queued.
#![allow(unsafe_code)]

pub mod attention;
mod device;
pub mod driver;
pub mod exec;
pub mod kernels;
mod linear;
mod loads;
pub mod memory;
mod ops;
pub mod pinned;
mod recurrent;
mod sample;

pub use driver::{DeviceProps, Driver, Gemm, Graph};
pub use exec::GraphStats;
pub use loads::LoadStats;

use arbor_engine_core::backend::SampleRow;
use arbor_engine_core::{
    AttentionBackend, Backend, BackendCapabilities, BackendOptions, BufferId, BufferOwner,
    CoreError, DType, DeviceBuffer, DeviceInfo, HostData, HostRows, HostTensor, LinearRef, Result,
    RopeStyle, Tensor, tensor::next_device_tag,
};
use device::{Device, GraphConfig};
use exec::{Args, Op, State};
use kernels::K;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Largest decode batch captured as a graph when the options do not say.
pub const DEFAULT_CUDA_GRAPH_MAX_BS: usize = 256;

/// A GPU behind a [`Driver`].
#[derive(Clone)]
pub struct GpuBackend {
    pub(crate) dev: Arc<Device>,
    caps: Arc<BackendCapabilities>,
    synthetic: Arc<Mutex<Option<u64>>>,
    uploads: Arc<AtomicU64>,
    /// Prefill attention may use the tensor-core kernel where it applies.
    pub(crate) tensor_core_prefill: Arc<AtomicBool>,
    /// Scaled-block linears may use the tensor-core GEMM where it applies.
    pub(crate) tensor_core_linear: Arc<AtomicBool>,
}

impl GpuBackend {
    /// A backend over `drv`, with graphs for decode batches up to
    /// `opts.cuda_graph_max_bs` (default 256) unless `opts.disable_cuda_graph`.
    /// `attention` names its paged attention (`cuda-paged`, `rocm-paged`).
    pub fn new(drv: Box<dyn Driver>, opts: &BackendOptions, attention: &'static str) -> Self {
        let graphs = GraphConfig::new(
            !opts.disable_cuda_graph,
            opts.cuda_graph_max_bs.unwrap_or(DEFAULT_CUDA_GRAPH_MAX_BS),
        );
        let floats = vec![DType::F32, DType::F16, DType::BF16];
        Self {
            dev: Arc::new(Device::new(next_device_tag(), drv, graphs)),
            caps: Arc::new(BackendCapabilities {
                weight_dtypes: [
                    floats.as_slice(),
                    &[
                        DType::F8_S32,
                        DType::F8A8_S32,
                        DType::U4_S32,
                        DType::U8_S32,
                        DType::F4_S16,
                    ],
                ]
                .concat(),
                kv_dtypes: attention::KV_DTYPES.to_vec(),
                asynchronous: true,
                attention: vec![attention],
            }),
            synthetic: Arc::new(Mutex::new(None)),
            uploads: Arc::new(AtomicU64::new(0)),
            tensor_core_prefill: Arc::new(AtomicBool::new(true)),
            tensor_core_linear: Arc::new(AtomicBool::new(true)),
        }
    }

    /// The device's properties.
    pub fn props(&self) -> &DeviceProps {
        self.dev.props()
    }

    /// Graph use so far.
    pub fn graph_stats(&self) -> GraphStats {
        self.dev.lock().map(|st| st.stats).unwrap_or_default()
    }

    /// Asynchronous writes (`write_async`) so far.
    pub fn load_stats(&self) -> LoadStats {
        self.dev
            .lock()
            .map(|_st| self.dev.loads().stats)
            .unwrap_or_default()
    }

    /// The decode batch sizes captured as graphs (empty when disabled).
    pub fn graph_buckets(&self) -> Vec<usize> {
        if self.dev.graphs.enabled {
            self.dev.graphs.buckets.clone()
        } else {
            Vec::new()
        }
    }

    /// The target the kernels were built for (`sm_90`, `compute_90` PTX, `gfx90a`).
    pub fn kernel_target(&self) -> &str {
        &self.dev.props().arch
    }

    /// For benchmarks: `false` runs every prefill on the f32 attention
    /// kernels, also where the tensor-core kernel applies (on by default).
    pub fn set_tensor_core_prefill(&self, on: bool) {
        self.tensor_core_prefill.store(on, Ordering::Relaxed);
    }

    /// For benchmarks and tests: `false` multiplies scaled-block weights
    /// (FP8, INT4, NVFP4) by dequantizing them to f32 before each GEMM, also
    /// where the tensor-core GEMM applies (on by default); W8A8 FP8 weights
    /// then meet their E4M3-rounded inputs there instead of on FP8 tensor cores.
    pub fn set_tensor_core_linear(&self, on: bool) {
        self.tensor_core_linear.store(on, Ordering::Relaxed);
    }

    /// For benchmarks: while `Some(seed)`, uploads of 2-D f16/bf16 tensors
    /// ignore the host data and fill the tensor on the device with uniform
    /// values in [-0.02, 0.02) derived from the seed, so random weights of any
    /// size never cross PCIe. Everything else uploads normally.
    pub fn set_synthetic_weights(&self, seed: Option<u64>) {
        *self.synthetic.lock().unwrap_or_else(|e| e.into_inner()) = seed;
    }

    /// Runs `queue` with the device addresses of `tensors` (in their order)
    /// and the driver's native stream, once everything queued before it is
    /// on the stream: for vendor libraries that queue their own work there
    /// (NCCL's collectives). A decode step being recorded ends here and runs
    /// without a graph. `queue` must touch the tensors' bytes only through
    /// work on that stream, which keeps it ordered with every other use of
    /// the memory (the pool reuses freed blocks in stream order).
    pub fn enqueue_native<R>(
        &self,
        tensors: &[&Tensor],
        queue: impl FnOnce(&[u64], u64) -> Result<R>,
    ) -> Result<R> {
        let mut st = self.dev.lock()?;
        if st.step.is_some() {
            st.no_graph("a collective queued by a vendor library");
        }
        self.dev.flush(&mut st)?;
        let ptrs = tensors
            .iter()
            .map(|t| self.dev.ptr(&st, t, 1))
            .collect::<Result<Vec<_>>>()?;
        queue(&ptrs, self.dev.drv.native_stream())
    }

    fn new_tensor(
        &self,
        st: &mut State,
        dtype: DType,
        shape: &[usize],
        cap: usize,
        zero: bool,
    ) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let bytes = dtype.bytes_for(n)?;
        let cap = cap.max(bytes).max(1);
        let slot = self.dev.alloc_block(st, cap)?;
        let owner: Arc<dyn BufferOwner> = self.dev.clone();
        let buf = Arc::new(DeviceBuffer::new(
            BufferId {
                device: self.dev.tag,
                slot,
            },
            bytes,
            owner,
        ));
        let t = Tensor::new(buf, dtype, shape)?;
        if zero {
            let dst = self.dev.ptr(st, &t, 1)?;
            self.dev.submit(st, Op::Memset { dst, bytes: cap })?;
        }
        Ok(t)
    }

    /// A tensor of exactly `shape` (not scaled in a graph step), for the
    /// backend's own scratch and metadata.
    pub(crate) fn alloc_in(
        &self,
        st: &mut State,
        dtype: DType,
        shape: &[usize],
        zero: bool,
    ) -> Result<Tensor> {
        self.new_tensor(st, dtype, shape, 0, zero)
    }

    /// A tensor for the caller: padded to the bucket in a graph step.
    fn alloc_for_caller(
        &self,
        st: &mut State,
        dtype: DType,
        shape: &[usize],
        zero: bool,
    ) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let cap = st.padded_bytes(dtype.bytes_for(n)?);
        self.new_tensor(st, dtype, shape, cap, zero)
    }

    /// Bytes a whole-buffer transfer to `t` covers: padded in a graph step.
    fn transfer_bytes(st: &mut State, t: &Tensor, bytes: usize) -> usize {
        match st.step_shape() {
            Some((b, bucket)) if bucket > b && st.rows(b, &[t]) == bucket => st.padded_bytes(bytes),
            _ => bytes,
        }
    }
}

/// The byte length of `dst`, which a write of `bytes` bytes must match.
fn write_len(dst: &Tensor, bytes: usize) -> Result<usize> {
    let len = dst.byte_len()?;
    if len != bytes {
        return Err(CoreError::invalid(format!(
            "write of {bytes} bytes into {dst:?} of {len} bytes"
        )));
    }
    Ok(len)
}

impl Backend for GpuBackend {
    fn info(&self) -> DeviceInfo {
        let props = self.dev.props();
        let free = self.dev.lock().ok().and_then(|st| {
            self.dev
                .drv
                .mem_info()
                .map(|(free, _)| free + st.mem.cached_bytes as u64)
        });
        DeviceInfo {
            backend: self.dev.drv.backend_name().into(),
            name: format!("{} ({})", props.name, props.arch),
            total_memory: Some(props.total_memory),
            free_memory: free,
            parallelism: Some(props.compute_units as usize),
        }
    }

    fn capabilities(&self) -> &BackendCapabilities {
        &self.caps
    }

    fn alloc(&self, dtype: DType, shape: &[usize]) -> Result<Tensor> {
        let mut st = self.dev.lock()?;
        self.alloc_for_caller(&mut st, dtype, shape, true)
    }

    fn upload(&self, host: &HostTensor<'_>) -> Result<Tensor> {
        host.validate("upload")?;
        let synthetic = *self.synthetic.lock().unwrap_or_else(|e| e.into_inner());
        let mut st = self.dev.lock()?;
        let t = self.alloc_for_caller(&mut st, host.dtype, &host.shape, false)?;
        let p = self.dev.ptr(&st, &t, 1)?;
        if let Some(seed) = synthetic
            && host.shape.len() == 2
            && matches!(host.dtype, DType::F16 | DType::BF16)
        {
            let n = t.numel();
            let k = if host.dtype == DType::BF16 {
                K::FillBf16
            } else {
                K::FillF16
            };
            let salt = self.uploads.fetch_add(1, Ordering::Relaxed);
            let seed = seed ^ salt.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            let args = Args::new().p(p).l(n as u64).l(seed).f(0.02).f(0.0);
            let grid = ops::stride_grid(self, n);
            self.dev.launch(&mut st, k, [grid, 1, 1], 256, 0, args)?;
            return Ok(t);
        }
        let bytes = Self::transfer_bytes(&mut st, &t, host.data.len());
        self.dev.upload_to(&mut st, p, &host.data, bytes)?;
        Ok(t)
    }

    fn write(&self, dst: &Tensor, data: &[u8]) -> Result<()> {
        let len = write_len(dst, data.len())?;
        let mut st = self.dev.lock()?;
        let p = self.dev.ptr(&st, dst, 1)?;
        let bytes = Self::transfer_bytes(&mut st, dst, len);
        self.dev.upload_to(&mut st, p, data, bytes)
    }

    fn write_async(&self, writes: &[(&Tensor, HostRows<'_>)], held: HostData) -> Result<()> {
        for (dst, data) in writes {
            write_len(dst, data.len())?;
        }
        let mut st = self.dev.lock()?;
        if st.step.is_none() {
            let mut batch = Vec::with_capacity(writes.len());
            for (dst, data) in writes {
                batch.push(loads::LoadWrite {
                    slot: dst.buffer_id().slot,
                    dst: self.dev.ptr(&st, dst, 1)?,
                    data: *data,
                    in_place: held == HostData::UntilSync && self.dev.is_pinned(data.span()),
                });
            }
            let mut loads = self.dev.loads();
            let queued = loads.queue(self.dev.drv.as_ref(), &batch)?;
            self.dev.note_loads(&loads);
            if queued {
                return Ok(());
            }
        }
        // In a recorded decode step (or without room in staging): on the main stream.
        for (dst, data) in writes {
            let p = self.dev.ptr(&st, dst, 1)?;
            let bytes = Self::transfer_bytes(&mut st, dst, data.len());
            match data.contiguous() {
                Some(d) => self.dev.upload_to(&mut st, p, d, bytes)?,
                None => self.dev.upload_to(&mut st, p, &data.to_vec(), bytes)?,
            }
        }
        Ok(())
    }

    fn host_memory(&self) -> Option<Arc<dyn arbor_engine_core::HostMemory>> {
        Some(Arc::new(pinned::PinnedHost::new(self.dev.clone())))
    }

    fn download(&self, src: &Tensor, dst: &mut [u8]) -> Result<()> {
        let len = src.byte_len()?;
        if len != dst.len() {
            return Err(CoreError::invalid(format!(
                "download of {src:?} ({len} bytes) into {} bytes",
                dst.len()
            )));
        }
        let mut st = self.dev.lock()?;
        let p = self.dev.ptr(&st, src, 1)?;
        self.dev.download_from(&mut st, p, dst)
    }

    fn synchronize(&self) -> Result<()> {
        let mut st = self.dev.lock()?;
        self.dev.sync(&mut st)
    }

    fn copy(&self, src: &Tensor, dst: &Tensor) -> Result<()> {
        self.op_copy(src, dst)
    }

    fn embedding(&self, table: &Tensor, ids: &Tensor, out: &Tensor) -> Result<()> {
        self.op_embedding(table, ids, out)
    }

    fn linear(&self, x: &Tensor, w: &Tensor, bias: Option<&Tensor>, out: &Tensor) -> Result<()> {
        self.op_linear_many(x, &[LinearRef::new(w, bias, out)])
    }

    fn linear_many(&self, x: &Tensor, layers: &[LinearRef<'_>]) -> Result<()> {
        self.op_linear_many(x, layers)
    }

    fn rms_norm(&self, x: &Tensor, w: &Tensor, eps: f32, out: &Tensor) -> Result<()> {
        self.op_rms_norm(x, w, eps, out)
    }

    fn add_rms_norm(
        &self,
        residual: &Tensor,
        x: &Tensor,
        w: &Tensor,
        eps: f32,
        out: &Tensor,
    ) -> Result<()> {
        self.op_add_rms_norm(residual, x, w, eps, out)
    }

    fn rope(
        &self,
        x: &Tensor,
        positions: &Tensor,
        inv_freq: &Tensor,
        head_dim: usize,
        style: RopeStyle,
    ) -> Result<()> {
        self.op_rope(x, positions, inv_freq, head_dim, style)
    }

    fn silu_mul(&self, gate: &Tensor, up: &Tensor, out: &Tensor) -> Result<()> {
        self.op_silu_mul(gate, up, out)
    }

    fn gated_delta_net(
        &self,
        call: &arbor_engine_core::backend::recurrent::GatedDeltaNet<'_>,
    ) -> Result<()> {
        self.op_gated_delta_net(call)
    }

    fn sigmoid_mul(&self, gate: &Tensor, x: &Tensor, out: &Tensor) -> Result<()> {
        self.op_sigmoid_mul(gate, x, out)
    }

    fn add_assign(&self, dst: &Tensor, src: &Tensor) -> Result<()> {
        self.op_add_assign(dst, src)
    }

    fn gather_rows(&self, x: &Tensor, rows: &Tensor, out: &Tensor) -> Result<()> {
        self.op_gather_rows(x, rows, out)
    }

    fn linear_heads(&self, x: &Tensor, w: &Tensor, heads: usize, out: &Tensor) -> Result<()> {
        self.op_linear_heads(x, w, heads, out)
    }

    fn concat_cols(&self, parts: &[&Tensor], out: &Tensor) -> Result<()> {
        self.op_concat_cols(parts, out)
    }

    fn create_attention(&self, name: &str) -> Result<Arc<dyn AttentionBackend>> {
        if self.caps.attention.contains(&name) {
            return Ok(Arc::new(attention::GpuAttention::new(self.clone())));
        }
        Err(CoreError::NotRegistered {
            kind: "attention backend",
            name: name.to_string(),
            available: self.caps.attention.join(", "),
        })
    }

    fn edit_logits(&self, logits: &Tensor, edits: &arbor_engine_core::LogitEdits) -> Result<()> {
        self.op_edit_logits(logits, edits)
    }

    fn logprob_stats(
        &self,
        logits: &Tensor,
        top: usize,
        lse: &Tensor,
        top_ids: &Tensor,
        top_logprobs: &Tensor,
    ) -> Result<()> {
        self.op_logprob_stats(logits, top, lse, top_ids, top_logprobs)
    }

    fn sample(&self, logits: &Tensor, rows: &[SampleRow], out: &Tensor) -> Result<()> {
        self.op_sample(logits, rows, out)
    }
}
