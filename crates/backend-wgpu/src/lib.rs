//! Arbor's portable GPU backend: WGSL kernels on Vulkan, Metal and DX12
//! through `wgpu` (tested on Mesa's CPU Vulkan driver, lavapipe).
//!
//! [`WgpuBackend`] implements engine-core's [`Backend`]: tensors live in
//! device buffers ([`memory::DeviceMemory`]); operations are recorded into one
//! pending command encoder and submitted in batches ([`context::Gpu`]), so a
//! forward pass reaches the device in a few submissions and the host waits
//! only in [`Backend::download`] and [`Backend::synchronize`]. Linear layers
//! ([`linear`]) take f32/f16/bf16 weights (accumulated in f32) and GGUF
//! Q8_0/Q4_0/Q4_1 blocks (integer dot products against Q8-quantized
//! activations, as ggml and the CPU backend do). [`attention::WgpuAttention`]
//! writes K/V into the paged cache and runs paged causal attention; sampling
//! ([`Backend::sample`]) runs on the device so only token ids are read back.
//!
//! Every operation validates dtypes, shapes, device ownership and overlap on
//! the host before recording work. Ids and row indices that live on the device
//! cannot be checked there: out-of-range ones produce zero rows, never reads
//! outside a buffer.
//!
//! Registered as the backend `wgpu`; `BackendOptions::adapter` picks an
//! adapter by a case-insensitive substring of its name. Set `XDG_RUNTIME_DIR`
//! to silence lavapipe's warnings.

pub mod attention;
pub mod context;
pub mod kernels;
mod linear;
mod matmul_gen;
pub mod memory;
mod ops;
mod recurrent;
mod sample;

use arbor_engine_core::backend::SampleRow;
use arbor_engine_core::registry::BackendEntry;
use arbor_engine_core::{
    AttentionBackend, Backend, BackendCapabilities, BackendOptions, CoreError, DType, DeviceInfo,
    HostTensor, LinearRef, Result, RopeStyle, Tensor, inventory, tensor::next_device_tag,
};
use context::{Access, Gpu, View};
use std::sync::Arc;

/// An adapter as `arbor info` lists it.
#[derive(Clone, Debug)]
pub struct AdapterSummary {
    pub name: String,
    pub backend: String,
    pub device_type: String,
    pub driver: String,
    pub shader_f16: bool,
    pub max_buffer_size: u64,
    pub max_storage_binding: u64,
    pub max_workgroup_invocations: u32,
    pub max_workgroups_per_dim: u32,
}

fn instance() -> wgpu::Instance {
    wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env())
}

fn rank(t: wgpu::DeviceType) -> u8 {
    match t {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Other => 3,
        wgpu::DeviceType::Cpu => 4,
    }
}

fn sorted_adapters(instance: &wgpu::Instance) -> Vec<wgpu::Adapter> {
    let mut all = pollster::block_on(instance.enumerate_adapters(wgpu::Backends::all()));
    all.sort_by_key(|a| rank(a.get_info().device_type));
    all
}

/// The adapters wgpu finds on this machine, the preferred first.
pub fn adapters() -> Vec<AdapterSummary> {
    sorted_adapters(&instance())
        .iter()
        .map(|a| {
            let i = a.get_info();
            let l = a.limits();
            AdapterSummary {
                name: i.name,
                backend: format!("{:?}", i.backend),
                device_type: format!("{:?}", i.device_type),
                driver: format!("{} {}", i.driver, i.driver_info).trim().to_string(),
                shader_f16: a.features().contains(wgpu::Features::SHADER_F16),
                max_buffer_size: l.max_buffer_size,
                max_storage_binding: l.max_storage_buffer_binding_size,
                max_workgroup_invocations: l.max_compute_invocations_per_workgroup,
                max_workgroups_per_dim: l.max_compute_workgroups_per_dimension,
            }
        })
        .collect()
}

/// A wgpu device.
pub struct WgpuBackend {
    gpu: Arc<Gpu>,
    caps: BackendCapabilities,
}

impl WgpuBackend {
    /// Opens the adapter `opts.adapter` names (a substring of its name), or the
    /// preferred one; `opts.device_index` picks among several matches.
    pub fn new(opts: &BackendOptions) -> Result<Self> {
        let instance = instance();
        let all = sorted_adapters(&instance);
        if all.is_empty() {
            return Err(CoreError::Device(
                "no wgpu adapter found (no Vulkan, Metal or DX12 driver; on Debian, \
                 `apt-get install mesa-vulkan-drivers libvulkan1` provides the CPU driver lavapipe)"
                    .into(),
            ));
        }
        let names: Vec<String> = all.iter().map(|a| a.get_info().name).collect();
        let matching: Vec<&wgpu::Adapter> = match &opts.adapter {
            Some(f) => {
                let f = f.to_lowercase();
                all.iter()
                    .filter(|a| a.get_info().name.to_lowercase().contains(&f))
                    .collect()
            }
            None => all.iter().collect(),
        };
        let adapter = matching.get(opts.device_index).ok_or_else(|| {
            CoreError::Device(format!(
                "no wgpu adapter {}matches (index {}); available: {}",
                opts.adapter
                    .as_ref()
                    .map(|f| format!("named like '{f}' "))
                    .unwrap_or_default(),
                opts.device_index,
                names.join(", ")
            ))
        })?;
        let info = adapter.get_info();
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("arbor"),
            required_features: wgpu::Features::empty(),
            required_limits: adapter.limits(),
            experimental_features: wgpu::ExperimentalFeatures::default(),
            memory_hints: wgpu::MemoryHints::Performance,
            trace: wgpu::Trace::Off,
        }))
        .map_err(|e| CoreError::Device(format!("opening wgpu adapter {}: {e}", info.name)))?;
        let gpu = Gpu::new(device, queue, info, next_device_tag());
        Ok(Self {
            gpu: Arc::new(gpu),
            caps: BackendCapabilities {
                weight_dtypes: vec![
                    DType::F32,
                    DType::F16,
                    DType::BF16,
                    DType::Q8_0,
                    DType::Q4_0,
                    DType::Q4_1,
                    DType::F8_S32,
                    DType::F8A8_S32,
                    DType::U4_S32,
                    DType::U8_S32,
                    DType::F4_S16,
                ],
                kv_dtypes: vec![
                    DType::F32,
                    DType::F16,
                    DType::BF16,
                    DType::F8E4M3,
                    DType::F8E5M2,
                ],
                asynchronous: true,
                attention: vec!["wgpu-paged"],
            },
        })
    }

    /// The adapter's name.
    pub fn adapter_name(&self) -> &str {
        &self.gpu.info.name
    }

    /// Bytes allocated to live tensors.
    pub fn allocated_bytes(&self) -> u64 {
        self.gpu.mem.allocated_bytes()
    }

    pub(crate) fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// Resolves `t` for a kernel after checking its dtype.
    pub(crate) fn view(&self, t: &Tensor, dtype: DType, access: Access) -> Result<View> {
        if t.dtype() != dtype {
            return Err(CoreError::invalid(format!(
                "expected a {dtype} tensor, got {t:?}"
            )));
        }
        self.view_any(t, access)
    }

    pub(crate) fn view_any(&self, t: &Tensor, access: Access) -> Result<View> {
        let v = self.gpu.view(t, access)?;
        if !t.dtype().is_quantized() && t.dtype().block_bytes() >= 4 && !v.off.is_multiple_of(4) {
            return Err(CoreError::invalid(format!(
                "tensor {t:?} is not aligned to 4 bytes"
            )));
        }
        Ok(v)
    }

    /// A tensor whose contents are left as they are (scratch space).
    pub(crate) fn alloc_uninit(&self, dtype: DType, shape: &[usize]) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let bytes = dtype.bytes_for(n)?;
        let a = self
            .gpu
            .mem
            .allocate(bytes, self.gpu.limits.max_buffer_size)?;
        Tensor::new(a.handle, dtype, shape)
    }

    /// Uploads u32 values as a new tensor.
    pub(crate) fn upload_words(&self, values: &[u32]) -> Result<Tensor> {
        let t = self.alloc_uninit(DType::U32, &[values.len().max(1)])?;
        let data: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        if !data.is_empty() {
            let buf = self.gpu.mem.buffer(&t)?;
            self.gpu.write(&buf, 0, &data)?;
        }
        Ok(t)
    }
}

pub(crate) fn u32_of(v: usize, what: &str) -> Result<u32> {
    u32::try_from(v).map_err(|_| CoreError::unsupported(format!("{what} of {v} exceeds 32 bits")))
}

impl Backend for WgpuBackend {
    fn info(&self) -> DeviceInfo {
        let i = &self.gpu.info;
        DeviceInfo {
            backend: "wgpu".into(),
            name: format!("{} ({:?}, {:?})", i.name, i.backend, i.device_type),
            total_memory: None,
            free_memory: None,
            parallelism: None,
        }
    }

    fn capabilities(&self) -> &BackendCapabilities {
        &self.caps
    }

    fn alloc(&self, dtype: DType, shape: &[usize]) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let bytes = dtype.bytes_for(n)?;
        let a = self
            .gpu
            .mem
            .allocate(bytes, self.gpu.limits.max_buffer_size)?;
        if a.reused {
            self.gpu.clear(&a.buffer, 0, a.buffer.size())?;
        }
        Tensor::new(a.handle, dtype, shape)
    }

    fn upload(&self, host: &HostTensor<'_>) -> Result<Tensor> {
        host.validate("upload")?;
        let t = self.alloc_uninit(host.dtype, &host.shape)?;
        self.write(&t, &host.data)?;
        Ok(t)
    }

    fn write(&self, dst: &Tensor, data: &[u8]) -> Result<()> {
        let range = dst.byte_range()?;
        if range.len() != data.len() {
            return Err(CoreError::invalid(format!(
                "write of {} bytes into {dst:?} of {} bytes",
                data.len(),
                range.len()
            )));
        }
        let buf = self.gpu.mem.buffer(dst)?;
        if !range.start.is_multiple_of(4) {
            return Err(CoreError::unsupported(format!(
                "writing {dst:?}: device writes start on 4-byte boundaries"
            )));
        }
        if data.len().is_multiple_of(4) {
            return self.gpu.write(&buf, range.start as u64, data);
        }
        // The padding after the view belongs to no tensor only at the buffer's end.
        if range.end != dst.buffer().bytes() {
            return Err(CoreError::unsupported(format!(
                "writing {dst:?}: device writes cover whole 4-byte words"
            )));
        }
        let mut padded = data.to_vec();
        padded.resize(data.len().div_ceil(4) * 4, 0);
        self.gpu.write(&buf, range.start as u64, &padded)
    }

    fn download(&self, src: &Tensor, dst: &mut [u8]) -> Result<()> {
        let range = src.byte_range()?;
        if range.len() != dst.len() {
            return Err(CoreError::invalid(format!(
                "download of {src:?} ({} bytes) into {} bytes",
                range.len(),
                dst.len()
            )));
        }
        let buf = self.gpu.mem.buffer(src)?;
        let start = range.start / 4 * 4;
        let end = memory::padded(range.end).min(buf.size()) as usize;
        if start == range.start && end - start == dst.len() {
            return self.gpu.read(&buf, start as u64, dst.len() as u64, dst);
        }
        let mut tmp = vec![0u8; end - start];
        self.gpu
            .read(&buf, start as u64, tmp.len() as u64, &mut tmp)?;
        let skip = range.start - start;
        dst.copy_from_slice(&tmp[skip..skip + dst.len()]);
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        self.gpu.wait()
    }

    fn copy(&self, src: &Tensor, dst: &Tensor) -> Result<()> {
        if src.dtype() != dst.dtype() || src.numel() != dst.numel() {
            return Err(CoreError::invalid(format!("copy {src:?} into {dst:?}")));
        }
        dst.check_no_overlap(&[src])?;
        let s = self.gpu.mem.buffer(src)?;
        let d = self.gpu.mem.buffer(dst)?;
        let (sr, dr) = (src.byte_range()?, dst.byte_range()?);
        let len = sr.len() as u64;
        if s == d {
            // wgpu cannot copy within one buffer: go through a scratch buffer.
            let tmp = self.alloc_uninit(DType::U8, &[sr.len()])?;
            let t = self.gpu.mem.buffer(&tmp)?;
            self.gpu.copy(&s, sr.start as u64, &t, 0, len)?;
            return self.gpu.copy(&t, 0, &d, dr.start as u64, len);
        }
        self.gpu.copy(&s, sr.start as u64, &d, dr.start as u64, len)
    }

    fn embedding(&self, table: &Tensor, ids: &Tensor, out: &Tensor) -> Result<()> {
        ops::embedding(self, table, ids, out)
    }

    fn linear(&self, x: &Tensor, w: &Tensor, bias: Option<&Tensor>, out: &Tensor) -> Result<()> {
        linear::linear_many(self, x, &[LinearRef::new(w, bias, out)])
    }

    fn linear_many(&self, x: &Tensor, layers: &[LinearRef<'_>]) -> Result<()> {
        linear::linear_many(self, x, layers)
    }

    fn rms_norm(&self, x: &Tensor, w: &Tensor, eps: f32, out: &Tensor) -> Result<()> {
        ops::rms_norm(self, None, x, w, eps, out)
    }

    fn add_rms_norm(
        &self,
        residual: &Tensor,
        x: &Tensor,
        w: &Tensor,
        eps: f32,
        out: &Tensor,
    ) -> Result<()> {
        ops::rms_norm(self, Some(residual), x, w, eps, out)
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

    fn gated_delta_net(
        &self,
        call: &arbor_engine_core::backend::recurrent::GatedDeltaNet<'_>,
    ) -> Result<()> {
        recurrent::gated_delta_net(self, call)
    }

    fn sigmoid_mul(&self, gate: &Tensor, x: &Tensor, out: &Tensor) -> Result<()> {
        recurrent::sigmoid_mul(self, gate, x, out)
    }

    fn silu_mul(&self, gate: &Tensor, up: &Tensor, out: &Tensor) -> Result<()> {
        ops::silu_mul(self, gate, up, out)
    }

    fn add_assign(&self, dst: &Tensor, src: &Tensor) -> Result<()> {
        ops::add_assign(self, dst, src)
    }

    fn gather_rows(&self, x: &Tensor, rows: &Tensor, out: &Tensor) -> Result<()> {
        ops::gather_rows(self, x, rows, out)
    }

    fn create_attention(&self, name: &str) -> Result<Arc<dyn AttentionBackend>> {
        match name {
            "wgpu-paged" => Ok(Arc::new(attention::WgpuAttention::new(self.clone_handle()))),
            other => Err(CoreError::NotRegistered {
                kind: "attention backend",
                name: other.to_string(),
                available: self.caps.attention.join(", "),
            }),
        }
    }

    fn sample(&self, logits: &Tensor, rows: &[SampleRow], out: &Tensor) -> Result<()> {
        sample::sample(self, logits, rows, out)
    }

    fn edit_logits(&self, logits: &Tensor, edits: &arbor_engine_core::LogitEdits) -> Result<()> {
        sample::edit_logits(self, logits, edits)
    }

    fn logprob_stats(
        &self,
        logits: &Tensor,
        top: usize,
        lse: &Tensor,
        top_ids: &Tensor,
        top_logprobs: &Tensor,
    ) -> Result<()> {
        sample::logprob_stats(self, logits, top, lse, top_ids, top_logprobs)
    }
}

impl WgpuBackend {
    /// Another handle on the same device (shares memory and the queue).
    fn clone_handle(&self) -> WgpuBackend {
        WgpuBackend {
            gpu: self.gpu.clone(),
            caps: self.caps.clone(),
        }
    }
}

inventory::submit! {
    BackendEntry {
        name: "wgpu",
        about: "WGSL kernels on Vulkan, Metal or DX12 through wgpu (--wgpu-adapter picks the adapter)",
        create: |opts: &BackendOptions| Ok(Arc::new(WgpuBackend::new(opts)?) as Arc<dyn Backend>),
    }
}
