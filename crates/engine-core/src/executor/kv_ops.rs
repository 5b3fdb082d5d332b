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
use crate::error::{CoreError, Result};
use crate::kv::KvSpec;
use crate::step::SeqPlan;
use crate::tier::{CopyDirection, KvCopyStats, KvTierOps};

/// Bytes of one slot row of one shard's tensor (its heads of one token).
fn row_bytes(spec: &KvSpec) -> usize {
    spec.num_kv_heads * spec.head_dim * spec.dtype.block_bytes() / spec.dtype.block_size()
}

/// Runs `ops` (in order) for `shards`: one executor, or the ranks of a
/// tensor-parallel group in rank order, holding consecutive blocks of the
/// KV heads (`replicated`: each holding all of them). On the CPU a copy is
/// a memcpy; it is still counted and timed.
pub(crate) fn copy_tier_pages(
    shards: &[&LocalExecutor],
    replicated: bool,
    ops: &KvTierOps,
) -> Result<KvCopyStats> {
    let mut stats = KvCopyStats::default();
    let Some(host) = ops.host.as_ref().filter(|_| !ops.is_empty()) else {
        return Ok(stats);
    };
    let Some(first) = shards.first() else {
        return Err(CoreError::Internal("KV copies with no executor".into()));
    };
    let start = std::time::Instant::now();
    let spec = *first.runner.kv().spec();
    let parts = spec.tensors_per_layer() * spec.num_layers;
    // The shards whose bytes make up a host page, and each one's row.
    let sources = if replicated { &shards[..1] } else { shards };
    let rows: Vec<usize> = sources
        .iter()
        .map(|e| row_bytes(e.runner.kv().spec()))
        .collect();
    let group_row: usize = rows.iter().sum();
    if host.page_bytes() != parts * spec.page_size * group_row {
        return Err(CoreError::invalid(format!(
            "host KV pages of {} bytes for device pages of {}",
            host.page_bytes(),
            parts * spec.page_size * group_row
        )));
    }
    // Per shard, its views of one device page, and a scratch page.
    let mut views: Vec<Vec<crate::tensor::Tensor>> = vec![Vec::with_capacity(parts); shards.len()];
    let mut scratch: Vec<Vec<u8>> = rows.iter().map(|r| vec![0u8; r * spec.page_size]).collect();
    for c in &ops.copies {
        if c.device_page as usize >= spec.num_pages {
            return Err(CoreError::invalid(format!(
                "KV copy of device page {} of {}",
                c.device_page, spec.num_pages
            )));
        }
        let first_slot = c.device_page as usize * spec.page_size;
        for (e, v) in shards.iter().zip(views.iter_mut()) {
            v.clear();
            let kv = e.runner.kv();
            for l in 0..spec.num_layers {
                for t in kv.layer(l)?.stored() {
                    v.push(t.narrow(first_slot, spec.page_size)?);
                }
            }
            if v.len() != parts {
                return Err(CoreError::Internal(format!(
                    "the KV cache stores {} tensors for a spec of {parts}",
                    v.len()
                )));
            }
        }
        let mut failed = None;
        match c.direction {
            CopyDirection::ToHost => {
                let written = host.write(c.host, |bytes| {
                    for (p, dst) in bytes
                        .chunks_exact_mut(spec.page_size * group_row)
                        .enumerate()
                    {
                        if let Err(e) = download_part(sources, &views, &mut scratch, &rows, p, dst)
                        {
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
                stats.pages_to_host += 1;
            }
            CopyDirection::ToDevice => {
                let read = host.read(c.host, std::time::Duration::ZERO, |bytes| {
                    for (p, src) in bytes.chunks_exact(spec.page_size * group_row).enumerate() {
                        if let Err(e) =
                            upload_part(shards, replicated, &views, &mut scratch, &rows, p, src)
                        {
                            failed = Some(e);
                            return;
                        }
                    }
                });
                if read.is_none() {
                    return Err(CoreError::Internal(format!(
                        "KV load from host slot {} that holds no page",
                        c.host.slot
                    )));
                }
                stats.pages_to_device += 1;
            }
        }
        if let Some(e) = failed {
            return Err(e);
        }
        stats.bytes += host.page_bytes() as u64;
    }
    stats.seconds = start.elapsed().as_secs_f64();
    Ok(stats)
}

/// Part `p` (one tensor of one layer) of a host page from the shards'
/// device pages: each slot row is the shards' rows in rank order.
fn download_part(
    sources: &[&LocalExecutor],
    views: &[Vec<crate::tensor::Tensor>],
    scratch: &mut [Vec<u8>],
    rows: &[usize],
    p: usize,
    dst: &mut [u8],
) -> Result<()> {
    if let [e] = sources {
        return e.runner.backend().download(&views[0][p], dst);
    }
    let group_row: usize = rows.iter().sum();
    let mut off = 0;
    for (i, e) in sources.iter().enumerate() {
        e.runner.backend().download(&views[i][p], &mut scratch[i])?;
        for (s, row) in scratch[i].chunks_exact(rows[i]).enumerate() {
            dst[s * group_row + off..s * group_row + off + rows[i]].copy_from_slice(row);
        }
        off += rows[i];
    }
    Ok(())
}

/// Part `p` of a host page into the shards' device pages (every shard gets
/// the whole part when `replicated`).
fn upload_part(
    shards: &[&LocalExecutor],
    replicated: bool,
    views: &[Vec<crate::tensor::Tensor>],
    scratch: &mut [Vec<u8>],
    rows: &[usize],
    p: usize,
    src: &[u8],
) -> Result<()> {
    if replicated || shards.len() == 1 {
        for (i, e) in shards.iter().enumerate() {
            e.runner.backend().write(&views[i][p], src)?;
        }
        return Ok(());
    }
    let group_row: usize = rows.iter().sum();
    let mut off = 0;
    for (i, e) in shards.iter().enumerate() {
        for (s, row) in scratch[i].chunks_exact_mut(rows[i]).enumerate() {
            row.copy_from_slice(&src[s * group_row + off..s * group_row + off + rows[i]]);
        }
        e.runner.backend().write(&views[i][p], &scratch[i])?;
        off += rows[i];
    }
    Ok(())
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
