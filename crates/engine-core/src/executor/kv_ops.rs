//! The executor's KV operations outside the forward: HiCache's page copies
//! between device pages and host slots, and moving a verified draft tree's
//! accepted path into chain order.

use super::LocalExecutor;
use crate::error::{CoreError, Result};
use crate::step::SeqPlan;
use crate::tier::{CopyDirection, KvCopyStats, KvTierOps};

impl LocalExecutor {
    /// Runs a plan's copies between device pages and host slots, in order.
    /// A host page holds, per layer, the page's K bytes then its V bytes
    /// (only K when the values are in the keys). On the CPU a copy is a
    /// memcpy; it is still counted and timed.
    pub(super) fn copy_tier_pages(&self, ops: &KvTierOps) -> Result<KvCopyStats> {
        let mut stats = KvCopyStats::default();
        let Some(host) = ops.host.as_ref().filter(|_| !ops.is_empty()) else {
            return Ok(stats);
        };
        let start = std::time::Instant::now();
        let kv = self.runner.kv();
        let spec = *kv.spec();
        let backend = self.runner.backend();
        let parts = spec.tensors_per_layer() * spec.num_layers;
        let part = spec.bytes_per_token() * spec.page_size / parts;
        if host.page_bytes() != parts * part {
            return Err(CoreError::invalid(format!(
                "host KV pages of {} bytes for device pages of {}",
                host.page_bytes(),
                parts * part
            )));
        }
        let mut views = Vec::with_capacity(parts);
        for c in &ops.copies {
            if c.device_page as usize >= spec.num_pages {
                return Err(CoreError::invalid(format!(
                    "KV copy of device page {} of {}",
                    c.device_page, spec.num_pages
                )));
            }
            let first = c.device_page as usize * spec.page_size;
            views.clear();
            for l in 0..spec.num_layers {
                for t in kv.layer(l)?.stored() {
                    views.push(t.narrow(first, spec.page_size)?);
                }
            }
            if views.len() != parts {
                return Err(CoreError::Internal(format!(
                    "the KV cache stores {} tensors for a spec of {parts}",
                    views.len()
                )));
            }
            let mut failed = None;
            match c.direction {
                CopyDirection::ToHost => {
                    let written = host.write(c.host, |bytes| {
                        for (view, dst) in views.iter().zip(bytes.chunks_exact_mut(part)) {
                            if let Err(e) = backend.download(view, dst) {
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
                        for (view, src) in views.iter().zip(bytes.chunks_exact(part)) {
                            if let Err(e) = backend.write(view, src) {
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
