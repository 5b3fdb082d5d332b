//! NCCL between CUDA devices: a group of ranks on distinct devices of this
//! process ([`NcclGroup`]), each rank's [`Communicator`] ([`NcclComm`])
//! queuing the collectives on its backend's stream, and [`open_group`], the
//! registry's `cuda` device group that `--tp-size` uses. The library is
//! loaded at run time ([`library`]).
//!
//! Invariants:
//! - One rank per device: NCCL refuses two ranks on one device, so
//!   [`open_group`] puts ranks that share a device (`--gpu-id-step 0`) in
//!   the host-staged `LocalGroup` instead.
//! - A collective is queued on the rank's one stream after everything queued
//!   before it (`GpuBackend::enqueue_native`), so its inputs and outputs are
//!   ordered with the other kernels without host synchronization; a decode
//!   step being recorded ends there and runs without a CUDA graph.
//! - Sums equal the host-staged group's bit for bit, whatever the batch:
//!   two ranks go through NCCL's sum (one f32 addition, which commutes
//!   exactly); with more ranks NCCL would add in an order that follows its
//!   algorithm and the message size (a row's sum would then depend on the
//!   rest of the batch), so the contributions are gathered and added on the
//!   device in rank order, as `LocalGroup` does.
//! - [`Communicator::abort`] aborts every rank's NCCL communicator (kernels
//!   waiting for a peer that failed return) and fails later collectives;
//!   [`Communicator::reset`] creates the group's communicators again, all
//!   ranks at once (`ncclCommInitAll`). A rank holds its communicator (a
//!   read lock) only while it queues work, so an abort waits for nothing
//!   but a queuing call in progress.

#![allow(unsafe_code)]

mod library;

pub use library::{MIN_VERSION, Nccl, library};

use arbor_backend_gpu::GpuBackend;
use arbor_engine_core::comm::{Communicator, DeviceGroup, all_to_all_width};
use arbor_engine_core::{Backend, BackendOptions, CoreError, DType, HostTensor, Result, Tensor};
use cudarc::nccl::sys;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};

/// No device appears twice (NCCL takes one rank per device).
fn all_distinct(devices: &[usize]) -> bool {
    let mut seen = devices.to_vec();
    seen.sort_unstable();
    seen.dedup();
    seen.len() == devices.len()
}

const F32: sys::ncclDataType_t = sys::ncclDataType_t::ncclFloat32;
const SUM: sys::ncclRedOp_t = sys::ncclRedOp_t::ncclSum;

/// The communicators of one group, by rank (null once aborted).
struct Comms(Vec<sys::ncclComm_t>);

// SAFETY: NCCL communicators may be used from any thread; each rank's is
// used by one thread at a time (its rank's), under the group's lock.
unsafe impl Send for Comms {}
// SAFETY: as above.
unsafe impl Sync for Comms {}

/// NCCL communicators over devices of this process, one rank per device.
pub struct NcclGroup {
    nccl: &'static Nccl,
    devices: Vec<c_int>,
    comms: RwLock<Comms>,
    aborted: AtomicBool,
}

impl NcclGroup {
    /// A group of one rank per device of `devices` (CUDA ordinals, all
    /// different), in that order.
    pub fn new(devices: &[usize]) -> Result<Arc<Self>> {
        let nccl = library().map_err(CoreError::Device)?;
        if devices.is_empty() || !all_distinct(devices) {
            return Err(CoreError::invalid(format!(
                "an NCCL group needs one distinct device per rank, got devices {devices:?}"
            )));
        }
        let devices = devices
            .iter()
            .map(|&d| c_int::try_from(d).map_err(|_| CoreError::invalid("device index")))
            .collect::<Result<Vec<_>>>()?;
        let comms = Self::init(nccl, &devices)?;
        Ok(Arc::new(Self {
            nccl,
            devices,
            comms: RwLock::new(comms),
            aborted: AtomicBool::new(false),
        }))
    }

    fn init(nccl: &Nccl, devices: &[c_int]) -> Result<Comms> {
        let mut comms = vec![std::ptr::null_mut(); devices.len()];
        let n = c_int::try_from(devices.len()).map_err(|_| CoreError::invalid("group size"))?;
        // SAFETY: `comms` has room for one communicator per device.
        let rc = unsafe { (nccl.comm_init_all)(comms.as_mut_ptr(), n, devices.as_ptr()) };
        nccl.check(rc, &format!("ncclCommInitAll over devices {devices:?}"))?;
        Ok(Comms(comms))
    }

    /// Ranks in the group.
    pub fn world_size(&self) -> usize {
        self.devices.len()
    }

    /// One communicator per rank, rank `i` queuing on `backends[i]`'s stream
    /// (opened on device `devices[i]`).
    pub fn ranks(self: &Arc<Self>, backends: &[GpuBackend]) -> Result<Vec<Arc<NcclComm>>> {
        if backends.len() != self.devices.len() {
            return Err(CoreError::invalid(format!(
                "{} backends for an NCCL group of {} ranks",
                backends.len(),
                self.devices.len()
            )));
        }
        Ok(backends
            .iter()
            .enumerate()
            .map(|(rank, b)| {
                Arc::new(NcclComm {
                    group: self.clone(),
                    rank,
                    backend: b.clone(),
                })
            })
            .collect())
    }

    fn aborted() -> CoreError {
        CoreError::Internal("a collective was aborted: another rank of the group failed".into())
    }
}

impl Drop for NcclGroup {
    fn drop(&mut self) {
        let comms = self.comms.get_mut().unwrap_or_else(|e| e.into_inner());
        for c in comms.0.drain(..).filter(|c| !c.is_null()) {
            // SAFETY: a live communicator, destroyed once; errors at teardown
            // are ignored.
            unsafe { (self.nccl.comm_destroy)(c) };
        }
    }
}

/// One rank of an [`NcclGroup`].
pub struct NcclComm {
    group: Arc<NcclGroup>,
    rank: usize,
    backend: GpuBackend,
}

/// A device address as NCCL's buffer argument.
fn buf(p: u64) -> *mut c_void {
    p as usize as *mut c_void
}

fn stream(s: u64) -> sys::cudaStream_t {
    s as usize as sys::cudaStream_t
}

impl NcclComm {
    /// Queues NCCL work on this rank's stream: `queue` gets the library, this
    /// rank's communicator, the device addresses of `tensors` and the stream.
    fn enqueue(
        &self,
        tensors: &[&Tensor],
        queue: impl FnOnce(&Nccl, sys::ncclComm_t, &[u64], sys::cudaStream_t) -> Result<()>,
    ) -> Result<()> {
        for t in tensors {
            if t.dtype() != DType::F32 {
                return Err(CoreError::invalid(format!(
                    "collective on a {} tensor (f32 only)",
                    t.dtype()
                )));
            }
        }
        let comms = self.group.comms.read().map_err(|_| NcclGroup::aborted())?;
        let comm = comms.0[self.rank];
        if self.group.aborted.load(Ordering::Acquire) || comm.is_null() {
            return Err(NcclGroup::aborted());
        }
        self.backend.enqueue_native(tensors, |ptrs, s| {
            queue(self.group.nccl, comm, ptrs, stream(s))
        })
    }

    /// `out` (`[world * n]` elements) = every rank's `x` (`n` elements), by rank.
    fn gather_raw(&self, x: &Tensor, out: &Tensor) -> Result<()> {
        if out.numel() != x.numel() * self.world_size() {
            return Err(CoreError::invalid(format!(
                "all_gather of {x:?} from {} ranks into {out:?}",
                self.world_size()
            )));
        }
        let n = x.numel();
        self.enqueue(&[x, out], |nccl, comm, p, s| {
            // SAFETY: `x` covers `n` f32 and `out` `world * n`, both live
            // device buffers of this rank's device, used in stream order.
            let rc = unsafe { (nccl.all_gather)(buf(p[0]), buf(p[1]), n, F32, comm, s) };
            nccl.check(rc, "ncclAllGather")
        })
    }

    /// `[world, n]`: every rank's `x` gathered on this rank's device.
    fn gathered(&self, x: &Tensor) -> Result<Tensor> {
        let g = self
            .backend
            .alloc(DType::F32, &[self.world_size(), x.numel()])?;
        self.gather_raw(x, &g)?;
        Ok(g)
    }

    /// `out = Σ_s rows[s]` in rank order, where `rows(s)` is rank `s`'s
    /// contribution (a view of a gathered tensor shaped like `out`).
    fn ordered_sum(&self, out: &Tensor, rows: impl Fn(usize) -> Result<Tensor>) -> Result<()> {
        self.backend.copy(&rows(0)?, out)?;
        for s in 1..self.world_size() {
            self.backend.add_assign(out, &rows(s)?)?;
        }
        Ok(())
    }

    fn check_peer(&self, r: usize) -> Result<c_int> {
        if r >= self.world_size() || r == self.rank {
            return Err(CoreError::invalid(format!(
                "rank {} cannot exchange with rank {r} in a group of {}",
                self.rank,
                self.world_size()
            )));
        }
        c_int::try_from(r).map_err(|_| CoreError::invalid("rank"))
    }

    /// The row counts every rank sends to every rank, and the widths:
    /// `table[s][j]` rows from `s` to `j`, `table[s][world]` the width.
    fn exchange_counts(&self, blocks: &[Tensor]) -> Result<Vec<Vec<usize>>> {
        let w = self.world_size();
        let mut mine: Vec<f32> = blocks.iter().map(|b| b.rows() as f32).collect();
        mine.push(blocks[0].row_len() as f32);
        let t = self
            .backend
            .upload(&HostTensor::from_f32(&[1, w + 1], &mine))?;
        let host: &dyn Backend = &self.backend;
        let all = host.download_f32(&self.gathered(&t)?)?;
        Ok(all
            .chunks(w + 1)
            .map(|r| r.iter().map(|&v| v as usize).collect())
            .collect())
    }
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.group.world_size()
    }

    fn all_reduce(&self, t: &Tensor) -> Result<()> {
        let n = t.numel();
        if self.world_size() != 2 {
            let g = self.gathered(t)?;
            return self.ordered_sum(&t.reshape(&[1, n])?, |s| g.narrow(s, 1));
        }
        self.enqueue(&[t], |nccl, comm, p, s| {
            // SAFETY: in place over `n` f32 of a live buffer, in stream order.
            let rc = unsafe { (nccl.all_reduce)(buf(p[0]), buf(p[0]), n, F32, SUM, comm, s) };
            nccl.check(rc, "ncclAllReduce")
        })
    }

    fn all_gather(&self, x: &Tensor, out: &Tensor) -> Result<()> {
        let (m, n, w) = (x.rows(), x.row_len(), self.world_size());
        if out.rows() != m || out.row_len() != n * w {
            return Err(CoreError::invalid(format!(
                "all_gather of {x:?} from {w} ranks into {out:?}"
            )));
        }
        if m == 1 {
            return self.gather_raw(x, out);
        }
        // NCCL lays the ranks' blocks one after the other; row i of `out`
        // is row i of every rank's block, side by side: a permutation of
        // rows of width n (`out` row i*w + r = gathered row r*m + i).
        let g = self.backend.alloc(DType::F32, &[w * m, n])?;
        self.gather_raw(x, &g)?;
        let order: Vec<u32> = (0..m)
            .flat_map(|i| (0..w).map(move |r| (r * m + i) as u32))
            .collect();
        let host: &dyn Backend = &self.backend;
        let order = host.upload_u32(&[m * w], &order)?;
        self.backend
            .gather_rows(&g, &order, &out.reshape(&[m * w, n])?)
    }

    fn reduce_scatter(&self, x: &Tensor, out: &Tensor) -> Result<()> {
        let (m, n, w) = (x.rows(), x.row_len(), self.world_size());
        if !m.is_multiple_of(w) || out.rows() != m / w || out.row_len() != n {
            return Err(CoreError::invalid(format!(
                "reduce_scatter of {x:?} over {w} ranks into {out:?}"
            )));
        }
        if w != 2 {
            let per = m / w;
            let g = self.backend.alloc(DType::F32, &[w * m, n])?;
            self.gather_raw(x, &g)?;
            return self.ordered_sum(out, |s| g.narrow(s * m + self.rank * per, per));
        }
        let count = out.numel();
        self.enqueue(&[x, out], |nccl, comm, p, s| {
            // SAFETY: `x` covers `world * count` f32 and `out` `count`, live
            // buffers used in stream order.
            let rc =
                unsafe { (nccl.reduce_scatter)(buf(p[0]), buf(p[1]), count, F32, SUM, comm, s) };
            nccl.check(rc, "ncclReduceScatter")
        })
    }

    fn all_to_all(&self, blocks: &[Tensor]) -> Result<Vec<Tensor>> {
        let w = self.world_size();
        let d = all_to_all_width(blocks, w)?;
        let table = self.exchange_counts(blocks)?;
        if table.iter().any(|r| r[w] != d) {
            return Err(CoreError::invalid("all_to_all blocks of different widths"));
        }
        let got = (0..w)
            .map(|s| self.backend.alloc(DType::F32, &[table[s][self.rank], d]))
            .collect::<Result<Vec<_>>>()?;
        if blocks[self.rank].rows() > 0 {
            self.backend.copy(&blocks[self.rank], &got[self.rank])?;
        }
        let peers: Vec<usize> = (0..w).filter(|&j| j != self.rank).collect();
        let tensors: Vec<&Tensor> = blocks.iter().chain(&got).collect();
        self.enqueue(&tensors, |nccl, comm, p, s| {
            // SAFETY: grouped sends and receives of whole live buffers (`got`
            // sized from the peers' counts), queued in stream order; the group
            // is closed on every path.
            unsafe {
                nccl.check((nccl.group_start)(), "ncclGroupStart")?;
                let mut out = Ok(());
                for &j in &peers {
                    let peer = j as c_int;
                    let (send, recv) = (blocks[j].numel(), got[j].numel());
                    if out.is_ok() && send > 0 {
                        out = nccl
                            .check((nccl.send)(buf(p[j]), send, F32, peer, comm, s), "ncclSend");
                    }
                    if out.is_ok() && recv > 0 {
                        out = nccl.check(
                            (nccl.recv)(buf(p[w + j]), recv, F32, peer, comm, s),
                            "ncclRecv",
                        );
                    }
                }
                let end = nccl.check((nccl.group_end)(), "ncclGroupEnd");
                out.and(end)
            }
        })?;
        Ok(got)
    }

    fn send(&self, x: &Tensor, to: usize) -> Result<()> {
        let peer = self.check_peer(to)?;
        let n = x.numel();
        self.enqueue(&[x], |nccl, comm, p, s| {
            // SAFETY: `n` f32 of a live buffer, in stream order.
            let rc = unsafe { (nccl.send)(buf(p[0]), n, F32, peer, comm, s) };
            nccl.check(rc, "ncclSend")
        })
    }

    fn recv(&self, out: &Tensor, from: usize) -> Result<()> {
        let peer = self.check_peer(from)?;
        let n = out.numel();
        self.enqueue(&[out], |nccl, comm, p, s| {
            // SAFETY: `n` f32 of a live buffer, in stream order.
            let rc = unsafe { (nccl.recv)(buf(p[0]), n, F32, peer, comm, s) };
            nccl.check(rc, "ncclRecv")
        })
    }

    fn barrier(&self) -> Result<()> {
        let t = self.backend.alloc(DType::F32, &[1])?;
        self.enqueue(&[&t], |nccl, comm, p, s| {
            // SAFETY: one f32 of a live buffer, in stream order.
            let rc = unsafe { (nccl.all_reduce)(buf(p[0]), buf(p[0]), 1, F32, SUM, comm, s) };
            nccl.check(rc, "ncclAllReduce")
        })?;
        self.backend.synchronize()
    }

    fn abort(&self) {
        self.group.aborted.store(true, Ordering::Release);
        let mut comms = self.group.comms.write().unwrap_or_else(|e| e.into_inner());
        for c in comms.0.iter_mut().filter(|c| !c.is_null()) {
            // SAFETY: a live communicator, aborted once (then forgotten);
            // no rank is queuing on it (the write lock).
            unsafe { (self.group.nccl.comm_abort)(*c) };
            *c = std::ptr::null_mut();
        }
    }

    fn reset(&self) -> Result<()> {
        let mut comms = self.group.comms.write().unwrap_or_else(|e| e.into_inner());
        if !self.group.aborted.load(Ordering::Acquire) {
            return Ok(());
        }
        *comms = NcclGroup::init(self.group.nccl, &self.group.devices)?;
        self.group.aborted.store(false, Ordering::Release);
        Ok(())
    }
}

/// The `cuda` device group: one backend per options (`device_index` each),
/// meeting in an [`NcclGroup`]; ranks that share a device meet in the
/// host-staged `LocalGroup` instead (NCCL takes one rank per device).
pub fn open_group(options: &[BackendOptions]) -> Result<DeviceGroup> {
    let backends = options
        .iter()
        .map(crate::open)
        .collect::<Result<Vec<_>>>()?;
    let shared: Vec<Arc<dyn Backend>> = backends
        .iter()
        .map(|b| Arc::new(b.clone()) as Arc<dyn Backend>)
        .collect();
    let devices: Vec<usize> = options.iter().map(|o| o.device_index).collect();
    if !all_distinct(&devices) {
        tracing::info!(
            "tensor-parallel ranks on CUDA devices {devices:?} share a device: their \
             collectives go through host memory (NCCL takes one rank per device)"
        );
        return DeviceGroup::local(shared);
    }
    let group = NcclGroup::new(&devices)?;
    let comms = group
        .ranks(&backends)?
        .into_iter()
        .map(|c| c as Arc<dyn Communicator>)
        .collect();
    Ok(DeviceGroup {
        backends: shared,
        comms,
    })
}
