//! The tokenizer as llguidance sees it: a `toktrie` [`TokenizerEnv`] built from
//! engine-core's [`GrammarVocab`] or straight from a `tokenizers::Tokenizer`.
//!
//! This replaces `toktrie_hf_tokenizers` (which links its own, older copy of
//! `tokenizers`): token bytes come from `llguidance::token_bytes_from_tokenizer_json`
//! (byte-level BPE and SentencePiece byte-fallback vocabularies; special
//! added tokens get toktrie's `0xFF` marker so grammar text never matches
//! them), and canonical tokenization of forced bytes from the workspace's
//! `tokenizers`.
//!
//! Invariants: the trie has `max(model vocab, tokenizer vocab)` ids, ids
//! without bytes are never allowed, and at least one EOS id is in range.
//! A tokenizer is only declared canonical (so llguidance forces tokens for
//! jump-forward) after it re-tokenizes probe strings to exactly their bytes;
//! otherwise forced text is left to the model (forced bytes, no forced tokens).

use arbor_engine_core::grammar::{
    GrammarError, GrammarResult, GrammarVocab, VocabSource, catch_panic,
};
use serde_json::Value;
use std::sync::Arc;
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

/// A [`TokenizerEnv`] over a `tokenizers::Tokenizer` (or only token bytes).
pub struct HfTokenizerEnv {
    trie: TokTrie,
    tokenizer: Option<tokenizers::Tokenizer>,
    canonical: bool,
}

impl std::fmt::Debug for HfTokenizerEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "HfTokenizerEnv(vocab {}, canonical {})",
            self.trie.vocab_size(),
            self.canonical
        )
    }
}

impl TokenizerEnv for HfTokenizerEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        match &self.tokenizer {
            Some(t) => self.trie.tokenize_with_greedy_fallback(s, |s| {
                t.encode_fast(s, false)
                    .map(|e| e.get_ids().to_vec())
                    .unwrap_or_else(|_| self.trie.greedy_tokenize(s.as_bytes()))
            }),
            None => self.trie.greedy_tokenize(s),
        }
    }

    fn tokenize_is_canonical(&self) -> bool {
        self.canonical
    }
}

impl HfTokenizerEnv {
    /// Whether forced bytes are tokenized canonically (jump-forward gets tokens).
    pub fn is_canonical(&self) -> bool {
        self.canonical
    }
}

fn vocab_err(msg: impl std::fmt::Display) -> GrammarError {
    GrammarError::Vocab(msg.to_string())
}

/// Drops the normalizer and pre-tokenizer steps that prepend `▁` to every
/// input (SentencePiece `add_space_prefix`), which would make tokenizing a
/// fragment of the output add a space.
fn strip_prefix_space(tok: &mut Value) {
    let normalizer = &mut tok["normalizer"];
    if normalizer["type"] == "Prepend" {
        *normalizer = Value::Null;
    } else if let Some(list) = normalizer
        .get_mut("normalizers")
        .and_then(Value::as_array_mut)
    {
        list.retain(|n| n["type"] != "Prepend");
    }
    fn metaspace(v: &mut Value) {
        if v["type"] == "Metaspace" {
            if let Some(o) = v.as_object_mut() {
                o.insert("prepend_scheme".into(), Value::String("never".into()));
                o.insert("add_prefix_space".into(), Value::Bool(false));
            }
        } else if let Some(list) = v.get_mut("pretokenizers").and_then(Value::as_array_mut) {
            list.iter_mut().for_each(metaspace);
        }
    }
    metaspace(&mut tok["pre_tokenizer"]);
}

/// Builds the environment from a `tokenizer.json` document.
pub fn env_from_tokenizer_json(
    json: &str,
    eos_token_ids: &[u32],
    vocab_size: Option<usize>,
) -> GrammarResult<Arc<HfTokenizerEnv>> {
    let mut doc: Value = serde_json::from_str(json)
        .map_err(|e| vocab_err(format!("tokenizer.json is not valid JSON: {e}")))?;
    let token_bytes = catch_panic(|| {
        llguidance::token_bytes_from_tokenizer_json(&doc).map_err(|e| vocab_err(format!("{e:#}")))
    })?;
    strip_prefix_space(&mut doc);
    let tokenizer: tokenizers::Tokenizer = serde_json::from_value(doc)
        .map_err(|e| vocab_err(format!("tokenizer.json does not load: {e}")))?;
    let n = vocab_size.unwrap_or(0).max(tokenizer.get_vocab_size(true));
    build_env(token_bytes, n, eos_token_ids, Some(tokenizer))
}

/// Builds the environment from a loaded tokenizer (e.g. from a GGUF file).
pub fn env_from_tokenizer(
    tokenizer: &tokenizers::Tokenizer,
    eos_token_ids: &[u32],
    vocab_size: Option<usize>,
) -> GrammarResult<Arc<HfTokenizerEnv>> {
    let json = tokenizer
        .to_string(false)
        .map_err(|e| vocab_err(format!("cannot serialize the tokenizer: {e}")))?;
    env_from_tokenizer_json(&json, eos_token_ids, vocab_size)
}

/// Builds the environment from engine-core's neutral description.
pub fn env_from_vocab(vocab: &GrammarVocab) -> GrammarResult<Arc<HfTokenizerEnv>> {
    match &vocab.source {
        VocabSource::TokenizerJson(json) => {
            env_from_tokenizer_json(json, &vocab.eos_token_ids, vocab.vocab_size)
        }
        VocabSource::TokenBytes { tokens, special } => {
            let mut bytes: Vec<Vec<u8>> = tokens.as_ref().clone();
            for &s in special {
                if let Some(b) = bytes.get_mut(s as usize)
                    && b.first() != Some(&TokTrie::SPECIAL_TOKEN_MARKER)
                {
                    b.insert(0, TokTrie::SPECIAL_TOKEN_MARKER);
                }
            }
            let n = vocab.vocab_size.unwrap_or(0);
            build_env(bytes, n, &vocab.eos_token_ids, None)
        }
    }
}

fn build_env(
    mut token_bytes: Vec<Vec<u8>>,
    min_vocab: usize,
    eos_token_ids: &[u32],
    tokenizer: Option<tokenizers::Tokenizer>,
) -> GrammarResult<Arc<HfTokenizerEnv>> {
    let n = min_vocab.max(token_bytes.len());
    if n == 0 {
        return Err(vocab_err("the vocabulary is empty"));
    }
    let n32 = u32::try_from(n).map_err(|_| vocab_err(format!("vocabulary of {n} ids")))?;
    token_bytes.resize(n, Vec::new());
    if eos_token_ids.is_empty() {
        return Err(vocab_err("no EOS token id given"));
    }
    if let Some(&bad) = eos_token_ids.iter().find(|&&e| e >= n32) {
        return Err(vocab_err(format!(
            "EOS id {bad} is outside the vocabulary of {n} ids"
        )));
    }
    if let Some(t) = token_bytes.iter().find(|t| t.len() > u16::MAX as usize) {
        return Err(vocab_err(format!("a token of {} bytes", t.len())));
    }
    let trie = catch_panic(|| {
        let info = TokRxInfo::new(n32, eos_token_ids[0]);
        Ok(TokTrie::from(&info, &token_bytes).with_eos_tokens(eos_token_ids))
    })
    .map_err(|e| vocab_err(format!("cannot build the token trie: {e}")))?;
    let mut env = HfTokenizerEnv {
        trie,
        tokenizer,
        canonical: false,
    };
    if env.tokenizer.is_some() {
        env.canonical = catch_panic(|| Ok(probe_canonical(&env))).unwrap_or(false);
        if !env.canonical {
            tracing::warn!(
                "grammar: the tokenizer does not round-trip text fragments; jump-forward will force bytes, not tokens"
            );
        }
    }
    Ok(Arc::new(env))
}

/// True when tokenizing fragments gives back exactly their bytes.
fn probe_canonical(env: &HfTokenizerEnv) -> bool {
    const PROBES: &[&str] = &[
        "a",
        "{\"name\": \"",
        " world",
        "\n  ",
        "x1.5e-3}",
        "é€😀",
        "\":",
    ];
    PROBES.iter().all(|p| {
        let toks = env.tokenize_bytes(p.as_bytes());
        !toks.is_empty() && env.trie.decode_raw(&toks) == p.as_bytes()
    })
}

/// The environment as llguidance's shared handle.
pub fn to_tok_env(env: Arc<HfTokenizerEnv>) -> TokEnv {
    env
}
