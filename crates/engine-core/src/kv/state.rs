//! Recurrent state slots: what a Gated DeltaNet (linear attention) layer
//! keeps per sequence instead of KV pages, as cache state.
//!
//! A hybrid model (Qwen3.5, Qwen3-Next) declares a [`StateSpec`]: its
//! recurrent layers each keep, per sequence, a convolution state (the last
//! `conv_kernel - 1` inputs of the causal depthwise convolution, channel
//! major) and a recurrent state (`[v_heads, k_dim, v_dim]` f32). The
//! [`StateCache`] holds both for a fixed number of slots on the device;
//! [`StatePool`] hands slots out, and a [`StateSlot`] returns its slot when
//! dropped, so a slot is owned by one sequence at a time and never leaks.
//! The recurrence itself (the kernel interface, the reference kernel and
//! the host defaults) is the device's: `crate::backend::recurrent`,
//! re-exported here.

use crate::backend::Backend;
pub use crate::backend::recurrent::{
    GatedDeltaNet, GatedDeltaWeights, GroupInputs, GroupRanges, GroupState, StateLayer, StateSeq,
    StateSpec, gated_delta_group, gated_delta_net_on_host, group_ranges, group_state,
    sigmoid_mul_on_host, sigmoid_times,
};
use crate::dtype::DType;
use crate::error::{CoreError, Result};
use std::fmt;
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};

/// The device storage of every slot's state.
#[derive(Debug)]
pub struct StateCache {
    spec: StateSpec,
    slots: usize,
    layers: Vec<StateLayer>,
}

impl StateCache {
    /// Allocates `slots` slots of `spec` on `backend` (zeroed).
    pub fn allocate(backend: &dyn Backend, spec: StateSpec, slots: usize) -> Result<Self> {
        spec.validate()?;
        if slots == 0 {
            return Err(CoreError::Config(
                "a model with recurrent layers needs at least one state slot \
                 (--max-mamba-cache-size)"
                    .into(),
            ));
        }
        let layers = (0..spec.layers)
            .map(|_| {
                Ok(StateLayer {
                    conv: backend.alloc(DType::F32, &[slots, spec.conv_len()])?,
                    recurrent: backend.alloc(DType::F32, &[slots, spec.recurrent_len()])?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            spec,
            slots,
            layers,
        })
    }
    /// The state's shape.
    pub fn spec(&self) -> &StateSpec {
        &self.spec
    }
    /// Slots held.
    pub fn slots(&self) -> usize {
        self.slots
    }
    /// Copies slot `from`'s state of every layer into slot `to` (restoring
    /// a snapshot into a sequence's slot).
    pub fn copy_slot(&self, backend: &dyn Backend, from: u32, to: u32) -> Result<()> {
        let (f, t) = (from as usize, to as usize);
        if f >= self.slots || t >= self.slots || f == t {
            return Err(CoreError::invalid(format!(
                "state copy from slot {from} to {to} of {}",
                self.slots
            )));
        }
        for l in &self.layers {
            backend.copy(&l.conv.narrow(f, 1)?, &l.conv.narrow(t, 1)?)?;
            backend.copy(&l.recurrent.narrow(f, 1)?, &l.recurrent.narrow(t, 1)?)?;
        }
        Ok(())
    }

    /// State of recurrent layer `i` (counted among the recurrent layers).
    pub fn layer(&self, i: usize) -> Result<&StateLayer> {
        self.layers
            .get(i)
            .ok_or_else(|| CoreError::invalid(format!("recurrent state layer {i} out of range")))
    }
}

struct SlotState {
    free: Vec<u32>,
    total: usize,
}

/// Hands out state slots. Cloning shares the same pool.
#[derive(Clone)]
pub struct StatePool {
    state: Arc<Mutex<SlotState>>,
}

impl fmt::Debug for StatePool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "StatePool(free {}/{})",
            self.free_slots(),
            self.total_slots()
        )
    }
}

impl StatePool {
    /// A pool of `slots` slots.
    pub fn new(slots: usize) -> Self {
        Self::over(0..slots)
    }

    /// A pool of the slots `range` of a cache (running requests' slots and
    /// snapshots' slots are two pools over one cache).
    pub fn over(range: Range<usize>) -> Self {
        Self {
            state: Arc::new(Mutex::new(SlotState {
                total: range.len(),
                free: range.rev().map(|s| s as u32).collect(),
            })),
        }
    }
    fn lock(&self) -> MutexGuard<'_, SlotState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
    /// Slots in the pool.
    pub fn total_slots(&self) -> usize {
        self.lock().total
    }
    /// Slots not held.
    pub fn free_slots(&self) -> usize {
        self.lock().free.len()
    }
    /// Slots held.
    pub fn used_slots(&self) -> usize {
        let s = self.lock();
        s.total - s.free.len()
    }
    /// Takes a slot, or an out-of-memory error when none is free.
    pub fn alloc(&self) -> Result<StateSlot> {
        let slot =
            self.lock().free.pop().ok_or_else(|| {
                CoreError::OutOfMemory("every recurrent state slot is in use".into())
            })?;
        Ok(StateSlot {
            slot,
            pool: self.clone(),
        })
    }
}

/// One sequence's state slot; returned to its pool on drop.
pub struct StateSlot {
    slot: u32,
    pool: StatePool,
}

impl fmt::Debug for StateSlot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "StateSlot({})", self.slot)
    }
}

impl StateSlot {
    /// The slot's index in the [`StateCache`].
    pub fn index(&self) -> u32 {
        self.slot
    }
}

impl Drop for StateSlot {
    fn drop(&mut self) {
        let mut s = self.pool.lock();
        s.free.push(self.slot);
        debug_assert!(s.free.len() <= s.total, "state slot freed twice");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_return_on_drop() {
        let pool = StatePool::new(2);
        let a = pool.alloc().unwrap();
        let b = pool.alloc().unwrap();
        assert_ne!(a.index(), b.index());
        assert!(pool.alloc().is_err());
        drop(a);
        assert_eq!(pool.free_slots(), 1);
        drop(b);
        assert_eq!(pool.used_slots(), 0);
    }
}
