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
//! handle's `Drop`. A released map of at most [`SPARE_ONE`] bytes is kept
//! (up to [`SPARE_MAX`] in all, the oldest dropped first) and handed,
//! zeroed again, to the next allocation of exactly its size: a step's
//! large temporaries (logits, MLP activations) then reuse warm pages
//! instead of faulting in fresh zero pages every step.

use arbor_engine_core::{BufferId, BufferOwner, CoreError, DeviceBuffer, Result, Tensor};
use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::collections::VecDeque;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

const ALIGN: usize = 64;

/// Allocations of at least this many bytes are anonymous maps (page-aligned).
/// Below it they come from the heap, whose allocator may hand large blocks
/// back to the OS when they are freed and fault them in again on the next
/// allocation: a prefill's per-layer temporaries of 64 KiB to 1 MiB did
/// that (9% of a 512-token prefill in page faults and clearing), so from 64
/// KiB on they are maps the spares below keep warm.
pub const MAP_MIN: usize = 64 << 10;

/// Largest released map kept for reuse.
pub const SPARE_ONE: usize = 16 << 20;
/// Most bytes of released maps kept for reuse.
pub const SPARE_MAX: usize = 64 << 20;

/// A zeroed heap block, freed on drop.
struct HeapBlock {
    ptr: NonNull<u8>,
    layout: Layout,
}

enum Allocation {
    Heap(HeapBlock),
    Mapped(memmap2::MmapMut),
}

impl Allocation {
    fn ptr(&self) -> *mut u8 {
        match self {
            Allocation::Heap(h) => h.ptr.as_ptr(),
            Allocation::Mapped(m) => m.as_ptr() as *mut u8,
        }
    }

    fn size(&self) -> usize {
        match self {
            Allocation::Heap(h) => h.layout.size(),
            Allocation::Mapped(m) => m.len(),
        }
    }
}

// SAFETY: the allocation is plain memory; synchronization of its contents is
// the operations' responsibility (disjoint writes per thread).
unsafe impl Send for Allocation {}

impl Drop for HeapBlock {
    fn drop(&mut self) {
        // SAFETY: allocated in `HostMemory::allocate` with this layout.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

#[derive(Default)]
struct Slab {
    slots: Vec<Option<Allocation>>,
    free: Vec<usize>,
    /// Released maps kept for reuse, oldest first, `spare_bytes` in all.
    spare: VecDeque<memmap2::MmapMut>,
    spare_bytes: usize,
}

impl Slab {
    /// A kept map of exactly `bytes`, if there is one.
    fn take_spare(&mut self, bytes: usize) -> Option<memmap2::MmapMut> {
        let i = self.spare.iter().position(|m| m.len() == bytes)?;
        let m = self.spare.remove(i)?;
        self.spare_bytes -= bytes;
        Some(m)
    }

    /// Keeps a released map (at most [`SPARE_ONE`] bytes), dropping the
    /// oldest kept ones while the total would pass [`SPARE_MAX`]: the kept
    /// sizes follow the current workload instead of the first one.
    fn keep_spare(&mut self, m: memmap2::MmapMut) {
        if m.len() > SPARE_ONE {
            return;
        }
        while self.spare_bytes + m.len() > SPARE_MAX {
            let Some(old) = self.spare.pop_front() else {
                break;
            };
            self.spare_bytes -= old.len();
        }
        self.spare_bytes += m.len();
        self.spare.push_back(m);
    }
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
            let spare = self
                .slab
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take_spare(bytes);
            let m = match spare {
                Some(mut m) => {
                    m.fill(0);
                    m
                }
                None => memmap2::MmapMut::map_anon(bytes).map_err(|e| {
                    CoreError::OutOfMemory(format!("host allocation of {bytes} bytes: {e}"))
                })?,
            };
            Allocation::Mapped(m)
        } else {
            let layout = Layout::from_size_align(bytes.max(1), ALIGN)
                .map_err(|e| CoreError::OutOfMemory(format!("{bytes} bytes: {e}")))?;
            // SAFETY: layout has non-zero size.
            let ptr = unsafe { alloc_zeroed(layout) };
            let ptr = NonNull::new(ptr).ok_or_else(|| {
                CoreError::OutOfMemory(format!("host allocation of {bytes} bytes"))
            })?;
            Allocation::Heap(HeapBlock { ptr, layout })
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
            if let Allocation::Mapped(m) = a {
                slab.keep_spare(m);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arbor_engine_core::DType;

    fn bytes_of(mem: &HostMemory, t: &Tensor) -> &'static mut [u8] {
        let v = mem.resolve(t, 1).expect("resolves");
        // SAFETY: the view covers the tensor's bytes, alive while `t` is.
        unsafe { std::slice::from_raw_parts_mut(v.ptr, v.bytes) }
    }

    #[test]
    fn a_released_map_comes_back_zeroed_to_the_same_size_only() {
        let mem = Arc::new(HostMemory::new(u32::MAX - 7));
        let n = MAP_MIN / 4 + 100;
        let first = Tensor::new(mem.allocate(n * 4).unwrap(), DType::F32, &[n]).unwrap();
        let ptr = bytes_of(&mem, &first).as_ptr();
        bytes_of(&mem, &first).fill(0xAB);
        drop(first);
        assert_eq!(mem.allocated_bytes(), 0);
        // Another size maps anew; the same size takes the kept map, zeroed.
        let other = Tensor::new(mem.allocate(n * 4 + 64).unwrap(), DType::F32, &[n + 16]).unwrap();
        assert_ne!(bytes_of(&mem, &other).as_ptr(), ptr);
        let again = Tensor::new(mem.allocate(n * 4).unwrap(), DType::F32, &[n]).unwrap();
        assert_eq!(bytes_of(&mem, &again).as_ptr(), ptr);
        assert!(bytes_of(&mem, &again).iter().all(|&b| b == 0));
        drop((other, again));
        assert_eq!(mem.allocated_bytes(), 0);
        // Kept maps never exceed the cap.
        let big: Vec<_> = (0..6).map(|_| mem.allocate(SPARE_ONE).unwrap()).collect();
        drop(big);
        let consistent = |mem: &HostMemory| {
            let slab = mem.slab.lock().unwrap();
            assert!(slab.spare_bytes <= SPARE_MAX);
            assert_eq!(
                slab.spare_bytes,
                slab.spare.iter().map(|m| m.len()).sum::<usize>()
            );
        };
        consistent(&mem);
        // A full set of spares gives way to a newly released size, oldest
        // first: the new size is reused next time.
        let fresh =
            Tensor::new(mem.allocate(n * 4 + 4096).unwrap(), DType::F32, &[n + 1024]).unwrap();
        let fresh_ptr = bytes_of(&mem, &fresh).as_ptr();
        drop(fresh);
        consistent(&mem);
        let reused = mem.allocate(n * 4 + 4096).unwrap();
        let t = Tensor::new(reused, DType::F32, &[n + 1024]).unwrap();
        assert_eq!(bytes_of(&mem, &t).as_ptr(), fresh_ptr);
        drop(t);
        consistent(&mem);
        assert_eq!(mem.allocated_bytes(), 0);
    }
}
