//! Compares the tokenizer with llama.cpp on a corpus written by
//! `tools/llamacpp/tokenize_corpus.py` (random strings; not committed).
//! Ignored by default: needs `ARBOR_TOKENIZE_CORPUS` (the JSON) and
//! `ARBOR_TOKENIZE_GGUF` (the GGUF it was made with).

use arbor_gguf::{GgufFile, load_tokenizer};
use std::path::{Path, PathBuf};

/// A path as given, or relative to the workspace root (tests run in the crate dir).
fn resolve(p: &str) -> PathBuf {
    let path = Path::new(p);
    if path.exists() || path.is_absolute() {
        return path.to_path_buf();
    }
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(path)
}

#[test]
#[ignore = "needs ARBOR_TOKENIZE_CORPUS and ARBOR_TOKENIZE_GGUF"]
fn corpus_matches_llamacpp() {
    let (Ok(corpus), Ok(gguf)) = (
        std::env::var("ARBOR_TOKENIZE_CORPUS"),
        std::env::var("ARBOR_TOKENIZE_GGUF"),
    ) else {
        eprintln!("skipping: set ARBOR_TOKENIZE_CORPUS and ARBOR_TOKENIZE_GGUF");
        return;
    };
    let file = GgufFile::open(&resolve(&gguf)).expect("GGUF opens");
    let tok = load_tokenizer(&file).expect("tokenizer loads");
    let cases: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(resolve(&corpus)).expect("corpus"))
            .expect("JSON");
    let cases = cases.as_array().expect("array");
    let mut bad = 0;
    for c in cases {
        let text = c["text"].as_str().expect("text");
        let want: Vec<u32> = c["ids"]
            .as_array()
            .expect("ids")
            .iter()
            .map(|x| x.as_u64().expect("id") as u32)
            .collect();
        let got = tok.encode(text, true).expect("encodes");
        if got != want {
            bad += 1;
            if bad <= 10 {
                eprintln!("{text:?}\n  llama.cpp {want:?}\n  arbor     {got:?}");
            }
        }
    }
    eprintln!(
        "{} / {} strings match llama.cpp",
        cases.len() - bad,
        cases.len()
    );
    assert_eq!(bad, 0);
}
