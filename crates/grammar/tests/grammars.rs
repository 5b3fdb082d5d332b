//! The llguidance backend through engine-core's traits: each input kind,
//! rollback, EOS and termination, forced tokens (jump-forward), errors and
//! panics, the registry entry and the grammar cache. Runs on a small
//! byte-level BPE built in code, and on SmolLM2's tokenizer when the default
//! GGUF is present.
#![allow(clippy::unwrap_used)]

mod common;

use arbor_engine_core::grammar::{
    GrammarBackend, GrammarBackendConfig, GrammarCache, GrammarCacheConfig, GrammarError,
    GrammarMatcher, GrammarOptions, GrammarSpec, GrammarVocab, JsonWhitespace, TokenBitmask,
    VocabSource,
};
use arbor_grammar::LlgBackend;
use common::{Tok, Walk, small_bpe, smollm2, walk};
use std::sync::Arc;

fn toks() -> Vec<Tok> {
    let mut v = vec![small_bpe()];
    v.extend(smollm2());
    v
}

fn compact() -> GrammarOptions {
    GrammarOptions {
        json_whitespace: JsonWhitespace::Compact,
        ..Default::default()
    }
}

fn sorted(v: &[u32]) -> Vec<u32> {
    let mut v = v.to_vec();
    v.sort_unstable();
    v
}

/// Whether `text` is accepted token by token (each token in its mask, EOS at the end).
fn accepts(tok: &Tok, b: &LlgBackend, spec: &GrammarSpec, text: &str) -> bool {
    let c = b.compile(spec).unwrap();
    walk(&c, b.vocab_size(), &tok.encode(text), tok.eos[0]).0 == Walk::Accepted
}

#[test]
fn regex() {
    for tok in toks() {
        let b = tok.backend(&GrammarOptions::default());
        let spec = GrammarSpec::Regex(r"\d{3}-[a-z]+(\.[a-z]{2,3})?".into());
        assert!(accepts(&tok, &b, &spec, "123-abc"), "{}", tok.name);
        assert!(accepts(&tok, &b, &spec, "007-x.com"), "{}", tok.name);
        assert!(!accepts(&tok, &b, &spec, "12-abc"), "{}", tok.name);
        assert!(!accepts(&tok, &b, &spec, "123-abc.c"), "{}", tok.name);
    }
}

#[test]
fn ebnf_sglang_dialect() {
    // The example from SGLang's structured-output docs.
    let g = r#"
        root ::= city | description
        city ::= "London" | "Paris" | "Berlin" | "Rome"
        description ::= city " is " status
        status ::= "the capital of " country
        country ::= "England" | "France" | "Germany" | "Italy"
    "#;
    for tok in toks() {
        let b = tok.backend(&GrammarOptions::default());
        let spec = GrammarSpec::Ebnf(g.into());
        assert!(accepts(&tok, &b, &spec, "Paris"), "{}", tok.name);
        assert!(
            accepts(&tok, &b, &spec, "Rome is the capital of Italy"),
            "{}",
            tok.name
        );
        assert!(
            !accepts(&tok, &b, &spec, "Rome is the capital of Spain"),
            "{}",
            tok.name
        );
        assert!(!accepts(&tok, &b, &spec, "Madrid"), "{}", tok.name);
        // Character-level meaning, not greedy lexing: "ab" splits as "a" "b".
        let spec = GrammarSpec::Ebnf(r#"root ::= "ab" "c" | "a" "b""#.into());
        assert!(accepts(&tok, &b, &spec, "ab"), "{}", tok.name);
        assert!(accepts(&tok, &b, &spec, "abc"), "{}", tok.name);
        // A GBNF JSON-ish grammar with classes, repetition ranges and escapes.
        let spec = GrammarSpec::Ebnf(
            r#"root ::= "{" ws pair ("," ws pair)* "}"
               pair ::= str ":" ws val
               str ::= "\"" [^"\\\x00-\x1F]* "\""
               val ::= str | [0-9]{1,4} | "true"
               ws ::= [ \t\n]{0,2}"#
                .into(),
        );
        assert!(
            accepts(&tok, &b, &spec, r#"{"a": 12,"bc":"x y", "t":true}"#),
            "{}",
            tok.name
        );
        assert!(!accepts(&tok, &b, &spec, r#"{"a": 12345}"#), "{}", tok.name);
    }
}

#[test]
fn lark_and_json_object() {
    for tok in toks() {
        let b = tok.backend(&GrammarOptions::default());
        let spec = GrammarSpec::Lark("start: \"yes\" | \"no\"".into());
        assert!(accepts(&tok, &b, &spec, "no"));
        assert!(!accepts(&tok, &b, &spec, "maybe"));
        // Lark terminals are lexed greedily (longest match), EBNF keeps its
        // character-level meaning: `ab` is "a" then "b" only in EBNF.
        let lark = GrammarSpec::Lark(r#"start: ("a" | "ab") "b""#.into());
        let ebnf = GrammarSpec::Ebnf(r#"root ::= ("a" | "ab") "b""#.into());
        assert!(!accepts(&tok, &b, &lark, "ab") && accepts(&tok, &b, &lark, "abb"));
        assert!(accepts(&tok, &b, &ebnf, "ab") && accepts(&tok, &b, &ebnf, "abb"));
        let spec = GrammarSpec::JsonObject;
        assert!(
            accepts(&tok, &b, &spec, r#"{"a":[1,2.5,{"b":null}],"c":"d"}"#),
            "{}",
            tok.name
        );
        assert!(accepts(&tok, &b, &spec, "{ }"), "{}", tok.name);
        assert!(!accepts(&tok, &b, &spec, "[1]"), "{}", tok.name);
        assert!(!accepts(&tok, &b, &spec, r#""x""#), "{}", tok.name);
    }
}

#[test]
fn rollback_restores_masks_and_eos_terminates() {
    for tok in toks() {
        let b = tok.backend(&GrammarOptions::default());
        let c = b.compile(&GrammarSpec::Regex("(ab|cd)+".into())).unwrap();
        let mut m = c.matcher().unwrap();
        let n = b.vocab_size();
        let (mut m0, mut m1) = (TokenBitmask::new(n), TokenBitmask::new(n));
        m.fill_mask(&mut m0).unwrap();
        let toks = tok.encode("abcd");
        assert_eq!(m.accept_tokens(&toks).unwrap(), toks.len());
        assert!(m.can_end().unwrap());
        m.fill_mask(&mut m1).unwrap();
        assert!(m1.is_allowed(tok.eos[0]), "{}", tok.name);
        m.accept(tok.eos[0]).unwrap();
        assert!(m.is_terminated());
        // After EOS only EOS is allowed (compute_mask would error here).
        m.fill_mask(&mut m1).unwrap();
        assert_eq!(m1.allowed_tokens(), sorted(&tok.eos));
        assert!(matches!(
            m.accept(toks[0]),
            Err(GrammarError::Rejected { .. })
        ));
        m.rollback(toks.len() + 1).unwrap();
        assert!(!m.is_terminated());
        m.fill_mask(&mut m1).unwrap();
        assert_eq!(m0, m1, "{}", tok.name);
        assert!(!m.can_end().unwrap());
        // A rejected token leaves the state unchanged.
        let bad = tok.encode("x")[0];
        assert_eq!(m.accept(bad), Err(GrammarError::Rejected { token: bad }));
        assert!(m.error().is_none());
        assert_eq!(m.validate_tokens(&toks).unwrap(), toks.len());
        assert_eq!(m.accept_tokens(&toks).unwrap(), toks.len());
    }
}

#[test]
fn stops_when_nothing_can_follow() {
    for tok in toks() {
        let b = tok.backend(&GrammarOptions::default());
        let c = b.compile(&GrammarSpec::Regex("ok".into())).unwrap();
        let mut m = c.matcher().unwrap();
        let t = tok.encode("ok");
        m.accept_tokens(&t).unwrap();
        assert!(m.is_terminated() && m.can_end().unwrap());
        let mut mask = TokenBitmask::new(b.vocab_size());
        m.fill_mask(&mut mask).unwrap();
        assert_eq!(mask.allowed_tokens(), sorted(&tok.eos));
        m.accept(tok.eos[0]).unwrap();
        m.rollback(1).unwrap();
        m.accept(tok.eos[0]).unwrap();
        m.rollback(1 + t.len()).unwrap();
        assert!(!m.is_terminated());
        assert_eq!(m.forced_bytes().unwrap(), b"ok".to_vec());
    }
}

/// Forced tokens on `{"name": ...}` and the claim in the crate docs: when
/// bytes are forced, the mask allows exactly the first forced token, so
/// jump-forward and token-by-token decoding emit the same tokens.
#[test]
fn forced_tokens_jump_forward() {
    let schema = r#"{"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"}},
                     "required":["name","age"],"additionalProperties":false}"#;
    for tok in toks() {
        let b = tok.backend(&compact());
        assert!(b.forces_tokens(), "{}", tok.name);
        let c = b.compile(&GrammarSpec::JsonSchema(schema.into())).unwrap();
        let mut m = c.matcher().unwrap();
        assert_eq!(m.forced_bytes().unwrap(), br#"{"name":""#.to_vec());
        let forced = m.forced_tokens().unwrap();
        let text = tok.tokenizer.decode(&forced, false).unwrap();
        assert!(
            !forced.is_empty() && r#"{"name":""#.starts_with(&text),
            "{}: {text:?}",
            tok.name
        );
        // Token-by-token: each mask is exactly the next forced token.
        let mut mask = TokenBitmask::new(b.vocab_size());
        for &t in &forced {
            m.fill_mask(&mut mask).unwrap();
            assert_eq!(mask.allowed_tokens(), vec![t], "{}", tok.name);
            m.accept(t).unwrap();
        }
        // The rest of `{"name":"` (if chopped) is a required prefix of the next token.
        m.fill_mask(&mut mask).unwrap();
        let rest = &r#"{"name":""#[text.len()..];
        for t in mask.allowed_tokens().into_iter().take(200) {
            let s = tok.tokenizer.decode(&[t], false).unwrap();
            assert!(
                s.starts_with(rest) || rest.starts_with(&s),
                "{}: {s:?} vs {rest:?}",
                tok.name
            );
        }
        // Finish the value; then `","age":` is forced.
        let rest_toks = tok.encode(&format!("{rest}Ann\""));
        m.accept_tokens(&rest_toks).unwrap();
        assert_eq!(m.forced_bytes().unwrap(), br#","age":"#.to_vec());
        let f2 = m.forced_tokens().unwrap();
        assert_eq!(m.accept_tokens(&f2).unwrap(), f2.len());
    }
}

#[test]
fn flexible_whitespace_by_default() {
    let tok = small_bpe();
    let b = tok.backend(&GrammarOptions::default());
    let spec = GrammarSpec::JsonSchema(
        r#"{"type":"object","properties":{"a":{"type":"integer"}}}"#.into(),
    );
    assert!(accepts(&tok, &b, &spec, "{ \"a\" : 1 }"));
    let b = tok.backend(&compact());
    assert!(!accepts(&tok, &b, &spec, "{ \"a\" : 1 }"));
    assert!(accepts(&tok, &b, &spec, "{\"a\":1}"));
    let b = tok.backend(&GrammarOptions {
        json_whitespace: JsonWhitespace::Pattern(" ?".into()),
        ..Default::default()
    });
    assert!(accepts(&tok, &b, &spec, "{\"a\": 1}"));
    assert!(!accepts(&tok, &b, &spec, "{\"a\":\n1}"));
}

#[test]
fn malformed_grammars_give_clear_errors() {
    let tok = small_bpe();
    let b = tok.backend(&GrammarOptions::default());
    let cases = [
        (
            GrammarSpec::JsonSchema("{\"type\": ".into()),
            "not valid JSON",
        ),
        (
            GrammarSpec::JsonSchema(r#"{"type":"objekt"}"#.into()),
            "objekt",
        ),
        (GrammarSpec::JsonSchema("false".into()), "matches nothing"),
        (GrammarSpec::Regex("(ab".into()), "invalid regex grammar"),
        (
            GrammarSpec::Ebnf("root ::= foo".into()),
            "`foo` is used but not defined",
        ),
        (GrammarSpec::Lark("start: bar".into()), "bar"),
    ];
    for (spec, needle) in cases {
        let e = b.compile(&spec).err().unwrap();
        assert!(e.is_client_error(), "{e}");
        let msg = e.to_string();
        assert!(msg.contains(needle), "{msg}");
        assert!(msg.len() < 2000, "{msg}");
    }
}

#[test]
fn panic_inside_the_matcher_becomes_an_error() {
    let tok = small_bpe();
    let b = tok.backend(&GrammarOptions::default());
    let c = b.compile_llg(&GrammarSpec::Regex("a+".into())).unwrap();
    let mut m = c.llg_matcher();
    m.accept(tok.encode("a")[0]).unwrap();
    // llguidance's test hook panics inside the parser ("synthetic error").
    assert!(m.inner_mut().test_trigger_lexer_error().is_err());
    let mut mask = TokenBitmask::new(b.vocab_size());
    let e = m.fill_mask(&mut mask).err().unwrap();
    assert!(matches!(e, GrammarError::Matcher(_)), "{e}");
    assert!(
        m.error().unwrap().contains("synthetic error"),
        "{:?}",
        m.error()
    );
    assert!(m.accept(tok.encode("a")[0]).is_err());
    assert!(m.forced_tokens().is_err());
    assert!(!m.is_terminated());
}

#[test]
fn registry_cache_and_vocab_sources() {
    let tok = small_bpe();
    let reg = arbor_engine_core::Registry::builtin().unwrap();
    let create = reg.grammar_backends.get("llguidance").unwrap();
    let json = tok.tokenizer.to_string(false).unwrap();
    let padded = tok.vocab_size() + 50;
    let cfg = GrammarBackendConfig {
        vocab: GrammarVocab {
            source: VocabSource::TokenizerJson(Arc::from(json.as_str())),
            eos_token_ids: tok.eos.clone(),
            vocab_size: Some(padded),
        },
        options: GrammarOptions::default(),
    };
    let backend = create(&cfg).unwrap();
    assert_eq!(backend.name(), "llguidance");
    assert_eq!(backend.vocab_size(), padded);
    let cache = GrammarCache::new(backend, GrammarCacheConfig::default());
    let spec = GrammarSpec::JsonObject;
    let mut m = cache.matcher(&spec).unwrap();
    let mut mask = TokenBitmask::new(padded);
    m.fill_mask(&mut mask).unwrap();
    assert!(
        mask.allowed_tokens()
            .iter()
            .all(|&t| (t as usize) < tok.vocab_size())
    );
    let _ = cache.get(&spec).unwrap();
    assert_eq!((cache.stats().hits, cache.stats().misses), (1, 1));
    let e = cache
        .get(&GrammarSpec::JsonSchema("{".into()))
        .err()
        .unwrap();
    assert!(e.is_client_error());

    // Token bytes only: no canonical tokenizer, so forced bytes but no forced tokens.
    let bytes: Vec<Vec<u8>> = (0..=255u8)
        .map(|b| vec![b])
        .chain([b"<eos>".to_vec()])
        .collect();
    let cfg = GrammarBackendConfig {
        vocab: GrammarVocab {
            source: VocabSource::TokenBytes {
                tokens: Arc::new(bytes),
                special: vec![256],
            },
            eos_token_ids: vec![256],
            vocab_size: None,
        },
        options: GrammarOptions::default(),
    };
    let b = LlgBackend::new(&cfg).unwrap();
    assert!(!b.forces_tokens());
    let mut m = b
        .compile(&GrammarSpec::Regex("hello+".into()))
        .unwrap()
        .matcher()
        .unwrap();
    assert_eq!(m.forced_bytes().unwrap(), b"hello".to_vec());
    assert!(m.forced_tokens().unwrap().is_empty());
    let mut mask = TokenBitmask::new(257);
    m.fill_mask(&mut mask).unwrap();
    assert_eq!(mask.allowed_tokens(), vec![b'h' as u32]);

    // Bad vocabularies are errors, not panics.
    let bad = GrammarVocab {
        source: VocabSource::TokenizerJson(Arc::from("{}")),
        eos_token_ids: vec![0],
        vocab_size: None,
    };
    assert!(matches!(
        LlgBackend::new(&GrammarBackendConfig {
            vocab: bad,
            options: GrammarOptions::default()
        }),
        Err(GrammarError::Vocab(_))
    ));
}

#[test]
fn matcher_state_is_per_request() {
    let tok = small_bpe();
    let b = tok.backend(&GrammarOptions::default());
    let c = b.compile(&GrammarSpec::Regex("[a-c]{3}".into())).unwrap();
    let (mut m1, mut m2) = (c.matcher().unwrap(), c.matcher().unwrap());
    m1.accept_tokens(&tok.encode("ab")).unwrap();
    let mut mask = TokenBitmask::new(b.vocab_size());
    m2.fill_mask(&mut mask).unwrap();
    assert!(mask.is_allowed(tok.encode("a")[0]));
    let h = std::thread::spawn(move || {
        m1.accept_tokens(&[0]).ok();
        m1.is_terminated()
    });
    let _ = h.join().unwrap();
    let _: Box<dyn GrammarMatcher> = m2;
}

/// Token boundary case 2 of the crate docs: when the canonical tokenization
/// would merge the last sampled token with forced text, llguidance leaves
/// the sampled token alone and forces the rest tokenized on its own.
#[test]
fn forced_tokens_never_rewrite_the_sampled_token() {
    let tok = small_bpe(); // has the merge `":`
    let b = tok.backend(&GrammarOptions::default());
    let c = b
        .compile(&GrammarSpec::Regex(r#""[a-z]+":1"#.into()))
        .unwrap();
    let mut m = c.matcher().unwrap();
    let quote = tok.encode("\"");
    assert_eq!(
        tok.encode("\":"),
        vec![tok.encode("\":")[0]],
        "one token for `\":`"
    );
    m.accept_tokens(&quote).unwrap();
    m.accept_tokens(&tok.encode("ab")).unwrap();
    m.accept_tokens(&quote).unwrap(); // the closing quote, sampled
    assert_eq!(m.forced_bytes().unwrap(), b":1".to_vec());
    let forced = m.forced_tokens().unwrap();
    assert_eq!(forced, tok.encode(":1"));
    // Canonical tokenization of the whole text differs at that boundary.
    let whole = tok.encode("\"ab\":1");
    assert_ne!(&whole[whole.len() - forced.len()..], &forced[..]);
    assert_eq!(m.accept_tokens(&forced).unwrap(), forced.len());
    assert!(m.can_end().unwrap());
}

#[test]
fn compiled_size_limit_is_a_clear_error() {
    let tok = small_bpe();
    let props: Vec<String> = (0..40)
        .map(|i| format!(r#""p{i}":{{"type":"string"}}"#))
        .collect();
    let schema = format!(
        r#"{{"type":"object","properties":{{{}}}}}"#,
        props.join(",")
    );
    let spec = GrammarSpec::JsonSchema(schema);
    assert!(
        tok.backend(&GrammarOptions::default())
            .compile(&spec)
            .is_ok()
    );
    let small = tok.backend(&GrammarOptions {
        max_compiled_size: 100,
        ..Default::default()
    });
    let e = small.compile(&spec).err().unwrap();
    assert!(e.is_client_error());
    assert!(e.to_string().contains("too big"), "{e}");
}

/// `oneOf` whose branches llguidance cannot prove disjoint compiles by
/// default as `anyOf`, and is refused under `json_strict_one_of`, naming the
/// keyword; provably disjoint branches compile exactly either way.
#[test]
fn one_of_is_coerced_unless_strict() {
    let tok = small_bpe();
    let disjoint = GrammarSpec::JsonSchema(
        r#"{"type":"object","properties":{"id":{"oneOf":[{"type":"integer"},{"type":"string","maxLength":4}]}},"required":["id"]}"#
            .into(),
    );
    let overlapping = GrammarSpec::JsonSchema(
        r#"{"type":"object","properties":{"id":{"oneOf":[{"type":"string","maxLength":4},{"type":"string","pattern":"^a"}]}},"required":["id"]}"#
            .into(),
    );
    let strict = tok.backend(&GrammarOptions {
        json_strict_one_of: true,
        ..compact()
    });
    let b = tok.backend(&compact());
    for b in [&b, &strict] {
        assert!(accepts(&tok, b, &disjoint, r#"{"id":12}"#));
        assert!(accepts(&tok, b, &disjoint, r#"{"id":"ab"}"#));
        assert!(!accepts(&tok, b, &disjoint, r#"{"id":true}"#));
        assert!(!accepts(&tok, b, &disjoint, r#"{"id":"abcdef"}"#));
    }
    assert!(accepts(&tok, &b, &overlapping, r#"{"id":"xy"}"#));
    assert!(accepts(&tok, &b, &overlapping, r#"{"id":"abcdefg"}"#));
    assert!(!accepts(&tok, &b, &overlapping, r#"{"id":"xyzwv"}"#));
    let e = strict
        .compile(&overlapping)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(e.contains("oneOf"), "{e}");
}
