//! The llguidance grammar backend: engine-core's [`GrammarBackend`],
//! [`CompiledGrammar`] and [`GrammarMatcher`] over `llguidance`'s
//! `ParserFactory` and `Matcher`.
//!
//! - One [`LlgBackend`] per tokenizer holds the `ParserFactory` (token trie,
//!   sliced bias computer). `compile` builds a `TokenParser` (JSON schema →
//!   grammar, lexer construction); the result keeps a started `Matcher` that
//!   each request clones. Clones share the lazily built lexer automaton
//!   (behind a mutex), so later requests for one grammar are fast from their
//!   first mask, but masks of requests with the same grammar computed on
//!   parallel threads take turns on that lexer.
//! - [`LlgMatcher`] maps llguidance's states onto the trait: a token that is
//!   not allowed is reported as [`GrammarError::Rejected`] without touching
//!   the state (it is validated before being consumed); any other llguidance
//!   error puts the matcher in its error state. Once the grammar is complete
//!   llguidance refuses `compute_mask`, so masks come from
//!   `compute_mask_or_eos` (EOS only), and an EOS accepted after that point is
//!   counted here so that `rollback` stays exact.
//!
//! Every llguidance call already runs under its own `catch_unwind`; the
//! [`GrammarCache`](arbor_engine_core::grammar::GrammarCache) adds a second guard.

use crate::ebnf::ebnf_to_lark;
use crate::vocab::{HfTokenizerEnv, env_from_vocab};
use arbor_engine_core::grammar::{
    CompiledGrammar, GrammarBackend, GrammarBackendConfig, GrammarError, GrammarKind,
    GrammarMatcher, GrammarOptions, GrammarResult, GrammarSpec, JsonWhitespace, TokenBitmask,
    catch_panic,
};
use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::earley::SlicedBiasComputer;
use llguidance::{Matcher, ParserFactory};
use serde_json::{Value, json};
use std::sync::Arc;
use toktrie::{InferenceCapabilities, TokEnv, TokenizerEnv};

/// Longest error message passed on (llguidance can print whole grammars).
const MAX_ERROR_CHARS: usize = 1500;

fn clip(msg: String) -> String {
    if msg.chars().count() <= MAX_ERROR_CHARS {
        return msg;
    }
    let mut s: String = msg.chars().take(MAX_ERROR_CHARS).collect();
    s.push_str(" …");
    s
}

/// The llguidance backend for one tokenizer.
pub struct LlgBackend {
    factory: ParserFactory,
    env: TokEnv,
    canonical: bool,
    vocab_size: usize,
    options: GrammarOptions,
}

impl std::fmt::Debug for LlgBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "LlgBackend(vocab {}, canonical {})",
            self.vocab_size, self.canonical
        )
    }
}

impl LlgBackend {
    /// Builds the backend from engine-core's configuration (what the registry calls).
    pub fn new(config: &GrammarBackendConfig) -> GrammarResult<Self> {
        let env = env_from_vocab(&config.vocab)?;
        Self::from_env(env, &config.options)
    }

    /// Builds the backend from a loaded tokenizer (e.g. a GGUF file's).
    pub fn from_tokenizer(
        tokenizer: &tokenizers::Tokenizer,
        eos_token_ids: &[u32],
        vocab_size: Option<usize>,
        options: &GrammarOptions,
    ) -> GrammarResult<Self> {
        let env = crate::vocab::env_from_tokenizer(tokenizer, eos_token_ids, vocab_size)?;
        Self::from_env(env, options)
    }

    /// Builds the backend over a prepared environment.
    pub fn from_env(env: Arc<HfTokenizerEnv>, options: &GrammarOptions) -> GrammarResult<Self> {
        let canonical = env.is_canonical();
        let vocab_size = env.tok_trie().vocab_size();
        let env: TokEnv = env;
        let caps = InferenceCapabilities {
            ff_tokens: canonical,
            ..Default::default()
        };
        let mut factory = catch_panic(|| {
            ParserFactory::new(&env, caps, &SlicedBiasComputer::general_slices())
                .map_err(|e| GrammarError::Vocab(format!("{e:#}")))
        })?;
        factory.quiet();
        let limits = factory.limits_mut();
        limits.verbose_errors = false;
        if options.max_compiled_size > 0 {
            limits.max_grammar_size = options.max_compiled_size;
        }
        Ok(Self {
            factory,
            env,
            canonical,
            vocab_size,
            options: options.clone(),
        })
    }

    /// Whether forced tokens (jump-forward) are available with this tokenizer.
    pub fn forces_tokens(&self) -> bool {
        self.canonical
    }

    /// llguidance's limits (step fuel, lexer states, grammar size).
    pub fn limits(&self) -> &ParserLimits {
        self.factory.limits()
    }

    /// The llguidance token environment (trie and tokenizer).
    pub fn tok_env(&self) -> &TokEnv {
        &self.env
    }

    /// Adds this backend's JSON options to a schema (unless it sets its own `x-guidance`).
    fn json_schema(&self, mut schema: Value) -> GrammarResult<Value> {
        match &schema {
            Value::Bool(true) => schema = json!({}),
            Value::Bool(false) => {
                return Err(GrammarError::Invalid {
                    kind: GrammarKind::JsonSchema,
                    message: "the schema `false` matches nothing".into(),
                });
            }
            Value::Object(_) => {}
            _ => {
                return Err(GrammarError::Invalid {
                    kind: GrammarKind::JsonSchema,
                    message: "a JSON schema must be an object or a boolean".into(),
                });
            }
        }
        let mut opts = serde_json::Map::new();
        match &self.options.json_whitespace {
            JsonWhitespace::Flexible => {}
            JsonWhitespace::Compact => {
                opts.insert("whitespace_flexible".into(), json!(false));
                opts.insert("item_separator".into(), json!(","));
                opts.insert("key_separator".into(), json!(":"));
            }
            JsonWhitespace::Pattern(p) => {
                opts.insert("whitespace_pattern".into(), json!(p));
            }
        }
        if self.options.json_lenient {
            opts.insert("lenient".into(), json!(true));
        }
        if self.options.json_lenient || !self.options.json_strict_one_of {
            opts.insert("coerce_one_of".into(), json!(true));
        }
        if let Some(obj) = schema.as_object_mut()
            && !opts.is_empty()
            && !obj.contains_key("x-guidance")
        {
            obj.insert("x-guidance".into(), Value::Object(opts));
        }
        Ok(schema)
    }

    fn top_level(&self, spec: &GrammarSpec) -> GrammarResult<TopLevelGrammar> {
        Ok(match spec {
            GrammarSpec::JsonSchema(text) => {
                let v: Value = serde_json::from_str(text).map_err(|e| GrammarError::Invalid {
                    kind: GrammarKind::JsonSchema,
                    message: format!("not valid JSON: {e}"),
                })?;
                TopLevelGrammar::from_json_schema(self.json_schema(v)?)
            }
            GrammarSpec::JsonObject => {
                TopLevelGrammar::from_json_schema(self.json_schema(json!({"type": "object"}))?)
            }
            GrammarSpec::Regex(rx) => TopLevelGrammar::from_regex(rx),
            GrammarSpec::Ebnf(text) => TopLevelGrammar::from_lark(ebnf_to_lark(text)?),
            GrammarSpec::Lark(text) => TopLevelGrammar::from_lark(text.clone()),
        })
    }
}

impl GrammarBackend for LlgBackend {
    fn name(&self) -> &str {
        "llguidance"
    }

    fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    fn compile(&self, spec: &GrammarSpec) -> GrammarResult<Arc<dyn CompiledGrammar>> {
        Ok(Arc::new(self.compile_llg(spec)?))
    }
}

impl LlgBackend {
    /// Compiles a grammar into the concrete type.
    pub fn compile_llg(&self, spec: &GrammarSpec) -> GrammarResult<LlgCompiled> {
        let kind = spec.kind();
        let grammar = self.top_level(spec)?;
        let invalid = |e: String| GrammarError::Invalid {
            kind,
            message: clip(e),
        };
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| invalid(format!("{e:#}")))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(invalid(e));
        }
        Ok(LlgCompiled {
            matcher,
            vocab_size: self.vocab_size,
        })
    }
}

/// A compiled llguidance grammar: a started matcher cloned per request.
pub struct LlgCompiled {
    matcher: Matcher,
    vocab_size: usize,
}

impl LlgCompiled {
    /// A fresh matcher as the concrete type (for access to llguidance's matcher).
    pub fn llg_matcher(&self) -> LlgMatcher {
        LlgMatcher {
            m: self.matcher.clone(),
            vocab_size: self.vocab_size,
            eos_after_stop: 0,
        }
    }
}

impl CompiledGrammar for LlgCompiled {
    fn matcher(&self) -> GrammarResult<Box<dyn GrammarMatcher>> {
        Ok(Box::new(self.llg_matcher()))
    }
}

/// One request's llguidance matcher.
pub struct LlgMatcher {
    m: Matcher,
    vocab_size: usize,
    /// EOS tokens accepted after llguidance stopped (it no longer takes tokens then).
    eos_after_stop: usize,
}

impl LlgMatcher {
    fn fail(&self, e: impl std::fmt::Display) -> GrammarError {
        GrammarError::Matcher(clip(self.m.get_error().unwrap_or_else(|| e.to_string())))
    }

    fn is_eos(&self, token: u32) -> bool {
        self.m
            .tok_env()
            .is_ok_and(|env| env.tok_trie().eos_tokens().contains(&token))
    }

    /// The underlying llguidance matcher.
    pub fn inner(&self) -> &Matcher {
        &self.m
    }

    /// The underlying llguidance matcher, mutably (tests, diagnostics).
    pub fn inner_mut(&mut self) -> &mut Matcher {
        &mut self.m
    }
}

impl GrammarMatcher for LlgMatcher {
    fn fill_mask(&mut self, mask: &mut TokenBitmask) -> GrammarResult<()> {
        if mask.vocab_size() != self.vocab_size {
            return Err(GrammarError::Matcher(format!(
                "mask has {} ids, the grammar's vocabulary {}",
                mask.vocab_size(),
                self.vocab_size
            )));
        }
        let v = self.m.compute_mask_or_eos().map_err(|e| self.fail(e))?;
        let src = v.as_slice();
        let dst = mask.words_mut();
        let n = src.len().min(dst.len());
        dst[..n].copy_from_slice(&src[..n]);
        dst[n..].fill(0);
        mask.clear_tail();
        Ok(())
    }

    fn accept(&mut self, token: u32) -> GrammarResult<()> {
        if self.m.is_error() {
            return Err(self.fail("matcher is in the error state"));
        }
        if self.m.is_stopped() || self.eos_after_stop > 0 {
            if self.eos_after_stop == 0 && self.is_eos(token) {
                self.eos_after_stop = 1;
                return Ok(());
            }
            return Err(GrammarError::Rejected { token });
        }
        match self.m.try_consume_tokens(&[token]) {
            Ok(1) => Ok(()),
            Ok(_) => Err(GrammarError::Rejected { token }),
            Err(e) => Err(self.fail(e)),
        }
    }

    fn validate_tokens(&mut self, tokens: &[u32]) -> GrammarResult<usize> {
        if self.m.is_stopped() && !self.m.is_error() {
            let eos = usize::from(
                self.eos_after_stop == 0 && tokens.first().is_some_and(|&t| self.is_eos(t)),
            );
            return Ok(eos);
        }
        self.m.validate_tokens(tokens).map_err(|e| self.fail(e))
    }

    fn rollback(&mut self, n: usize) -> GrammarResult<()> {
        let own = n.min(self.eos_after_stop);
        self.eos_after_stop -= own;
        self.m.rollback(n - own).map_err(|e| self.fail(e))
    }

    fn forced_tokens(&mut self) -> GrammarResult<Vec<u32>> {
        if self.m.is_stopped() {
            return self.error_or(Vec::new());
        }
        let t = self.m.compute_ff_tokens();
        self.error_or(t)
    }

    fn forced_bytes(&mut self) -> GrammarResult<Vec<u8>> {
        if self.m.is_stopped() {
            return self.error_or(Vec::new());
        }
        let b = self.m.compute_ff_bytes();
        self.error_or(b)
    }

    fn can_end(&mut self) -> GrammarResult<bool> {
        if self.m.is_error() {
            return Err(self.fail("matcher is in the error state"));
        }
        if self.m.is_stopped() {
            return Ok(true);
        }
        self.m.is_accepting().map_err(|e| self.fail(e))
    }

    fn is_terminated(&self) -> bool {
        self.eos_after_stop > 0 || (self.m.is_stopped() && !self.m.is_error())
    }

    fn error(&self) -> Option<String> {
        self.m.get_error()
    }
}

impl LlgMatcher {
    fn error_or<T>(&self, v: T) -> GrammarResult<T> {
        match self.m.get_error() {
            Some(e) => Err(GrammarError::Matcher(clip(e))),
            None => Ok(v),
        }
    }
}
