//! The reader on files built in memory: round trips of every value type and
//! tensor layout, typed getters, and each kind of bad input the issue names
//! (truncation, corrupt counts, unknown types, wrong value types, tensors out
//! of bounds), each giving an error that says what is wrong.

mod common;

use arbor_engine_core::DType;
use arbor_gguf::{GgufArray, GgufError, GgufFile, GgufValue, GgufWriter, load_tokenizer};
use common::{gpt2_vocab_writer, pattern, sample_writer};

fn open(bytes: Vec<u8>) -> Result<GgufFile, GgufError> {
    GgufFile::from_bytes(bytes)
}

fn err(bytes: Vec<u8>) -> String {
    match open(bytes) {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn round_trip_all_value_types_and_tensors() {
    for version in [2, 3] {
        let mut w = sample_writer();
        w.set_version(version);
        let f = open(w.to_bytes()).unwrap();
        assert_eq!(f.version(), version);
        assert_eq!(f.alignment(), 32);
        assert_eq!(f.data_offset() % 32, 0);
        assert_eq!(f.architecture().unwrap(), "llama");
        assert_eq!(f.get_str("general.name").unwrap(), Some("tiny ünïcode 🦀"));
        assert_eq!(f.get("t.u8"), Some(&GgufValue::U8(200)));
        assert_eq!(f.get("t.i16"), Some(&GgufValue::I16(-300)));
        assert_eq!(f.get("t.f64"), Some(&GgufValue::F64(0.25)));
        assert_eq!(f.get_bool("t.bool").unwrap(), Some(true));
        assert_eq!(
            f.get_str_array("t.strs").unwrap().unwrap(),
            &["a".to_string(), String::new(), "ß".to_string()]
        );
        assert_eq!(f.get_f32_array("t.f32s").unwrap().unwrap(), &[1.0, -2.5]);
        assert_eq!(f.get_i32_array("t.i32s").unwrap().unwrap(), &[1, -2, 3]);
        let nested = f.get_array("t.nested").unwrap().unwrap();
        assert_eq!(nested.len(), 3);
        assert_eq!(
            nested,
            &GgufArray::Array(vec![
                GgufArray::U32(vec![1, 2]),
                GgufArray::String(vec!["x".into()]),
                GgufArray::Array(vec![GgufArray::I64(vec![-1])]),
            ])
        );

        let names: Vec<&str> = f.tensors().iter().map(|t| t.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "token_embd.weight",
                "blk.0.attn_q.weight",
                "blk.0.ffn_down.weight",
                "output_norm.weight",
                "blk.0.bias"
            ]
        );
        let q = f.tensor("blk.0.attn_q.weight").unwrap();
        assert_eq!(
            (q.dtype, q.shape.clone(), q.bytes),
            (DType::Q4_0, vec![2, 64], 72)
        );
        assert_eq!(q.ne(), vec![64, 2]);
        assert_eq!(q.offset % 32, 0);
        assert_eq!(
            f.tensor_data("blk.0.attn_q.weight").unwrap().unwrap(),
            pattern(72, 2)
        );
        assert_eq!(
            f.tensor_data("token_embd.weight").unwrap().unwrap(),
            pattern(48, 1)
        );
        assert_eq!(
            f.tensor_data("blk.0.ffn_down.weight").unwrap().unwrap(),
            pattern(210, 3)
        );
        assert_eq!(f.tensor_data("blk.0.bias").unwrap().unwrap().len(), 12);
        assert_eq!(f.tensor("blk.0.bias").unwrap().numel(), 6);
        assert!(f.tensor_data("missing").unwrap().is_none());
    }
}

#[test]
fn open_from_disk_matches_from_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.gguf");
    sample_writer().write(&path).unwrap();
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.path(), Some(path.as_path()));
    assert_eq!(f.tensors().len(), 5);
    assert_eq!(
        f.tensor_data("blk.0.attn_q.weight").unwrap().unwrap(),
        pattern(72, 2)
    );

    let empty = dir.path().join("empty.gguf");
    std::fs::write(&empty, b"").unwrap();
    let e = GgufFile::open(&empty).unwrap_err().to_string();
    assert!(e.contains("truncated") && e.contains("magic"), "{e}");
    let e = GgufFile::open(&dir.path().join("nope.gguf"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("nope.gguf"), "{e}");
}

#[test]
fn custom_alignment() {
    let mut w = sample_writer();
    w.set_alignment(64).unwrap();
    let f = open(w.to_bytes()).unwrap();
    assert_eq!(f.alignment(), 64);
    assert!(f.tensors().iter().all(|t| t.offset % 64 == 0));
    assert_eq!(
        f.tensor_data("blk.0.attn_q.weight").unwrap().unwrap(),
        pattern(72, 2)
    );
}

#[test]
fn typed_getters_convert_and_name_wrong_types() {
    let f = open(sample_writer().to_bytes()).unwrap();
    assert_eq!(f.get_u64("t.u16").unwrap(), Some(60000));
    assert_eq!(f.get_u64("t.u64").unwrap(), Some(1 << 40));
    assert_eq!(f.get_u32("llama.block_count").unwrap(), Some(2));
    assert_eq!(f.get_i64("t.i8").unwrap(), Some(-5));
    assert_eq!(f.get_f32("llama.rope.freq_base").unwrap(), Some(10000.5));
    assert_eq!(f.get_f32("t.f64").unwrap(), Some(0.25));
    assert_eq!(f.get_f32("llama.block_count").unwrap(), Some(2.0));
    assert_eq!(f.get_u64("absent").unwrap(), None);
    assert_eq!(f.get_u64_array("t.u8s").unwrap(), Some(vec![1, 2, 3]));
    assert_eq!(
        f.get_u64_or_array("llama.attention.head_count").unwrap(),
        Some(vec![4, 4])
    );
    assert_eq!(
        f.get_u64_or_array("llama.block_count").unwrap(),
        Some(vec![2])
    );
    assert_eq!(f.arch_key("block_count").unwrap(), "llama.block_count");

    let e = f.get_u64("t.i8").unwrap_err().to_string();
    assert!(
        e.contains("t.i8") && e.contains("-5") && e.contains("u64"),
        "{e}"
    );
    let e = f.get_u32("t.u64").unwrap_err().to_string();
    assert!(e.contains("t.u64") && e.contains("u32"), "{e}");
    let e = f.get_str("llama.block_count").unwrap_err().to_string();
    assert!(
        e.contains("llama.block_count") && e.contains("expected string") && e.contains("u32"),
        "{e}"
    );
    let e = f.get_u64("general.name").unwrap_err().to_string();
    assert!(e.contains("general.name") && e.contains("string"), "{e}");
    let e = f.get_str_array("t.f32s").unwrap_err().to_string();
    assert!(
        e.contains("array of f32") && e.contains("array of string"),
        "{e}"
    );
    let e = f.get_bool("t.u8").unwrap_err().to_string();
    assert!(e.contains("t.u8") && e.contains("bool"), "{e}");
    let e = f.get_u64_array("t.f32s").unwrap_err().to_string();
    assert!(e.contains("t.f32s"), "{e}");
    let e = f.get_u64_array("t.i32s").unwrap_err().to_string();
    assert!(e.contains("-2"), "{e}");

    let mut w = GgufWriter::new();
    w.add_u32("general.architecture", 7);
    let f = open(w.to_bytes()).unwrap();
    let e = f.architecture().unwrap_err().to_string();
    assert!(e.contains("general.architecture"), "{e}");
    let f = open(GgufWriter::new().to_bytes()).unwrap();
    let e = f.architecture().unwrap_err().to_string();
    assert!(
        e.contains("general.architecture") && e.contains("absent"),
        "{e}"
    );
}

#[test]
fn bad_header() {
    let good = sample_writer().to_bytes();

    let mut b = good.clone();
    b[..4].copy_from_slice(b"GGML");
    assert!(err(b).contains("magic"));

    for (v, needle) in [
        (1u32, "version 1"),
        (4, "version 4"),
        (3u32.swap_bytes(), "big-endian"),
    ] {
        let mut b = good.clone();
        b[4..8].copy_from_slice(&v.to_le_bytes());
        let e = err(b);
        assert!(e.contains(needle), "{e}");
    }

    // Counts far beyond what the file could hold are refused before allocating.
    for (at, what) in [(8, "tensor count"), (16, "metadata count")] {
        let mut b = good.clone();
        b[at..at + 8].copy_from_slice(&u64::MAX.to_le_bytes());
        let e = err(b);
        assert!(e.contains(what) && e.contains("claims"), "{e}");
    }

    // The first key's length.
    let mut b = good.clone();
    b[24..32].copy_from_slice(&(1u64 << 62).to_le_bytes());
    let e = err(b);
    assert!(
        e.contains("key of metadata entry #0") && e.contains("truncated"),
        "{e}"
    );
}

#[test]
fn every_truncation_is_an_error() {
    let good = sample_writer().to_bytes();
    let header_end = open(good.clone()).unwrap().data_offset() as usize;
    for len in 0..good.len() {
        let r = open(good[..len].to_vec());
        match r {
            Err(e) => {
                let s = e.to_string();
                assert!(
                    s.contains("truncated") || s.contains("past the end") || s.contains("claims"),
                    "len {len}: {s}"
                );
            }
            // Only a cut inside the trailing padding of the last tensor can still be valid.
            Ok(f) => assert!(
                len > header_end
                    && f.tensors()
                        .iter()
                        .all(|t| t.offset as usize + t.bytes <= len),
                "len {len} opened"
            ),
        }
    }
}

/// A writer-built file with one metadata entry whose value type id is patched.
fn with_value_type(type_id: u32) -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.add_u32("k", 5);
    let mut b = w.to_bytes();
    // magic 4 + version 4 + counts 16 + key len 8 + "k" 1 = 33
    b[33..37].copy_from_slice(&type_id.to_le_bytes());
    b
}

#[test]
fn bad_metadata() {
    let e = err(with_value_type(13));
    assert!(
        e.contains("'k'") && e.contains("unknown value type id 13"),
        "{e}"
    );

    // Array of arrays nested too deep.
    let mut inner = GgufArray::U8(vec![1]);
    for _ in 0..8 {
        inner = GgufArray::Array(vec![inner]);
    }
    let mut w = GgufWriter::new();
    w.add_array("deep", inner);
    let e = err(w.to_bytes());
    assert!(e.contains("'deep'") && e.contains("deeper"), "{e}");

    // An array claiming more elements than the file holds.
    let mut w = GgufWriter::new();
    w.add_array("arr", GgufArray::String(vec!["x".into()]));
    let mut b = w.to_bytes();
    // key "arr": 24 + 8 + 3 = 35, then type 4, elem type 4, len 8
    b[43..51].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
    let e = err(b);
    assert!(e.contains("array 'arr'") && e.contains("claims"), "{e}");

    // Invalid UTF-8 in a string value.
    let mut w = GgufWriter::new();
    w.add_str("s", "ab");
    let mut b = w.to_bytes();
    let n = b.len();
    b[n - 1] = 0xff;
    let e = err(b);
    assert!(e.contains("'s'") && e.contains("UTF-8"), "{e}");

    // Duplicate keys.
    let mut b = GgufWriter::new().to_bytes();
    b[16..24].copy_from_slice(&2u64.to_le_bytes());
    for _ in 0..2 {
        b.extend_from_slice(&1u64.to_le_bytes());
        b.push(b'k');
        b.extend_from_slice(&7u32.to_le_bytes());
        b.push(1);
    }
    let e = err(b);
    assert!(e.contains("'k'") && e.contains("more than once"), "{e}");

    // general.alignment of the wrong type, zero or not a power of two.
    let mut w = GgufWriter::new();
    w.add_str("general.alignment", "32");
    let e = err(w.to_bytes());
    assert!(
        e.contains("general.alignment") && e.contains("string"),
        "{e}"
    );
    for bad in [0u32, 48] {
        let mut w = GgufWriter::new();
        w.add_u32("general.alignment", bad);
        let e = err(w.to_bytes());
        assert!(
            e.contains("general.alignment") && e.contains("power of two"),
            "{e}"
        );
    }
}

#[test]
fn bad_tensors() {
    let raw = |ty: u32, ne: &[u64], data: Vec<u8>| {
        let mut w = GgufWriter::new();
        w.add_raw_tensor("w", ty, ne, data);
        w.to_bytes()
    };
    let e = err(raw(99, &[4], vec![0; 16]));
    assert!(
        e.contains("'w'") && e.contains("unknown ggml type id 99"),
        "{e}"
    );
    let e = err(raw(4, &[4], vec![0; 16]));
    assert!(e.contains("unknown ggml type id 4"), "{e}");
    let e = err(raw(16, &[256], vec![0; 66]));
    assert!(
        e.contains("'w'") && e.contains("iq2_xxs") && e.contains("16"),
        "{e}"
    );
    let e = err(raw(0, &[1, 1, 1, 1, 1], vec![0; 4]));
    assert!(e.contains("5 dimensions"), "{e}");
    let e = err(raw(2, &[33], vec![0; 36]));
    assert!(e.contains("33 elements") && e.contains("q4_0"), "{e}");
    let e = err(raw(0, &[u64::MAX / 2, 4], vec![]));
    assert!(e.contains("'w'") && e.contains("overflow"), "{e}");
    let e = err(raw(0, &[1 << 40], vec![0; 4]));
    assert!(e.contains("'w'") && e.contains("past the end"), "{e}");

    // The data of the last tensor cut off.
    let mut b = raw(0, &[8], vec![0; 32]);
    b.truncate(b.len() - 4);
    let e = err(b);
    assert!(
        e.contains("'w'") && e.contains("past the end") && e.contains("bytes"),
        "{e}"
    );

    // A misaligned offset, then an offset far past the end.
    let b = raw(0, &[8], vec![0; 32]);
    // header, then name length + "w", n_dims, ne[0], type, offset
    let info_end = 24 + 8 + 1 + 4 + 8 + 4 + 8;
    let mut b2 = b.clone();
    b2[info_end - 8..info_end].copy_from_slice(&4u64.to_le_bytes());
    let e = err(b2);
    assert!(
        e.contains("'w'") && e.contains("multiple of the alignment"),
        "{e}"
    );
    let mut b3 = b.clone();
    b3[info_end - 8..info_end].copy_from_slice(&(u64::MAX - 31).to_le_bytes());
    let e = err(b3);
    assert!(e.contains("'w'") && e.contains("past the end"), "{e}");

    // Two tensors with one name.
    let mut w = GgufWriter::new();
    w.add_tensor("w", DType::F32, &[1], vec![0; 4]).unwrap();
    w.add_tensor("w", DType::F32, &[1], vec![0; 4]).unwrap();
    let e = err(w.to_bytes());
    assert!(e.contains("'w'") && e.contains("more than once"), "{e}");

    // The writer refuses inconsistent tensors itself.
    let mut w = GgufWriter::new();
    assert!(
        w.add_tensor("x", DType::Q4_0, &[2, 33], vec![0; 36])
            .is_err()
    );
    assert!(w.add_tensor("x", DType::F32, &[2], vec![0; 3]).is_err());
    assert!(w.add_tensor("x", DType::U8, &[2], vec![0; 2]).is_err());
}

#[test]
fn zero_tensor_file_may_end_at_header() {
    let bytes = gpt2_vocab_writer("gpt-2").to_bytes();
    let len = bytes.len();
    let f = open(bytes).unwrap();
    assert!(f.tensors().is_empty());
    assert_eq!(f.len(), len);
    assert!(f.data_offset() >= len as u64);
}

#[test]
fn tokenizer_metadata_errors_name_the_key() {
    let mut w = gpt2_vocab_writer("gpt-2");
    w.remove("tokenizer.ggml.merges");
    let e = load_tokenizer(&open(w.to_bytes()).unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("tokenizer.ggml.merges"), "{e}");

    let mut w = gpt2_vocab_writer("gpt-2");
    w.add_str("tokenizer.ggml.model", "bert");
    let e = load_tokenizer(&open(w.to_bytes()).unwrap())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("tokenizer.ggml.model") && e.contains("bert"),
        "{e}"
    );

    let mut w = gpt2_vocab_writer("gpt-2");
    w.add_array("tokenizer.ggml.token_type", GgufArray::I32(vec![1, 2]));
    let e = load_tokenizer(&open(w.to_bytes()).unwrap())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("tokenizer.ggml.token_type") && e.contains("2 entries"),
        "{e}"
    );

    let mut w = gpt2_vocab_writer("gpt-2");
    w.add_str("tokenizer.ggml.bos_token_id", "1");
    let e = load_tokenizer(&open(w.to_bytes()).unwrap())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("tokenizer.ggml.bos_token_id") && e.contains("string"),
        "{e}"
    );

    let mut w = gpt2_vocab_writer("gpt-2");
    w.add_array("tokenizer.ggml.tokens", GgufArray::U32(vec![1]));
    let e = load_tokenizer(&open(w.to_bytes()).unwrap())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("tokenizer.ggml.tokens") && e.contains("array of u32"),
        "{e}"
    );

    // Out-of-vocabulary ids are ignored with a warning, as in llama.cpp.
    let mut w = gpt2_vocab_writer("gpt-2");
    w.add_u32("tokenizer.ggml.eos_token_id", 1_000_000);
    let t = load_tokenizer(&open(w.to_bytes()).unwrap()).unwrap();
    assert!(
        t.warnings.iter().any(|w| w.contains("eos_token_id")),
        "{:?}",
        t.warnings
    );
}

#[test]
fn small_gpt2_vocab_tokenizes() {
    let f = open(gpt2_vocab_writer("llama-bpe").to_bytes()).unwrap();
    let t = load_tokenizer(&f).unwrap();
    assert_eq!(t.pre_tokenizer, "llama3");
    assert!(t.add_bos);
    let ids = t.encode("<|im_start|>the  12 ü", true).unwrap();
    assert_eq!(ids[0], 1, "BOS");
    assert_eq!(ids[1], 1, "<|im_start|> in text");
    assert_eq!(t.decode(&ids, true).unwrap(), "the  12 ü");
    assert_eq!(t.decode(&ids[1..], false).unwrap(), "<|im_start|>the  12 ü");
    assert_eq!(t.chat_template.as_deref(), Some("{{ messages }}"));
    // <|endoftext|> and <|im_end|> end generation.
    assert_eq!(t.eos_token_ids, vec![2, 0]);

    let mut w = gpt2_vocab_writer("something-new");
    w.add_bool("tokenizer.ggml.add_bos_token", false);
    let t = load_tokenizer(&open(w.to_bytes()).unwrap()).unwrap();
    assert_eq!(t.pre_tokenizer, "default");
    assert!(t.warnings.iter().any(|w| w.contains("something-new")));
    assert_eq!(t.encode("he", true).unwrap().len(), 1);
}
