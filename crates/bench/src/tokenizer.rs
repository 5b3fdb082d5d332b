//! The tokenizer the client side uses to build prompts and count tokens.
//!
//! A benchmark client does not know the server's tokenizer. Like SGLang's
//! `bench_serving`, it uses the model's tokenizer when given one
//! (`--tokenizer`, or a local `--model` folder holding `tokenizer.json`):
//! then [`PromptTokenizer::Exact`] counts exactly what the server will count
//! for plain text (chat backends add their template's tokens on the server).
//!
//! Without one, [`PromptTokenizer::Words`] is a documented approximation:
//! a "token" is a whitespace-separated word; synthetic prompts are made of
//! common English words from [`WORDS`], each a single token in the
//! Llama/Qwen/GPT BPE vocabularies when preceded by a space, so their server
//! token count is close to the word count; natural text (ShareGPT) usually has
//! more tokens than words. The server's own `prompt_tokens` are recorded per
//! request, and the result block uses them for input totals in this mode.
//!
//! Invariants: `encode` is deterministic; for `Words`, `decode(encode(t))`
//! reproduces `t` up to whitespace for texts made of [`WORDS`], and ids of
//! other words are stable hashes (equal words, equal ids), so prefix sharing
//! measured on ids reflects sharing in the text.

use crate::error::{BenchError, Result};
use arbor_models::TextTokenizer;
use std::path::Path;
use std::sync::Arc;

/// Common English words used for synthetic prompts without a tokenizer.
pub const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by",
    "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an",
    "had", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has", "there",
    "been", "if", "more", "when", "will", "would", "who", "so", "no", "she", "other", "its", "may",
    "these", "what", "them", "than", "some", "him", "time", "into", "only", "do", "could", "new",
    "about", "two", "then", "first", "also", "any", "my", "now", "such", "like", "our", "over",
    "man", "me", "even", "most", "made", "after", "many", "did", "must", "before", "back", "see",
    "through", "way", "where", "get", "much", "go", "well", "your", "know", "should", "down",
    "work", "year", "because", "come", "people", "just", "say", "each", "those", "take", "day",
    "good", "how", "long", "own", "too", "little", "use", "us", "very", "great", "still", "make",
    "between", "life", "being", "here", "old", "both", "under", "never", "last", "world", "same",
    "might", "while", "another", "house", "part", "found", "place", "again", "off", "state",
    "high", "right", "small", "three", "think", "water", "public", "every", "around", "system",
    "point", "number", "home", "hand", "end", "set", "left", "why", "name", "since", "large",
    "light", "help", "open", "city", "next", "line", "form", "case", "fact", "group", "real",
    "body", "night", "word", "book", "road", "table", "power", "money", "change", "order", "story",
    "river", "market", "field", "value", "model", "data", "plan", "idea", "green", "blue", "red",
    "white", "black", "music", "paper", "game", "food", "test", "answer", "question", "result",
    "reason", "school",
];

/// A client-side tokenizer: the model's, or the word approximation.
#[derive(Clone, Debug)]
pub enum PromptTokenizer {
    /// The model's tokenizer.
    Exact(Arc<TextTokenizer>),
    /// Words stand for tokens (no tokenizer given).
    Words,
}

/// Whether `path` is a file starting with the GGUF magic.
fn is_gguf(path: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    path.is_file()
        && std::fs::File::open(path)
            .and_then(|mut f| f.read_exact(&mut magic))
            .is_ok()
        && &magic == b"GGUF"
}

/// Id of a word outside [`WORDS`]: a stable hash with the top bit set, so
/// it never collides with a word-list index.
fn word_hash(w: &str) -> u32 {
    let mut h: u32 = 0x811C_9DC5;
    for b in w.bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h | 0x8000_0000
}

impl PromptTokenizer {
    /// Loads a tokenizer from a model folder (with `tokenizer.json`), a
    /// `tokenizer.json` file or a GGUF model file (its `tokenizer.ggml.*` metadata).
    pub fn load(path: &Path) -> Result<Self> {
        if path.is_dir() {
            let config = std::fs::read_to_string(path.join("config.json"))
                .ok()
                .and_then(|t| serde_json::from_str(&t).ok())
                .unwrap_or(serde_json::Value::Null);
            let t = TextTokenizer::from_dir(path, &config)
                .map_err(|e| BenchError::Tokenizer(e.to_string()))?;
            return Ok(Self::Exact(Arc::new(t)));
        }
        if is_gguf(path) {
            let err = |e: arbor_gguf::GgufError| {
                BenchError::Tokenizer(format!("{}: {e}", path.display()))
            };
            let file = arbor_gguf::GgufFile::open(path).map_err(err)?;
            let g = arbor_gguf::load_tokenizer(&file).map_err(err)?;
            return Ok(Self::Exact(Arc::new(TextTokenizer::new(
                g.tokenizer,
                g.bos_token_id,
                g.eos_token_ids,
            ))));
        }
        if path.is_file() {
            let inner = tokenizers::Tokenizer::from_file(path)
                .map_err(|e| BenchError::Tokenizer(format!("{}: {e}", path.display())))?;
            return Ok(Self::Exact(Arc::new(TextTokenizer::new(
                inner,
                None,
                Vec::new(),
            ))));
        }
        Err(BenchError::Tokenizer(format!(
            "{}: no such file or folder (expected a model folder, a tokenizer.json or a GGUF file)",
            path.display()
        )))
    }

    /// Whether `path` can supply a tokenizer: a folder with `tokenizer.json`,
    /// or a GGUF file.
    pub fn usable(path: &Path) -> bool {
        path.join("tokenizer.json").is_file() || is_gguf(path)
    }

    /// The tokenizer named by `--tokenizer`, else the first of `candidates`
    /// (the `--model` name, then the server's model name and tokenizer path,
    /// as SGLang uses the model name as the tokenizer) that is a local model,
    /// else the word approximation (with a note on stderr).
    pub fn resolve(tokenizer: Option<&Path>, candidates: &[&str]) -> Result<Self> {
        if let Some(p) = tokenizer {
            return Self::load(p);
        }
        if let Some(p) = candidates.iter().map(Path::new).find(|p| Self::usable(p)) {
            eprintln!("tokenizer: {}", p.display());
            return Self::load(p);
        }
        eprintln!(
            "note: no tokenizer given (--tokenizer); words stand in for tokens, so client-side \
             token counts are approximate (the server's prompt_tokens are used when it reports them)"
        );
        Ok(Self::Words)
    }

    /// Whether counts are exact.
    pub fn is_exact(&self) -> bool {
        matches!(self, Self::Exact(_))
    }

    /// Token ids of `text`; `special` adds the tokenizer's special tokens (BOS),
    /// like Hugging Face's `encode` default.
    pub fn encode(&self, text: &str, special: bool) -> Result<Vec<u32>> {
        match self {
            Self::Exact(t) => t
                .encode(text, special)
                .map_err(|e| BenchError::Tokenizer(e.to_string())),
            Self::Words => Ok(text
                .split_whitespace()
                .map(|w| {
                    WORDS
                        .iter()
                        .position(|x| *x == w)
                        .map_or_else(|| word_hash(w), |i| i as u32)
                })
                .collect()),
        }
    }

    /// Number of tokens of `text` (with special tokens when `special`).
    pub fn count(&self, text: &str, special: bool) -> Result<usize> {
        Ok(self.encode(text, special)?.len())
    }

    /// Text of `ids` (special tokens skipped). For `Words`, ids index [`WORDS`].
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        match self {
            Self::Exact(t) => t
                .inner()
                .decode(ids, true)
                .map_err(|e| BenchError::Tokenizer(e.to_string())),
            Self::Words => Ok(ids
                .iter()
                .map(|&i| WORDS[i as usize % WORDS.len()])
                .collect::<Vec<_>>()
                .join(" ")),
        }
    }

    /// Ids that random prompts draw from: the vocabulary without special
    /// (added, `special: true`) tokens; for `Words`, the word-list indices.
    pub fn sample_ids(&self) -> Vec<u32> {
        match self {
            Self::Exact(t) => {
                let inner = t.inner();
                let special: std::collections::HashSet<u32> = inner
                    .get_added_tokens_decoder()
                    .iter()
                    .filter(|(_, tok)| tok.special)
                    .map(|(id, _)| *id)
                    .collect();
                (0..inner.get_vocab_size(true) as u32)
                    .filter(|i| !special.contains(i))
                    .collect()
            }
            Self::Words => (0..WORDS.len() as u32).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_round_trip_and_hash_unknown_words() {
        let t = PromptTokenizer::Words;
        let ids = t.encode("the  river of   time", true).unwrap();
        assert_eq!(ids.len(), 4);
        assert_eq!(t.decode(&ids).unwrap(), "the river of time");
        let a = t.encode("zebra", false).unwrap();
        assert_eq!(a, t.encode("zebra", false).unwrap());
        assert!(a[0] >= 0x8000_0000);
        assert_eq!(t.count("one two three", false).unwrap(), 3);
        assert_eq!(t.sample_ids().len(), WORDS.len());
        assert!(!t.is_exact());
    }

    #[test]
    fn missing_tokenizer_path_is_an_error() {
        let e = PromptTokenizer::load(Path::new("/nonexistent/tok")).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/tok"));
    }
}
