//! Writes on the driver's copy stream (`Backend::write_async`, which
//! HiCache's load-back calls once per layer): which buffers still wait for
//! a copy, and the pinned staging the copies read.
//!
//! [`Loads::queue`] copies a batch of host data into staging (unless it is
//! pinned memory held unchanged by the caller, which is copied from in
//! place: strided rows, such as a tensor-parallel rank's heads of a host
//! KV page, by one 2-D copy), queues its copies on the copy stream after the main stream's
//! queued work, and files
//! one fence for the batch under every destination buffer. The first
//! main-stream use of such a buffer (resolving its address in
//! [`Device::ptr`](crate::device::Device)) makes the main stream wait for that
//! fence alone, so a forward's layer `l` waits for layer `l`'s copies while
//! later layers still copy. A buffer's later batch replaces its fence (a
//! later point of the same stream covers the earlier one).
//!
//! Invariants: staging is rewritten only after every fence was waited for
//! on the main stream and the main stream drained ([`Loads::settle`], then
//! the driver's sync, then [`Loads::drained`]), so no copy in flight reads
//! rewritten bytes; a batch that does not fit while copies are in flight is
//! written on the main stream instead (correct, not overlapped), and staging
//! grows to the largest run seen at the next drained point.

#![allow(unsafe_code)]

use crate::driver::{Driver, Fence};
use arbor_engine_core::{HostRows, Result};
use std::collections::HashMap;
use std::sync::Arc;

/// Staging grows in steps of this many bytes.
const STAGING_GRAIN: usize = 1 << 20;

/// Staging is at least this large, so that the first load-back of a run of
/// layers already overlaps (a batch that does not fit while copies are in
/// flight goes on the main stream).
const STAGING_MIN: usize = 32 << 20;

fn round_up(x: usize, a: usize) -> usize {
    x.div_ceil(a) * a
}

/// One destination of a batch: its buffer's slot, its address and its
/// bytes (host rows, written one after another).
pub(crate) struct LoadWrite<'a> {
    pub slot: u64,
    pub dst: u64,
    pub data: HostRows<'a>,
    /// `data` is pinned memory of this device held unchanged until the next
    /// drained point: copied from in place (strided rows by one 2-D copy),
    /// not staged.
    pub in_place: bool,
}

/// The copy stream's pending writes and their staging (see the module doc).
pub(crate) struct Loads {
    /// Per buffer slot, the fence the main stream must wait for before touching it.
    pending: HashMap<u64, Arc<dyn Fence>>,
    staging: *mut u8,
    cap: usize,
    off: usize,
    /// Bytes asked for since staging was last reset.
    want: usize,
    /// The most bytes asked for between two resets (staging's next size).
    hwm: usize,
    /// Copies queued since the last drained point may still read staging.
    in_flight: bool,
    /// Pinned memory could not be had: every batch goes on the main stream.
    no_pinned: bool,
    /// What was queued, and how.
    pub stats: LoadStats,
}

/// Counters of asynchronous writes, for tests and benchmarks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoadStats {
    /// Batches queued on the copy stream.
    pub batches: u64,
    /// Bytes they copied.
    pub bytes: u64,
    /// Times the main stream waited for a fence.
    pub waits: u64,
    /// Batches written on the main stream (no room in staging while copies ran).
    pub fallbacks: u64,
    /// Bytes copied in place from pinned host pages (the rest went through staging).
    pub in_place_bytes: u64,
}

// SAFETY: the staging pointer is pinned host memory owned by this struct,
// touched only under the device's lock of it.
unsafe impl Send for Loads {}

impl Default for Loads {
    fn default() -> Self {
        Self {
            pending: HashMap::new(),
            staging: std::ptr::null_mut(),
            cap: 0,
            off: 0,
            want: 0,
            hwm: 0,
            in_flight: false,
            no_pinned: false,
            stats: LoadStats::default(),
        }
    }
}

impl Loads {
    /// Whether some buffer still waits for a copy.
    pub fn any_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Makes the main stream wait for `slot`'s copies, if it has any pending.
    pub fn await_buffer(&mut self, slot: u64) -> Result<()> {
        if let Some(f) = self.pending.remove(&slot) {
            self.stats.waits += 1;
            f.main_waits()?;
        }
        Ok(())
    }

    /// Makes the main stream wait for every pending copy.
    pub fn settle(&mut self) -> Result<()> {
        for (_, f) in self.pending.drain() {
            self.stats.waits += 1;
            f.main_waits()?;
        }
        Ok(())
    }

    /// After [`Loads::settle`] and a sync of the main stream: no copy reads
    /// staging any more.
    pub fn drained(&mut self, drv: &dyn Driver) {
        if self.pending.is_empty() {
            self.in_flight = false;
            self.off = 0;
            self.want = 0;
            if self.hwm > self.cap {
                self.free_staging(drv);
            }
        }
    }

    /// Queues `writes` on the copy stream as one batch under one fence.
    /// Returns false, having queued nothing, when staging has no room while
    /// earlier copies may still read it (the caller writes on the main stream).
    pub fn queue(&mut self, drv: &dyn Driver, writes: &[LoadWrite<'_>]) -> Result<bool> {
        let need: usize = writes
            .iter()
            .filter(|w| !w.in_place)
            .map(|w| round_up(w.data.len(), 64))
            .sum();
        if writes.iter().all(|w| w.data.is_empty()) {
            return Ok(true);
        }
        self.want += need;
        self.hwm = self.hwm.max(self.want);
        if need > 0 && self.off + need > self.cap {
            if self.in_flight || self.no_pinned {
                self.stats.fallbacks += 1;
                return Ok(false);
            }
            self.free_staging(drv);
            let cap = round_up((self.hwm * 3 / 2).max(STAGING_MIN), STAGING_GRAIN);
            match drv.malloc_host(cap) {
                Ok(p) if !p.is_null() => {
                    self.staging = p;
                    self.cap = cap;
                    self.off = 0;
                }
                _ => {
                    tracing::warn!(
                        "no {cap} bytes of pinned memory for KV loads; they run on the main stream"
                    );
                    self.no_pinned = true;
                    self.stats.fallbacks += 1;
                    return Ok(false);
                }
            }
        }
        drv.copies_after_main()?;
        self.in_flight = true;
        for w in writes {
            if w.data.is_empty() {
                continue;
            }
            if w.in_place {
                self.stats.in_place_bytes += w.data.len() as u64;
                let (row, pitch) = w.data.row_and_pitch();
                // SAFETY: `dst` was resolved from a live buffer covering the
                // bytes; the rows are pinned memory the caller holds
                // unchanged until the drained point; main-stream work on the
                // buffer waits for the fence below.
                unsafe {
                    match w.data.contiguous() {
                        Some(d) => drv.htod_on_copy_stream(w.dst, d.as_ptr(), d.len())?,
                        None => drv.htod_rows_on_copy_stream(
                            w.dst,
                            w.data.span().as_ptr(),
                            row,
                            pitch,
                            w.data.len() / row,
                        )?,
                    }
                }
                continue;
            }
            // SAFETY: [off, off + len) lies inside the pinned allocation
            // (checked above), which no queued copy reads (staging is reset
            // only at a drained point); the rows are packed one after another.
            let p = unsafe {
                let p = self.staging.add(self.off);
                let mut at = p;
                for r in w.data.rows() {
                    std::ptr::copy_nonoverlapping(r.as_ptr(), at, r.len());
                    at = at.add(r.len());
                }
                p as *const u8
            };
            self.off += round_up(w.data.len(), 64);
            // SAFETY: as above; `p` is pinned staging until the drained point.
            unsafe { drv.htod_on_copy_stream(w.dst, p, w.data.len())? };
        }
        let fence: Arc<dyn Fence> = Arc::from(drv.copy_fence()?);
        for w in writes {
            self.pending.insert(w.slot, fence.clone());
        }
        self.stats.batches += 1;
        self.stats.bytes += writes.iter().map(|w| w.data.len() as u64).sum::<u64>();
        Ok(true)
    }

    fn free_staging(&mut self, drv: &dyn Driver) {
        if !self.staging.is_null() {
            // SAFETY: allocated by malloc_host; no copy is in flight (checked
            // by the callers: `queue` only when none is, teardown after a drain).
            unsafe { drv.free_host(self.staging) };
            self.staging = std::ptr::null_mut();
            self.cap = 0;
            self.off = 0;
        }
    }

    /// Frees staging (the device is being dropped; everything drained).
    pub fn teardown(&mut self, drv: &dyn Driver) {
        self.pending.clear();
        self.free_staging(drv);
    }
}
