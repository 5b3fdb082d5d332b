//! Example plugin: the `size-aware` eviction policy for the radix cache.
//!
//! LRU evicts the oldest leaf whatever its size. When memory is what runs out,
//! freeing one long, rarely reused prefix can spare many short hot ones. This
//! policy orders leaves by tokens per hit (largest first), breaking ties by
//! age — a GreedyDual-Size flavour. Keys: `(-(tokens / (hits + 1)), last_access)`.
#![allow(unsafe_code)]

use arbor_plugin_api::NodeMetaV1;

/// The eviction key: smaller is evicted first.
pub fn size_aware_key(m: &NodeMetaV1) -> (f64, f64) {
    (
        -(m.tokens as f64) / (m.hit_count as f64 + 1.0),
        m.last_access as f64,
    )
}

arbor_plugin_api::export_plugin! {
    name: "size-aware-eviction",
    version: "0.1.0",
    eviction_policies: [("size-aware", "evicts the largest, least reused prefixes first (tokens per hit)", size_aware_key)],
    logits_processors: [],
    samplers: [],
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn big_cold_nodes_go_first() {
        let big = NodeMetaV1 {
            tokens: 512,
            hit_count: 0,
            last_access: 10,
            ..Default::default()
        };
        let small = NodeMetaV1 {
            tokens: 16,
            hit_count: 0,
            last_access: 1,
            ..Default::default()
        };
        assert!(size_aware_key(&big) < size_aware_key(&small));
        let big_hot = NodeMetaV1 {
            hit_count: 100,
            ..big
        };
        assert!(size_aware_key(&small) < size_aware_key(&big_hot));
    }
}
