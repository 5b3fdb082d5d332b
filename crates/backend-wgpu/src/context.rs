//! The device, its queue, and the recording of work.
//!
//! [`Gpu`] owns the wgpu device and one pending command encoder. Backend
//! operations only *record* work (compute dispatches, buffer copies and
//! clears) into that encoder; it is submitted when the host needs a result
//! ([`Gpu::read`], [`Gpu::wait`]) or when it holds [`FLUSH_DISPATCHES`]
//! dispatches, so that a whole forward pass goes to the device in a few
//! submissions.
//!
//! Kernel parameters are small uniform structs. Each dispatch's parameters are
//! appended to a host-side arena that is uploaded right before the encoder is
//! submitted; each dispatch binds its own aligned slice of that arena.
//!
//! Invariants:
//! - All commands go through the one encoder and the one queue, in the order
//!   the operations were called, so a later operation always sees the effects
//!   of an earlier one. Host writes are ordered with recorded work: a write
//!   made while commands are pending is itself recorded (a staged copy);
//!   only when nothing is pending does it go through `Queue::write_buffer`,
//!   which lands before the next submission.
//! - A storage binding covers a window of a buffer that starts at a multiple
//!   of the adapter's storage-offset alignment; kernels receive the tensor's
//!   offset inside that window as a parameter.
//! - A dispatch never binds one buffer both read-only and writable (wgpu
//!   forbids it): an input that shares a buffer with an output of the same
//!   dispatch is first copied to a scratch buffer.
//! - Validation errors are captured (never panics) and returned as
//!   `CoreError::Device` by the next call that waits for the device.

use crate::memory::{DeviceMemory, padded};
use arbor_engine_core::{CoreError, Result, Tensor};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

/// Dispatches recorded before the encoder is submitted without being asked.
pub const FLUSH_DISPATCHES: usize = 256;
/// Bytes reserved per dispatch in the parameter arena (before alignment):
/// the largest parameter block a kernel takes (attention's 17 words, padded
/// to 80 bytes), checked in [`Gpu::dispatch`].
const PARAM_BYTES: u64 = 128;
/// Host writes queued through `Queue::write_buffer` before an empty submission
/// releases their staging memory.
const WRITE_FLUSH_BYTES: u64 = 64 << 20;

/// How a kernel uses a binding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// `var<storage, read>`.
    Read,
    /// `var<storage, read_write>`.
    Write,
}

/// A tensor resolved to a binding window.
#[derive(Clone, Debug)]
pub struct View {
    pub buffer: wgpu::Buffer,
    /// Window start in the buffer (aligned).
    pub base: u64,
    /// Window size in bytes (a multiple of 4).
    pub size: u64,
    /// Byte offset of the tensor inside the window.
    pub off: u32,
    pub access: Access,
}

impl View {
    /// The tensor's offset inside the window, in 4-byte words.
    pub fn word_off(&self) -> u32 {
        self.off / 4
    }
}

/// Kernel parameters: 32-bit words, padded to 16 bytes.
#[derive(Clone, Debug, Default)]
pub struct Params(Vec<u32>);

impl Params {
    pub fn new() -> Self {
        Self(Vec::with_capacity(16))
    }
    pub fn u(mut self, v: u32) -> Self {
        self.0.push(v);
        self
    }
    pub fn us(mut self, v: usize) -> Result<Self> {
        let v = u32::try_from(v).map_err(|_| {
            CoreError::unsupported(format!("{v} does not fit a 32-bit kernel index"))
        })?;
        self.0.push(v);
        Ok(self)
    }
    pub fn f(mut self, v: f32) -> Self {
        self.0.push(v.to_bits());
        self
    }
    fn bytes(&self) -> Vec<u8> {
        let mut b: Vec<u8> = self.0.iter().flat_map(|w| w.to_le_bytes()).collect();
        b.resize(b.len().div_ceil(16).max(1) * 16, 0);
        b
    }
}

struct Pending {
    encoder: wgpu::CommandEncoder,
    arena: wgpu::Buffer,
    params: Vec<u8>,
    dispatches: usize,
    commands: usize,
}

struct State {
    pending: Option<Pending>,
    readback: Option<wgpu::Buffer>,
    written: u64,
}

/// The device and the work recorded for it.
pub struct Gpu {
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub info: wgpu::AdapterInfo,
    pub limits: wgpu::Limits,
    pub features: wgpu::Features,
    pub mem: Arc<DeviceMemory>,
    state: Mutex<State>,
    pipelines: Mutex<HashMap<String, wgpu::ComputePipeline>>,
    errors: Arc<Mutex<Vec<String>>>,
    arena_bytes: u64,
    param_stride: u64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // The guarded state is left consistent by every operation.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// An error with its sources, on one line.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut msg = e.to_string().trim().to_string();
    let mut src = e.source();
    while let Some(s) = src {
        let t = s.to_string();
        if !t.trim().is_empty() && !msg.contains(t.trim()) {
            msg.push_str(": ");
            msg.push_str(t.trim());
        }
        src = s.source();
    }
    msg.replace('\n', " ")
}

fn align_up(v: u64, a: u64) -> u64 {
    v.div_ceil(a) * a
}

impl Gpu {
    /// The loop iterations an invocation may run in all, where the adapter
    /// caps them: llvmpipe (lavapipe) ends every loop of an invocation once
    /// 65535 iterations have run together (Mesa's
    /// `LP_MAX_TGSI_LOOP_ITERATIONS`), silently. `None`: no cap.
    pub fn loop_budget(&self) -> Option<usize> {
        let llvmpipe = |s: &str| s.to_ascii_lowercase().contains("llvmpipe");
        (llvmpipe(&self.info.name) || llvmpipe(&self.info.driver)).then_some(65_535)
    }

    /// Wraps an opened device.
    pub fn new(
        device: wgpu::Device,
        queue: wgpu::Queue,
        info: wgpu::AdapterInfo,
        tag: u32,
    ) -> Self {
        let errors: Arc<Mutex<Vec<String>>> = Arc::new(Mutex::new(Vec::new()));
        let sink = errors.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            let mut v = lock(&sink);
            if v.len() < 16 {
                v.push(error_chain(&e));
            }
        }));
        let lost = errors.clone();
        device.set_device_lost_callback(move |reason, msg| {
            lock(&lost).push(format!("device lost ({reason:?}): {msg}"));
        });
        let limits = device.limits();
        let features = device.features();
        let param_stride = align_up(
            PARAM_BYTES,
            u64::from(limits.min_uniform_buffer_offset_alignment.max(16)),
        );
        let mem = Arc::new(DeviceMemory::new(tag, device.clone()));
        Self {
            device,
            queue,
            info,
            limits,
            features,
            mem,
            state: Mutex::new(State {
                pending: None,
                readback: None,
                written: 0,
            }),
            pipelines: Mutex::new(HashMap::new()),
            errors,
            arena_bytes: param_stride * FLUSH_DISPATCHES as u64,
            param_stride,
        }
    }

    fn check_errors(&self) -> Result<()> {
        let mut e = lock(&self.errors);
        if e.is_empty() {
            Ok(())
        } else {
            let msg = e.join("; ");
            e.clear();
            Err(CoreError::Device(format!("wgpu: {msg}")))
        }
    }

    /// The compute pipeline `key`, compiled from `source()` on first use.
    pub fn pipeline(
        &self,
        key: &str,
        source: impl FnOnce() -> String,
    ) -> Result<wgpu::ComputePipeline> {
        if let Some(p) = lock(&self.pipelines).get(key) {
            return Ok(p.clone());
        }
        let src = source();
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let module = self
            .device
            .create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some(key),
                source: wgpu::ShaderSource::Wgsl(src.into()),
            });
        let pipeline = self
            .device
            .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(key),
                layout: None,
                module: &module,
                entry_point: Some("main"),
                compilation_options: wgpu::PipelineCompilationOptions::default(),
                cache: None,
            });
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(CoreError::Internal(format!(
                "compiling kernel {key}: {}",
                error_chain(&e)
            )));
        }
        lock(&self.pipelines).insert(key.to_string(), pipeline.clone());
        Ok(pipeline)
    }

    /// The compute pipeline of a kernel variant.
    pub fn kernel(&self, k: &crate::kernels::Kernel) -> Result<wgpu::ComputePipeline> {
        self.pipeline(&k.key(), || k.source())
    }

    /// Resolves a tensor to a binding window.
    pub fn view(&self, t: &Tensor, access: Access) -> Result<View> {
        let buffer = self.mem.buffer(t)?;
        let range = t.byte_range()?;
        let align = u64::from(self.limits.min_storage_buffer_offset_alignment.max(4));
        let start = range.start as u64;
        let base = start / align * align;
        let end = padded(range.end).min(buffer.size());
        let size = align_up(end.max(base + 4) - base, 4);
        if size > self.limits.max_storage_buffer_binding_size {
            return Err(CoreError::unsupported(format!(
                "tensor {t:?} spans {size} bytes, more than one storage binding allows ({})",
                self.limits.max_storage_buffer_binding_size
            )));
        }
        let off = u32::try_from(start - base)
            .map_err(|_| CoreError::Internal("binding offset overflow".into()))?;
        Ok(View {
            buffer,
            base,
            size,
            off,
            access,
        })
    }

    fn begin(&self) -> Pending {
        Pending {
            encoder: self
                .device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None }),
            arena: self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("kernel parameters"),
                size: self.arena_bytes,
                usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            }),
            params: Vec::new(),
            dispatches: 0,
            commands: 0,
        }
    }

    /// Submits pending work (without waiting for it).
    fn submit_locked(&self, st: &mut State) -> Option<wgpu::SubmissionIndex> {
        let p = st.pending.take()?;
        if !p.params.is_empty() {
            self.queue.write_buffer(&p.arena, 0, &p.params);
        }
        st.written = 0;
        Some(self.queue.submit([p.encoder.finish()]))
    }

    /// Submits pending work now.
    pub fn flush(&self) -> Result<()> {
        let mut st = lock(&self.state);
        self.submit_locked(&mut st);
        drop(st);
        self.check_errors()
    }

    /// Submits pending work and waits until the device has finished it all.
    pub fn wait(&self) -> Result<()> {
        let mut st = lock(&self.state);
        self.submit_locked(&mut st);
        drop(st);
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| CoreError::Device(format!("waiting for the device: {e}")))?;
        self.check_errors()
    }

    /// Records a compute dispatch of `pipeline` over `groups` workgroups.
    pub fn dispatch(
        &self,
        pipeline: &wgpu::ComputePipeline,
        params: &Params,
        views: &[&View],
        groups: (u32, u32, u32),
    ) -> Result<()> {
        if groups.0 == 0 || groups.1 == 0 || groups.2 == 0 {
            return Ok(());
        }
        let maxg = self.limits.max_compute_workgroups_per_dimension;
        if groups.0 > maxg || groups.1 > maxg || groups.2 > maxg {
            return Err(CoreError::unsupported(format!(
                "dispatch of {groups:?} workgroups exceeds the adapter's {maxg} per dimension"
            )));
        }
        let bytes = params.bytes();
        if bytes.len() as u64 > PARAM_BYTES {
            return Err(CoreError::invalid(format!(
                "kernel parameters of {} bytes exceed the {PARAM_BYTES} reserved per dispatch",
                bytes.len()
            )));
        }
        let mut st = lock(&self.state);
        if st
            .pending
            .as_ref()
            .is_some_and(|p| p.dispatches >= FLUSH_DISPATCHES)
        {
            self.submit_locked(&mut st);
        }
        let p = st.pending.get_or_insert_with(|| self.begin());
        // Inputs that share a buffer with an output are read from a copy.
        let mut copies: Vec<View> = Vec::new();
        for v in views {
            let aliased = v.access == Access::Read
                && views
                    .iter()
                    .any(|w| w.access == Access::Write && w.buffer == v.buffer);
            if aliased {
                let tmp = self.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("alias copy"),
                    size: v.size,
                    usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                });
                p.encoder
                    .copy_buffer_to_buffer(&v.buffer, v.base, &tmp, 0, v.size);
                copies.push(View {
                    buffer: tmp,
                    base: 0,
                    size: v.size,
                    off: v.off,
                    access: Access::Read,
                });
            } else {
                copies.push((*v).clone());
            }
        }
        let offset = p.params.len() as u64;
        p.params.resize(offset as usize, 0);
        p.params.extend_from_slice(&bytes);
        let next = align_up(p.params.len() as u64, self.param_stride);
        p.params.resize(next as usize, 0);
        let layout = pipeline.get_bind_group_layout(0);
        let mut entries = vec![wgpu::BindGroupEntry {
            binding: 0,
            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer: &p.arena,
                offset,
                size: wgpu::BufferSize::new(bytes.len() as u64),
            }),
        }];
        for (i, v) in copies.iter().enumerate() {
            entries.push(wgpu::BindGroupEntry {
                binding: i as u32 + 1,
                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer: &v.buffer,
                    offset: v.base,
                    size: wgpu::BufferSize::new(v.size),
                }),
            });
        }
        let group = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &layout,
            entries: &entries,
        });
        {
            let mut pass = p
                .encoder
                .begin_compute_pass(&wgpu::ComputePassDescriptor::default());
            pass.set_pipeline(pipeline);
            pass.set_bind_group(0, &group, &[]);
            pass.dispatch_workgroups(groups.0, groups.1, groups.2);
        }
        p.dispatches += 1;
        p.commands += 1;
        Ok(())
    }

    /// Records a copy of `size` bytes (offsets and size multiples of 4).
    pub fn copy(
        &self,
        src: &wgpu::Buffer,
        src_off: u64,
        dst: &wgpu::Buffer,
        dst_off: u64,
        size: u64,
    ) -> Result<()> {
        if !(src_off | dst_off | size).is_multiple_of(4) {
            return Err(CoreError::unsupported(
                "device copies need offsets and sizes in whole 4-byte words",
            ));
        }
        if size == 0 {
            return Ok(());
        }
        let mut st = lock(&self.state);
        let p = st.pending.get_or_insert_with(|| self.begin());
        p.encoder
            .copy_buffer_to_buffer(src, src_off, dst, dst_off, size);
        p.commands += 1;
        Ok(())
    }

    /// Records a zero fill of `size` bytes at `offset` (multiples of 4).
    pub fn clear(&self, buffer: &wgpu::Buffer, offset: u64, size: u64) -> Result<()> {
        if !(offset | size).is_multiple_of(4) {
            return Err(CoreError::unsupported(
                "device clears need offsets and sizes in whole 4-byte words",
            ));
        }
        let mut st = lock(&self.state);
        let p = st.pending.get_or_insert_with(|| self.begin());
        p.encoder.clear_buffer(buffer, offset, Some(size));
        p.commands += 1;
        Ok(())
    }

    /// Writes `data` at `offset` of `buffer`, ordered after all recorded work.
    /// `offset` and `data.len()` must be multiples of 4.
    pub fn write(&self, buffer: &wgpu::Buffer, offset: u64, data: &[u8]) -> Result<()> {
        if !(offset | data.len() as u64).is_multiple_of(4) {
            return Err(CoreError::Internal("unaligned device write".into()));
        }
        if data.is_empty() {
            return Ok(());
        }
        let mut st = lock(&self.state);
        match st.pending.as_mut() {
            None => {
                self.queue.write_buffer(buffer, offset, data);
                st.written += data.len() as u64;
                if st.written >= WRITE_FLUSH_BYTES {
                    st.written = 0;
                    self.queue.submit([]);
                }
            }
            Some(p) => {
                let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("upload"),
                    size: data.len() as u64,
                    usage: wgpu::BufferUsages::COPY_SRC,
                    mapped_at_creation: true,
                });
                staging
                    .slice(..)
                    .get_mapped_range_mut()
                    .map_err(|e| CoreError::Device(format!("mapping an upload buffer: {e}")))?
                    .copy_from_slice(data);
                staging.unmap();
                p.encoder
                    .copy_buffer_to_buffer(&staging, 0, buffer, offset, data.len() as u64);
                p.commands += 1;
            }
        }
        Ok(())
    }

    /// Waits for all recorded work, then reads `size` bytes at `offset` of
    /// `buffer` (multiples of 4) into `dst` (which may be shorter: the rest is dropped).
    pub fn read(
        &self,
        buffer: &wgpu::Buffer,
        offset: u64,
        size: u64,
        dst: &mut [u8],
    ) -> Result<()> {
        if !(offset | size).is_multiple_of(4) || (dst.len() as u64) > size {
            return Err(CoreError::Internal("unaligned device read".into()));
        }
        if size == 0 {
            return Ok(());
        }
        let mut st = lock(&self.state);
        let rb = match st.readback.take() {
            Some(b) if b.size() >= size => b,
            _ => self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("readback"),
                size: align_up(size, 1 << 16),
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            }),
        };
        let p = st.pending.get_or_insert_with(|| self.begin());
        p.encoder
            .copy_buffer_to_buffer(buffer, offset, &rb, 0, size);
        let index = self.submit_locked(&mut st);
        let slot: Arc<Mutex<Option<std::result::Result<(), wgpu::BufferAsyncError>>>> =
            Arc::new(Mutex::new(None));
        let s2 = slot.clone();
        rb.slice(..size)
            .map_async(wgpu::MapMode::Read, move |r| *lock(&s2) = Some(r));
        self.device
            .poll(wgpu::PollType::Wait {
                submission_index: index,
                timeout: None,
            })
            .map_err(|e| CoreError::Device(format!("waiting for the device: {e}")))?;
        self.check_errors()?;
        match lock(&slot).take() {
            Some(Ok(())) => {}
            Some(Err(e)) => return Err(CoreError::Device(format!("reading back: {e}"))),
            None => {
                return Err(CoreError::Device(
                    "reading back: the map did not complete".into(),
                ));
            }
        }
        {
            let view = rb
                .slice(..size)
                .get_mapped_range()
                .map_err(|e| CoreError::Device(format!("reading back: {e}")))?;
            dst.copy_from_slice(&view[..dst.len()]);
        }
        rb.unmap();
        st.readback = Some(rb);
        Ok(())
    }
}
