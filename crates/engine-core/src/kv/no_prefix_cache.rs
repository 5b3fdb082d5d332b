//! [`NoPrefixCache`]: the prefix cache that reuses nothing (`--disable-radix-cache`).
//!
//! It keeps the same contract as the radix cache so the scheduler needs no
//! special case: `match_prefix` always returns an empty match at the root,
//! `insert` checks the page count and returns every page to the pool, and
//! `lock`/`unlock` accept only the root. It holds no pages, so its cached,
//! evictable and protected counts are always zero.

use crate::error::{CoreError, Result as CoreResult};
use crate::kv::PageSet;
use crate::kv::prefix_cache::{
    CacheNamespace, InsertOutcome, NodeId, PrefixCache, PrefixCacheOptions, PrefixCacheStats,
    PrefixMatch,
};

/// The only node of a [`NoPrefixCache`].
const ROOT: NodeId = NodeId(0);

/// A prefix cache that caches nothing.
#[derive(Debug)]
pub struct NoPrefixCache {
    page_size: usize,
    queried_tokens: u64,
}

impl NoPrefixCache {
    /// A no-reuse cache checking inserts against `options.page_size`.
    pub fn new(options: &PrefixCacheOptions) -> CoreResult<Self> {
        Self::with_page_size(options.page_size)
    }

    /// A no-reuse cache for pages of `page_size` tokens.
    pub fn with_page_size(page_size: usize) -> CoreResult<Self> {
        if page_size == 0 {
            return Err(CoreError::invalid("a prefix cache with page size 0"));
        }
        Ok(Self {
            page_size,
            queried_tokens: 0,
        })
    }

    fn check_root(node: NodeId) -> CoreResult<()> {
        if node == ROOT {
            Ok(())
        } else {
            Err(CoreError::invalid(format!(
                "node {} is not in the prefix cache",
                node.0
            )))
        }
    }
}

impl PrefixCache for NoPrefixCache {
    fn name(&self) -> &str {
        "none"
    }

    fn peek_prefix(&self, _ns: &CacheNamespace, _tokens: &[u32]) -> usize {
        0
    }

    fn match_prefix(&mut self, _ns: &CacheNamespace, tokens: &[u32]) -> PrefixMatch {
        self.queried_tokens += tokens.len() as u64;
        PrefixMatch::empty(ROOT)
    }

    fn insert(
        &mut self,
        _ns: &CacheNamespace,
        tokens: &[u32],
        pages: PageSet,
        _priority: i64,
    ) -> CoreResult<InsertOutcome> {
        let expected = tokens.len().div_ceil(self.page_size);
        if pages.len() != expected {
            return Err(CoreError::invalid(format!(
                "{} pages for {} tokens of page size {} (expected {expected})",
                pages.len(),
                tokens.len(),
                self.page_size
            )));
        }
        drop(pages);
        Ok(InsertOutcome {
            already_cached: 0,
            cached: 0,
            node: ROOT,
        })
    }

    fn lock(&mut self, node: NodeId) -> CoreResult<()> {
        Self::check_root(node)
    }

    fn unlock(&mut self, node: NodeId) -> CoreResult<()> {
        Self::check_root(node)
    }

    fn evict(&mut self, _n_tokens: usize) -> usize {
        0
    }

    fn stats(&self) -> PrefixCacheStats {
        PrefixCacheStats {
            queried_tokens: self.queried_tokens,
            ..PrefixCacheStats::default()
        }
    }

    fn flush(&mut self) {}

    fn dump(&self) -> String {
        format!(
            "no prefix cache (reuse disabled): page size {}, {} tokens queried\n",
            self.page_size, self.queried_tokens
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::PagePool;

    #[test]
    fn reuses_nothing_and_frees_everything() {
        let pool = PagePool::new(8, 4);
        let mut c = NoPrefixCache::with_page_size(4).unwrap();
        let ns = CacheNamespace::default();
        let toks: Vec<u32> = (0..10).collect();
        let out = c.insert(&ns, &toks, pool.alloc(3).unwrap(), 0).unwrap();
        assert_eq!((out.already_cached, out.cached, out.node), (0, 0, ROOT));
        assert_eq!(pool.free_pages(), 8);
        let m = c.match_prefix(&ns, &toks);
        assert_eq!((m.matched_tokens, m.pages.len(), m.node), (0, 0, ROOT));
        c.lock(m.node).unwrap();
        c.unlock(m.node).unwrap();
        assert!(c.lock(NodeId(1)).is_err());
        assert_eq!(c.evict(100), 0);
        let s = c.stats();
        assert_eq!(
            (s.cached_tokens, s.queried_tokens, s.hit_tokens),
            (0, 10, 0)
        );
        assert!(c.dump().contains("disabled"));
    }

    #[test]
    fn checks_page_count() {
        let pool = PagePool::new(8, 4);
        let mut c = NoPrefixCache::with_page_size(4).unwrap();
        let e = c
            .insert(
                &CacheNamespace::default(),
                &[1, 2, 3, 4, 5],
                pool.alloc(1).unwrap(),
                0,
            )
            .unwrap_err();
        assert!(e.to_string().contains("expected 2"), "{e}");
        assert_eq!(pool.free_pages(), 8);
        let e = c
            .insert_with_prefix(
                &CacheNamespace::default(),
                &[1, 2, 3, 4],
                4,
                pool.alloc(0).unwrap(),
                0,
            )
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("cannot insert after a cached prefix"),
            "{e}"
        );
        assert!(NoPrefixCache::with_page_size(0).is_err());
    }
}
