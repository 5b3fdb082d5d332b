//! The SentencePiece-style ("llama") tokenizer against llama.cpp.
//!
//! `tests/fixtures/spm/vocab.gguf` is a 600-token SentencePiece BPE vocabulary
//! (byte fallback, control and user-defined tokens) and `llamacpp.json` holds
//! llama.cpp's ids for prompts with `add_space_prefix` true and false; both are
//! written by `tools/llamacpp/make_spm_fixture.py`. No download is needed.

use arbor_gguf::{GgufFile, GgufValue, GgufWriter, TokenizerKind, load_tokenizer};
use serde_json::Value;
use std::path::PathBuf;

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/spm")
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("ids")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

fn check(file: &GgufFile, cases: &Value) -> usize {
    let tok = load_tokenizer(file).expect("tokenizer loads");
    assert_eq!(tok.kind, TokenizerKind::Llama);
    assert!(tok.add_bos && !tok.add_eos);
    assert_eq!(tok.bos_token_id, Some(1));
    let mut failures = Vec::new();
    let cases = cases.as_array().expect("cases");
    for case in cases {
        let text = case["text"].as_str().expect("text");
        for (key, add_special) in [("ids", true), ("ids_without_special", false)] {
            let want = ids(&case[key]);
            let got = tok.encode(text, add_special).expect("encodes");
            if got != want {
                failures.push(format!(
                    "{text:?} add_special={add_special}\n  llama.cpp {want:?}\n  arbor     {got:?}"
                ));
            }
        }
    }
    assert!(failures.is_empty(), "mismatches:\n{}", failures.join("\n"));
    cases.len()
}

#[test]
fn spm_tokenization_matches_llamacpp() {
    let dir = fixture_dir();
    let fx: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("llamacpp.json")).expect("fixture"))
            .expect("JSON");
    let file = GgufFile::open(&dir.join("vocab.gguf")).expect("vocab opens");
    assert_eq!(file.get_str("tokenizer.ggml.model").unwrap(), Some("llama"));
    let n = check(&file, &fx["cases"]["add_space_prefix"]);

    // The same vocabulary with add_space_prefix = false.
    let mut w = GgufWriter::from_file(&file).expect("copy");
    w.add("tokenizer.ggml.add_space_prefix", GgufValue::Bool(false));
    let no_prefix = GgufFile::from_bytes(w.to_bytes()).expect("rewritten file opens");
    let m = check(&no_prefix, &fx["cases"]["no_space_prefix"]);
    eprintln!("spm: {n} + {m} prompts match llama.cpp exactly (with and without BOS)");
}

#[test]
fn spm_decode_round_trips() {
    let file = GgufFile::open(&fixture_dir().join("vocab.gguf")).expect("vocab opens");
    let tok = load_tokenizer(&file).expect("tokenizer loads");
    for text in ["Hello world", "café über 🦀 ☃", "a  b\n\tc", " lead"] {
        let ids = tok.encode(text, false).unwrap();
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
    }
    // Like llama.cpp, the space prefix is added after every special or
    // user-defined token, and only the first one is stripped when decoding.
    let ids = tok.encode("<tool> x", false).unwrap();
    assert_eq!(tok.decode(&ids, false).unwrap(), "<tool>  x");
    let ids = tok.encode("<|im_start|>user", true).unwrap();
    assert_eq!(tok.decode(&ids, true).unwrap(), "user");
}
