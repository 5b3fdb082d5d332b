//! Device memory: the buffers behind [`Tensor`] handles.
//!
//! Every allocation is one `wgpu::Buffer` (usable as storage, copy source and
//! copy destination) in a slab indexed by the slot of its [`BufferId`]. A
//! buffer's size is rounded up to a multiple of 4 bytes (wgpu copies and
//! storage bindings work in 4-byte words); the padding is never part of a
//! tensor view.
//!
//! Invariants: a slot holds a buffer from `allocate` until the handle's `Drop`
//! calls [`BufferOwner::release`]; released buffers go to a small free list
//! keyed by exact size and are handed out again by later allocations. Reuse is
//! safe without waiting for the device because every command that touches a
//! buffer is recorded on the one queue in program order (see `context`): work
//! recorded before the release runs before work recorded after the reuse, and
//! `wgpu` keeps a buffer alive while recorded commands reference it. A reused
//! buffer is zero-filled by a recorded clear, like a fresh one.

use arbor_engine_core::{BufferId, BufferOwner, CoreError, DeviceBuffer, Result, Tensor};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// Largest total size of released buffers kept for reuse.
const FREE_LIST_BYTES: u64 = 256 << 20;

#[derive(Default)]
struct Slab {
    slots: Vec<Option<wgpu::Buffer>>,
    free_slots: Vec<usize>,
    /// Released buffers by size, ready for reuse.
    free_buffers: HashMap<u64, Vec<wgpu::Buffer>>,
    free_bytes: u64,
}

/// The buffers of one wgpu backend instance.
pub struct DeviceMemory {
    tag: u32,
    device: wgpu::Device,
    slab: Mutex<Slab>,
    allocated: AtomicU64,
}

/// A buffer obtained from [`DeviceMemory::allocate`]: the handle, the wgpu
/// buffer, and whether it was reused (and so must be cleared before use).
pub struct Allocation {
    pub handle: Arc<DeviceBuffer>,
    pub buffer: wgpu::Buffer,
    pub reused: bool,
}

/// Rounds a byte count up to whole 4-byte words (at least one word).
pub fn padded(bytes: usize) -> u64 {
    (bytes.max(1) as u64).div_ceil(4) * 4
}

impl DeviceMemory {
    /// Empty memory for the device with this tag.
    pub fn new(tag: u32, device: wgpu::Device) -> Self {
        Self {
            tag,
            device,
            slab: Mutex::new(Slab::default()),
            allocated: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Slab> {
        // Every operation leaves the slab consistent; a panic elsewhere does not poison it.
        self.slab.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Bytes currently allocated to live tensors.
    pub fn allocated_bytes(&self) -> u64 {
        self.allocated.load(Ordering::Relaxed)
    }

    /// Allocates a buffer for `bytes` bytes, at most `max_bytes` in size.
    pub fn allocate(self: &Arc<Self>, bytes: usize, max_bytes: u64) -> Result<Allocation> {
        let size = padded(bytes);
        if size > max_bytes {
            return Err(CoreError::OutOfMemory(format!(
                "a buffer of {bytes} bytes exceeds the adapter's largest buffer ({max_bytes} bytes)"
            )));
        }
        let mut slab = self.lock();
        let recycled = slab.free_buffers.get_mut(&size).and_then(Vec::pop);
        let reused = recycled.is_some();
        let buffer = match recycled {
            Some(b) => {
                slab.free_bytes -= size;
                b
            }
            None => self.device.create_buffer(&wgpu::BufferDescriptor {
                label: None,
                size,
                usage: wgpu::BufferUsages::STORAGE
                    | wgpu::BufferUsages::COPY_SRC
                    | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            }),
        };
        let slot = match slab.free_slots.pop() {
            Some(s) => {
                slab.slots[s] = Some(buffer.clone());
                s
            }
            None => {
                slab.slots.push(Some(buffer.clone()));
                slab.slots.len() - 1
            }
        };
        drop(slab);
        self.allocated.fetch_add(size, Ordering::Relaxed);
        let owner: Arc<dyn BufferOwner> = self.clone();
        let handle = Arc::new(DeviceBuffer::new(
            BufferId {
                device: self.tag,
                slot: slot as u64,
            },
            bytes,
            owner,
        ));
        Ok(Allocation {
            handle,
            buffer,
            reused,
        })
    }

    /// The wgpu buffer behind a tensor, after checking that it belongs to this device.
    pub fn buffer(&self, t: &Tensor) -> Result<wgpu::Buffer> {
        let id = t.buffer_id();
        if id.device != self.tag {
            return Err(CoreError::invalid(format!(
                "tensor {t:?} belongs to another device"
            )));
        }
        let range = t.byte_range()?;
        if range.end > t.buffer().bytes() {
            return Err(CoreError::invalid(format!("tensor {t:?} past its buffer")));
        }
        self.lock()
            .slots
            .get(id.slot as usize)
            .and_then(|s| s.clone())
            .ok_or_else(|| CoreError::Internal(format!("buffer {id:?} is not allocated")))
    }

    /// Drops every buffer kept for reuse.
    pub fn trim(&self) {
        let mut slab = self.lock();
        slab.free_buffers.clear();
        slab.free_bytes = 0;
    }
}

impl BufferOwner for DeviceMemory {
    fn release(&self, id: BufferId) {
        let mut slab = self.lock();
        let Some(buffer) = slab.slots.get_mut(id.slot as usize).and_then(Option::take) else {
            return;
        };
        slab.free_slots.push(id.slot as usize);
        let size = buffer.size();
        self.allocated.fetch_sub(size, Ordering::Relaxed);
        if slab.free_bytes + size <= FREE_LIST_BYTES {
            slab.free_bytes += size;
            slab.free_buffers.entry(size).or_default().push(buffer);
        }
    }
}
