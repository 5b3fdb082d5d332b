//! The executor's KV operations outside the forward: HiCache's page copies
//! between device pages and host slots (for one executor or a
//! tensor-parallel group of them), and moving a verified draft tree's
//! accepted path into chain order.
//!
//! Host page layout: per layer, the page's K bytes then its V bytes (only K
//! when the values are in the keys), each `[page_size slots, kv_heads,
//! head_dim]` over the whole model's KV heads. A tensor-parallel group's
//! ranks hold consecutive blocks of the heads; their slot rows are
//! interleaved into that layout, so a page stored by a group of any size
//! reads back in any other (and in a single engine). A group whose ranks
//! each hold the whole (latent) cache stores rank 0's bytes and writes them
//! back to every rank.

use super::LocalExecutor;
use crate::backend::{HostData, HostRows};
use crate::error::{CoreError, Result};
use crate::kv::KvSpec;
use crate::kv::tier::{CopyDirection, HeldSlots, HostKvPool, KvCopyStats, KvTierOps};
use crate::step::SeqPlan;
use std::sync::Arc;

/// Bytes of one slot row of one shard's tensor (its heads of one token).
fn row_bytes(spec: &KvSpec) -> usize {
    spec.num_kv_heads * spec.head_dim * spec.dtype.block_bytes() / spec.dtype.block_size()
}

/// Runs `ops` (in order) for `shards`: one executor, or the ranks of a
/// tensor-parallel group in rank order, holding consecutive blocks of the
/// KV heads (`replicated`: each holding all of them). On the CPU a copy is
/// a memcpy; it is still counted and timed.
///
/// Each run of consecutive loads (host to device) is written one part (a
/// layer's K or V) at a time with [`Backend::write_async`](crate::Backend::write_async),
/// layers in order, so on an asynchronous device the forward's layer `l`
/// waits only for its own pages. A backup (device to host) waits for
/// whatever was queued before it, so the order of the copies holds.
///
/// On asynchronous devices the loaded slots are held unchanged
/// ([`HeldSlots`]) until the returned guard drops, after the step: the
/// device may copy from them in place. A backup into a slot held by this
/// step first waits for the devices.
pub(crate) fn copy_tier_pages(
    shards: &[&LocalExecutor],
    replicated: bool,
    ops: &KvTierOps,
) -> Result<(KvCopyStats, HeldUntilSync)> {
    let mut stats = KvCopyStats::default();
    let Some(host) = ops.host.as_ref().filter(|_| !ops.is_empty()) else {
        return Ok((stats, HeldUntilSync::default()));
    };
    let mut held = HeldUntilSync {
        slots: Vec::new(),
        backends: shards.iter().map(|e| e.runner.backend().clone()).collect(),
    };
    let Some(first) = shards.first() else {
        return Err(CoreError::Internal("KV copies with no executor".into()));
    };
    let start = std::time::Instant::now();
    let layout = Layout::new(shards, replicated, *first.runner.kv().spec());
    if host.page_bytes() != layout.page_bytes() {
        return Err(CoreError::invalid(format!(
            "host KV pages of {} bytes for device pages of {}",
            host.page_bytes(),
            layout.page_bytes()
        )));
    }
    let mut scratch: Vec<Vec<u8>> = layout
        .rows
        .iter()
        .map(|r| vec![0u8; r * layout.spec.page_size])
        .collect();
    let mut at = 0;
    while let Some(c) = ops.copies.get(at) {
        match c.direction {
            CopyDirection::ToHost => {
                if held.slots.iter().any(|h| h.contains(c.host.slot)) {
                    held.release()?;
                }
                let views = layout.page_views(c.device_page)?;
                let mut failed = None;
                let written = host.write(c.host, |bytes| {
                    for (p, dst) in bytes.chunks_exact_mut(layout.part_bytes()).enumerate() {
                        if let Err(e) = layout.download_part(&views, &mut scratch, p, dst) {
                            failed = Some(e);
                            return;
                        }
                    }
                });
                if !written {
                    return Err(CoreError::Internal(format!(
                        "KV backup into freed host slot {}",
                        c.host.slot
                    )));
                }
                if let Some(e) = failed {
                    return Err(e);
                }
                stats.pages_to_host += 1;
                at += 1;
            }
            CopyDirection::ToDevice => {
                let run = ops.copies[at..]
                    .iter()
                    .take_while(|c| c.direction == CopyDirection::ToDevice)
                    .count();
                held.slots
                    .extend(layout.load(host, &ops.copies[at..at + run])?);
                stats.pages_to_device += run as u64;
                at += run;
            }
        }
    }
    stats.bytes = ops.copies.len() as u64 * host.page_bytes() as u64;
    stats.seconds = start.elapsed().as_secs_f64();
    Ok((stats, held))
}

/// Host slots a step's devices may still copy from; dropped after the step,
/// it waits for the devices, then releases the slots.
#[derive(Default)]
pub(crate) struct HeldUntilSync {
    slots: Vec<HeldSlots>,
    backends: Vec<Arc<dyn crate::Backend>>,
}

impl HeldUntilSync {
    /// Waits for the devices and releases the slots now.
    fn release(&mut self) -> Result<()> {
        if !self.slots.is_empty() {
            for b in &self.backends {
                b.synchronize()?;
            }
            self.slots.clear();
        }
        Ok(())
    }
}

impl Drop for HeldUntilSync {
    fn drop(&mut self) {
        if let Err(e) = self.release() {
            // A device that fails here has failed the step already; the
            // slots are released anyway.
            tracing::warn!("waiting for the KV loads of a step: {e}");
        }
    }
}

/// How the shards' device pages map onto a host page.
struct Layout<'a> {
    shards: &'a [&'a LocalExecutor],
    /// The shards whose bytes make up a host page (rank 0 alone when replicated).
    sources: &'a [&'a LocalExecutor],
    replicated: bool,
    spec: KvSpec,
    /// Per source, the bytes of its slot row.
    rows: Vec<usize>,
}

impl<'a> Layout<'a> {
    fn new(shards: &'a [&'a LocalExecutor], replicated: bool, spec: KvSpec) -> Self {
        let sources = if replicated { &shards[..1] } else { shards };
        let rows = sources
            .iter()
            .map(|e| row_bytes(e.runner.kv().spec()))
            .collect();
        Self {
            shards,
            sources,
            replicated,
            spec,
            rows,
        }
    }

    /// Tensors of a page: every layer's K (and V).
    fn parts(&self) -> usize {
        self.spec.tensors_per_layer() * self.spec.num_layers
    }

    /// Bytes of one part of a host page (all shards' rows of its slots).
    fn part_bytes(&self) -> usize {
        self.spec.page_size * self.rows.iter().sum::<usize>()
    }

    fn page_bytes(&self) -> usize {
        self.parts() * self.part_bytes()
    }

    /// Per shard, its views of device page `page`, one per part.
    fn page_views(&self, page: u32) -> Result<Vec<Vec<crate::tensor::Tensor>>> {
        let spec = &self.spec;
        if page as usize >= spec.num_pages {
            return Err(CoreError::invalid(format!(
                "KV copy of device page {page} of {}",
                spec.num_pages
            )));
        }
        let first_slot = page as usize * spec.page_size;
        let mut out = Vec::with_capacity(self.shards.len());
        for e in self.shards {
            let kv = e.runner.kv();
            let mut v = Vec::with_capacity(self.parts());
            for l in 0..spec.num_layers {
                for t in kv.layer(l)?.stored() {
                    v.push(t.narrow(first_slot, spec.page_size)?);
                }
            }
            if v.len() != self.parts() {
                return Err(CoreError::Internal(format!(
                    "the KV cache stores {} tensors for a spec of {}",
                    v.len(),
                    self.parts()
                )));
            }
            out.push(v);
        }
        Ok(out)
    }

    /// Part `p` (one tensor of one layer) of a host page from the shards'
    /// device pages: each slot row is the shards' rows in rank order.
    fn download_part(
        &self,
        views: &[Vec<crate::tensor::Tensor>],
        scratch: &mut [Vec<u8>],
        p: usize,
        dst: &mut [u8],
    ) -> Result<()> {
        if let [e] = self.sources {
            return e.runner.backend().download(&views[0][p], dst);
        }
        let group_row: usize = self.rows.iter().sum();
        let mut off = 0;
        for (i, e) in self.sources.iter().enumerate() {
            let row = self.rows[i];
            e.runner.backend().download(&views[i][p], &mut scratch[i])?;
            for (s, r) in scratch[i].chunks_exact(row).enumerate() {
                dst[s * group_row + off..s * group_row + off + row].copy_from_slice(r);
            }
            off += row;
        }
        Ok(())
    }

    /// Loads `copies` (all to the device) part by part: every page's part
    /// `p` into every shard with one `write_async` per shard, then part `p + 1`.
    /// On asynchronous devices the slots are read in place, held until the
    /// returned guard drops after the step.
    fn load(
        &self,
        host: &Arc<HostKvPool>,
        copies: &[crate::kv::tier::PageCopy],
    ) -> Result<Option<HeldSlots>> {
        let views = copies
            .iter()
            .map(|c| self.page_views(c.device_page))
            .collect::<Result<Vec<_>>>()?;
        let slots: Vec<_> = copies.iter().map(|c| c.host).collect();
        let part = self.part_bytes();
        let split = !self.replicated && self.shards.len() > 1;
        let asynchronous = self
            .shards
            .iter()
            .any(|e| e.runner.backend().capabilities().asynchronous);
        // Every rank reads its rows from the host slots where they lie.
        let held = asynchronous.then(|| host.hold(&slots)).flatten();
        let data = if held.is_some() {
            HostData::UntilSync
        } else {
            HostData::Transient
        };
        let group_row: usize = self.rows.iter().sum();
        // Shard i's rows start `offsets[i]` bytes into each slot row.
        let offsets: Vec<usize> = self
            .rows
            .iter()
            .scan(0, |off, r| {
                *off += r;
                Some(*off - r)
            })
            .collect();
        let loaded = host.read_many(&slots, |pages| -> Result<()> {
            for p in 0..self.parts() {
                let src = |c: usize| &pages[c][p * part..(p + 1) * part];
                for (i, e) in self.shards.iter().enumerate() {
                    let writes = (0..copies.len())
                        .map(|c| {
                            let rows = if split {
                                // Its heads of every slot row, in place.
                                let (row, off) = (self.rows[i], offsets[i]);
                                HostRows::strided(
                                    &src(c)[off..],
                                    row,
                                    group_row,
                                    self.spec.page_size,
                                )?
                            } else {
                                HostRows::whole(src(c))
                            };
                            Ok((&views[c][i][p], rows))
                        })
                        .collect::<Result<Vec<_>>>()?;
                    e.runner.backend().write_async(&writes, data)?;
                }
            }
            Ok(())
        });
        loaded
            .unwrap_or_else(|| {
                Err(CoreError::Internal(format!(
                    "KV load from a host slot that holds no page (slots {:?})",
                    slots.iter().map(|s| s.slot).collect::<Vec<_>>()
                )))
            })
            .inspect_err(|_| {
                if held.is_some() {
                    // Copies of this run may be in flight: let them finish
                    // before the slots are released.
                    for sh in self.shards {
                        let _ = sh.runner.backend().synchronize();
                    }
                }
            })
            .map(|()| held)
    }
}

impl LocalExecutor {
    /// After a draft tree's verification, moves the KV of the accepted path
    /// (plan indices `path`, increasing) into chain order, so that the
    /// sequence's first `prefix_len + 1 + path.len()` slots hold its tokens
    /// in order. Safe in place: the j-th accepted token moves from index
    /// `path[j] >= j + 1` to `j + 1`, and later sources lie past every
    /// earlier destination.
    pub(super) fn compact_accepted(&self, s: &SeqPlan, path: &[usize]) -> Result<()> {
        let kv = self.runner.kv();
        let ps = kv.spec().page_size;
        let slot = |i: usize| -> Result<usize> {
            let t = s.prefix_len + i;
            let page = s
                .pages
                .get(t / ps)
                .ok_or_else(|| crate::error::CoreError::invalid("draft past its pages"))?;
            Ok(*page as usize * ps + t % ps)
        };
        let backend = self.runner.backend();
        for (j, &src) in path.iter().enumerate() {
            let dst = j + 1;
            if src == dst {
                continue;
            }
            let (from, to) = (slot(src)?, slot(dst)?);
            for l in 0..kv.spec().num_layers {
                for t in kv.layer(l)?.stored() {
                    backend.copy(&t.narrow(from, 1)?, &t.narrow(to, 1)?)?;
                }
            }
        }
        Ok(())
    }
}
