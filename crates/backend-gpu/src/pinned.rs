//! [`PinnedHost`]: pinned (page-locked) host memory for the host KV tier,
//! which the device's copies reach at full speed without the runtime
//! staging them through a bounce buffer.
//!
//! Memory comes from the driver's `malloc_host` in chunks of at least
//! [`CHUNK_BYTES`] and is handed out as disjoint regions, each owned by one
//! page slot. A region is never handed out twice; the chunks go back to the
//! driver when the allocator and every region from it are dropped (each
//! region holds the arena), with the device's context bound.

#![allow(unsafe_code)]

use crate::device::Device;
use arbor_engine_core::{HostMemory, HostRegion};
use std::sync::{Arc, Mutex};

/// Bytes asked of the driver at a time (more for a larger region).
pub const CHUNK_BYTES: usize = 64 << 20;

/// Regions start on this alignment.
const ALIGN: usize = 64;

/// The chunks and where the next region starts in the last one.
struct Chunks {
    list: Vec<(*mut u8, usize)>,
    used: usize,
}

struct Arena {
    dev: Arc<Device>,
    chunks: Mutex<Chunks>,
}

// SAFETY: the chunk pointers are pinned host memory owned by the arena,
// touched only under its lock (regions own disjoint ranges of them).
unsafe impl Send for Arena {}
// SAFETY: as above.
unsafe impl Sync for Arena {}

impl Arena {
    /// `bytes` of fresh zeroed pinned memory, or `None` when the driver has none.
    fn take(&self, bytes: usize) -> Option<*mut u8> {
        let need = bytes.max(1).div_ceil(ALIGN) * ALIGN;
        let mut c = self.chunks.lock().unwrap_or_else(|e| e.into_inner());
        let room = c.list.last().map_or(0, |&(_, cap)| cap - c.used);
        if room < need {
            let cap = need.max(CHUNK_BYTES);
            // Binds the device's context for the allocation.
            let st = self.dev.lock().ok()?;
            let p = self
                .dev
                .drv
                .malloc_host(cap)
                .ok()
                .filter(|p| !p.is_null())?;
            drop(st);
            self.dev.note_pinned(p, cap, true);
            c.list.push((p, cap));
            c.used = 0;
        }
        let &(base, _) = c.list.last()?;
        // SAFETY: [used, used + need) lies in the last chunk (checked above)
        // and was never handed out.
        let p = unsafe { base.add(c.used) };
        c.used += need;
        // SAFETY: as above; the range is `bytes` long at least.
        unsafe { std::ptr::write_bytes(p, 0, bytes) };
        Some(p)
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        let c = self.chunks.get_mut().unwrap_or_else(|e| e.into_inner());
        if c.list.is_empty() {
            return;
        }
        // Binds the context; the regions, and so any copy into them, are gone.
        let Ok(st) = self.dev.lock() else {
            return;
        };
        for (p, cap) in c.list.drain(..) {
            self.dev.note_pinned(p, cap, false);
            // SAFETY: from malloc_host of this driver, freed once; no region
            // of it is alive (each holds the arena).
            unsafe { self.dev.drv.free_host(p) };
        }
        drop(st);
    }
}

/// Pinned host memory of one device (see the module doc).
pub struct PinnedHost {
    arena: Arc<Arena>,
}

impl PinnedHost {
    pub(crate) fn new(dev: Arc<Device>) -> Self {
        Self {
            arena: Arc::new(Arena {
                dev,
                chunks: Mutex::new(Chunks {
                    list: Vec::new(),
                    used: 0,
                }),
            }),
        }
    }

    /// Bytes taken from the driver so far.
    pub fn reserved_bytes(&self) -> usize {
        let c = self.arena.chunks.lock().unwrap_or_else(|e| e.into_inner());
        c.list.iter().map(|&(_, cap)| cap).sum()
    }
}

impl HostMemory for PinnedHost {
    fn alloc(&self, bytes: usize) -> Option<Box<dyn HostRegion>> {
        let ptr = self.arena.take(bytes)?;
        Some(Box::new(Region {
            ptr,
            len: bytes,
            _arena: self.arena.clone(),
        }))
    }

    fn kind(&self) -> &'static str {
        "pinned"
    }
}

/// One region of a chunk, owned alone.
struct Region {
    ptr: *mut u8,
    len: usize,
    _arena: Arc<Arena>,
}

// SAFETY: the region owns its bytes alone; the arena keeps them alive.
unsafe impl Send for Region {}
// SAFETY: as above (shared access is read-only).
unsafe impl Sync for Region {}

impl HostRegion for Region {
    fn bytes(&self) -> &[u8] {
        // SAFETY: `len` bytes at `ptr`, alive while the arena is and handed
        // to this region alone.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}
