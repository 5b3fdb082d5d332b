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
//! It also owns [`ModelDrafter`], the speculators that run a model to draft:
//! `standalone` (a separate draft model sharing the target's tokenizer,
//! SGLang's STANDALONE) and `layerskip` (the target's own first N layers,
//! self-speculative).
//!
//! And it owns [`Eagle3Head`], an EAGLE3 draft head (SpecForge / SGLang
//! `LlamaForCausalLMEagle3` checkpoints): loading, the fusion of the
//! target's three aux hidden states and one draft forward over its own
//! one-layer KV cache; and [`EagleHead`], an EAGLE draft head (EAGLE-1 /
//! EAGLE-2 checkpoints, SGLang `LlamaForCausalLMEagle`): `fc` over the
//! target token's embedding and the target's final normed hidden state,
//! Llama layer(s) without the first input norm, and the target's own LM
//! head. [`HeadDrafter`] drafts with either (or any [`DraftHead`]) from the
//! target's hidden states (`eagle3`, SGLang's EAGLE3; `eagle`, SGLang's EAGLE).
//!
//! And [`MtpHead`], the MTP / NEXTN draft head: the next-n prediction layer
//! shipped in the target's own checkpoint (DeepSeek-V3 layout,
//! `num_nextn_predict_layers`), run by [`HeadDrafter`] over the target's
//! final normed hidden states (`nextn`, SGLang's NEXTN).
//!
//! They register with `inventory` as the speculators `ngram`, `standalone`,
//! `layerskip`, `eagle3`, `eagle` and `nextn`; a binary must reference the
//! crate (`use
//! arbor_spec_decode as _;`) for the entries to be linked in.
//!
//! Invariant kept by every call: the trie never holds more than `capacity`
//! nodes, and drafts satisfy [`Draft`](arbor_engine_core::Draft)'s tree
//! invariant.

mod choose;
mod draft;
mod eagle;
mod eagle3;
mod head;
mod head_common;
mod head_drafter;
mod head_tree;
mod model;
mod mtp;
mod ngram;
mod trie;

#[cfg(test)]
mod tests;

pub use eagle::{EAGLE_ARCHITECTURE, EagleConfig, EagleHead, EagleOutput};
pub use eagle3::{EAGLE3_ARCHITECTURE, Eagle3Config, Eagle3Head, Eagle3Output};
pub use head::{DraftHead, HeadOutput};
pub use head_drafter::HeadDrafter;
pub use model::ModelDrafter;
pub use mtp::{MtpHead, NEXTN_LAYERS_KEY};
pub use ngram::{MAX_CAPACITY, MAX_PATH_LEN, NgramSpeculator, NgramStats};

use arbor_engine_core::registry::SpeculatorEntry;

arbor_engine_core::inventory::submit! {
    SpeculatorEntry {
        name: "ngram",
        about: "n-gram trie over recent prompt and output tokens (SGLang's NGRAM): chain, BFS or PROB trees",
        create: |cfg, _| Ok(Box::new(NgramSpeculator::from_config(cfg)?)),
    }
}

arbor_engine_core::inventory::submit! {
    SpeculatorEntry {
        name: "standalone",
        about: "a separate draft model with the target's tokenizer (SGLang's STANDALONE): greedy chains, its KV in the target's pages",
        create: |cfg, inputs| Ok(Box::new(ModelDrafter::standalone(cfg, inputs)?)),
    }
}

arbor_engine_core::inventory::submit! {
    SpeculatorEntry {
        name: "layerskip",
        about: "self-speculative layer skip: the target's first N layers, final norm and LM head draft greedy chains over its own KV",
        create: |cfg, inputs| Ok(Box::new(ModelDrafter::layer_skip(cfg, inputs)?)),
    }
}

arbor_engine_core::inventory::submit! {
    SpeculatorEntry {
        name: "eagle3",
        about: "an EAGLE3 draft head over the target's low/mid/high hidden states (SGLang's EAGLE3): chains or trees, its KV in the target's pages",
        create: |cfg, inputs| Ok(Box::new(HeadDrafter::eagle3(cfg, inputs)?)),
    }
}

arbor_engine_core::inventory::submit! {
    SpeculatorEntry {
        name: "nextn",
        about: "the next-n prediction (MTP) layer of the target's own checkpoint (SGLang's NEXTN) over its final hidden states: chains or trees, its KV in the target's pages",
        create: |cfg, inputs| Ok(Box::new(HeadDrafter::nextn(cfg, inputs)?)),
    }
}

arbor_engine_core::inventory::submit! {
    SpeculatorEntry {
        name: "eagle",
        about: "an EAGLE (EAGLE-1/2) draft head over the target's final hidden state, with the target's LM head (SGLang's EAGLE): chains or trees, its KV in the target's pages",
        create: |cfg, inputs| Ok(Box::new(HeadDrafter::eagle(cfg, inputs)?)),
    }
}
