//! The scheduler's side of KV export and import ([`crate::engine::transfer`]).
//!
//! Both run between steps on the scheduler thread, so no forward writes the
//! pages being read and the pool is not shared with a step in flight.
//! Invariants: an export leaves the cache's locks as it found them; an
//! import either inserts every page it allocated into the cache or frees
//! them all (the [`PageSet`](crate::kv::PageSet) drops on error).

use super::Scheduler;
use crate::engine::transfer::{KvPages, TransferOp};
use crate::error::{CoreError, Result};
use crate::kv::prefix_cache::CacheNamespace;
use crate::kv::tier::{CopyDirection, HostKvPool, KvTierOps, PageCopy, TierIdentity};
use crate::step::StepPlan;
use std::time::Duration;

impl Scheduler {
    pub(super) fn transfer(&mut self, op: TransferOp) {
        match op {
            TransferOp::Export {
                namespace,
                tokens,
                reply,
            } => {
                let _ = reply.send(self.export_kv(&namespace, &tokens));
            }
            TransferOp::Import { pages, reply } => {
                let _ = reply.send(self.import_kv(pages));
            }
        }
        self.publish();
    }

    /// The layout KV pages of this engine have.
    fn transfer_layout(&self) -> TierIdentity {
        let m = self.executor.model_spec();
        let model = format!(
            "{}/{}x{}/{}/{}",
            m.architecture, m.num_layers, m.hidden_size, m.vocab_size, m.num_heads
        );
        TierIdentity::new(model, self.executor.kv_spec())
    }

    fn transfer_ready(&self) -> Result<()> {
        if self.cfg.disable_radix_cache {
            return Err(CoreError::invalid(
                "KV transfer needs the prefix cache (disable_radix_cache is set)",
            ));
        }
        if self.halted() {
            return Err(CoreError::invalid(
                "generation is paused or memory released",
            ));
        }
        Ok(())
    }

    fn export_kv(&mut self, namespace: &CacheNamespace, tokens: &[u32]) -> Result<KvPages> {
        self.transfer_ready()?;
        let layout = self.transfer_layout();
        let ns = self.current_namespace(namespace);
        let m = self.cache.match_prefix(&ns, tokens);
        // A host-tier hit recorded its load-back: run it before reading.
        self.run_tier_copies()?;
        self.cache.lock(m.node)?;
        let read = self.read_pages(&layout, &m.pages);
        self.cache.unlock(m.node)?;
        Ok(KvPages {
            layout: layout.digest(),
            page_size: layout.page_size,
            page_bytes: layout.page_bytes(),
            namespace: namespace.clone(),
            tokens: tokens[..m.matched_tokens].to_vec(),
            pages: read?,
        })
    }

    fn copy(&self, host: &std::sync::Arc<HostKvPool>, copies: Vec<PageCopy>) -> Result<()> {
        let plan = StepPlan {
            kv_ops: KvTierOps {
                host: Some(host.clone()),
                copies,
            },
            ..StepPlan::default()
        };
        self.executor.execute(&plan).map(|_| ())
    }

    fn read_pages(&self, layout: &TierIdentity, pages: &[u32]) -> Result<Vec<Vec<u8>>> {
        if pages.is_empty() {
            return Ok(Vec::new());
        }
        let host = HostKvPool::new(layout.page_bytes(), pages.len());
        let slots = host
            .alloc(pages.len())
            .ok_or_else(|| CoreError::Internal("a fresh host pool had no slots".into()))?;
        let copies = pages
            .iter()
            .zip(slots.slots())
            .map(|(&p, &s)| PageCopy {
                direction: CopyDirection::ToHost,
                device_page: p,
                host: s,
            })
            .collect();
        self.copy(&host, copies)?;
        slots
            .slots()
            .iter()
            .map(|&s| {
                host.read(s, Duration::ZERO, |b| b.to_vec())
                    .ok_or_else(|| CoreError::Internal("an exported page was not copied".into()))
            })
            .collect()
    }

    fn import_kv(&mut self, p: KvPages) -> Result<usize> {
        self.transfer_ready()?;
        p.check()?;
        let layout = self.transfer_layout();
        if p.layout != layout.digest()
            || p.page_size != layout.page_size
            || p.page_bytes != layout.page_bytes()
        {
            return Err(CoreError::invalid(format!(
                "KV pages of another layout (page size {}, {} bytes per page; this engine: {}, {})",
                p.page_size,
                p.page_bytes,
                layout.page_size,
                layout.page_bytes()
            )));
        }
        let n = p.pages.len();
        if n == 0 {
            return Ok(0);
        }
        let free = self.pool.free_pages();
        if free < n {
            self.cache.evict((n - free) * layout.page_size);
        }
        let set = self.pool.alloc(n)?;
        let host = HostKvPool::new(layout.page_bytes(), n);
        let slots = host
            .alloc(n)
            .ok_or_else(|| CoreError::Internal("a fresh host pool had no slots".into()))?;
        for (&s, bytes) in slots.slots().iter().zip(&p.pages) {
            host.write(s, |dst| dst.copy_from_slice(bytes));
        }
        let copies = set
            .pages()
            .iter()
            .zip(slots.slots())
            .map(|(&d, &s)| PageCopy {
                direction: CopyDirection::ToDevice,
                device_page: d,
                host: s,
            })
            .collect();
        self.copy(&host, copies)?;
        let ns = self.current_namespace(&p.namespace);
        let out = self.cache.insert(&ns, &p.tokens, set, 0)?;
        Ok(out.cached)
    }
}
