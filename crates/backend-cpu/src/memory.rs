//! Host memory standing in for device memory.
//!
//! Buffers live in a slab of 64-byte-aligned, zero-initialized allocations
//! indexed by the slot of their [`BufferId`]. Large ones (from
//! [`MAP_MIN`] bytes: the KV pool, weight matrices) are anonymous memory
//! maps, zero pages the kernel commits on first touch, so a KV pool costs
//! resident memory only for the pages requests have written. A [`Tensor`] is resolved to a raw
//! pointer only inside an operation, after checking that it belongs to this
//! device, that its byte range lies inside its buffer and that it is aligned
//! for its element type. The allocation stays alive during the operation
//! because the tensor holds the buffer handle, and a slot is freed only by the
//! handle's `Drop`.

use arbor_engine_core::{BufferId, BufferOwner, CoreError, DeviceBuffer, Result, Tensor};
use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

const ALIGN: usize = 64;

/// Allocations of at least this many bytes are anonymous maps (page-aligned).
pub const MAP_MIN: usize = 1 << 20;

enum Allocation {
    Heap { ptr: NonNull<u8>, layout: Layout },
    Mapped(memmap2::MmapMut),
}

impl Allocation {
    fn ptr(&self) -> *mut u8 {
        match self {
            Allocation::Heap { ptr, .. } => ptr.as_ptr(),
            Allocation::Mapped(m) => m.as_ptr() as *mut u8,
        }
    }

    fn size(&self) -> usize {
        match self {
            Allocation::Heap { layout, .. } => layout.size(),
            Allocation::Mapped(m) => m.len(),
        }
    }
}

// SAFETY: the allocation is plain memory; synchronization of its contents is
// the operations' responsibility (disjoint writes per thread).
unsafe impl Send for Allocation {}

impl Drop for Allocation {
    fn drop(&mut self) {
        if let Allocation::Heap { ptr, layout } = self {
            // SAFETY: allocated in `HostMemory::allocate` with this layout.
            unsafe { dealloc(ptr.as_ptr(), *layout) }
        }
    }
}

#[derive(Default)]
struct Slab {
    slots: Vec<Option<Allocation>>,
    free: Vec<usize>,
}

/// The buffers of one CPU backend instance.
pub struct HostMemory {
    tag: u32,
    slab: Mutex<Slab>,
    allocated: AtomicU64,
}

/// A resolved view: a raw pointer to the first byte and its length.
#[derive(Clone, Copy, Debug)]
pub struct RawView {
    pub ptr: *mut u8,
    pub bytes: usize,
}

/// A raw pointer that may cross to pool threads; each thread touches a disjoint part.
#[derive(Clone, Copy, Debug)]
pub struct SendPtr<T>(pub *mut T);
impl<T> SendPtr<T> {
    /// The pointer (a method, so closures capture the whole `Sync` wrapper).
    #[inline(always)]
    pub fn get(self) -> *mut T {
        self.0
    }
}

// SAFETY: users guarantee disjoint access per thread (see each kernel).
unsafe impl<T> Send for SendPtr<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for SendPtr<T> {}

impl HostMemory {
    /// Empty memory for the device with this tag.
    pub fn new(tag: u32) -> Self {
        Self {
            tag,
            slab: Mutex::new(Slab::default()),
            allocated: AtomicU64::new(0),
        }
    }

    /// Bytes currently allocated.
    pub fn allocated_bytes(&self) -> u64 {
        self.allocated.load(Ordering::Relaxed)
    }

    /// Allocates `bytes` zeroed bytes and returns the owning handle.
    pub fn allocate(self: &Arc<Self>, bytes: usize) -> Result<Arc<DeviceBuffer>> {
        let a = if bytes >= MAP_MIN {
            let m = memmap2::MmapMut::map_anon(bytes).map_err(|e| {
                CoreError::OutOfMemory(format!("host allocation of {bytes} bytes: {e}"))
            })?;
            Allocation::Mapped(m)
        } else {
            let layout = Layout::from_size_align(bytes.max(1), ALIGN)
                .map_err(|e| CoreError::OutOfMemory(format!("{bytes} bytes: {e}")))?;
            // SAFETY: layout has non-zero size.
            let ptr = unsafe { alloc_zeroed(layout) };
            let ptr = NonNull::new(ptr).ok_or_else(|| {
                CoreError::OutOfMemory(format!("host allocation of {bytes} bytes"))
            })?;
            Allocation::Heap { ptr, layout }
        };
        let size = a.size();
        let mut slab = self.slab.lock().unwrap_or_else(|e| e.into_inner());
        let slot = match slab.free.pop() {
            Some(s) => {
                slab.slots[s] = Some(a);
                s
            }
            None => {
                slab.slots.push(Some(a));
                slab.slots.len() - 1
            }
        };
        drop(slab);
        self.allocated.fetch_add(size as u64, Ordering::Relaxed);
        let owner: Arc<dyn BufferOwner> = self.clone();
        Ok(Arc::new(DeviceBuffer::new(
            BufferId {
                device: self.tag,
                slot: slot as u64,
            },
            bytes,
            owner,
        )))
    }

    /// Resolves a tensor to its bytes, checking device, bounds and alignment for `align`.
    pub fn resolve(&self, t: &Tensor, align: usize) -> Result<RawView> {
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
        let slab = self.slab.lock().unwrap_or_else(|e| e.into_inner());
        let a = slab
            .slots
            .get(id.slot as usize)
            .and_then(|s| s.as_ref())
            .ok_or_else(|| CoreError::Internal(format!("buffer {id:?} is not allocated")))?;
        // SAFETY: range.start <= buffer bytes <= allocation size.
        let ptr = unsafe { a.ptr().add(range.start) };
        if !(ptr as usize).is_multiple_of(align.max(1)) {
            return Err(CoreError::invalid(format!(
                "tensor {t:?} is not aligned to {align} bytes"
            )));
        }
        Ok(RawView {
            ptr,
            bytes: range.len(),
        })
    }
}

impl BufferOwner for HostMemory {
    fn release(&self, id: BufferId) {
        let mut slab = self.slab.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(slot) = slab.slots.get_mut(id.slot as usize)
            && let Some(a) = slot.take()
        {
            self.allocated.fetch_sub(a.size() as u64, Ordering::Relaxed);
            slab.free.push(id.slot as usize);
        }
    }
}
