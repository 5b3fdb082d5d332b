//! Collective communication between the ranks of a tensor- or
//! expert-parallel group: the [`Communicator`] trait, its in-process
//! implementation ([`LocalGroup`]: ranks are threads of one process, data
//! moves through host memory), and [`DeviceGroup`], a group's backends with
//! their communicators (a backend's own, such as NCCL in `backend-cuda`,
//! comes from the registry's device groups).
//!
//! Invariants:
//! - Every rank calls the same collectives in the same order; a call returns
//!   once every rank has contributed.
//! - Reductions add the ranks' contributions in rank order, so every rank
//!   receives bit-identical results (the ranks then sample the same tokens).
//! - [`Communicator::abort`] fails the collectives other ranks wait in (a
//!   rank that failed mid-step must not leave the others blocked forever);
//!   the group stays failed until [`Communicator::reset`].
//! - Tensors are f32 and row-major; `all_gather` concatenates along the last
//!   dimension (the layout of column-parallel outputs: logits of a
//!   vocab-parallel LM head), `reduce_scatter` splits along rows.

use crate::backend::Backend;
use crate::dtype::DType;
use crate::error::{CoreError, Result};
use crate::tensor::Tensor;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// One rank's end of a communication group.
pub trait Communicator: Send + Sync {
    /// This rank, `0..world_size`.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn world_size(&self) -> usize;
    /// `t = Σ_ranks t`, in place.
    fn all_reduce(&self, t: &Tensor) -> Result<()>;
    /// `out = [x_0 | x_1 | …]`: `x` `[m, n]` from every rank, concatenated
    /// along the last dimension into `out` `[m, n * world]`.
    fn all_gather(&self, x: &Tensor, out: &Tensor) -> Result<()>;
    /// `out` = this rank's block of rows of `Σ_ranks x` (`x` `[m, n]`, `out`
    /// `[m / world, n]`).
    fn reduce_scatter(&self, x: &Tensor, out: &Tensor) -> Result<()>;
    /// Sends `blocks[j]` (`[n_j, d]`) to rank `j` and returns the block every
    /// rank sent to this one, by source rank (the dispatch/combine of expert
    /// parallelism). Row counts may differ between blocks.
    fn all_to_all(&self, blocks: &[Tensor]) -> Result<Vec<Tensor>>;
    /// Sends `x` to rank `to` (received by its matching [`Communicator::recv`]).
    fn send(&self, x: &Tensor, to: usize) -> Result<()>;
    /// Receives into `out` what rank `from` sent.
    fn recv(&self, out: &Tensor, from: usize) -> Result<()>;
    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<()>;
    /// Fails the collectives the other ranks wait in, and later ones.
    fn abort(&self);
    /// Makes the group usable again once no rank is inside a collective.
    fn reset(&self) -> Result<()>;
}

/// The ranks of a tensor-parallel group: rank `i` computes on `backends[i]`
/// and communicates through `comms[i]`.
pub struct DeviceGroup {
    pub backends: Vec<Arc<dyn Backend>>,
    pub comms: Vec<Arc<dyn Communicator>>,
}

impl DeviceGroup {
    /// `backends` meeting in a host-staged [`LocalGroup`].
    pub fn local(backends: Vec<Arc<dyn Backend>>) -> Result<Self> {
        let comms = LocalGroup::new(backends.len())?
            .ranks(&backends)?
            .into_iter()
            .map(|c| c as Arc<dyn Communicator>)
            .collect();
        Ok(Self { backends, comms })
    }
}

/// The common width of `blocks`, one per rank of a group of `world`: the
/// checks of [`Communicator::all_to_all`]'s arguments.
pub fn all_to_all_width(blocks: &[Tensor], world: usize) -> Result<usize> {
    if blocks.len() != world {
        return Err(CoreError::invalid(format!(
            "all_to_all with {} blocks in a group of {world}",
            blocks.len()
        )));
    }
    let d = blocks[0].row_len();
    if blocks.iter().any(|b| b.row_len() != d) {
        return Err(CoreError::invalid("all_to_all blocks of different widths"));
    }
    Ok(d)
}

/// What each rank contributed to one collective: per-destination payloads.
type Payload = Arc<Vec<Vec<f32>>>;

#[derive(Default)]
struct Round {
    /// Contributions of the current round, by rank.
    payloads: Vec<Option<Payload>>,
    arrived: usize,
    /// Set when the round is complete: every contribution, by rank.
    results: Option<Arc<Vec<Payload>>>,
    departed: usize,
    aborted: bool,
    /// Point-to-point messages by (from, to).
    mail: HashMap<(usize, usize), VecDeque<Vec<f32>>>,
}

/// An in-process group of `world` ranks (threads); [`LocalGroup::ranks`]
/// hands out one [`LocalComm`] per rank.
pub struct LocalGroup {
    world: usize,
    state: Mutex<Round>,
    cv: Condvar,
}

impl LocalGroup {
    /// A group of `world` ranks.
    pub fn new(world: usize) -> Result<Arc<Self>> {
        if world == 0 {
            return Err(CoreError::invalid("a communication group of 0 ranks"));
        }
        Ok(Arc::new(Self {
            world,
            state: Mutex::new(Round {
                payloads: vec![None; world],
                ..Round::default()
            }),
            cv: Condvar::new(),
        }))
    }

    /// One communicator per rank, rank `i` moving data with `backends[i]`.
    pub fn ranks(self: &Arc<Self>, backends: &[Arc<dyn Backend>]) -> Result<Vec<Arc<LocalComm>>> {
        if backends.len() != self.world {
            return Err(CoreError::invalid(format!(
                "{} backends for a group of {} ranks",
                backends.len(),
                self.world
            )));
        }
        Ok(backends
            .iter()
            .enumerate()
            .map(|(rank, b)| {
                Arc::new(LocalComm {
                    group: self.clone(),
                    rank,
                    backend: b.clone(),
                })
            })
            .collect())
    }

    fn lock(&self) -> Result<MutexGuard<'_, Round>> {
        self.state
            .lock()
            .map_err(|_| CoreError::Internal("communication group lock poisoned".into()))
    }

    fn aborted() -> CoreError {
        CoreError::Internal("a collective was aborted: another rank of the group failed".into())
    }

    /// Contributes `payload` for `rank` and returns every rank's contribution.
    fn exchange(&self, rank: usize, payload: Vec<Vec<f32>>) -> Result<Arc<Vec<Payload>>> {
        let mut s = self.lock()?;
        // The previous round is still being read by slower ranks.
        while s.results.is_some() && !s.aborted {
            s = self.cv.wait(s).map_err(|_| Self::aborted())?;
        }
        if s.aborted {
            return Err(Self::aborted());
        }
        s.payloads[rank] = Some(Arc::new(payload));
        s.arrived += 1;
        if s.arrived == self.world {
            let all: Vec<Payload> = s.payloads.iter_mut().filter_map(Option::take).collect();
            s.results = Some(Arc::new(all));
            self.cv.notify_all();
        } else {
            while s.results.is_none() && !s.aborted {
                s = self.cv.wait(s).map_err(|_| Self::aborted())?;
            }
            if s.aborted {
                return Err(Self::aborted());
            }
        }
        let out = s.results.clone().ok_or_else(Self::aborted)?;
        s.departed += 1;
        if s.departed == self.world {
            s.results = None;
            s.arrived = 0;
            s.departed = 0;
            self.cv.notify_all();
        }
        Ok(out)
    }
}

/// One rank of a [`LocalGroup`].
pub struct LocalComm {
    group: Arc<LocalGroup>,
    rank: usize,
    backend: Arc<dyn Backend>,
}

impl LocalComm {
    fn host(&self, t: &Tensor) -> Result<Vec<f32>> {
        if t.dtype() != DType::F32 {
            return Err(CoreError::invalid(format!(
                "collective on a {} tensor (f32 only)",
                t.dtype()
            )));
        }
        self.backend.download_f32(t)
    }

    fn put(&self, t: &Tensor, v: &[f32]) -> Result<()> {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.backend.write(t, &bytes)
    }

    fn check_rank(&self, r: usize) -> Result<()> {
        if r >= self.group.world || r == self.rank {
            return Err(CoreError::invalid(format!(
                "rank {} cannot exchange with rank {r} in a group of {}",
                self.rank, self.group.world
            )));
        }
        Ok(())
    }

    /// Sums every rank's first payload in rank order.
    fn sum(all: &[Payload]) -> Vec<f32> {
        let mut acc = all[0][0].clone();
        for p in &all[1..] {
            for (a, &b) in acc.iter_mut().zip(&p[0]) {
                *a += b;
            }
        }
        acc
    }
}

impl Communicator for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.group.world
    }

    fn all_reduce(&self, t: &Tensor) -> Result<()> {
        if self.group.world == 1 {
            return Ok(());
        }
        let all = self.group.exchange(self.rank, vec![self.host(t)?])?;
        if all.iter().any(|p| p[0].len() != t.numel()) {
            return Err(CoreError::invalid(
                "all_reduce of tensors of different sizes",
            ));
        }
        self.put(t, &Self::sum(&all))
    }

    fn all_gather(&self, x: &Tensor, out: &Tensor) -> Result<()> {
        let (m, n, w) = (x.rows(), x.row_len(), self.group.world);
        if out.rows() != m || out.row_len() != n * w {
            return Err(CoreError::invalid(format!(
                "all_gather of {x:?} from {w} ranks into {out:?}"
            )));
        }
        let all = self.group.exchange(self.rank, vec![self.host(x)?])?;
        if all.iter().any(|p| p[0].len() != m * n) {
            return Err(CoreError::invalid(
                "all_gather of tensors of different sizes",
            ));
        }
        let mut v = Vec::with_capacity(m * n * w);
        for row in 0..m {
            for p in all.iter() {
                v.extend_from_slice(&p[0][row * n..(row + 1) * n]);
            }
        }
        self.put(out, &v)
    }

    fn reduce_scatter(&self, x: &Tensor, out: &Tensor) -> Result<()> {
        let (m, n, w) = (x.rows(), x.row_len(), self.group.world);
        if !m.is_multiple_of(w) || out.rows() != m / w || out.row_len() != n {
            return Err(CoreError::invalid(format!(
                "reduce_scatter of {x:?} over {w} ranks into {out:?}"
            )));
        }
        let all = self.group.exchange(self.rank, vec![self.host(x)?])?;
        if all.iter().any(|p| p[0].len() != m * n) {
            return Err(CoreError::invalid(
                "reduce_scatter of tensors of different sizes",
            ));
        }
        let sum = Self::sum(&all);
        let per = (m / w) * n;
        self.put(out, &sum[self.rank * per..(self.rank + 1) * per])
    }

    fn all_to_all(&self, blocks: &[Tensor]) -> Result<Vec<Tensor>> {
        let w = self.group.world;
        let d = all_to_all_width(blocks, w)?;
        let mut payload = blocks
            .iter()
            .map(|b| self.host(b))
            .collect::<Result<Vec<_>>>()?;
        payload.push(vec![d as f32]);
        let all = self.group.exchange(self.rank, payload)?;
        all.iter()
            .map(|p| {
                if p[w] != [d as f32] {
                    return Err(CoreError::invalid("all_to_all blocks of different widths"));
                }
                let v = &p[self.rank];
                let t = self.backend.alloc(DType::F32, &[v.len() / d.max(1), d])?;
                self.put(&t, v)?;
                Ok(t)
            })
            .collect()
    }

    fn send(&self, x: &Tensor, to: usize) -> Result<()> {
        self.check_rank(to)?;
        let v = self.host(x)?;
        let mut s = self.group.lock()?;
        if s.aborted {
            return Err(LocalGroup::aborted());
        }
        s.mail.entry((self.rank, to)).or_default().push_back(v);
        self.group.cv.notify_all();
        Ok(())
    }

    fn recv(&self, out: &Tensor, from: usize) -> Result<()> {
        self.check_rank(from)?;
        let mut s = self.group.lock()?;
        let v = loop {
            if s.aborted {
                return Err(LocalGroup::aborted());
            }
            if let Some(v) = s
                .mail
                .get_mut(&(from, self.rank))
                .and_then(VecDeque::pop_front)
            {
                break v;
            }
            s = self.group.cv.wait(s).map_err(|_| LocalGroup::aborted())?;
        };
        drop(s);
        if v.len() != out.numel() {
            return Err(CoreError::invalid(format!(
                "received {} values from rank {from} into {out:?}",
                v.len()
            )));
        }
        self.put(out, &v)
    }

    fn barrier(&self) -> Result<()> {
        self.group.exchange(self.rank, Vec::new()).map(drop)
    }

    fn abort(&self) {
        if let Ok(mut s) = self.group.lock() {
            s.aborted = true;
        }
        self.group.cv.notify_all();
    }

    fn reset(&self) -> Result<()> {
        let mut s = self.group.lock()?;
        *s = Round {
            payloads: vec![None; self.group.world],
            ..Round::default()
        };
        Ok(())
    }
}

/// Checks that `comms[i]` is rank `i` of a group of exactly `ranks` ranks.
pub(crate) fn check_group(comms: &[Arc<dyn Communicator>], ranks: usize) -> Result<()> {
    if comms.len() != ranks
        || comms
            .iter()
            .enumerate()
            .any(|(i, c)| c.rank() != i || c.world_size() != ranks)
    {
        return Err(CoreError::invalid(
            "each rank needs the communicator of its own rank in a group of all of them",
        ));
    }
    Ok(())
}

/// Runs `f(rank, input)` on every rank at once (rank 0 on this thread, the
/// others on scoped threads), each with its own input; a rank that fails
/// aborts the group so that no other rank stays blocked in a collective.
pub(crate) fn on_every_rank<I: Send, T: Send>(
    comms: &[Arc<dyn Communicator>],
    inputs: Vec<I>,
    f: impl Fn(usize, I) -> Result<T> + Sync,
) -> Vec<Result<T>> {
    let f = &f;
    std::thread::scope(|s| {
        let mut inputs = inputs.into_iter();
        let first_input = inputs.next();
        let handles: Vec<_> = comms
            .iter()
            .skip(1)
            .zip(inputs)
            .enumerate()
            .map(|(i, (c, input))| {
                s.spawn(move || {
                    let out = f(i + 1, input);
                    if out.is_err() {
                        c.abort();
                    }
                    out
                })
            })
            .collect();
        let first = match first_input {
            Some(input) => f(0, input),
            None => Err(CoreError::Internal("no rank to run".into())),
        };
        if first.is_err()
            && let Some(c) = comms.first()
        {
            c.abort();
        }
        let mut all = vec![first];
        for h in handles {
            all.push(h.join().unwrap_or_else(|_| {
                Err(CoreError::Internal(
                    "a tensor-parallel rank panicked".into(),
                ))
            }));
        }
        all
    })
}

/// Every rank's output, or the first failure (the cause: the others were
/// aborted by it) after resetting the group for the next collective.
pub(crate) fn settle<T>(
    comms: &[Arc<dyn Communicator>],
    results: Vec<Result<T>>,
) -> Result<Vec<T>> {
    if results.iter().any(Result::is_err) {
        if let Some(c) = comms.first() {
            c.reset()?;
        }
        let cause = results.into_iter().find_map(Result::err);
        return Err(cause.unwrap_or_else(|| CoreError::Internal("a rank failed".into())));
    }
    results.into_iter().collect()
}
