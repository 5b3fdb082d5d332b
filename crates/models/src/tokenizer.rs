//! Tokenizers, generation configs and special tokens of a model folder.
//!
//! [`TextTokenizer`] wraps a `tokenizers` tokenizer (from `tokenizer.json` or
//! built from GGUF metadata) together with the ids the engine needs: BOS,
//! every EOS id (from `generation_config.json`, `config.json` and the
//! tokenizer config), and whether BOS is added. It implements engine-core's
//! [`TokenDecoder`] for incremental detokenization.

use arbor_engine_core::{CoreError, Result, TokenDecoder};
use serde_json::Value;
use std::path::Path;

/// A tokenizer and the special tokens around it.
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    /// BOS id, when the model has one.
    pub bos_token_id: Option<u32>,
    /// Ids that end generation.
    pub eos_token_ids: Vec<u32>,
    /// Text of the BOS token (for chat templates).
    pub bos_token: Option<String>,
    /// Text of the main EOS token (for chat templates).
    pub eos_token: Option<String>,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "TextTokenizer(vocab {}, bos {:?}, eos {:?})",
            self.vocab_size(),
            self.bos_token_id,
            self.eos_token_ids
        )
    }
}

fn read_json(path: &Path) -> Result<Option<Value>> {
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|e| CoreError::io(path, e))?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| CoreError::load(format!("{}: invalid JSON: {e}", path.display())))
}

/// Ids from a JSON value that is an id or a list of ids.
fn ids_of(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_u64())
            .map(|x| x as u32)
            .collect(),
        _ => Vec::new(),
    }
}

/// A special token's text in tokenizer_config.json (a string or `{"content": ...}`).
fn token_text(v: Option<&Value>) -> Option<String> {
    match v {
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Object(o)) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

impl TextTokenizer {
    /// Wraps a tokenizer with its special tokens.
    pub fn new(
        inner: tokenizers::Tokenizer,
        bos_token_id: Option<u32>,
        eos_token_ids: Vec<u32>,
    ) -> Self {
        let bos_token = bos_token_id.and_then(|i| inner.id_to_token(i));
        let eos_token = eos_token_ids.first().and_then(|&i| inner.id_to_token(i));
        Self {
            inner,
            bos_token_id,
            eos_token_ids,
            bos_token,
            eos_token,
        }
    }

    /// Loads `tokenizer.json` and the special tokens of a HF model folder.
    pub fn from_dir(dir: &Path, config: &Value) -> Result<Self> {
        let tpath = dir.join("tokenizer.json");
        if !tpath.exists() {
            return Err(CoreError::load(format!(
                "{}: file is missing",
                tpath.display()
            )));
        }
        let inner = tokenizers::Tokenizer::from_file(&tpath)
            .map_err(|e| CoreError::load(format!("{}: {e}", tpath.display())))?;
        let tcfg = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or(Value::Null);
        let gen_cfg = read_json(&dir.join("generation_config.json"))?.unwrap_or(Value::Null);
        let by_text = |v: Option<&Value>| token_text(v).and_then(|t| inner.token_to_id(&t));
        let bos = ids_of(gen_cfg.get("bos_token_id"))
            .first()
            .copied()
            .or_else(|| ids_of(config.get("bos_token_id")).first().copied())
            .or_else(|| by_text(tcfg.get("bos_token")));
        let mut eos = ids_of(gen_cfg.get("eos_token_id"));
        for id in ids_of(config.get("eos_token_id"))
            .into_iter()
            .chain(by_text(tcfg.get("eos_token")))
        {
            if !eos.contains(&id) {
                eos.push(id);
            }
        }
        let mut t = Self::new(inner, bos, eos);
        if let Some(s) = token_text(tcfg.get("bos_token")) {
            t.bos_token = Some(s);
        }
        if let Some(s) = token_text(tcfg.get("eos_token")) {
            t.eos_token = Some(s);
        }
        Ok(t)
    }

    /// Token ids of `text`; `add_special_tokens` applies the tokenizer's post-processor (BOS).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        self.inner
            .encode(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| CoreError::invalid(format!("tokenizing: {e}")))
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The id of a token's text, if it is one token.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

impl TokenDecoder for TextTokenizer {
    fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| CoreError::invalid(format!("detokenizing: {e}")))
    }
}
