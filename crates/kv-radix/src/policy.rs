//! Built-in eviction policies and their registration by name.
//!
//! A policy maps a node's [`NodeMeta`] to an [`EvictionKey`]; the radix cache
//! evicts the unlocked leaf with the smallest key first (ties broken by node
//! id). Keys must be a pure function of the metadata: the cache recomputes a
//! node's key only when its metadata changes. Times are the cache's logical
//! clock (one tick per `match_prefix` or `insert`, one more for the leaf an
//! `insert` adds), so orders are deterministic. The definitions follow
//! SGLang's `evict_policy.py`:
//!
//! | name | key (smallest evicted first) |
//! |---|---|
//! | `lru` | `last_access` |
//! | `lfu` | `(hit_count, last_access)` |
//! | `fifo` | `created` |
//! | `mru` | `-last_access` |
//! | `filo` | `-created` |
//! | `priority` | `(priority, last_access)`: low priority values go first |
//! | `slru` | `(hit_count >= 2, last_access)`: probationary before protected |
//!
//! Each is registered with `inventory` as an
//! [`EvictionPolicyEntry`].

use crate::error::RadixError;
use arbor_engine_core::registry::EvictionPolicyEntry;
use arbor_engine_core::{EvictionKey, EvictionPolicy, NodeMeta};
use std::sync::Arc;

/// Names of the built-in policies.
pub const POLICY_NAMES: [&str; 7] = ["lru", "lfu", "fifo", "mru", "filo", "priority", "slru"];

// Logical times and counts stay far below 2^53, where u64 -> f64 is exact.
fn f(x: u64) -> f64 {
    x as f64
}

/// Least recently used first.
#[derive(Clone, Copy, Debug, Default)]
pub struct Lru;

impl EvictionPolicy for Lru {
    fn name(&self) -> &str {
        "lru"
    }
    fn key(&self, m: &NodeMeta) -> EvictionKey {
        EvictionKey(f(m.last_access), 0.0)
    }
}

/// Least frequently matched first, then least recently used.
#[derive(Clone, Copy, Debug, Default)]
pub struct Lfu;

impl EvictionPolicy for Lfu {
    fn name(&self) -> &str {
        "lfu"
    }
    fn key(&self, m: &NodeMeta) -> EvictionKey {
        EvictionKey(f(m.hit_count), f(m.last_access))
    }
}

/// Oldest created first.
#[derive(Clone, Copy, Debug, Default)]
pub struct Fifo;

impl EvictionPolicy for Fifo {
    fn name(&self) -> &str {
        "fifo"
    }
    fn key(&self, m: &NodeMeta) -> EvictionKey {
        EvictionKey(f(m.created), 0.0)
    }
}

/// Most recently used first.
#[derive(Clone, Copy, Debug, Default)]
pub struct Mru;

impl EvictionPolicy for Mru {
    fn name(&self) -> &str {
        "mru"
    }
    fn key(&self, m: &NodeMeta) -> EvictionKey {
        EvictionKey(-f(m.last_access), 0.0)
    }
}

/// Newest created first.
#[derive(Clone, Copy, Debug, Default)]
pub struct Filo;

impl EvictionPolicy for Filo {
    fn name(&self) -> &str {
        "filo"
    }
    fn key(&self, m: &NodeMeta) -> EvictionKey {
        EvictionKey(-f(m.created), 0.0)
    }
}

/// Lowest request priority first, then least recently used.
#[derive(Clone, Copy, Debug, Default)]
pub struct Priority;

impl EvictionPolicy for Priority {
    fn name(&self) -> &str {
        "priority"
    }
    fn key(&self, m: &NodeMeta) -> EvictionKey {
        EvictionKey(m.priority as f64, f(m.last_access))
    }
}

/// Segmented LRU: nodes matched at least `protect_after` times form the
/// protected segment and are evicted only after every probationary node;
/// within a segment, least recently used first.
#[derive(Clone, Copy, Debug)]
pub struct Slru {
    /// Hits that move a node to the protected segment.
    pub protect_after: u64,
}

impl Default for Slru {
    fn default() -> Self {
        Self { protect_after: 2 }
    }
}

impl EvictionPolicy for Slru {
    fn name(&self) -> &str {
        "slru"
    }
    fn key(&self, m: &NodeMeta) -> EvictionKey {
        let segment = if m.hit_count >= self.protect_after {
            1.0
        } else {
            0.0
        };
        EvictionKey(segment, f(m.last_access))
    }
}

/// The built-in policy named `name` (without going through the registry).
pub fn builtin_policy(name: &str) -> Result<Arc<dyn EvictionPolicy>, RadixError> {
    Ok(match name {
        "lru" => Arc::new(Lru),
        "lfu" => Arc::new(Lfu),
        "fifo" => Arc::new(Fifo),
        "mru" => Arc::new(Mru),
        "filo" => Arc::new(Filo),
        "priority" => Arc::new(Priority),
        "slru" => Arc::new(Slru::default()),
        _ => {
            return Err(RadixError::UnknownPolicy {
                name: name.to_string(),
                available: POLICY_NAMES.join(", "),
            });
        }
    })
}

arbor_engine_core::inventory::submit! {
    EvictionPolicyEntry {
        name: "lru",
        about: "least recently used leaf first (SGLang's default)",
        create: || Ok(Arc::new(Lru)),
    }
}
arbor_engine_core::inventory::submit! {
    EvictionPolicyEntry {
        name: "lfu",
        about: "least frequently matched leaf first, then least recently used",
        create: || Ok(Arc::new(Lfu)),
    }
}
arbor_engine_core::inventory::submit! {
    EvictionPolicyEntry {
        name: "fifo",
        about: "oldest leaf first",
        create: || Ok(Arc::new(Fifo)),
    }
}
arbor_engine_core::inventory::submit! {
    EvictionPolicyEntry {
        name: "mru",
        about: "most recently used leaf first",
        create: || Ok(Arc::new(Mru)),
    }
}
arbor_engine_core::inventory::submit! {
    EvictionPolicyEntry {
        name: "filo",
        about: "newest leaf first",
        create: || Ok(Arc::new(Filo)),
    }
}
arbor_engine_core::inventory::submit! {
    EvictionPolicyEntry {
        name: "priority",
        about: "lowest request priority first, then least recently used",
        create: || Ok(Arc::new(Priority)),
    }
}
arbor_engine_core::inventory::submit! {
    EvictionPolicyEntry {
        name: "slru",
        about: "segmented LRU: leaves matched twice or more go after the others",
        create: || Ok(Arc::new(Slru::default())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(last_access: u64, created: u64, hit_count: u64, priority: i64) -> NodeMeta {
        NodeMeta {
            last_access,
            created,
            hit_count,
            priority,
            tokens: 1,
        }
    }

    /// Indices of `metas` in eviction order under `p`.
    fn order(p: &dyn EvictionPolicy, metas: &[NodeMeta]) -> Vec<usize> {
        let mut idx: Vec<usize> = (0..metas.len()).collect();
        idx.sort_by(|&a, &b| {
            p.key(&metas[a])
                .total_cmp(&p.key(&metas[b]))
                .then(a.cmp(&b))
        });
        idx
    }

    // (last_access, created, hit_count, priority)
    fn sample() -> Vec<NodeMeta> {
        vec![
            meta(10, 1, 5, 0), // 0: old, hot, created first
            meta(30, 3, 1, 2), // 1: recent, cold
            meta(20, 2, 1, 1), // 2: middle
            meta(40, 4, 2, 0), // 3: newest, warm
        ]
    }

    #[test]
    fn lru_order() {
        assert_eq!(order(&Lru, &sample()), [0, 2, 1, 3]);
    }

    #[test]
    fn lfu_order() {
        // hit 1: nodes 1 (t30) and 2 (t20); then 3 (hit 2); then 0 (hit 5).
        assert_eq!(order(&Lfu, &sample()), [2, 1, 3, 0]);
    }

    #[test]
    fn fifo_order() {
        assert_eq!(order(&Fifo, &sample()), [0, 2, 1, 3]);
    }

    #[test]
    fn mru_order() {
        assert_eq!(order(&Mru, &sample()), [3, 1, 2, 0]);
    }

    #[test]
    fn filo_order() {
        assert_eq!(order(&Filo, &sample()), [3, 1, 2, 0]);
    }

    #[test]
    fn priority_order() {
        // priority 0: nodes 0 (t10), 3 (t40); then 2 (p1); then 1 (p2).
        assert_eq!(order(&Priority, &sample()), [0, 3, 2, 1]);
        let neg = [meta(5, 0, 0, -3), meta(1, 0, 0, 7)];
        assert_eq!(
            order(&Priority, &neg),
            [0, 1],
            "negative priorities go first"
        );
    }

    #[test]
    fn slru_order() {
        // probationary (hit < 2): 2 (t20), 1 (t30); protected: 0 (t10), 3 (t40).
        assert_eq!(order(&Slru::default(), &sample()), [2, 1, 0, 3]);
        let strict = Slru { protect_after: 3 };
        assert_eq!(order(&strict, &sample()), [2, 1, 3, 0]);
    }

    #[test]
    fn lookup_by_name() {
        for name in POLICY_NAMES {
            assert_eq!(builtin_policy(name).unwrap().name(), name);
        }
        let e = builtin_policy("random").err().unwrap();
        assert!(e.to_string().contains("available: lru, lfu"), "{e}");
    }

    #[test]
    fn registered_with_inventory() {
        let r = arbor_engine_core::Registry::builtin().unwrap();
        for name in POLICY_NAMES {
            let create = r.eviction_policies.get(name).unwrap();
            assert_eq!(create().unwrap().name(), name);
        }
    }
}
