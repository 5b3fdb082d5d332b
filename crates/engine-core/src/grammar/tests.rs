//! Tests of the grammar interface: bitmask, guard and cache, over a toy backend.

use super::*;
use std::sync::atomic::AtomicUsize;

/// A toy backend over a byte vocabulary (ids 0..=255, EOS = 256): a
/// `Regex(text)` spec matches exactly `text`. "panic" panics at compile,
/// "slow..." sleeps 200 ms, and a matcher panics when fed `!`.
struct Literal {
    compiles: AtomicUsize,
}
const EOS: u32 = 256;

struct LiteralGrammar(Vec<u8>);
struct LiteralMatcher {
    text: Vec<u8>,
    pos: usize,
    ended: bool,
}

impl GrammarBackend for Literal {
    fn name(&self) -> &str {
        "literal"
    }
    fn vocab_size(&self) -> usize {
        257
    }
    fn compile(&self, spec: &GrammarSpec) -> GrammarResult<Arc<dyn CompiledGrammar>> {
        self.compiles.fetch_add(1, Ordering::SeqCst);
        let text = spec.text();
        if text == "panic" {
            panic!("compile exploded");
        }
        if text.is_empty() {
            return Err(GrammarError::Invalid {
                kind: spec.kind(),
                message: "empty".into(),
            });
        }
        if text.starts_with("slow") {
            std::thread::sleep(Duration::from_millis(200));
        }
        Ok(Arc::new(LiteralGrammar(text.as_bytes().to_vec())))
    }
}

impl CompiledGrammar for LiteralGrammar {
    fn matcher(&self) -> GrammarResult<Box<dyn GrammarMatcher>> {
        Ok(Box::new(LiteralMatcher {
            text: self.0.clone(),
            pos: 0,
            ended: false,
        }))
    }
}

impl GrammarMatcher for LiteralMatcher {
    fn fill_mask(&mut self, mask: &mut TokenBitmask) -> GrammarResult<()> {
        mask.clear();
        match self.text.get(self.pos) {
            Some(&b) if !self.ended => mask.allow(b as u32),
            _ => mask.allow(EOS),
        }
        Ok(())
    }
    fn accept(&mut self, token: u32) -> GrammarResult<()> {
        if token == b'!' as u32 {
            panic!("matcher exploded");
        }
        if token == EOS && self.pos == self.text.len() {
            self.ended = true;
            return Ok(());
        }
        if self.text.get(self.pos).map(|&b| b as u32) == Some(token) {
            self.pos += 1;
            Ok(())
        } else {
            Err(GrammarError::Rejected { token })
        }
    }
    fn validate_tokens(&mut self, tokens: &[u32]) -> GrammarResult<usize> {
        Ok(tokens
            .iter()
            .zip(&self.text[self.pos..])
            .take_while(|(t, b)| **t == **b as u32)
            .count())
    }
    fn rollback(&mut self, n: usize) -> GrammarResult<()> {
        let n = if self.ended {
            self.ended = false;
            n - 1
        } else {
            n
        };
        self.pos -= n;
        Ok(())
    }
    fn forced_tokens(&mut self) -> GrammarResult<Vec<u32>> {
        Ok(self.text[self.pos..].iter().map(|&b| b as u32).collect())
    }
    fn forced_bytes(&mut self) -> GrammarResult<Vec<u8>> {
        Ok(self.text[self.pos..].to_vec())
    }
    fn can_end(&mut self) -> GrammarResult<bool> {
        Ok(self.pos == self.text.len())
    }
    fn is_terminated(&self) -> bool {
        self.ended || self.pos == self.text.len()
    }
    fn error(&self) -> Option<String> {
        None
    }
}

fn cache(capacity: usize, timeout: Option<Duration>) -> (Arc<Literal>, GrammarCache) {
    let b = Arc::new(Literal {
        compiles: AtomicUsize::new(0),
    });
    let c = GrammarCache::new(
        b.clone(),
        GrammarCacheConfig {
            capacity,
            max_grammar_bytes: 64,
            compile_timeout: timeout,
        },
    );
    (b, c)
}

#[test]
fn bitmask_basics() {
    let mut m = TokenBitmask::new(70);
    assert_eq!(m.words().len(), 3);
    m.allow(0);
    m.allow(33);
    m.allow(69);
    m.allow(70); // out of range: ignored
    assert!(m.is_allowed(33) && !m.is_allowed(34) && !m.is_allowed(70));
    assert_eq!(m.allowed_tokens(), vec![0, 33, 69]);
    let mut logits = vec![1.0f32; 75];
    m.apply_to_logits(&mut logits);
    let kept: Vec<usize> = (0..75).filter(|&i| logits[i].is_finite()).collect();
    assert_eq!(kept, vec![0, 33, 69]);
    m.allow_all();
    assert_eq!(m.count_allowed(), 70);
    m.disallow(5);
    assert_eq!(m.count_allowed(), 69);
    let mut logits = vec![0.5f32; 72];
    m.apply_to_logits(&mut logits);
    assert!(logits[5].is_infinite() && logits[69].is_finite() && logits[70].is_infinite());
}

#[test]
fn cache_compiles_once_and_evicts_lru() {
    let (b, c) = cache(2, None);
    let a = GrammarSpec::Regex("ab".into());
    c.get(&a).unwrap();
    c.get(&a).unwrap();
    assert_eq!(b.compiles.load(Ordering::SeqCst), 1);
    // Same text, other kind: another entry.
    c.get(&GrammarSpec::Ebnf("ab".into())).unwrap();
    c.get(&a).unwrap(); // a is now most recent
    c.get(&GrammarSpec::Regex("cd".into())).unwrap(); // evicts the ebnf entry
    assert!(c.contains(&a));
    assert!(!c.contains(&GrammarSpec::Ebnf("ab".into())));
    let s = c.stats();
    assert_eq!((s.hits, s.misses, s.evictions, s.entries), (2, 3, 1, 2));
}

#[test]
fn cache_limits_and_errors() {
    let (b, c) = cache(8, None);
    let e = c.get(&GrammarSpec::Regex("x".repeat(65))).err().unwrap();
    assert!(e.is_client_error());
    assert!(
        e.to_string().contains("65 bytes, over the limit of 64"),
        "{e}"
    );
    // Errors are cached.
    let bad = GrammarSpec::Regex(String::new());
    assert!(matches!(c.get(&bad), Err(GrammarError::Invalid { .. })));
    assert!(matches!(c.get(&bad), Err(GrammarError::Invalid { .. })));
    assert_eq!(b.compiles.load(Ordering::SeqCst), 1);
    // A panic during compile is an error, not a crash.
    let e = c.get(&GrammarSpec::Regex("panic".into())).err().unwrap();
    assert!(
        matches!(&e, GrammarError::Panic(m) if m.contains("compile exploded")),
        "{e}"
    );
    assert!(!e.is_client_error());
    assert_eq!(c.stats().compile_errors, 2);
    // Timeout: the caller gives up, the compilation lands in the cache.
    let (_, c) = cache(8, Some(Duration::from_millis(50)));
    let slow = GrammarSpec::Regex("slow".into());
    let e = c.get(&slow).err().unwrap();
    assert_eq!(
        e,
        GrammarError::CompileTimeout {
            kind: GrammarKind::Regex,
            limit_ms: 50
        }
    );
    std::thread::sleep(Duration::from_millis(400));
    assert!(c.get(&slow).is_ok());
    assert_eq!(c.stats().timeouts, 1);
}

#[test]
fn concurrent_lookups_share_one_compile() {
    let (b, c) = cache(8, Some(Duration::from_secs(5)));
    let c = Arc::new(c);
    let spec = GrammarSpec::Regex("slow-shared".into());
    let handles: Vec<_> = (0..4)
        .map(|_| {
            let c = c.clone();
            let spec = spec.clone();
            std::thread::spawn(move || c.get(&spec).is_ok())
        })
        .collect();
    for h in handles {
        assert!(h.join().unwrap());
    }
    assert_eq!(b.compiles.load(Ordering::SeqCst), 1);
}

#[test]
fn matcher_panic_becomes_error_state() {
    let (_, c) = cache(8, None);
    let mut m = c.matcher(&GrammarSpec::Regex("a!".into())).unwrap();
    let mut mask = TokenBitmask::new(257);
    m.fill_mask(&mut mask).unwrap();
    assert_eq!(mask.allowed_tokens(), vec![b'a' as u32]);
    assert_eq!(
        m.accept(b'b' as u32),
        Err(GrammarError::Rejected { token: b'b' as u32 })
    );
    m.accept(b'a' as u32).unwrap();
    let e = m.accept(b'!' as u32).err().unwrap();
    assert!(matches!(&e, GrammarError::Panic(msg) if msg.contains("matcher exploded")));
    // Poisoned from now on.
    assert!(m.fill_mask(&mut mask).is_err());
    assert!(m.error().unwrap().contains("matcher exploded"));
    assert!(!m.is_terminated());
}

#[test]
fn default_accept_tokens_stops_at_rejection() {
    let (_, c) = cache(8, None);
    let mut m = c.matcher(&GrammarSpec::Regex("abc".into())).unwrap();
    assert_eq!(
        m.accept_tokens(&[b'a' as u32, b'b' as u32, b'x' as u32])
            .unwrap(),
        2
    );
    assert_eq!(m.forced_tokens().unwrap(), vec![b'c' as u32]);
    m.rollback(1).unwrap();
    assert_eq!(m.forced_bytes().unwrap(), b"bc".to_vec());
}

#[test]
fn spec_kinds() {
    assert_eq!(
        GrammarSpec::from_kind("json_object", "").unwrap(),
        GrammarSpec::JsonObject
    );
    assert_eq!(
        GrammarSpec::from_kind("ebnf", "root ::= \"a\"")
            .unwrap()
            .kind()
            .as_str(),
        "ebnf"
    );
    assert!(GrammarSpec::from_kind("xml", "").is_err());
    let e: CoreError = GrammarError::Unsupported("x".into()).into();
    assert!(matches!(e, CoreError::InvalidArgument(_)));
}
