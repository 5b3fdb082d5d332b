//! A `tokenizers::Tokenizer` built from GGUF `tokenizer.ggml.*` metadata,
//! tokenizing as llama.cpp does (`llama_tokenize` with `parse_special = true`).
//!
//! Supported `tokenizer.ggml.model` values:
//! - `gpt2`: byte-level BPE from `tokens` + `merges`, pre-tokenized by the
//!   regexes llama.cpp picks from `tokenizer.ggml.pre` (see [`crate::pretok`]);
//! - `llama`: SentencePiece-style BPE. llama.cpp merges the adjacent pair whose
//!   concatenation is the vocabulary token with the highest score; we derive the
//!   equivalent merge list (every split of every token into two vocabulary
//!   tokens, ranked by the token's score) and use byte fallback (`<0xXX>`).
//!   Spaces become `▁`, and `▁` is prepended to every text segment when
//!   `tokenizer.ggml.add_space_prefix` (default true) says so, which is what
//!   llama.cpp does after BOS and after every special token.
//!
//! Tokens typed control (3), user-defined (4) or unknown (2) in
//! `tokenizer.ggml.token_type` become added tokens matched in raw text before
//! the model runs; control and unknown ones are "special" (skipped by
//! `decode(.., true)`). BOS/EOS are added by the post-processor when
//! `add_bos_token`/`add_eos_token` (or llama.cpp's defaults) say so, i.e. when
//! `encode(text, true)` is called.
//!
//! Invariant: every id the tokenizer produces is `< tokens.len()`.

use crate::error::{GgufError, Result};
use crate::file::GgufFile;
use crate::pretok::bpe_pre_tokenizer;
use crate::special;
use std::collections::{HashMap, HashSet};
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormalizerSequence};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence as PreSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{
    AddedToken, DecoderWrapper, NormalizerWrapper, PreTokenizerWrapper, SplitDelimiterBehavior,
    Tokenizer,
};

/// `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`).
pub mod token_type {
    pub const NORMAL: i32 = 1;
    pub const UNKNOWN: i32 = 2;
    pub const CONTROL: i32 = 3;
    pub const USER_DEFINED: i32 = 4;
    pub const UNUSED: i32 = 5;
    pub const BYTE: i32 = 6;
}

/// Which tokenizer model the file uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenizerKind {
    /// `gpt2`: byte-level BPE.
    Gpt2,
    /// `llama`: SentencePiece-style BPE with byte fallback.
    Llama,
}

/// The tokenizer of a GGUF file and the facts around it.
#[derive(Clone, Debug)]
pub struct GgufTokenizer {
    /// The tokenizer; `encode(text, true)` adds BOS/EOS as llama.cpp would.
    pub tokenizer: Tokenizer,
    /// Which tokenizer model the metadata named.
    pub kind: TokenizerKind,
    /// The pre-tokenizer type used (`smollm`, `llama3`, ...; `spm` for `llama`).
    pub pre_tokenizer: String,
    /// `tokenizer.ggml.bos_token_id`.
    pub bos_token_id: Option<u32>,
    /// Stop ids, llama.cpp's end-of-generation set: `eos_token_id` first, then
    /// EOT and EOM, then the rest ascending (tokens such as `<|endoftext|>` and
    /// `<|im_end|>` found by text, and FIM pad/repo/sep tokens, as llama.cpp does).
    pub eos_token_ids: Vec<u32>,
    /// `tokenizer.ggml.unknown_token_id`.
    pub unk_token_id: Option<u32>,
    /// `tokenizer.ggml.padding_token_id`.
    pub pad_token_id: Option<u32>,
    /// Whether `encode(.., true)` puts BOS first.
    pub add_bos: bool,
    /// Whether `encode(.., true)` puts EOS last.
    pub add_eos: bool,
    /// `tokenizer.chat_template`.
    pub chat_template: Option<String>,
    /// Vocabulary size (`tokenizer.ggml.tokens` length).
    pub vocab_size: usize,
    /// Things that loaded but deserve a log line (an unknown `pre`, ...).
    pub warnings: Vec<String>,
}

impl GgufTokenizer {
    /// Token ids of `text`; special-token texts in it become their ids, and
    /// BOS/EOS are added when `add_special` and the metadata say so.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        self.tokenizer
            .encode_fast(text, add_special)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| GgufError::tokenizer(format!("encoding failed: {e}")))
    }

    /// Text of `ids`; special tokens are left out when `skip_special`.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.tokenizer
            .decode(ids, skip_special)
            .map_err(|e| GgufError::tokenizer(format!("decoding failed: {e}")))
    }

    /// True for ids that end generation.
    pub fn is_eog(&self, id: u32) -> bool {
        self.eos_token_ids.contains(&id)
    }

    /// The first stop id: EOS when the metadata names one (else EOT, then EOM).
    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_token_ids.first().copied()
    }

    /// The text of a token id.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.tokenizer.id_to_token(id)
    }
}

impl arbor_engine_core::TokenDecoder for GgufTokenizer {
    fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> arbor_engine_core::Result<String> {
        GgufTokenizer::decode(self, ids, skip_special_tokens).map_err(Into::into)
    }
}

fn tok_err<E: std::fmt::Display>(what: &str) -> impl FnOnce(E) -> GgufError + '_ {
    move |e| GgufError::tokenizer(format!("{what}: {e}"))
}

/// Builds the tokenizer described by the file's `tokenizer.*` metadata.
pub fn load_tokenizer(file: &GgufFile) -> Result<GgufTokenizer> {
    const MODEL: &str = "tokenizer.ggml.model";
    const TOKENS: &str = "tokenizer.ggml.tokens";
    let model = file.require_str(MODEL)?;
    let kind = match model {
        "gpt2" => TokenizerKind::Gpt2,
        "llama" => TokenizerKind::Llama,
        other => {
            return Err(GgufError::InvalidValue {
                key: MODEL.into(),
                reason: format!(
                    "tokenizer model '{other}' is not supported (supported: gpt2, llama)"
                ),
            });
        }
    };
    let raw_tokens = file
        .get_str_array(TOKENS)?
        .ok_or_else(|| GgufError::MissingKey(TOKENS.into()))?;
    if raw_tokens.is_empty() || raw_tokens.len() >= u32::MAX as usize {
        return Err(GgufError::InvalidValue {
            key: TOKENS.into(),
            reason: format!("{} tokens; expected 1 to 2^32-2", raw_tokens.len()),
        });
    }
    let n = raw_tokens.len();
    // llama.cpp renames empty tokens so that every text is distinct from "".
    let tokens: Vec<String> = raw_tokens
        .iter()
        .enumerate()
        .map(|(i, t)| {
            if t.is_empty() {
                format!("[EMPTY_{i}]")
            } else {
                t.clone()
            }
        })
        .collect();
    let mut types = per_token(
        file.get_i32_array("tokenizer.ggml.token_type")?,
        n,
        token_type::NORMAL,
        "tokenizer.ggml.token_type",
    )?;
    let mut by_text: HashMap<&str, u32> = HashMap::with_capacity(n);
    for (id, t) in tokens.iter().enumerate() {
        by_text.insert(t.as_str(), id as u32);
    }

    let mut warnings = Vec::new();
    let defaults = match kind {
        TokenizerKind::Llama => (Some(1), Some(2), Some(0)),
        TokenizerKind::Gpt2 => (None, None, None),
    };
    let defaults = (
        defaults.0.filter(|&i| (i as usize) < n),
        defaults.1.filter(|&i| (i as usize) < n),
        defaults.2.filter(|&i| (i as usize) < n),
    );
    let ids = special::resolve(file, &tokens, &by_text, &mut types, defaults, &mut warnings)?;

    let (mut tokenizer, pre_name, default_add_bos) = match kind {
        TokenizerKind::Gpt2 => {
            let pre = file.get_str("tokenizer.ggml.pre")?;
            let spec = bpe_pre_tokenizer(pre);
            if spec.fallback || pre.is_none() {
                warnings.push(format!(
                    "tokenizer.ggml.pre {}; using llama.cpp's default pre-tokenizer",
                    pre.map_or("is absent".to_string(), |p| format!(
                        "'{p}' is not recognised"
                    ))
                ));
            }
            let merges = file
                .get_str_array("tokenizer.ggml.merges")?
                .ok_or_else(|| GgufError::MissingKey("tokenizer.ggml.merges".into()))?;
            let t = build_gpt2(&tokens, merges, spec.regexes, spec.ignore_merges)?;
            (t, spec.kind.to_string(), spec.add_bos)
        }
        TokenizerKind::Llama => {
            let scores = per_token(
                file.get_f32_array("tokenizer.ggml.scores")?,
                n,
                0.0,
                "tokenizer.ggml.scores",
            )?;
            let add_space_prefix = file
                .get_bool("tokenizer.ggml.add_space_prefix")?
                .unwrap_or(true);
            let unk = ids.unk.and_then(|id| tokens.get(id as usize).cloned());
            let t = build_spm(&tokens, &scores, &types, add_space_prefix, unk)?;
            (t, "spm".to_string(), true)
        }
    };

    let add_bos = file
        .get_bool("tokenizer.ggml.add_bos_token")?
        .unwrap_or(default_add_bos);
    let add_eos = file
        .get_bool("tokenizer.ggml.add_eos_token")?
        .unwrap_or(false);
    add_special_tokens(&mut tokenizer, &tokens, &types)?;
    set_post_processor(
        &mut tokenizer,
        &tokens,
        ids.bos.filter(|_| add_bos),
        ids.eos.filter(|_| add_eos),
    )?;
    if add_bos && ids.bos.is_none() {
        warnings.push("add_bos_token is set but there is no BOS token id".into());
    }
    if add_eos && ids.eos.is_none() {
        warnings.push("add_eos_token is set but there is no EOS token id".into());
    }

    Ok(GgufTokenizer {
        tokenizer,
        kind,
        pre_tokenizer: pre_name,
        bos_token_id: ids.bos,
        eos_token_ids: ids.eog,
        unk_token_id: ids.unk,
        pad_token_id: ids.pad,
        add_bos,
        add_eos,
        chat_template: file.get_str("tokenizer.chat_template")?.map(str::to_owned),
        vocab_size: n,
        warnings,
    })
}

/// A per-token array (types, scores): `default` for every token when absent;
/// an error naming the key when its length differs from the vocabulary's.
fn per_token<T: Copy>(values: Option<&[T]>, n: usize, default: T, key: &str) -> Result<Vec<T>> {
    match values {
        None => Ok(vec![default; n]),
        Some(v) if v.len() == n => Ok(v.to_vec()),
        Some(v) => Err(GgufError::InvalidValue {
            key: key.to_string(),
            reason: format!("{} entries for {n} tokens", v.len()),
        }),
    }
}

/// Token text → id; for duplicate texts the last id wins, as in llama.cpp.
fn vocab_map(tokens: &[String]) -> Vocab {
    tokens
        .iter()
        .enumerate()
        .map(|(id, t)| (t.clone(), id as u32))
        .collect()
}

fn build_gpt2(
    tokens: &[String],
    merges: &[String],
    regexes: &[&str],
    ignore_merges: bool,
) -> Result<Tokenizer> {
    let vocab = vocab_map(tokens);
    // llama.cpp splits a merge at the first space after the first byte and
    // keeps the first rank of a repeated pair. Pairs whose parts or result are
    // not tokens could never produce a vocabulary token; drop them.
    let mut seen = HashSet::with_capacity(merges.len());
    let mut pairs = Vec::with_capacity(merges.len());
    for m in merges {
        let split = m
            .char_indices()
            .skip(1)
            .find(|&(_, c)| c == ' ')
            .map(|(i, _)| i);
        let Some(i) = split else { continue };
        let (a, b) = (&m[..i], &m[i + 1..]);
        if vocab.contains_key(a)
            && vocab.contains_key(b)
            && vocab.contains_key(&format!("{a}{b}"))
            && seen.insert((a, b))
        {
            pairs.push((a.to_string(), b.to_string()));
        }
    }
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, pairs)
        .ignore_merges(ignore_merges)
        .build()
        .map_err(tok_err("building the BPE model"))?;
    let mut pre: Vec<PreTokenizerWrapper> = Vec::with_capacity(regexes.len() + 1);
    for re in regexes {
        let split = Split::new(
            SplitPattern::Regex((*re).to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(tok_err("compiling a pre-tokenizer regex"))?;
        pre.push(split.into());
    }
    pre.push(ByteLevel::new(false, false, false).into());
    let mut tokenizer = Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(PreSequence::new(pre)));
    tokenizer.with_decoder(Some(ByteLevel::new(false, false, false)));
    Ok(tokenizer)
}

fn build_spm(
    tokens: &[String],
    scores: &[f32],
    types: &[i32],
    add_space_prefix: bool,
    unk: Option<String>,
) -> Result<Tokenizer> {
    let vocab = vocab_map(tokens);
    // Every way to write a token as the concatenation of two tokens is a merge
    // ranked by the token's score (higher first, ties by id), matching
    // llama.cpp's "merge the bigram whose result scores highest".
    let mut ranked: Vec<(f32, u32, usize, usize)> = Vec::new();
    for (id, t) in tokens.iter().enumerate() {
        if vocab.get(t) != Some(&(id as u32)) || types.get(id) == Some(&token_type::BYTE) {
            continue;
        }
        for (i, _) in t.char_indices().skip(1) {
            if vocab.contains_key(&t[..i]) && vocab.contains_key(&t[i..]) {
                ranked.push((scores.get(id).copied().unwrap_or(0.0), id as u32, id, i));
            }
        }
    }
    ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.3.cmp(&b.3)));
    let merges: Vec<(String, String)> = ranked
        .iter()
        .filter_map(|&(_, _, id, i)| {
            let t = tokens.get(id)?;
            Some((t.get(..i)?.to_string(), t.get(i..)?.to_string()))
        })
        .collect();
    let mut builder = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true)
        .fuse_unk(true);
    if let Some(unk) = unk {
        builder = builder.unk_token(unk);
    }
    let bpe = builder
        .build()
        .map_err(tok_err("building the SentencePiece BPE model"))?;

    let mut norm: Vec<NormalizerWrapper> = Vec::new();
    if add_space_prefix {
        norm.push(Prepend::new("▁".into()).into());
    }
    norm.push(
        Replace::new(" ", "▁")
            .map_err(tok_err("space normalizer"))?
            .into(),
    );
    let mut dec: Vec<DecoderWrapper> = vec![
        Replace::new("▁", " ")
            .map_err(tok_err("space decoder"))?
            .into(),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];
    if add_space_prefix {
        dec.push(Strip::new(' ', 1, 0).into());
    }
    let mut tokenizer = Tokenizer::new(bpe);
    tokenizer
        .with_normalizer(Some(NormalizerSequence::new(norm)))
        .map_err(tok_err("setting the normalizer"))?;
    tokenizer.with_decoder(Some(DecoderSequence::new(dec)));
    Ok(tokenizer)
}

/// Control, user-defined and unknown tokens are matched in raw text first.
fn add_special_tokens(tokenizer: &mut Tokenizer, tokens: &[String], types: &[i32]) -> Result<()> {
    let mut special = Vec::new();
    let mut user = Vec::new();
    for (text, &ty) in tokens.iter().zip(types) {
        if text.is_empty() {
            continue;
        }
        match ty {
            token_type::CONTROL | token_type::UNKNOWN => {
                special.push(AddedToken::from(text.clone(), true).normalized(false));
            }
            token_type::USER_DEFINED => {
                user.push(AddedToken::from(text.clone(), false).normalized(false));
            }
            _ => {}
        }
    }
    tokenizer
        .add_special_tokens(special)
        .map_err(tok_err("adding control tokens"))?;
    tokenizer
        .add_tokens(user)
        .map_err(tok_err("adding user-defined tokens"))?;
    Ok(())
}

fn set_post_processor(
    tokenizer: &mut Tokenizer,
    tokens: &[String],
    bos: Option<u32>,
    eos: Option<u32>,
) -> Result<()> {
    if bos.is_none() && eos.is_none() {
        return Ok(());
    }
    let mut single = Vec::new();
    let mut pair = Vec::new();
    let mut specials = Vec::new();
    let text = |id: u32| tokens.get(id as usize).cloned().unwrap_or_default();
    if let Some(b) = bos {
        single.push("BOS");
        pair.push("BOS");
        specials.push(("BOS".to_string(), b, text(b)));
    }
    single.push("$A");
    pair.push("$A");
    if let Some(e) = eos {
        single.push("EOS");
        pair.push("EOS");
        specials.push(("EOS".to_string(), e, text(e)));
    }
    if bos.is_some() {
        pair.push("BOS:1");
    }
    pair.push("$B:1");
    if eos.is_some() {
        pair.push("EOS:1");
    }
    let mut builder = TemplateProcessing::builder();
    builder
        .try_single(single.join(" "))
        .map_err(tok_err("BOS/EOS template"))?
        .try_pair(pair.join(" "))
        .map_err(tok_err("BOS/EOS template"))?;
    let specials: Vec<tokenizers::processors::template::SpecialToken> = specials
        .into_iter()
        .map(|(name, id, text)| {
            tokenizers::processors::template::SpecialToken::new(name, vec![id], vec![text])
        })
        .collect::<std::result::Result<_, _>>()
        .map_err(tok_err("BOS/EOS template"))?;
    let processor = builder
        .special_tokens(specials)
        .build()
        .map_err(tok_err("BOS/EOS template"))?;
    tokenizer.with_post_processor(Some(processor));
    Ok(())
}
