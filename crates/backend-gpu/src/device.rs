//! One GPU device as the shared backend sees it: its [`Driver`], its tag,
//! how decode steps use graphs, and the locked state (memory, the recorded
//! step, captured graphs).
//!
//! Invariants: every operation binds the driver's context to the calling
//! thread before any other driver call ([`Device::lock`]); all work goes to
//! the driver's one stream, in call order (deferred steps keep that order, see
//! [`crate::exec`]), except the writes of `write_async` on the copy stream,
//! which main-stream work on their buffers waits for ([`crate::loads`]: the
//! wait is queued when the buffer's address is resolved, before the work
//! that uses it; a sync waits for them all; a buffer is released to the
//! pool only after the main stream waited for its copies); the loads lock is
//! taken only under the state lock; the state lock is never held while a tensor is dropped,
//! because buffer releases only push ids onto `releases`, which the next
//! locked operation drains.

use crate::driver::{DeviceProps, Driver};
use crate::exec::State;
use crate::loads::Loads;
use arbor_engine_core::{BufferId, BufferOwner, Result};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};

/// How decode steps use graphs.
#[derive(Clone, Debug)]
pub(crate) struct GraphConfig {
    pub enabled: bool,
    /// Bucket sizes, ascending; a decode batch runs padded to the first one that fits.
    pub buckets: Vec<usize>,
}

impl GraphConfig {
    pub fn new(enabled: bool, max_bs: usize) -> Self {
        let max_bs = max_bs.max(1);
        let mut buckets = vec![1, 2, 4, 8];
        let mut b = 16;
        while b < max_bs {
            buckets.push(b);
            b += 8;
        }
        buckets.retain(|&x| x < max_bs);
        buckets.push(max_bs);
        Self { enabled, buckets }
    }
    /// The bucket a decode batch of `n` sequences runs in, if any.
    pub fn bucket(&self, n: usize) -> Option<usize> {
        if !self.enabled || n == 0 {
            return None;
        }
        self.buckets.iter().copied().find(|&b| b >= n)
    }
}

/// A device with its driver and state.
pub(crate) struct Device {
    pub tag: u32,
    pub graphs: GraphConfig,
    pub drv: Box<dyn Driver>,
    state: Mutex<State>,
    releases: Mutex<Vec<BufferId>>,
    /// Writes on the copy stream (taken under the state lock only).
    loads: Mutex<Loads>,
    /// Some buffer waits for a copy (so resolving addresses must check).
    loads_pending: AtomicBool,
    /// The pinned host chunks of [`crate::pinned`]: (start, bytes).
    pinned: Mutex<Vec<(usize, usize)>>,
}

/// Largest dynamic shared memory the prefill kernels request (see attention.rs).
pub(crate) const PREFILL_SMEM_MAX: u32 = 120 * 1024;

impl Device {
    pub fn new(tag: u32, drv: Box<dyn Driver>, graphs: GraphConfig) -> Self {
        Self {
            tag,
            graphs,
            drv,
            state: Mutex::new(State::default()),
            releases: Mutex::new(Vec::new()),
            loads: Mutex::new(Loads::default()),
            loads_pending: AtomicBool::new(false),
            pinned: Mutex::new(Vec::new()),
        }
    }

    /// Records (or, `false`, forgets) a chunk of pinned host memory.
    pub fn note_pinned(&self, start: *const u8, bytes: usize, live: bool) {
        let mut p = self.pinned.lock().unwrap_or_else(|e| e.into_inner());
        let chunk = (start as usize, bytes);
        if live {
            p.push(chunk);
        } else {
            p.retain(|c| *c != chunk);
        }
    }

    /// Whether `data` lies in one chunk of this device's pinned host memory.
    pub fn is_pinned(&self, data: &[u8]) -> bool {
        let (a, n) = (data.as_ptr() as usize, data.len());
        let p = self.pinned.lock().unwrap_or_else(|e| e.into_inner());
        p.iter().any(|&(s, len)| a >= s && a + n <= s + len)
    }

    /// The copy stream's writes (lock only while holding the state lock).
    pub fn loads(&self) -> MutexGuard<'_, Loads> {
        self.loads.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records whether `loads` still has pending copies.
    pub fn note_loads(&self, loads: &Loads) {
        self.loads_pending
            .store(loads.any_pending(), Ordering::Release);
    }

    /// Makes the main stream wait for the copies into buffer `slot`, if any
    /// are pending (call under the state lock, before queuing work on it).
    pub fn await_load(&self, slot: u64) -> Result<()> {
        if !self.loads_pending.load(Ordering::Acquire) {
            return Ok(());
        }
        let mut loads = self.loads();
        loads.await_buffer(slot)?;
        self.note_loads(&loads);
        Ok(())
    }

    /// Makes the main stream wait for every pending copy (under the state lock).
    pub fn settle_loads(&self) -> Result<()> {
        if !self.loads_pending.load(Ordering::Acquire) {
            return Ok(());
        }
        let mut loads = self.loads();
        loads.settle()?;
        self.note_loads(&loads);
        Ok(())
    }

    pub fn props(&self) -> &DeviceProps {
        self.drv.props()
    }

    /// Binds the context and locks the state, applying pending buffer releases.
    pub fn lock(&self) -> Result<MutexGuard<'_, State>> {
        self.drv.bind()?;
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let released =
            std::mem::take(&mut *self.releases.lock().unwrap_or_else(|e| e.into_inner()));
        for id in released {
            // The pool hands the block out again in main-stream order.
            self.await_load(id.slot)?;
            st.mem.release(id.slot);
        }
        Ok(st)
    }
}

impl BufferOwner for Device {
    fn release(&self, id: BufferId) {
        if id.device == self.tag {
            self.releases
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(id);
        }
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        if self.drv.bind().is_err() {
            return;
        }
        let loads = self.loads.get_mut().unwrap_or_else(|e| e.into_inner());
        let _ = loads.settle();
        let _ = self.drv.sync();
        loads.teardown(self.drv.as_ref());
        let st = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        st.teardown(self.drv.as_ref());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets() {
        let g = GraphConfig::new(true, 64);
        assert_eq!(g.buckets, vec![1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]);
        assert_eq!(g.bucket(3), Some(4));
        assert_eq!(g.bucket(17), Some(24));
        assert_eq!(g.bucket(64), Some(64));
        assert_eq!(g.bucket(65), None);
        let g = GraphConfig::new(true, 20);
        assert_eq!(g.buckets, vec![1, 2, 4, 8, 16, 20]);
        let g = GraphConfig::new(true, 3);
        assert_eq!(g.buckets, vec![1, 2, 3]);
        assert_eq!(GraphConfig::new(false, 8).bucket(1), None);
    }
}
