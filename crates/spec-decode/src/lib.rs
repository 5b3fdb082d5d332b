//! Arbor's speculators for speculative decoding.
//!
//! This crate owns [`NgramSpeculator`], SGLang's NGRAM speculator
//! (`--speculative-algorithm NGRAM`): one trie shared by all requests over
//! their recent prompt and output tokens, counting how often each n-gram was
//! followed by each token, bounded to `capacity` nodes with the least recently
//! used dropped first. A request's draft continues the longest suffix of its
//! tokens found in the trie, as a chain (most frequent continuation) or as a
//! tree (`BFS` by recency with a breadth that shrinks with depth, or `PROB` by
//! estimated probability).
//!
//! It registers with `inventory` as the speculator `ngram`; a binary must
//! reference the crate (`use arbor_spec_decode as _;`) for the entry to be
//! linked in.
//!
//! Invariant kept by every call: the trie never holds more than `capacity`
//! nodes, and drafts satisfy [`Draft`](arbor_engine_core::Draft)'s tree
//! invariant.

mod draft;
mod ngram;
mod trie;

#[cfg(test)]
mod tests;

pub use ngram::{MAX_CAPACITY, MAX_PATH_LEN, NgramSpeculator, NgramStats};

use arbor_engine_core::registry::SpeculatorEntry;

arbor_engine_core::inventory::submit! {
    SpeculatorEntry {
        name: "ngram",
        about: "n-gram trie over recent prompt and output tokens (SGLang's NGRAM): chain, BFS or PROB trees",
        create: |cfg| Ok(Box::new(NgramSpeculator::from_config(cfg)?)),
    }
}
