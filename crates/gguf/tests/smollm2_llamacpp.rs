//! Compares the reader and tokenizer with llama.cpp on SmolLM2-135M-Instruct.
//!
//! The fixture `tests/fixtures/smollm2/llamacpp.json` is written by
//! `tools/llamacpp/make_fixtures.py` (llama-cpp-python + the `gguf` package).
//! The model file is looked up as `arbor_gguf::default_model_path()` says
//! (`$ARBOR_DEFAULT_GGUF`, else `$ARBOR_HOME/models/...`, else
//! `~/.cache/arbor/models/...`); the tests skip with a message when it is absent.

use arbor_gguf::{GgufFile, GgufTokenizer, TokenizerKind, default_model_path, load_tokenizer};
use serde_json::Value;
use std::path::PathBuf;

fn fixture() -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/smollm2/llamacpp.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("fixture {} missing: {e}", path.display()));
    serde_json::from_str(&text).expect("fixture is JSON")
}

fn open_model() -> Option<GgufFile> {
    let Some(path) = default_model_path() else {
        eprintln!("skipping: no ARBOR_DEFAULT_GGUF, ARBOR_HOME or HOME to find the model");
        return None;
    };
    if !path.is_file() {
        eprintln!(
            "skipping: model {} is absent (set ARBOR_DEFAULT_GGUF or run the fetch script)",
            path.display()
        );
        return None;
    }
    Some(GgufFile::open(&path).expect("the default model opens"))
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("ids array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

fn tokenizer(file: &GgufFile) -> GgufTokenizer {
    load_tokenizer(file).expect("tokenizer loads")
}

#[test]
fn header_and_tensors_match_gguf_py() {
    let Some(file) = open_model() else { return };
    let fx = fixture();
    let g = &fx["gguf"];
    assert_eq!(u64::from(file.version()), g["version"].as_u64().unwrap());
    assert_eq!(
        file.tensors().len() as u64,
        g["tensor_count"].as_u64().unwrap()
    );
    assert_eq!(
        file.metadata().len() as u64,
        g["kv_count"].as_u64().unwrap()
    );
    assert_eq!(file.alignment(), g["alignment"].as_u64().unwrap());
    assert_eq!(file.data_offset(), g["data_offset"].as_u64().unwrap());
    assert_eq!(file.len() as u64, g["file_size"].as_u64().unwrap());
    assert_eq!(file.architecture().unwrap(), "llama");

    let tensors = g["tensors"].as_array().unwrap();
    assert!(tensors.len() >= 8);
    for (i, t) in tensors.iter().enumerate() {
        let name = t["name"].as_str().unwrap();
        let info = file.tensor(name).unwrap_or_else(|| panic!("tensor {name}"));
        if i < 8 {
            assert_eq!(file.tensors()[i].name, name, "tensor order");
        }
        let want_type = t["ggml_type"].as_str().unwrap().to_ascii_lowercase();
        assert_eq!(info.dtype.name(), want_type, "{name}");
        let shape: Vec<usize> = t["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap() as usize)
            .collect();
        assert_eq!(info.shape, shape, "{name} shape (outermost first)");
        assert_eq!(info.offset, t["offset"].as_u64().unwrap(), "{name} offset");
        assert_eq!(
            info.bytes as u64,
            t["bytes"].as_u64().unwrap(),
            "{name} bytes"
        );
        let data = file.tensor_data(name).unwrap().unwrap();
        assert_eq!(data.len(), info.bytes);
    }

    // Scalar metadata as gguf-py read it.
    for (key, want) in g["metadata"].as_object().unwrap() {
        match want {
            Value::String(s) => assert_eq!(file.get_str(key).unwrap(), Some(s.as_str()), "{key}"),
            Value::Bool(b) => assert_eq!(file.get_bool(key).unwrap(), Some(*b), "{key}"),
            Value::Number(n) if n.is_u64() => {
                assert_eq!(file.get_u64(key).unwrap(), n.as_u64(), "{key}")
            }
            Value::Number(n) => {
                let got = file.get_f32(key).unwrap().unwrap();
                assert!((f64::from(got) - n.as_f64().unwrap()).abs() < 1e-6, "{key}");
            }
            other => panic!("unexpected fixture value {other} for {key}"),
        }
    }
    for (key, want) in g["arrays"].as_object().unwrap() {
        let len = want["len"].as_u64().unwrap() as usize;
        assert_eq!(file.get_array(key).unwrap().unwrap().len(), len, "{key}");
    }
    let tokens = file
        .get_str_array("tokenizer.ggml.tokens")
        .unwrap()
        .unwrap();
    let first: Vec<&str> = g["arrays"]["tokenizer.ggml.tokens"]["first"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(&tokens[..first.len()], first.as_slice());
}

#[test]
fn tokenizer_metadata() {
    let Some(file) = open_model() else { return };
    let fx = fixture();
    let tok = tokenizer(&file);
    assert_eq!(tok.kind, TokenizerKind::Gpt2);
    assert_eq!(tok.pre_tokenizer, "smollm");
    assert!(tok.warnings.is_empty(), "{:?}", tok.warnings);
    assert_eq!(
        tok.bos_token_id,
        Some(fx["bos_token_id"].as_u64().unwrap() as u32)
    );
    assert_eq!(
        tok.eos_token_id(),
        Some(fx["eos_token_id"].as_u64().unwrap() as u32)
    );
    // <|im_end|> is EOS; llama.cpp also stops on <|endoftext|> (found by
    // text) and on <reponame> (taken for a FIM repo token).
    let mut eog = tok.eos_token_ids.clone();
    eog.sort_unstable();
    assert_eq!(eog, ids(&fx["eog_token_ids"]));
    assert_eq!(tok.eos_token_ids[0], 2);
    // llama.cpp's control tokens are exactly our special added tokens.
    let mut special: Vec<u32> = tok
        .tokenizer
        .get_added_tokens_decoder()
        .iter()
        .filter(|(_, t)| t.special)
        .map(|(&id, _)| id)
        .collect();
    special.sort_unstable();
    assert_eq!(special, ids(&fx["control_token_ids"]));
    assert!(!tok.add_bos && !tok.add_eos);
    assert_eq!(
        tok.chat_template.as_deref(),
        fx["gguf"]["metadata"]["tokenizer.chat_template"].as_str()
    );
    assert_eq!(tok.vocab_size, 49152);
    assert_eq!(tok.tokenizer.get_vocab_size(true), 49152);
}

#[test]
fn tokenization_matches_llamacpp() {
    let Some(file) = open_model() else { return };
    let fx = fixture();
    let tok = tokenizer(&file);
    let cases = fx["tokenize"].as_array().unwrap();
    let mut failures = Vec::new();
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let want = ids(&case["ids"]);
        let got = tok
            .encode(text, case["add_special"].as_bool().unwrap())
            .unwrap();
        if got != want {
            failures.push(format!(
                "{text:?}\n  llama.cpp {want:?}\n  arbor     {got:?}"
            ));
        }
        // Decoding round-trips the text (no cleanup of spaces in this vocabulary).
        assert_eq!(tok.decode(&got, false).unwrap(), text, "decode of {text:?}");
    }
    eprintln!(
        "tokenization: {}/{} prompts match llama.cpp exactly",
        cases.len() - failures.len(),
        cases.len()
    );
    assert!(failures.is_empty(), "mismatches:\n{}", failures.join("\n"));
}

#[test]
fn chat_prompts_match_llamacpp() {
    let Some(file) = open_model() else { return };
    let fx = fixture();
    let tok = tokenizer(&file);
    let chats = fx["chat"].as_array().unwrap();
    let mut matched = 0;
    for chat in chats {
        let prompt = chat["prompt"].as_str().unwrap();
        let want = ids(&chat["prompt_ids"]);
        let got = tok.encode(prompt, true).unwrap();
        assert_eq!(got, want, "prompt ids of {prompt:?}");
        // llama.cpp's greedy continuation decodes to the text it reported.
        let greedy = ids(&chat["greedy_ids"]);
        assert!(!greedy.is_empty() && greedy.len() <= 32);
        let text = tok.decode(&greedy, true).unwrap();
        assert_eq!(text, chat["greedy_text"].as_str().unwrap());
        let pieces: Vec<String> = greedy
            .iter()
            .map(|&id| tok.decode(&[id], false).unwrap())
            .collect();
        let want_pieces: Vec<String> = chat["greedy_pieces"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p.as_str().unwrap().to_string())
            .collect();
        assert_eq!(pieces, want_pieces);
        matched += 1;
    }
    eprintln!(
        "chat prompts: {matched}/{} match llama.cpp exactly",
        chats.len()
    );
}
