//! Shared by the grammar tests and the mask benchmark: tokenizers (a small
//! byte-level BPE built here, SmolLM2's from the default GGUF, a Qwen3 one
//! written by `scripts/qwen_tokenizer.py`), the maskbench reader, and the
//! token-by-token checker. Real data is optional: loaders return `None`
//! with a printed reason when a file is absent.
#![allow(dead_code, clippy::unwrap_used)]

use arbor_engine_core::grammar::{
    CompiledGrammar, GrammarBackend, GrammarOptions, GrammarSpec, TokenBitmask,
};
use arbor_grammar::LlgBackend;
use std::io::BufRead;
use std::path::PathBuf;
use std::sync::Arc;
use tokenizers::Tokenizer;

/// A tokenizer with its EOS ids and a name for reports.
pub struct Tok {
    pub name: &'static str,
    pub tokenizer: Tokenizer,
    pub eos: Vec<u32>,
}

impl Tok {
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.tokenizer
            .encode_fast(text, false)
            .unwrap()
            .get_ids()
            .to_vec()
    }
    pub fn backend(&self, options: &GrammarOptions) -> LlgBackend {
        LlgBackend::from_tokenizer(&self.tokenizer, &self.eos, None, options).unwrap()
    }
    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }
}

/// A byte-level BPE (256 byte tokens, a few JSON-ish merges, `<|end|>` = EOS)
/// built in code, so tests need no download.
pub fn small_bpe() -> Tok {
    let json = r#"{"version":"1.0","truncation":null,"padding":null,
      "added_tokens":[{"id":ID,"content":"<|end|>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true}],
      "normalizer":null,
      "pre_tokenizer":{"type":"ByteLevel","add_prefix_space":false,"trim_offsets":false,"use_regex":true},
      "post_processor":null,
      "decoder":{"type":"ByteLevel","add_prefix_space":false,"trim_offsets":false,"use_regex":true},
      "model":{"type":"BPE","dropout":null,"unk_token":null,"continuing_subword_prefix":null,
               "end_of_word_suffix":null,"fuse_unk":false,"byte_fallback":false,"ignore_merges":false,
               "vocab":VOCAB,"merges":MERGES}}"#;
    // The GPT-2 byte-to-unicode table.
    let mut bs: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    let mut map = vec![' '; 256];
    for (b, c) in bs.iter().zip(&cs) {
        map[*b as usize] = char::from_u32(*c).unwrap();
    }
    let enc = |s: &str| s.bytes().map(|b| map[b as usize]).collect::<String>();
    let mut vocab: Vec<String> = (0..256).map(|b| map[b].to_string()).collect();
    let mut merges = Vec::new();
    for (a, b) in [
        ("n", "a"),
        ("na", "m"),
        ("nam", "e"),
        ("\"", ":"),
        (" ", "\""),
        ("{", "\""),
        ("t", "r"),
        ("tr", "u"),
        ("tru", "e"),
        ("a", "g"),
        ("ag", "e"),
        ("\"", ","),
        ("\"", "}"),
    ] {
        merges.push(format!("{} {}", enc(a), enc(b)));
        vocab.push(enc(&format!("{a}{b}")));
    }
    let vocab_json: serde_json::Map<String, serde_json::Value> = vocab
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), serde_json::Value::from(i)))
        .collect();
    let eos = vocab.len() as u32;
    let json = json
        .replace("ID", &eos.to_string())
        .replace("VOCAB", &serde_json::to_string(&vocab_json).unwrap())
        .replace("MERGES", &serde_json::to_string(&merges).unwrap());
    Tok {
        name: "small-bpe",
        tokenizer: Tokenizer::from_bytes(json.as_bytes()).unwrap(),
        eos: vec![eos],
    }
}

/// SmolLM2's tokenizer (49,152 ids) from the default GGUF, if present.
pub fn smollm2() -> Option<Tok> {
    let path = arbor_gguf::default_model_path()?;
    if !path.exists() {
        println!(
            "skipping SmolLM2 tokenizer: {} is absent (fetch the default model)",
            path.display()
        );
        return None;
    }
    let file = arbor_gguf::GgufFile::open(&path).unwrap();
    let t = arbor_gguf::load_tokenizer(&file).unwrap();
    Some(Tok {
        name: "smollm2-49k",
        tokenizer: t.tokenizer,
        eos: t.eos_token_ids,
    })
}

/// A Qwen3 tokenizer (151,669 ids), written by `scripts/qwen_tokenizer.py`.
pub fn qwen() -> Option<Tok> {
    let path = std::env::var_os("ARBOR_QWEN_TOKENIZER")
        .map(PathBuf::from)
        .or_else(|| {
            let home = std::env::var_os("ARBOR_HOME")
                .map(PathBuf::from)
                .or_else(|| {
                    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/arbor"))
                })?;
            Some(home.join("tokenizers/qwen3.tokenizer.json"))
        })?;
    if !path.exists() {
        println!(
            "skipping Qwen tokenizer: {} is absent (run crates/grammar/scripts/qwen_tokenizer.py)",
            path.display()
        );
        return None;
    }
    let tokenizer = Tokenizer::from_file(&path).unwrap();
    let eos = ["<|endoftext|>", "<|im_end|>"]
        .iter()
        .filter_map(|t| tokenizer.token_to_id(t))
        .collect();
    Some(Tok {
        name: "qwen3-151k",
        tokenizer,
        eos,
    })
}

/// One maskbench schema with its instances.
pub struct MaskbenchEntry {
    pub name: String,
    pub schema: String,
    /// (valid, compact JSON text) per instance.
    pub tests: Vec<(bool, String)>,
    /// The instances with object keys reordered as the schema lists them.
    pub reordered: Vec<String>,
}

/// Property names in order of first appearance under any `properties`.
fn schema_key_order(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, x) in m {
                if k == "properties"
                    && let Some(p) = x.as_object()
                {
                    for name in p.keys() {
                        if !out.contains(name) {
                            out.push(name.clone());
                        }
                    }
                }
                schema_key_order(x, out);
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|x| schema_key_order(x, out)),
        _ => {}
    }
}

/// `v` with every object's keys sorted by their rank in `order` (others last, stable).
fn reorder(v: &serde_json::Value, order: &[String]) -> serde_json::Value {
    match v {
        serde_json::Value::Object(m) => {
            let mut items: Vec<(&String, &serde_json::Value)> = m.iter().collect();
            items.sort_by_key(|(k, _)| order.iter().position(|o| o == *k).unwrap_or(usize::MAX));
            serde_json::Value::Object(
                items
                    .into_iter()
                    .map(|(k, x)| (k.clone(), reorder(x, order)))
                    .collect(),
            )
        }
        serde_json::Value::Array(a) => a.iter().map(|x| reorder(x, order)).collect(),
        x => x.clone(),
    }
}

pub fn maskbench_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/data/maskbench/maskbench.jsonl.gz")
}

/// Every `step`-th maskbench schema (all with step 1), or `None` when the data is absent.
pub fn maskbench(step: usize) -> Option<Vec<MaskbenchEntry>> {
    let path = maskbench_path();
    let Ok(f) = std::fs::File::open(&path) else {
        println!("skipping maskbench: {} is absent", path.display());
        return None;
    };
    let r = std::io::BufReader::new(flate2::read::GzDecoder::new(f));
    let mut out = Vec::new();
    for (i, line) in r.lines().enumerate() {
        let line = line.unwrap();
        if i % step != 0 || line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        let tests = v["tests"]
            .as_array()
            .map(|ts| {
                ts.iter()
                    .map(|t| {
                        (
                            t["valid"].as_bool().unwrap_or(false),
                            serde_json::to_string(&t["data"]).unwrap(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        let mut order = Vec::new();
        schema_key_order(&v["schema"], &mut order);
        let reordered = v["tests"]
            .as_array()
            .map(|ts| {
                ts.iter()
                    .map(|t| serde_json::to_string(&reorder(&t["data"], &order)).unwrap())
                    .collect()
            })
            .unwrap_or_default();
        out.push(MaskbenchEntry {
            name: v["name"].as_str().unwrap_or("?").to_string(),
            schema: serde_json::to_string(&v["schema"]).unwrap(),
            tests,
            reordered,
        });
    }
    Some(out)
}

/// Whether JSON text `before` ends where an object key starts or inside a key.
pub fn at_object_key(before: &str) -> bool {
    // Track strings and the container stack to know if we are at key position.
    let mut stack = Vec::new();
    let (mut in_str, mut esc, mut expect_key, mut in_key) = (false, false, false, false);
    for c in before.chars() {
        if in_str {
            if esc {
                esc = false;
            } else if c == '\\' {
                esc = true;
            } else if c == '"' {
                in_str = false;
                in_key = false;
            }
            continue;
        }
        match c {
            '"' => {
                in_str = true;
                in_key = expect_key;
                expect_key = false;
            }
            '{' => {
                stack.push('{');
                expect_key = true;
            }
            '[' => stack.push('['),
            '}' | ']' => {
                stack.pop();
            }
            ',' => expect_key = stack.last() == Some(&'{'),
            ':' => expect_key = false,
            _ => {}
        }
    }
    (in_str && in_key) || expect_key
}

/// How feeding one instance token by token went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Walk {
    /// Every token was in its mask and accepted, and EOS was allowed at the end.
    Accepted,
    /// Token `at` was not in the mask; `accept` said `accept_ok` for it.
    NotInMask { at: usize, accept_ok: bool },
    /// Token `at` was in the mask but `accept` refused it.
    AcceptFailed { at: usize, error: String },
    /// All tokens passed but the grammar could not end there.
    CannotEnd,
    /// The matcher failed (error state).
    Error(String),
}

/// Feeds `tokens` through a fresh matcher, checking each against the mask first.
/// Returns the outcome and the time spent in each `fill_mask` (seconds).
pub fn walk(
    compiled: &Arc<dyn CompiledGrammar>,
    vocab: usize,
    tokens: &[u32],
    eos: u32,
) -> (Walk, Vec<f64>) {
    let mut m = match compiled.matcher() {
        Ok(m) => m,
        Err(e) => return (Walk::Error(e.to_string()), vec![]),
    };
    let mut mask = TokenBitmask::new(vocab);
    let mut times = Vec::with_capacity(tokens.len() + 1);
    for (i, &t) in tokens.iter().enumerate() {
        let t0 = std::time::Instant::now();
        let r = m.fill_mask(&mut mask);
        times.push(t0.elapsed().as_secs_f64());
        if let Err(e) = r {
            return (Walk::Error(e.to_string()), times);
        }
        if !mask.is_allowed(t) {
            let accept_ok = m.accept(t).is_ok();
            return (Walk::NotInMask { at: i, accept_ok }, times);
        }
        if let Err(e) = m.accept(t) {
            return (
                Walk::AcceptFailed {
                    at: i,
                    error: e.to_string(),
                },
                times,
            );
        }
    }
    let t0 = std::time::Instant::now();
    let r = m.fill_mask(&mut mask);
    times.push(t0.elapsed().as_secs_f64());
    if let Err(e) = r {
        return (Walk::Error(e.to_string()), times);
    }
    if !mask.is_allowed(eos) || !m.can_end().unwrap_or(false) {
        return (Walk::CannotEnd, times);
    }
    (Walk::Accepted, times)
}

/// Results of a maskbench run with one tokenizer.
#[derive(Debug, Default)]
pub struct MaskbenchReport {
    pub schemas: usize,
    pub compiled: usize,
    pub compile_errors: Vec<(String, String)>,
    pub valid: usize,
    pub invalid: usize,
    /// (schema, instance index, outcome, instance text) of valid instances not accepted.
    pub false_rejections: Vec<(String, usize, Walk, String)>,
    /// False rejections by kind: `property order` (accepted once its keys
    /// follow the schema's order), `key order (rejected at a key)` (refused
    /// where an object key starts, where the global reordering cannot fix an
    /// order that differs per `anyOf` branch), `lexer budget`, `other`.
    pub rejection_kinds: std::collections::BTreeMap<&'static str, usize>,
    /// (schema, instance index, instance text) of invalid instances accepted.
    pub false_acceptances: Vec<(String, usize, String)>,
    pub mask_times: Vec<f64>,
    pub compile_times: Vec<f64>,
}

pub fn run_maskbench(tok: &Tok, entries: &[MaskbenchEntry], lenient: bool) -> MaskbenchReport {
    // A strict run refuses oneOf rather than approximate it: it may then
    // have no false acceptance.
    let backend = tok.backend(&GrammarOptions {
        json_lenient: lenient,
        json_strict_one_of: !lenient,
        ..Default::default()
    });
    let vocab = backend.vocab_size();
    let eos = tok.eos[0];
    let mut rep = MaskbenchReport::default();
    for e in entries {
        rep.schemas += 1;
        let t0 = std::time::Instant::now();
        let compiled = match backend.compile(&GrammarSpec::JsonSchema(e.schema.clone())) {
            Ok(c) => c,
            Err(err) => {
                rep.compile_errors.push((e.name.clone(), err.to_string()));
                continue;
            }
        };
        rep.compile_times.push(t0.elapsed().as_secs_f64());
        rep.compiled += 1;
        for (i, (valid, text)) in e.tests.iter().enumerate() {
            let tokens = tok.encode(text);
            let (w, times) = walk(&compiled, vocab, &tokens, eos);
            if *valid {
                rep.valid += 1;
                rep.mask_times.extend(times);
                if w != Walk::Accepted {
                    // Where it failed: the text before the failing token.
                    let at = match &w {
                        Walk::NotInMask { at, .. } | Walk::AcceptFailed { at, .. } => Some(*at),
                        _ => None,
                    };
                    let before = at.map(|a| tok.tokenizer.decode(&tokens[..a], false).unwrap());
                    let at_key = before.as_deref().is_some_and(at_object_key);
                    let kind = match &w {
                        Walk::Error(m) if m.contains("too many expressions") => "lexer budget",
                        _ => {
                            let toks = tok.encode(&e.reordered[i]);
                            if walk(&compiled, vocab, &toks, eos).0 == Walk::Accepted {
                                "property order"
                            } else if at_key {
                                "key order (rejected at a key)"
                            } else {
                                "other"
                            }
                        }
                    };
                    *rep.rejection_kinds.entry(kind).or_default() += 1;
                    if kind == "lexer budget" || kind == "other" {
                        let ctx = match &before {
                            Some(b) => {
                                let n = b.chars().count();
                                let rest: String = text.chars().skip(n).take(30).collect();
                                let head: String = b.chars().skip(n.saturating_sub(60)).collect();
                                format!("...{head} <HERE> {rest}")
                            }
                            None => text.clone(),
                        };
                        rep.false_rejections.push((e.name.clone(), i, w, ctx));
                    }
                }
            } else {
                rep.invalid += 1;
                if w == Walk::Accepted {
                    rep.false_acceptances
                        .push((e.name.clone(), i, text.clone()));
                }
            }
        }
    }
    rep
}

pub fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let idx = ((v.len() - 1) as f64 * p).round() as usize;
    v[idx]
}

impl MaskbenchReport {
    pub fn print(&mut self, name: &str) {
        println!(
            "maskbench [{name}]: {} schemas, {} compiled ({:.1}%), {} valid / {} invalid instances, \
             false rejections {:?}, {} false acceptances",
            self.schemas,
            self.compiled,
            100.0 * self.compiled as f64 / self.schemas.max(1) as f64,
            self.valid,
            self.invalid,
            self.rejection_kinds,
            self.false_acceptances.len()
        );
        let mut kinds = std::collections::BTreeMap::<String, usize>::new();
        for (_, err) in &self.compile_errors {
            let k: String = err.chars().take(70).collect();
            *kinds.entry(k).or_default() += 1;
        }
        let mut kinds: Vec<_> = kinds.into_iter().collect();
        kinds.sort_by_key(|k| std::cmp::Reverse(k.1));
        for (k, n) in kinds.iter().take(12) {
            println!("  compile error x{n}: {k}");
        }
        for (s, i, w, text) in self.false_rejections.iter().take(15) {
            let t: String = text.chars().take(160).collect();
            println!("  false rejection {s} #{i}: {w:?}: {t}");
        }
        for (s, i, text) in self.false_acceptances.iter().take(15) {
            let t: String = text.chars().take(160).collect();
            println!("  false acceptance {s} #{i}: {t}");
        }
        let (p50, p99) = (
            percentile(&mut self.mask_times, 0.5),
            percentile(&mut self.mask_times, 0.99),
        );
        let (c50, c99) = (
            percentile(&mut self.compile_times, 0.5),
            percentile(&mut self.compile_times, 0.99),
        );
        println!(
            "  mask p50 {:.1} µs, p99 {:.1} µs over {} masks; compile p50 {:.2} ms, p99 {:.2} ms",
            p50 * 1e6,
            p99 * 1e6,
            self.mask_times.len(),
            c50 * 1e3,
            c99 * 1e3
        );
    }
}
