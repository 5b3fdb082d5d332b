//! Fuzzing the reader and the tokenizer builder on mutated GGUF files.
//!
//! Seeds are valid files: every value type and several tensor dtypes
//! (`common::sample_writer`), a byte-level BPE vocabulary, and the
//! SentencePiece vocabulary fixture; plus vocabularies generated at random
//! (`vocab_file`) to reach the tokenizer builder with odd but well-formed data. Mutations truncate, flip bytes, write
//! "interesting" integers (huge counts and lengths, type ids just past the
//! valid ones, offsets past the end) at random places, insert and delete
//! bytes. Property: `GgufFile::from_bytes` returns Ok or an error, never
//! panics; when it opens, every getter, every tensor's data and the
//! tokenizer (built, then used to encode and decode) behave the same way.
//!
//! `proptest` runs a bounded number of cases in the normal test run. The
//! ignored `fuzz_long` runs for `ARBOR_FUZZ_SECS` seconds (default 300):
//! `cargo test -p arbor-gguf --release --test fuzz -- --ignored --nocapture`.

mod common;

use arbor_gguf::{GgufFile, GgufValue, load_tokenizer};
use proptest::prelude::*;
use std::collections::BTreeMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::time::{Duration, Instant};

fn seeds() -> Vec<Vec<u8>> {
    let mut v2 = common::sample_writer();
    v2.set_version(2);
    let mut aligned = common::sample_writer();
    aligned.set_alignment(64).expect("alignment");
    let spm = std::fs::read(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/spm/vocab.gguf"),
    )
    .expect("spm fixture");
    vec![
        common::sample_writer().to_bytes(),
        v2.to_bytes(),
        aligned.to_bytes(),
        common::gpt2_vocab_writer("smollm").to_bytes(),
        common::gpt2_vocab_writer("llama-bpe").to_bytes(),
        spm,
    ]
}

/// Texts encoded with every tokenizer that loads.
const TEXTS: &[&str] = &[
    "Hello world",
    " 12 ünï <|im_end|>  x\n",
    "",
    "🦀<0x41>",
    "\u{0}\t\r\n   ▁▁ab▁",
    "<s></s><unk>Ġ<|endoftext|>[EMPTY_0]",
];

/// Pieces that vocabulary tokens, merges and texts are made of.
const PIECES: &[&str] = &[
    "a",
    "b",
    "c",
    "ab",
    "bc",
    "abc",
    " ",
    "  ",
    "▁",
    "▁a",
    "Ġ",
    "Ġa",
    "Ċ",
    "\n",
    "\t",
    "é",
    "ü",
    "日",
    "本",
    "🦀",
    "\u{301}",
    "'s",
    "1",
    "12",
    "<s>",
    "</s>",
    "<unk>",
    "<0x41>",
    "<0x0A>",
    "<0xZZ>",
    "<|im_end|>",
    "<|endoftext|>",
    "<reponame>",
    "<|return|>",
    "<|call|>",
    "<|end|>",
    "[EMPTY_0]",
    "",
    "\u{0}",
    "\u{fffd}",
];

const PRES: &[&str] = &[
    "default",
    "llama-bpe",
    "qwen2",
    "smollm",
    "gpt-2",
    "falcon",
    "gpt-4o",
    "tekken",
    "bloom",
    "deepseek-coder",
    "deepseek-v3",
    "chameleon",
    "viking",
    "seed-coder",
    "bailingmoe",
    "?",
];

/// A random "gpt2" or "llama" vocabulary file: random tokens (duplicates,
/// empty and byte-looking ones included), types (valid and not), scores
/// (NaN and infinities included), merges (well- and ill-formed), special ids
/// (in and out of range, sometimes of the wrong type) and flags.
fn vocab_file(rng: &mut Rng) -> Vec<u8> {
    use arbor_gguf::{GgufArray, GgufWriter};
    let piece = |rng: &mut Rng| PIECES[rng.below(PIECES.len())];
    let n = 1 + rng.below(120);
    let tokens: Vec<String> = (0..n)
        .map(|_| (0..1 + rng.below(3)).map(|_| piece(rng)).collect())
        .collect();
    let mut w = GgufWriter::new();
    let model = ["gpt2", "llama", "bert"][rng.below(3).min(rng.below(3))];
    w.add_str("tokenizer.ggml.model", model);
    if rng.below(32) != 0 {
        w.add_array("tokenizer.ggml.tokens", GgufArray::String(tokens.clone()));
    }
    if rng.below(4) != 0 {
        let types = (0..n + usize::from(rng.below(64) == 0))
            .map(|_| [1, 1, 1, 2, 3, 4, 5, 6, 0, -1, 99][rng.below(11)])
            .collect();
        w.add_array("tokenizer.ggml.token_type", GgufArray::I32(types));
    }
    if rng.below(4) != 0 {
        let scores = (0..n)
            .map(|_| {
                let specials = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0];
                if rng.below(10) == 0 {
                    specials[rng.below(specials.len())]
                } else {
                    -(rng.below(1000) as f32) / 7.0
                }
            })
            .collect();
        w.add_array("tokenizer.ggml.scores", GgufArray::F32(scores));
    }
    if model == "gpt2" && rng.below(32) != 0 {
        let merges = (0..rng.below(200))
            .map(|_| match rng.below(6) {
                0 => piece(rng).to_string(),
                1 => format!("{}  {}", piece(rng), piece(rng)),
                2 => format!(" {}", piece(rng)),
                _ => {
                    let a = &tokens[rng.below(n)];
                    let b = &tokens[rng.below(n)];
                    format!("{a} {b}")
                }
            })
            .collect();
        w.add_array("tokenizer.ggml.merges", GgufArray::String(merges));
    }
    if rng.below(3) != 0 {
        w.add_str("tokenizer.ggml.pre", PRES[rng.below(PRES.len())]);
    }
    for key in [
        "bos_token_id",
        "eos_token_id",
        "eot_token_id",
        "eom_token_id",
        "unknown_token_id",
        "padding_token_id",
        "fim_rep_token_id",
    ] {
        let key = format!("tokenizer.ggml.{key}");
        match rng.below(64) {
            0..=7 => {}
            8..=11 => {
                w.add_u32(key, rng.next() as u32);
            }
            12 => {
                w.add_str(key, "1");
            }
            _ => {
                w.add_u32(key, rng.below(n + 2) as u32);
            }
        }
    }
    for key in ["add_bos_token", "add_eos_token", "add_space_prefix"] {
        let key = format!("tokenizer.ggml.{key}");
        match rng.below(32) {
            0..=7 => {}
            8 => {
                w.add_u32(key, 1);
            }
            _ => {
                w.add_bool(key, rng.below(2) == 0);
            }
        }
    }
    w.to_bytes()
}

/// Integers that stress counts, lengths, type ids, dims and offsets.
const INTERESTING: &[u64] = &[
    0,
    1,
    2,
    3,
    4,
    5,
    7,
    8,
    9,
    12,
    13,
    16,
    26,
    30,
    31,
    39,
    40,
    255,
    256,
    1 << 16,
    (1 << 31) - 1,
    1 << 31,
    u32::MAX as u64,
    1 << 32,
    1 << 40,
    1 << 62,
    i64::MAX as u64,
    u64::MAX - 31,
    u64::MAX,
];

#[derive(Clone, Debug)]
enum Mutation {
    Truncate(usize),
    Flip(usize, u8),
    Set64(usize, u64),
    Set32(usize, u32),
    Insert(usize, Vec<u8>),
    Delete(usize, usize),
}

fn apply(bytes: &mut Vec<u8>, m: &Mutation) {
    let n = bytes.len().max(1);
    match m {
        Mutation::Truncate(at) => bytes.truncate(at % (n + 1)),
        Mutation::Flip(at, x) => {
            if let Some(b) = bytes.get_mut(at % n) {
                *b ^= x.max(&1);
            }
        }
        Mutation::Set64(at, v) => {
            let at = at % n;
            for (i, b) in v.to_le_bytes().iter().enumerate() {
                if let Some(slot) = bytes.get_mut(at + i) {
                    *slot = *b;
                }
            }
        }
        Mutation::Set32(at, v) => {
            let at = at % n;
            for (i, b) in v.to_le_bytes().iter().enumerate() {
                if let Some(slot) = bytes.get_mut(at + i) {
                    *slot = *b;
                }
            }
        }
        Mutation::Insert(at, data) => {
            let at = at % (bytes.len() + 1);
            bytes.splice(at..at, data.iter().copied());
        }
        Mutation::Delete(at, len) => {
            let at = at % n;
            let end = (at + len % 64).min(bytes.len());
            if at < end {
                bytes.drain(at..end);
            }
        }
    }
}

/// What opening one input did.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Opened { tokenizer: Option<bool> },
    Refused(String),
}

/// The enum variant name at the start of a `Debug` rendering.
fn variant(debug: &str) -> String {
    debug
        .split(|c: char| !c.is_alphanumeric() && c != '_')
        .next()
        .unwrap_or_default()
        .to_string()
}

/// Opens `bytes` and exercises everything reachable from the result.
fn exercise(bytes: Vec<u8>, tokenizer_errors: Option<&mut BTreeMap<String, u64>>) -> Outcome {
    let file = match GgufFile::from_bytes(bytes) {
        Ok(f) => f,
        Err(e) => {
            assert!(!e.to_string().is_empty());
            return Outcome::Refused(variant(&format!("{e:?}")));
        }
    };
    let keys: Vec<String> = file.metadata().keys().cloned().collect();
    for k in &keys {
        let _ = file.get_str(k);
        let _ = file.get_u64(k);
        let _ = file.get_u32(k);
        let _ = file.get_i64(k);
        let _ = file.get_usize(k);
        let _ = file.get_f32(k);
        let _ = file.get_bool(k);
        let _ = file.get_str_array(k);
        let _ = file.get_f32_array(k);
        let _ = file.get_i32_array(k);
        let _ = file.get_u64_array(k);
        let _ = file.get_u64_or_array(k);
        if let Some(GgufValue::Array(a)) = file.get(k) {
            let _ = a.to_i128_vec();
        }
    }
    let _ = file.architecture();
    for t in file.tensors() {
        let data = file.tensor_data(&t.name).expect("validated tensor reads");
        let data = data.expect("listed tensor exists");
        assert_eq!(data.len(), t.bytes);
        assert_eq!(t.dtype.bytes_for(t.numel()).ok(), Some(t.bytes));
        assert!(t.offset as usize + t.bytes <= file.len());
    }
    let tokenizer = if file.get("tokenizer.ggml.model").is_some() {
        Some(match load_tokenizer(&file) {
            Ok(tok) => {
                for text in TEXTS {
                    if let Ok(ids) = tok.encode(text, true) {
                        assert!(ids.iter().all(|&id| (id as usize) < tok.vocab_size));
                        let _ = tok.decode(&ids, false);
                        let _ = tok.decode(&ids, true);
                    }
                }
                let _ = tok.decode(&[0, 1, 2, u32::MAX], false);
                let _ = tok.decode(&[0, 1, 2, u32::MAX], true);
                true
            }
            Err(e) => {
                assert!(!e.to_string().is_empty());
                if let Some(kinds) = tokenizer_errors {
                    *kinds.entry(variant(&format!("{e:?}"))).or_default() += 1;
                }
                false
            }
        })
    } else {
        None
    };
    Outcome::Opened { tokenizer }
}

fn mutation_strategy() -> impl Strategy<Value = Mutation> {
    let pos = 0usize..20_000;
    prop_oneof![
        pos.clone().prop_map(Mutation::Truncate),
        (pos.clone(), any::<u8>()).prop_map(|(p, x)| Mutation::Flip(p, x)),
        (pos.clone(), prop::sample::select(INTERESTING)).prop_map(|(p, v)| Mutation::Set64(p, v)),
        (pos.clone(), prop::sample::select(INTERESTING))
            .prop_map(|(p, v)| Mutation::Set32(p, v as u32)),
        (pos.clone(), prop::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(p, d)| Mutation::Insert(p, d)),
        (pos, 1usize..64).prop_map(|(p, l)| Mutation::Delete(p, l)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4096, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn mutated_files_never_panic(
        seed in 0usize..6,
        mutations in prop::collection::vec(mutation_strategy(), 1..5),
    ) {
        let mut bytes = seeds().swap_remove(seed);
        for m in &mutations {
            apply(&mut bytes, m);
        }
        let _ = exercise(bytes, None);
    }

    #[test]
    fn generated_vocabularies_never_panic(seed in any::<u64>(), mutate in any::<bool>()) {
        let mut rng = Rng(seed | 1);
        let mut bytes = vocab_file(&mut rng);
        if mutate {
            let m = random_mutation(&mut rng, bytes.len());
            apply(&mut bytes, &m);
        }
        let _ = exercise(bytes, None);
    }
}

#[test]
fn seeds_open_and_load() {
    for (i, s) in seeds().into_iter().enumerate() {
        let out = exercise(s, None);
        let want_tok = if i >= 3 { Some(true) } else { None };
        assert_eq!(
            out,
            Outcome::Opened {
                tokenizer: want_tok
            },
            "seed {i}"
        );
    }
}

/// xorshift64*: a small deterministic generator for the long run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn random_mutation(rng: &mut Rng, len: usize) -> Mutation {
    // Bias positions toward the header, where the structure is.
    let pos = if rng.below(4) == 0 {
        rng.below(len + 1)
    } else {
        rng.below(len.min(512) + 1)
    };
    match rng.below(6) {
        0 => Mutation::Truncate(pos),
        1 => Mutation::Flip(pos, rng.next() as u8),
        2 => Mutation::Set64(pos, INTERESTING[rng.below(INTERESTING.len())]),
        3 => Mutation::Set32(pos, INTERESTING[rng.below(INTERESTING.len())] as u32),
        4 => {
            let n = 1 + rng.below(16);
            Mutation::Insert(pos, (0..n).map(|_| rng.next() as u8).collect())
        }
        _ => Mutation::Delete(pos, 1 + rng.below(63)),
    }
}

#[test]
#[ignore = "long-running fuzz; set ARBOR_FUZZ_SECS (default 300)"]
fn fuzz_long() {
    let secs: u64 = std::env::var("ARBOR_FUZZ_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(300);
    let seed: u64 = std::env::var("ARBOR_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x9E37_79B9_7F4A_7C15);
    let seeds = seeds();
    let mut rng = Rng(seed | 1);
    let deadline = Instant::now() + Duration::from_secs(secs);
    let (mut runs, mut opened, mut tokenizers) = (0u64, 0u64, 0u64);
    let mut refusals: BTreeMap<String, u64> = BTreeMap::new();
    let mut tokenizer_errors: BTreeMap<String, u64> = BTreeMap::new();
    while Instant::now() < deadline {
        for _ in 0..64 {
            // Half the inputs are generated vocabularies, half mutated seed files.
            let generated = rng.below(2) == 0;
            let which = rng.below(seeds.len());
            let mut bytes = if generated {
                vocab_file(&mut rng)
            } else {
                seeds[which].clone()
            };
            let n = if generated {
                rng.below(2)
            } else {
                1 + rng.below(4)
            };
            let mut muts = Vec::with_capacity(n);
            for _ in 0..n {
                let m = random_mutation(&mut rng, bytes.len());
                apply(&mut bytes, &m);
                muts.push(m);
            }
            let input = bytes.clone();
            match catch_unwind(AssertUnwindSafe(|| {
                exercise(bytes, Some(&mut tokenizer_errors))
            })) {
                Ok(Outcome::Opened { tokenizer }) => {
                    opened += 1;
                    tokenizers += u64::from(tokenizer == Some(true));
                }
                Ok(Outcome::Refused(kind)) => {
                    *refusals.entry(kind).or_default() += 1;
                }
                Err(_) => {
                    let path = std::env::temp_dir().join(format!("arbor-gguf-crash-{runs}.gguf"));
                    let _ = std::fs::write(&path, &input);
                    let source = if generated {
                        "a generated vocabulary".to_string()
                    } else {
                        format!("seed file {which}")
                    };
                    panic!(
                        "panic on {source} after {muts:?} (run {runs}); input saved to {}",
                        path.display()
                    );
                }
            }
            runs += 1;
        }
    }
    eprintln!(
        "fuzz: {runs} inputs in {secs}s, {opened} opened ({tokenizers} with a tokenizer), {} refused",
        runs - opened
    );
    eprintln!("refused by the reader, by error kind:");
    for (kind, count) in &refusals {
        eprintln!("  {count:>9}  {kind}");
    }
    eprintln!("refused by load_tokenizer, by error kind:");
    for (kind, count) in &tokenizer_errors {
        eprintln!("  {count:>9}  {kind}");
    }
}
