//! Byte-level BPE pre-tokenization as llama.cpp chooses it from `tokenizer.ggml.pre`.
//!
//! llama.cpp (`llm_tokenizer_bpe` in `llama-vocab.cpp`) splits text with a list
//! of regexes applied one after the other, each keeping both the matches and
//! the text between them as pieces. That is exactly a sequence of
//! `Split(regex, Isolated)` pre-tokenizers, followed by the byte-to-unicode
//! mapping (`ByteLevel` without its own regex). The table below copies
//! llama.cpp's regexes and the flags it sets per pre-tokenizer name
//! (`ignore_merges`, default `add_bos`).
//!
//! llama.cpp quirks that change token ids are reproduced: it rewrites the
//! o200k (`gpt-4o`) regex without `\p{M}`, and regexes without `\p{..}`
//! classes see non-ASCII whitespace replaced by U+000B (see `DEEPSEEK_CJK`).
//! Each table entry was checked against llama.cpp on 3000 random strings
//! (`qwen35`, Qwen3.5's split, Qwen2's with combining marks in letter runs:
//! on 30000 over the tiny Qwen3.5 fixture's vocabulary, llama.cpp 0c1e57098,
//! 12 of which llama.cpp tokenizes differently under `qwen2`).

/// GPT-2's split, as llama.cpp writes it.
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";

const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen3.5's split: Qwen2's, letter runs taking combining marks (`\p{M}`).
const QWEN35: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// llama.cpp's rewrite of the o200k regex (no `\p{M}`, no `(?i:)`).
const GPT4O: &str = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const TEKKEN: &str = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const BAILING: &str = r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+";

const SEED_CODER: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The CJK ranges of the DeepSeek coder/LLM splits. llama.cpp matches
/// regexes without `\p{..}` on text whose non-ASCII whitespace was replaced
/// by U+000B, so whitespace inside these ranges (U+2028, U+3000, ...) never
/// matches there; the intersection reproduces that.
const DEEPSEEK_CJK: &str = r"[[一-龥ࠀ-一가-퟿]&&[^\s]]+";

const DEEPSEEK3: &str = r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##;

/// How one `tokenizer.ggml.pre` value pre-tokenizes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PreTokenizerSpec {
    /// llama.cpp's name for the pre-tokenizer type (`llama3`, `smollm`, ...).
    pub kind: &'static str,
    /// Regexes applied in order, each splitting every piece (matches isolated).
    pub regexes: &'static [&'static str],
    /// Use a word that is a whole vocabulary token as is, without merges.
    pub ignore_merges: bool,
    /// llama.cpp's default for `add_bos` (metadata overrides it).
    pub add_bos: bool,
    /// True when the name was not recognised and a fallback was used.
    pub fallback: bool,
}

const fn spec(
    kind: &'static str,
    regexes: &'static [&'static str],
    ignore_merges: bool,
    add_bos: bool,
) -> PreTokenizerSpec {
    PreTokenizerSpec {
        kind,
        regexes,
        ignore_merges,
        add_bos,
        fallback: false,
    }
}

/// llama.cpp's regexes for a missing or unrecognised `tokenizer.ggml.pre`.
const DEFAULT: &[&str] = &[r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"];

/// The pre-tokenizer for a `tokenizer.ggml.pre` value (`None`: key absent).
///
/// Missing and unknown names get llama.cpp's "default" regexes, as llama.cpp
/// does (`fallback` is set for unknown names so the caller can warn). Names
/// whose llama.cpp splitter is hand-written C++ (`kimi-k2`, `afmoe`) or uses
/// zero-width splits (`superbpe`), and `deepseek-llm`, are not reproduced and
/// also fall back.
pub fn bpe_pre_tokenizer(pre: Option<&str>) -> PreTokenizerSpec {
    let Some(pre) = pre else {
        return spec("default", DEFAULT, false, false);
    };
    match pre {
        "default" => spec("default", DEFAULT, false, false),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" => spec("llama3", &[LLAMA3], true, true),
        "dbrx" | "smaug-bpe" | "glm4" | "chatglm-bpe" => spec("llama3", &[LLAMA3], false, false),
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "megrez" | "stablelm2" | "hunyuan" | "grok-2" => {
            spec("qwen2", &[QWEN2], false, false)
        }
        "qwen35" => spec("qwen35", &[QWEN35], false, false),
        "starcoder" | "refact" | "command-r" | "smollm" | "codeshell" | "exaone" | "minerva-7b" => {
            spec("smollm", &[r"\p{N}", GPT2], false, false)
        }
        "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v1-en" | "jina-v2-es"
        | "jina-v2-de" | "jina-v2-code" | "roberta-bpe" | "mpt" | "olmo" | "jais" | "trillion"
        | "granite-docling" | "exaone4" | "a.x-4.0" | "mellum" => {
            spec("gpt-2", &[GPT2], false, false)
        }
        "falcon" => spec(
            "falcon",
            &[r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]"],
            false,
            false,
        ),
        "gpt-4o" | "llama4" | "minimax-m2" => spec("gpt-4o", &[GPT4O], false, false),
        "tekken" => spec("tekken", &[TEKKEN], true, true),
        "poro-chat" | "bloom" | "gpt3-finnish" => {
            spec("bloom", &[r" ?[^(\s|.,!?…。，、।۔،)]+"], false, false)
        }
        "viking" => spec(
            "viking",
            &[r" ?[^(\s|.,!?…。，、।۔،)]+", r"\p{N}"],
            false,
            false,
        ),
        "chameleon" => spec(
            "chameleon",
            &[
                r"<sentinel:[0-9]+>",
                r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
                r"([\t\n]|    |  )",
                r"\p{N}",
                r"[\p{P}!-/:-@\[-`{-~]",
                GPT2,
            ],
            false,
            true,
        ),
        "deepseek-coder" => spec(
            "deepseek-coder",
            &[
                r"[\r\n]",
                r"\s?\p{L}+",
                r"\s?\p{P}+",
                DEEPSEEK_CJK,
                r"\p{N}",
            ],
            false,
            false,
        ),
        "deepseek-v3" | "hunyuan-dense" => spec(
            "deepseek-v3",
            &[r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+", DEEPSEEK3],
            false,
            false,
        ),
        "bailingmoe" | "bailingmoe2" | "llada-moe" => spec("bailingmoe", &[BAILING], false, false),
        "seed-coder" => spec("seed-coder", &[SEED_CODER], false, false),
        _ => PreTokenizerSpec {
            fallback: true,
            ..spec("default", DEFAULT, false, false)
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_regex_compiles() {
        let names = [
            None,
            Some("default"),
            Some("llama3"),
            Some("dbrx"),
            Some("qwen2"),
            Some("qwen35"),
            Some("smollm"),
            Some("gpt-2"),
            Some("falcon"),
            Some("gpt-4o"),
            Some("tekken"),
            Some("bloom"),
            Some("deepseek-coder"),
            Some("deepseek-v3"),
            Some("viking"),
            Some("chameleon"),
            Some("bailingmoe"),
            Some("seed-coder"),
            Some("no-such-thing"),
        ];
        for name in names {
            let s = bpe_pre_tokenizer(name);
            for re in s.regexes {
                tokenizers::pre_tokenizers::split::Split::new(
                    tokenizers::pre_tokenizers::split::SplitPattern::Regex((*re).to_string()),
                    tokenizers::SplitDelimiterBehavior::Isolated,
                    false,
                )
                .unwrap_or_else(|e| panic!("{name:?}: {re}: {e}"));
            }
        }
        assert!(bpe_pre_tokenizer(Some("no-such-thing")).fallback);
        assert_eq!(bpe_pre_tokenizer(Some("llama-bpe")).kind, "llama3");
    }

    #[test]
    fn qwen35_keeps_combining_marks_in_words() {
        use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
        use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};
        let pieces = |re: &str, text: &str| -> Vec<String> {
            let split = Split::new(
                SplitPattern::Regex(re.to_string()),
                tokenizers::SplitDelimiterBehavior::Isolated,
                false,
            )
            .unwrap_or_else(|e| panic!("{re}: {e}"));
            let mut s = PreTokenizedString::from(text);
            split.pre_tokenize(&mut s).unwrap_or_else(|e| panic!("{e}"));
            s.get_splits(OffsetReferential::Original, OffsetType::Byte)
                .into_iter()
                .map(|(p, _, _)| p.to_string())
                .collect()
        };
        let text = "cafe\u{301} ok";
        assert_eq!(pieces(QWEN35, text), ["cafe\u{301}", " ok"]);
        assert_eq!(pieces(QWEN2, text), ["cafe", "\u{301}", " ok"]);
        assert_eq!(bpe_pre_tokenizer(Some("qwen35")).kind, "qwen35");
    }
}
