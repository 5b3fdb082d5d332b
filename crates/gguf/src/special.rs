//! Special token ids (BOS, EOS, EOT, EOM, FIM, ...) and the end-of-generation
//! set, resolved from metadata the way llama.cpp's `llama_vocab::load` does.
//!
//! llama.cpp reads the `tokenizer.ggml.*_token_id` keys (an id outside the
//! vocabulary is ignored with a warning and the default kept), then finds
//! missing EOT/EOM/FIM tokens by their text, forces every token it recognises
//! that way to the control type (so it becomes a special token in text), and
//! builds the EOG set from FIM pad/repo/sep, the usual end-of-turn texts and
//! EOS/EOT/EOM. We reproduce that, with one determinism fix: where llama.cpp
//! takes the first match in hash-map order we take the lowest id.

use crate::error::Result;
use crate::file::GgufFile;
use crate::tokenizer::token_type;
use std::collections::{BTreeSet, HashMap};

fn force_control(id: u32, types: &mut [i32]) {
    if let Some(t) = types.get_mut(id as usize) {
        *t = token_type::CONTROL;
    }
}

const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];
const EOM_TEXTS: &[&str] = &["<|eom_id|>"];
const FIM_PRE_TEXTS: &[&str] = &[
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<｜fim▁begin｜>",
    "<PRE>",
    "▁<PRE>",
    "<|code_prefix|>",
];
const FIM_SUF_TEXTS: &[&str] = &[
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<｜fim▁hole｜>",
    "<SUF>",
    "▁<SUF>",
    "<|code_suffix|>",
];
const FIM_MID_TEXTS: &[&str] = &[
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<｜fim▁end｜>",
    "<MID>",
    "▁<MID>",
    "<|code_middle|>",
];
const FIM_PAD_TEXTS: &[&str] = &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"];
const FIM_REP_TEXTS: &[&str] = &[
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
];
const FIM_SEP_TEXTS: &[&str] = &["<|file_sep|>"];
/// Texts that always end generation.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
];

/// The resolved special ids.
#[derive(Clone, Debug, Default)]
pub(crate) struct SpecialIds {
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub unk: Option<u32>,
    pub pad: Option<u32>,
    /// End-of-generation ids: EOS, EOT, EOM first (when set), then the rest ascending.
    pub eog: Vec<u32>,
}

/// Reads an id key; out-of-vocabulary ids warn and leave `default`.
fn read_id(
    file: &GgufFile,
    key: &str,
    n: usize,
    default: Option<u32>,
    warnings: &mut Vec<String>,
) -> Result<Option<u32>> {
    match file.get_u32(key)? {
        Some(id) if (id as usize) < n => Ok(Some(id)),
        Some(id) => {
            warnings.push(format!(
                "{key} = {id} is outside the vocabulary of {n} tokens; ignored"
            ));
            Ok(default)
        }
        None => Ok(default),
    }
}

/// Resolves the special ids and updates `types` where llama.cpp forces a
/// recognised token to the control type. `by_text` maps each text to the id
/// llama.cpp's `token_to_id` holds for it (the last of duplicates).
pub(crate) fn resolve(
    file: &GgufFile,
    tokens: &[String],
    by_text: &HashMap<&str, u32>,
    types: &mut [i32],
    defaults: (Option<u32>, Option<u32>, Option<u32>),
    warnings: &mut Vec<String>,
) -> Result<SpecialIds> {
    let n = tokens.len();
    let (default_bos, default_eos, default_unk) = defaults;
    let key = |k: &str| format!("tokenizer.ggml.{k}");
    let bos = read_id(file, &key("bos_token_id"), n, default_bos, warnings)?;
    let eos = read_id(file, &key("eos_token_id"), n, default_eos, warnings)?;
    let unk = read_id(file, &key("unknown_token_id"), n, default_unk, warnings)?;
    let pad = read_id(file, &key("padding_token_id"), n, None, warnings)?;
    let mut eot = read_id(file, &key("eot_token_id"), n, None, warnings)?;
    let mut eom = read_id(file, &key("eom_token_id"), n, None, warnings)?;
    let mut fim = Vec::new();
    for (k, old) in [
        ("fim_pre_token_id", "prefix_token_id"),
        ("fim_suf_token_id", "suffix_token_id"),
        ("fim_mid_token_id", "middle_token_id"),
        ("fim_pad_token_id", ""),
        ("fim_rep_token_id", ""),
        ("fim_sep_token_id", ""),
    ] {
        let mut id = read_id(file, &key(k), n, None, warnings)?;
        if !old.is_empty() {
            id = read_id(file, &key(old), n, id, warnings)?;
        }
        fim.push(id);
    }

    // Lowest id whose text is one of `texts` (as llama.cpp's token_to_id sees it).
    let find = |texts: &[&str]| -> Option<u32> {
        texts.iter().filter_map(|t| by_text.get(t).copied()).min()
    };
    if eot.is_none() {
        eot = find(EOT_TEXTS);
        if let Some(id) = eot {
            force_control(id, types);
        }
    }
    if eom.is_none() {
        eom = find(EOM_TEXTS);
        if let Some(id) = eom {
            force_control(id, types);
        }
    }
    let fim_lists = [
        FIM_PRE_TEXTS,
        FIM_SUF_TEXTS,
        FIM_MID_TEXTS,
        FIM_PAD_TEXTS,
        FIM_REP_TEXTS,
        FIM_SEP_TEXTS,
    ];
    for (slot, texts) in fim.iter_mut().zip(fim_lists) {
        if slot.is_none() {
            *slot = find(texts);
            if let Some(id) = *slot {
                force_control(id, types);
            }
        }
    }

    let mut rest = BTreeSet::new();
    // FIM pad, repo and sep end generation.
    rest.extend(fim[3..].iter().flatten().copied());
    for text in EOG_TEXTS {
        if let Some(&id) = by_text.get(text) {
            rest.insert(id);
            force_control(id, types);
        }
    }
    let mut eog = Vec::new();
    for id in [eos, eot, eom].into_iter().flatten().chain(rest) {
        if !eog.contains(&id) {
            eog.push(id);
        }
    }
    // gpt-oss (o200k harmony): "<|end|>" is not an end of generation there.
    let text_of = |id: &u32| tokens.get(*id as usize).map(String::as_str);
    let has = |t: &str| eog.iter().any(|id| text_of(id) == Some(t));
    let end = eog.iter().position(|id| text_of(id) == Some("<|end|>"));
    if let (true, Some(pos)) = (has("<|return|>") && has("<|call|>"), end) {
        let end = eog.remove(pos);
        if let Some(t) = types.get_mut(end as usize) {
            *t = token_type::USER_DEFINED;
        }
    }
    Ok(SpecialIds {
        bos,
        eos,
        unk,
        pad,
        eog,
    })
}
