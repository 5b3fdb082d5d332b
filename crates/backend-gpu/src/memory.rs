//! Device memory: a slab of buffers behind [`BufferId`] slots, a caching pool,
//! the per-step arena of graph steps, and pinned staging for their uploads.
//! Memory comes from the [`Driver`], which every method that allocates or
//! frees is given.
//!
//! Pool: sizes round up to a class (512 B steps below 1 MiB, 1 MiB steps below
//! 128 MiB, 32 MiB steps above) and freed blocks stay cached for reuse. Reuse is
//! safe without waiting for the device because every use of memory is ordered
//! on the one stream, and deferred steps keep that order. Cached blocks are
//! returned to the driver only when an allocation fails (then retried).
//!
//! Arena: during a decode step that may become a CUDA graph, allocations are
//! bumped from one region reset at the start of each step, so the same
//! sequence of allocations gets the same addresses every step, which is what
//! lets a captured graph be replayed. A step's buffers are "step buffers";
//! the arena is reset only when none of the previous step is still alive.
//! When it is too small the allocation comes from the pool instead (the step
//! then runs without a graph) and the arena grows before the next step.
//!
//! Staging: pinned host memory, bump-allocated per step like the arena, holds
//! the step's uploads until the recorded copies run; it is rewritten only
//! after the stream has drained.
//!
//! Invariants: a slot is freed exactly once (its `BufferOwner::release`); a
//! block's capacity covers its padded size; the arena and staging only move
//! between steps, after the stream is synchronized, and moving them drops every
//! captured graph (which embeds their addresses).

#![allow(unsafe_code)]

use crate::driver::Driver;
use arbor_engine_core::{CoreError, Result};
use std::collections::BTreeMap;

/// Alignment of every block and arena allocation.
pub const ALIGN: usize = 256;

fn round_up(x: usize, a: usize) -> usize {
    x.div_ceil(a) * a
}

/// The pool's size class for `bytes`.
pub fn size_class(bytes: usize) -> usize {
    let b = bytes.max(1);
    if b < 1 << 20 {
        round_up(b, 512)
    } else if b < 128 << 20 {
        round_up(b, 1 << 20)
    } else {
        round_up(b, 32 << 20)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A pool block of this capacity.
    Pool(usize),
    /// Part of the arena, in the step of this epoch.
    Arena(u64),
}

#[derive(Clone, Copy, Debug)]
pub struct Block {
    pub ptr: u64,
    pub kind: Kind,
}

/// The bump region of graph steps.
#[derive(Debug, Default)]
pub struct Arena {
    pub base: u64,
    pub cap: usize,
    pub off: usize,
    /// Bytes the current step asked for (may exceed `cap`).
    pub want: usize,
    /// Largest `want` seen.
    pub hwm: usize,
    /// Live step buffers.
    pub live: usize,
    /// The current step.
    pub epoch: u64,
}

/// Pinned host memory for the uploads of graph steps.
#[derive(Debug)]
pub struct Staging {
    pub base: *mut u8,
    pub cap: usize,
    pub off: usize,
    pub want: usize,
    pub hwm: usize,
}

impl Default for Staging {
    fn default() -> Self {
        Staging {
            base: std::ptr::null_mut(),
            cap: 0,
            off: 0,
            want: 0,
            hwm: 0,
        }
    }
}

/// All device memory of one backend.
#[derive(Debug, Default)]
pub struct Memory {
    slots: Vec<Option<Block>>,
    free_slots: Vec<usize>,
    cache: BTreeMap<usize, Vec<u64>>,
    pub cached_bytes: usize,
    pub pool_bytes: usize,
    pub arena: Arena,
    pub staging: Staging,
}

// SAFETY: the staging pointer is pinned host memory owned by this struct and
// only touched under the device's state lock.
unsafe impl Send for Memory {}

impl Memory {
    fn new_slot(&mut self, b: Block) -> u64 {
        match self.free_slots.pop() {
            Some(s) => {
                self.slots[s] = Some(b);
                s as u64
            }
            None => {
                self.slots.push(Some(b));
                (self.slots.len() - 1) as u64
            }
        }
    }

    /// The block of a live slot.
    pub fn block(&self, slot: u64) -> Option<Block> {
        self.slots.get(slot as usize).copied().flatten()
    }

    /// Frees a slot (called once per buffer, from the drained releases).
    pub fn release(&mut self, slot: u64) {
        let Some(b) = self.slots.get_mut(slot as usize).and_then(Option::take) else {
            return;
        };
        self.free_slots.push(slot as usize);
        match b.kind {
            Kind::Pool(cap) => {
                self.cache.entry(cap).or_default().push(b.ptr);
                self.cached_bytes += cap;
            }
            Kind::Arena(_) => self.arena.live = self.arena.live.saturating_sub(1),
        }
    }

    /// Returns every cached block to the driver.
    pub fn trim(&mut self, drv: &dyn Driver) {
        for (_, ptrs) in std::mem::take(&mut self.cache) {
            for p in ptrs {
                // SAFETY: a cached block is owned by no buffer; callers
                // synchronize the stream before trimming.
                unsafe { drv.free(p) };
            }
        }
        self.pool_bytes -= self.cached_bytes.min(self.pool_bytes);
        self.cached_bytes = 0;
    }

    /// A pool block of at least `bytes`, cached or new; `None` when the driver
    /// is out of memory (the caller drains the stream, trims and retries).
    pub fn pool_alloc(&mut self, drv: &dyn Driver, bytes: usize) -> Option<u64> {
        let cap = size_class(bytes);
        if let Some(p) = self.cache.get_mut(&cap).and_then(Vec::pop) {
            self.cached_bytes -= cap;
            return Some(self.new_slot(Block {
                ptr: p,
                kind: Kind::Pool(cap),
            }));
        }
        let ptr = drv.malloc(cap)?;
        self.pool_bytes += cap;
        Some(self.new_slot(Block {
            ptr,
            kind: Kind::Pool(cap),
        }))
    }

    /// `bytes` from the arena of the current step, or `None` when it does not fit.
    pub fn arena_alloc(&mut self, bytes: usize) -> Option<u64> {
        let need = round_up(bytes.max(1), ALIGN);
        let a = &mut self.arena;
        a.want += need;
        a.hwm = a.hwm.max(a.want);
        if a.off + need > a.cap {
            return None;
        }
        let ptr = a.base + a.off as u64;
        a.off += need;
        a.live += 1;
        let epoch = a.epoch;
        Some(self.new_slot(Block {
            ptr,
            kind: Kind::Arena(epoch),
        }))
    }

    /// Copies `data` into staging and pads it with zeros to `padded` bytes;
    /// returns the staging address, or `None` when it does not fit.
    pub fn stage(&mut self, data: &[u8], padded: usize) -> Option<*const u8> {
        let need = round_up(padded.max(data.len()).max(1), 64);
        let s = &mut self.staging;
        s.want += need;
        s.hwm = s.hwm.max(s.want);
        if s.off + need > s.cap || s.base.is_null() {
            return None;
        }
        // SAFETY: [off, off + need) lies inside the pinned allocation, which no
        // queued copy reads (staging is reset only after the stream drained).
        unsafe {
            let dst = s.base.add(s.off);
            std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len());
            std::ptr::write_bytes(dst.add(data.len()), 0, need - data.len());
            s.off += need;
            Some(dst as *const u8)
        }
    }

    /// Whether the next step must grow the arena or staging.
    pub fn needs_grow(&self) -> bool {
        self.arena.hwm > self.arena.cap || self.staging.hwm > self.staging.cap
    }

    /// Starts a step: resets the arena and staging, growing them to the largest
    /// step seen. Returns whether they moved (captured graphs are then stale).
    /// The caller has drained the stream when staging may still be read or
    /// [`Memory::needs_grow`] holds, and checked that no step buffer is alive.
    pub fn begin_step(&mut self, drv: &dyn Driver) -> Result<bool> {
        let mut moved = false;
        if self.arena.hwm > self.arena.cap {
            let cap = round_up(self.arena.hwm + self.arena.hwm / 2, 2 << 20);
            if self.arena.base != 0 {
                // SAFETY: no live step buffer (checked by the caller) and the stream drained.
                unsafe { drv.free(self.arena.base) };
                self.arena.base = 0;
                self.arena.cap = 0;
            }
            let base = drv.malloc(cap).ok_or_else(|| {
                CoreError::OutOfMemory(format!("the graph step arena of {cap} bytes"))
            })?;
            self.arena.base = base;
            self.arena.cap = cap;
            moved = true;
        }
        if self.staging.hwm > self.staging.cap {
            let cap = round_up(self.staging.hwm + self.staging.hwm / 2, 1 << 20);
            self.free_staging(drv);
            self.staging.base = drv.malloc_host(cap)?;
            self.staging.cap = cap;
            moved = true;
        }
        self.arena.off = 0;
        self.arena.want = 0;
        self.arena.epoch += 1;
        self.staging.off = 0;
        self.staging.want = 0;
        Ok(moved)
    }

    fn free_staging(&mut self, drv: &dyn Driver) {
        if !self.staging.base.is_null() {
            // SAFETY: allocated by malloc_host; the stream has drained.
            unsafe { drv.free_host(self.staging.base) };
            self.staging.base = std::ptr::null_mut();
            self.staging.cap = 0;
        }
    }

    /// Frees everything (the device is being dropped; the stream has drained).
    pub fn teardown(&mut self, drv: &dyn Driver) {
        for b in self.slots.iter_mut().filter_map(Option::take) {
            if let Kind::Pool(_) = b.kind {
                // SAFETY: the backend is dropped, so no buffer outlives this.
                unsafe { drv.free(b.ptr) };
            }
        }
        self.trim(drv);
        if self.arena.base != 0 {
            // SAFETY: as above.
            unsafe { drv.free(self.arena.base) };
            self.arena.base = 0;
        }
        self.free_staging(drv);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes() {
        assert_eq!(size_class(0), 512);
        assert_eq!(size_class(513), 1024);
        assert_eq!(size_class((1 << 20) + 1), 2 << 20);
        assert_eq!(size_class(200 << 20), 224 << 20);
    }

    #[test]
    fn staging_pads_with_zeros() {
        let mut host = vec![0xAAu8; 256];
        let mut m = Memory::default();
        m.staging.base = host.as_mut_ptr();
        m.staging.cap = host.len();
        let a = m.stage(&[1, 2, 3], 8).unwrap();
        let b = m.stage(&[9], 1).unwrap();
        assert_eq!(b as usize - a as usize, 64, "64-byte slots");
        assert!(m.stage(&[0; 200], 200).is_none(), "does not fit");
        assert_eq!(m.staging.hwm, 64 + 64 + 256);
        m.staging.base = std::ptr::null_mut();
        assert_eq!(&host[..9], &[1, 2, 3, 0, 0, 0, 0, 0, 0]);
        assert_eq!(host[64], 9);
        assert_eq!(host[65], 0);
    }

    #[test]
    fn arena_tracks_its_high_water_mark_without_memory() {
        let mut m = Memory::default();
        assert!(m.arena_alloc(100).is_none());
        assert!(m.arena_alloc(300).is_none());
        assert_eq!(m.arena.hwm, 256 + 512);
        assert!(m.stage(&[1, 2, 3], 8).is_none());
        assert_eq!(m.staging.hwm, 64);
    }
}
