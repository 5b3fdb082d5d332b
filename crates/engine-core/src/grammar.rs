//! Grammar-constrained decoding: the backend-neutral interface and the grammar cache.
//!
//! A [`GrammarBackend`] is built once per tokenizer (from a [`GrammarVocab`])
//! and compiles a [`GrammarSpec`] (JSON schema, `json_object`, regex, SGLang
//! EBNF, Lark) into a [`CompiledGrammar`], which is immutable, shared between
//! threads and hands out one [`GrammarMatcher`] per request. The scheduler
//! drives a matcher once per decode step:
//!
//! 1. [`GrammarMatcher::fill_mask`] right before sampling (it may overlap the
//!    forward pass) writes a [`TokenBitmask`]; [`TokenBitmask::apply_to_logits`]
//!    sets every disallowed logit to `-inf`;
//! 2. [`GrammarMatcher::accept`] with the sampled token (an error means the
//!    token was not allowed; a rejected token leaves the state unchanged);
//! 3. [`GrammarMatcher::forced_tokens`] (jump-forward): tokens the grammar
//!    forces next, which the engine may append without a forward and then
//!    feed through `accept`;
//! 4. [`GrammarMatcher::rollback`] undoes accepted tokens (speculative decoding).
//!
//! Invariants:
//! - A panic inside a backend never unwinds into the engine: [`guard_matcher`]
//!   and [`GrammarCache`] wrap every call in `catch_unwind`. After a panic
//!   (enforced by the guard) or an internal error (kept by the backend) the
//!   matcher stays in an error state ([`GrammarMatcher::error`]) that fails
//!   every later call; a [`GrammarError::Rejected`] token is not an error state.
//! - A mask has exactly [`GrammarBackend::vocab_size`] bits (the model's logits
//!   width); ids past the tokenizer's vocabulary are never allowed.
//! - The [`GrammarCache`] holds at most `capacity` grammars per backend (LRU),
//!   compiles each (kind, text) once even under concurrent requests, and
//!   turns size and time limits into [`GrammarError`]s that the server answers
//!   with HTTP 400 ([`GrammarError::is_client_error`]).

use crate::error::CoreError;
use std::collections::{BTreeMap, HashMap};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use thiserror::Error;

/// What a request constrains its output to.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum GrammarSpec {
    /// A JSON schema (SGLang `json_schema`, OpenAI `response_format: json_schema`).
    JsonSchema(String),
    /// Any JSON object (OpenAI `response_format: json_object`).
    JsonObject,
    /// A regular expression the whole output must match (SGLang `regex`).
    Regex(String),
    /// SGLang's EBNF dialect (GBNF-style `name ::= ...`, start rule `root`).
    Ebnf(String),
    /// A Lark grammar in the backend's own Lark dialect (start rule `start`).
    Lark(String),
}

/// The kind of a [`GrammarSpec`], for cache keys, metrics and messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GrammarKind {
    /// [`GrammarSpec::JsonSchema`].
    JsonSchema,
    /// [`GrammarSpec::JsonObject`].
    JsonObject,
    /// [`GrammarSpec::Regex`].
    Regex,
    /// [`GrammarSpec::Ebnf`].
    Ebnf,
    /// [`GrammarSpec::Lark`].
    Lark,
}

impl GrammarKind {
    /// The request field's name (`json_schema`, `regex`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            GrammarKind::JsonSchema => "json_schema",
            GrammarKind::JsonObject => "json_object",
            GrammarKind::Regex => "regex",
            GrammarKind::Ebnf => "ebnf",
            GrammarKind::Lark => "lark",
        }
    }
}

impl std::fmt::Display for GrammarKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl GrammarSpec {
    /// This spec's kind.
    pub fn kind(&self) -> GrammarKind {
        match self {
            GrammarSpec::JsonSchema(_) => GrammarKind::JsonSchema,
            GrammarSpec::JsonObject => GrammarKind::JsonObject,
            GrammarSpec::Regex(_) => GrammarKind::Regex,
            GrammarSpec::Ebnf(_) => GrammarKind::Ebnf,
            GrammarSpec::Lark(_) => GrammarKind::Lark,
        }
    }

    /// The grammar text (empty for `json_object`).
    pub fn text(&self) -> &str {
        match self {
            GrammarSpec::JsonSchema(s)
            | GrammarSpec::Regex(s)
            | GrammarSpec::Ebnf(s)
            | GrammarSpec::Lark(s) => s,
            GrammarSpec::JsonObject => "",
        }
    }

    /// Builds a spec from a request field name (`json_schema`, `regex`, `ebnf`,
    /// `lark`, `json_object`) and its text.
    pub fn from_kind(kind: &str, text: impl Into<String>) -> GrammarResult<Self> {
        let text = text.into();
        Ok(match kind {
            "json_schema" | "json" => GrammarSpec::JsonSchema(text),
            "json_object" => GrammarSpec::JsonObject,
            "regex" => GrammarSpec::Regex(text),
            "ebnf" => GrammarSpec::Ebnf(text),
            "lark" => GrammarSpec::Lark(text),
            other => {
                return Err(GrammarError::Unsupported(format!(
                    "unknown grammar kind '{other}' (expected json_schema, json_object, regex, ebnf or lark)"
                )));
            }
        })
    }
}

/// Errors of grammar compilation and matching.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum GrammarError {
    /// The grammar text is malformed or unsatisfiable (bad JSON schema, bad regex...).
    #[error("invalid {kind} grammar: {message}")]
    Invalid {
        /// The grammar's kind.
        kind: GrammarKind,
        /// What is wrong, as the backend says it.
        message: String,
    },
    /// The grammar uses a feature this backend does not implement.
    #[error("unsupported grammar: {0}")]
    Unsupported(String),
    /// The grammar text is longer than the configured limit.
    #[error("{kind} grammar is {size} bytes, over the limit of {limit} bytes")]
    TooLarge {
        /// The grammar's kind.
        kind: GrammarKind,
        /// Its size in bytes.
        size: usize,
        /// The limit in bytes.
        limit: usize,
    },
    /// Compilation did not finish within the configured time.
    #[error("compiling the {kind} grammar took longer than {limit_ms} ms")]
    CompileTimeout {
        /// The grammar's kind.
        kind: GrammarKind,
        /// The limit in milliseconds.
        limit_ms: u64,
    },
    /// A token the grammar does not allow was fed to `accept`; the state is unchanged.
    #[error("token {token} is not allowed by the grammar")]
    Rejected {
        /// The rejected token id.
        token: u32,
    },
    /// The tokenizer cannot be used by this backend.
    #[error("grammar vocabulary error: {0}")]
    Vocab(String),
    /// The matcher failed (internal error, exhausted step budget); it is now in the error state.
    #[error("grammar matcher error: {0}")]
    Matcher(String),
    /// The backend panicked; the matcher (or compile) is now in the error state.
    #[error("grammar backend panicked: {0}")]
    Panic(String),
}

impl GrammarError {
    /// True when the request is at fault (answer HTTP 400), false for engine faults.
    pub fn is_client_error(&self) -> bool {
        matches!(
            self,
            GrammarError::Invalid { .. }
                | GrammarError::Unsupported(_)
                | GrammarError::TooLarge { .. }
                | GrammarError::CompileTimeout { .. }
        )
    }
}

impl From<GrammarError> for CoreError {
    fn from(e: GrammarError) -> Self {
        if e.is_client_error() {
            CoreError::InvalidArgument(e.to_string())
        } else {
            CoreError::Plugin(e.to_string())
        }
    }
}

/// Result alias for grammar operations.
pub type GrammarResult<T> = std::result::Result<T, GrammarError>;

/// A set of allowed token ids: one bit per id, 32 ids per `u32` word, bit
/// `id % 32` of word `id / 32` (the layout of XGrammar's and llguidance's masks).
#[derive(Clone, PartialEq, Eq)]
pub struct TokenBitmask {
    words: Vec<u32>,
    vocab_size: usize,
}

impl std::fmt::Debug for TokenBitmask {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "TokenBitmask({} of {} allowed)",
            self.count_allowed(),
            self.vocab_size
        )
    }
}

impl TokenBitmask {
    /// A mask over `vocab_size` ids with nothing allowed.
    pub fn new(vocab_size: usize) -> Self {
        Self {
            words: vec![0; vocab_size.div_ceil(32)],
            vocab_size,
        }
    }

    /// A mask over `vocab_size` ids with everything allowed.
    pub fn new_allow_all(vocab_size: usize) -> Self {
        let mut m = Self::new(vocab_size);
        m.allow_all();
        m
    }

    /// Number of ids the mask covers.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The words (`vocab_size.div_ceil(32)` of them; bits past `vocab_size` are zero).
    pub fn words(&self) -> &[u32] {
        &self.words
    }

    /// Mutable words, for backends that write the mask directly. Writers must
    /// leave bits past `vocab_size` zero (or call [`TokenBitmask::clear_tail`]).
    pub fn words_mut(&mut self) -> &mut [u32] {
        &mut self.words
    }

    /// Clears the bits past `vocab_size` in the last word.
    pub fn clear_tail(&mut self) {
        let rem = self.vocab_size % 32;
        if rem != 0
            && let Some(last) = self.words.last_mut()
        {
            *last &= (1u32 << rem) - 1;
        }
    }

    /// Disallows everything.
    pub fn clear(&mut self) {
        self.words.fill(0);
    }

    /// Allows everything.
    pub fn allow_all(&mut self) {
        self.words.fill(u32::MAX);
        self.clear_tail();
    }

    /// Whether `token` is allowed (ids past the vocabulary never are).
    pub fn is_allowed(&self, token: u32) -> bool {
        let t = token as usize;
        t < self.vocab_size && self.words[t / 32] & (1 << (t % 32)) != 0
    }

    /// Allows `token` (ignored past the vocabulary).
    pub fn allow(&mut self, token: u32) {
        let t = token as usize;
        if t < self.vocab_size {
            self.words[t / 32] |= 1 << (t % 32);
        }
    }

    /// Disallows `token`.
    pub fn disallow(&mut self, token: u32) {
        let t = token as usize;
        if t < self.vocab_size {
            self.words[t / 32] &= !(1 << (t % 32));
        }
    }

    /// Number of allowed ids.
    pub fn count_allowed(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// The allowed ids, ascending.
    pub fn allowed_tokens(&self) -> Vec<u32> {
        let mut out = Vec::new();
        for (i, &w) in self.words.iter().enumerate() {
            let mut w = w;
            while w != 0 {
                let b = w.trailing_zeros();
                out.push(i as u32 * 32 + b);
                w &= w - 1;
            }
        }
        out
    }

    /// Sets every disallowed logit to `-inf`. Logits past the mask's
    /// vocabulary (a model's padded rows) are disallowed too.
    pub fn apply_to_logits(&self, logits: &mut [f32]) {
        for (i, chunk) in logits.chunks_mut(32).enumerate() {
            let w = self.words.get(i).copied().unwrap_or(0);
            if w == u32::MAX {
                continue;
            }
            for (j, l) in chunk.iter_mut().enumerate() {
                if w & (1 << j) == 0 {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
    }
}

/// Where a backend learns the tokenizer's tokens.
#[derive(Clone)]
pub enum VocabSource {
    /// A Hugging Face `tokenizer.json` (for a GGUF tokenizer, the JSON the
    /// `tokenizers` crate serializes). Gives canonical tokenization, so
    /// forced tokens (jump-forward) are available.
    TokenizerJson(Arc<str>),
    /// The bytes of every token (index = id); ids in `special` are control
    /// tokens that never match grammar text. Without a tokenizer a backend can
    /// only tokenize greedily, so it reports forced bytes but no forced tokens.
    TokenBytes {
        /// Bytes of each token.
        tokens: Arc<Vec<Vec<u8>>>,
        /// Control (special) token ids.
        special: Vec<u32>,
    },
}

/// The tokenizer as a grammar backend sees it.
#[derive(Clone)]
pub struct GrammarVocab {
    /// The tokens.
    pub source: VocabSource,
    /// Ids that end generation; allowed once the grammar can end. At least one.
    pub eos_token_ids: Vec<u32>,
    /// Width of the model's logits when larger than the tokenizer's vocabulary
    /// (the extra ids are never allowed); `None` = the tokenizer's size.
    pub vocab_size: Option<usize>,
}

impl std::fmt::Debug for GrammarVocab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let src = match &self.source {
            VocabSource::TokenizerJson(j) => format!("tokenizer.json ({} bytes)", j.len()),
            VocabSource::TokenBytes { tokens, .. } => {
                format!("{} token byte strings", tokens.len())
            }
        };
        write!(
            f,
            "GrammarVocab({src}, eos {:?}, vocab_size {:?})",
            self.eos_token_ids, self.vocab_size
        )
    }
}

/// Whitespace allowed between JSON tokens in `json_schema`/`json_object` output.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum JsonWhitespace {
    /// Any run of JSON whitespace between tokens (the backend's default).
    #[default]
    Flexible,
    /// None: `,` and `:` without spaces (SGLang `--constrained-json-disable-any-whitespace`).
    Compact,
    /// Whitespace matching this regex (SGLang `--constrained-json-whitespace-pattern`).
    Pattern(String),
}

/// Backend-neutral options, from the `[grammar]` configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GrammarOptions {
    /// JSON whitespace policy.
    pub json_whitespace: JsonWhitespace,
    /// Compile JSON schemas that use keywords or formats the backend cannot
    /// enforce (`not`, unknown `format`s, `oneOf` approximated by `anyOf`...)
    /// by ignoring those constraints, instead of refusing the schema. Output
    /// is then valid JSON but may break the ignored constraints.
    pub json_lenient: bool,
    /// Refuse JSON schemas with `oneOf` instead of compiling `oneOf` as
    /// `anyOf` (the default, as llguidance's `coerce_one_of`: exact where the
    /// branches are disjoint; where they overlap, output may match several).
    pub json_strict_one_of: bool,
    /// Upper bound on a compiled grammar's size in the backend's own unit
    /// (llguidance: grammar symbols); 0 = the backend's default.
    pub max_compiled_size: usize,
}

impl Default for GrammarOptions {
    fn default() -> Self {
        Self {
            json_whitespace: JsonWhitespace::Flexible,
            json_lenient: false,
            json_strict_one_of: false,
            max_compiled_size: 0,
        }
    }
}

/// Everything a grammar backend factory gets.
#[derive(Clone, Debug)]
pub struct GrammarBackendConfig {
    /// The tokenizer.
    pub vocab: GrammarVocab,
    /// Options.
    pub options: GrammarOptions,
}

/// A grammar engine for one tokenizer. Built once, shared by all requests.
pub trait GrammarBackend: Send + Sync {
    /// The registered name (`llguidance`, ...).
    fn name(&self) -> &str;
    /// Width of the masks this backend's matchers fill.
    fn vocab_size(&self) -> usize;
    /// Compiles a grammar. Errors are the request's fault unless they say otherwise.
    fn compile(&self, spec: &GrammarSpec) -> GrammarResult<Arc<dyn CompiledGrammar>>;
}

/// A compiled grammar: immutable, shared, one matcher per request.
pub trait CompiledGrammar: Send + Sync {
    /// A fresh matcher at the start of the grammar.
    fn matcher(&self) -> GrammarResult<Box<dyn GrammarMatcher>>;
}

/// One request's position in its grammar. See the module docs for the call order.
pub trait GrammarMatcher: Send {
    /// Writes the tokens allowed next into `mask` (which must have the
    /// backend's `vocab_size`). After the grammar has terminated, only EOS is allowed.
    fn fill_mask(&mut self, mask: &mut TokenBitmask) -> GrammarResult<()>;
    /// Advances by one token. [`GrammarError::Rejected`] leaves the state
    /// unchanged; EOS is accepted when the grammar can end and terminates it.
    fn accept(&mut self, token: u32) -> GrammarResult<()>;
    /// Advances by several tokens, stopping at the first error; returns how many were accepted.
    fn accept_tokens(&mut self, tokens: &[u32]) -> GrammarResult<usize> {
        for (i, &t) in tokens.iter().enumerate() {
            match self.accept(t) {
                Ok(()) => {}
                Err(GrammarError::Rejected { .. }) => return Ok(i),
                Err(e) => return Err(e),
            }
        }
        Ok(tokens.len())
    }
    /// How many leading tokens of `tokens` the grammar would accept, without
    /// changing the state (verification of speculative drafts).
    fn validate_tokens(&mut self, tokens: &[u32]) -> GrammarResult<usize>;
    /// Undoes the last `n` accepted tokens (including a terminating EOS).
    fn rollback(&mut self, n: usize) -> GrammarResult<()>;
    /// Tokens the grammar forces next (jump-forward), possibly empty. Does not
    /// change the state: the engine appends them and calls `accept` for each.
    fn forced_tokens(&mut self) -> GrammarResult<Vec<u32>>;
    /// Bytes the grammar forces next, possibly empty (also when no tokens are forced).
    fn forced_bytes(&mut self) -> GrammarResult<Vec<u8>>;
    /// Whether EOS is allowed now (the output so far is a complete match).
    fn can_end(&mut self) -> GrammarResult<bool>;
    /// Whether the grammar is finished: EOS was accepted, or nothing but EOS can follow.
    fn is_terminated(&self) -> bool;
    /// The error that put the matcher in its error state, if any.
    fn error(&self) -> Option<String>;
}

/// The text of a caught panic payload.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".to_string()
    }
}

/// Runs `f`, turning a panic into [`GrammarError::Panic`].
pub fn catch_panic<T>(f: impl FnOnce() -> GrammarResult<T>) -> GrammarResult<T> {
    catch_unwind(AssertUnwindSafe(f))
        .unwrap_or_else(|p| Err(GrammarError::Panic(panic_message(&*p))))
}

/// Wraps a matcher so that a panic in any call becomes an error and leaves
/// the matcher in the error state (every later call fails with it).
pub fn guard_matcher(inner: Box<dyn GrammarMatcher>) -> Box<dyn GrammarMatcher> {
    Box::new(GuardedMatcher {
        inner,
        failed: None,
    })
}

struct GuardedMatcher {
    inner: Box<dyn GrammarMatcher>,
    failed: Option<GrammarError>,
}

impl GuardedMatcher {
    fn call<T>(
        &mut self,
        f: impl FnOnce(&mut dyn GrammarMatcher) -> GrammarResult<T>,
    ) -> GrammarResult<T> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let inner = &mut self.inner;
        let r = catch_panic(|| f(inner.as_mut()));
        if let Err(e @ GrammarError::Panic(_)) = &r {
            self.failed = Some(e.clone());
        }
        r
    }
}

impl GrammarMatcher for GuardedMatcher {
    fn fill_mask(&mut self, mask: &mut TokenBitmask) -> GrammarResult<()> {
        self.call(|m| m.fill_mask(mask))
    }
    fn accept(&mut self, token: u32) -> GrammarResult<()> {
        self.call(|m| m.accept(token))
    }
    fn accept_tokens(&mut self, tokens: &[u32]) -> GrammarResult<usize> {
        self.call(|m| m.accept_tokens(tokens))
    }
    fn validate_tokens(&mut self, tokens: &[u32]) -> GrammarResult<usize> {
        self.call(|m| m.validate_tokens(tokens))
    }
    fn rollback(&mut self, n: usize) -> GrammarResult<()> {
        self.call(|m| m.rollback(n))
    }
    fn forced_tokens(&mut self) -> GrammarResult<Vec<u32>> {
        self.call(|m| m.forced_tokens())
    }
    fn forced_bytes(&mut self) -> GrammarResult<Vec<u8>> {
        self.call(|m| m.forced_bytes())
    }
    fn can_end(&mut self) -> GrammarResult<bool> {
        self.call(|m| m.can_end())
    }
    fn is_terminated(&self) -> bool {
        if self.failed.is_some() {
            return false;
        }
        catch_unwind(AssertUnwindSafe(|| self.inner.is_terminated())).unwrap_or(false)
    }
    fn error(&self) -> Option<String> {
        if let Some(e) = &self.failed {
            return Some(e.to_string());
        }
        catch_unwind(AssertUnwindSafe(|| self.inner.error()))
            .unwrap_or_else(|p| Some(format!("grammar backend panicked: {}", panic_message(&*p))))
    }
}

/// A compiled grammar whose matchers are guarded (see [`guard_matcher`]).
struct GuardedCompiled(Arc<dyn CompiledGrammar>);

impl CompiledGrammar for GuardedCompiled {
    fn matcher(&self) -> GrammarResult<Box<dyn GrammarMatcher>> {
        catch_panic(|| self.0.matcher()).map(guard_matcher)
    }
}

/// Limits and size of a [`GrammarCache`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GrammarCacheConfig {
    /// Most compiled grammars kept (least recently used go first); at least 1.
    pub capacity: usize,
    /// Longest grammar text accepted, in bytes.
    pub max_grammar_bytes: usize,
    /// Longest a caller waits for a compilation; `None` = no limit. The
    /// compilation itself runs on to completion on a helper thread and its
    /// result is cached (so a retry may hit); the backend's own step/fuel
    /// limits bound that work.
    pub compile_timeout: Option<Duration>,
}

impl Default for GrammarCacheConfig {
    fn default() -> Self {
        Self {
            capacity: 1024,
            max_grammar_bytes: 4 << 20,
            compile_timeout: Some(Duration::from_secs(10)),
        }
    }
}

/// Counters of a [`GrammarCache`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GrammarCacheStats {
    /// Lookups answered by an entry (finished or still compiling).
    pub hits: u64,
    /// Lookups that started a compilation.
    pub misses: u64,
    /// Entries dropped by the LRU bound.
    pub evictions: u64,
    /// Compilations that ended in an error (cached like successes).
    pub compile_errors: u64,
    /// Lookups that gave up waiting ([`GrammarError::CompileTimeout`]).
    pub timeouts: u64,
    /// Entries now held.
    pub entries: u64,
}

type CompileResult = GrammarResult<Arc<dyn CompiledGrammar>>;

#[derive(Clone, PartialEq, Eq, Hash)]
struct CacheKey {
    kind: GrammarKind,
    text: Arc<str>,
}

struct Slot {
    result: Mutex<Option<CompileResult>>,
    ready: Condvar,
}

impl Slot {
    fn lock(&self) -> MutexGuard<'_, Option<CompileResult>> {
        self.result.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn finish(&self, r: CompileResult) {
        *self.lock() = Some(r);
        self.ready.notify_all();
    }
}

#[derive(Default)]
struct CacheState {
    map: HashMap<CacheKey, (Arc<Slot>, u64)>,
    order: BTreeMap<u64, CacheKey>,
    tick: u64,
}

/// A thread-safe LRU cache of compiled grammars for one backend (so one tokenizer).
///
/// Keyed by (kind, grammar text). Concurrent lookups of one key wait for a
/// single compilation. Failed compilations are cached too, so a bad schema
/// sent again fails at once. Compilation runs on the calling thread, or on a
/// helper thread when `compile_timeout` is set.
pub struct GrammarCache {
    backend: Arc<dyn GrammarBackend>,
    config: GrammarCacheConfig,
    state: Mutex<CacheState>,
    hits: AtomicU64,
    misses: AtomicU64,
    evictions: AtomicU64,
    compile_errors: Arc<AtomicU64>,
    timeouts: AtomicU64,
}

impl GrammarCache {
    /// A cache over `backend`.
    pub fn new(backend: Arc<dyn GrammarBackend>, config: GrammarCacheConfig) -> Self {
        Self {
            backend,
            config,
            state: Mutex::new(CacheState::default()),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
            compile_errors: Arc::new(AtomicU64::new(0)),
            timeouts: AtomicU64::new(0),
        }
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<dyn GrammarBackend> {
        &self.backend
    }

    /// The configuration.
    pub fn config(&self) -> &GrammarCacheConfig {
        &self.config
    }

    fn state(&self) -> MutexGuard<'_, CacheState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether `spec` is compiled (successfully) and cached.
    pub fn contains(&self, spec: &GrammarSpec) -> bool {
        let key = CacheKey {
            kind: spec.kind(),
            text: Arc::from(spec.text()),
        };
        let slot = self.state().map.get(&key).map(|(s, _)| s.clone());
        slot.is_some_and(|s| matches!(*s.lock(), Some(Ok(_))))
    }

    /// The compiled grammar for `spec`, compiling it on a miss. Use it to warm
    /// the cache ahead of traffic too.
    pub fn get(&self, spec: &GrammarSpec) -> GrammarResult<Arc<dyn CompiledGrammar>> {
        let kind = spec.kind();
        let size = spec.text().len();
        if size > self.config.max_grammar_bytes {
            return Err(GrammarError::TooLarge {
                kind,
                size,
                limit: self.config.max_grammar_bytes,
            });
        }
        let key = CacheKey {
            kind,
            text: Arc::from(spec.text()),
        };
        let (slot, owner) = {
            let mut st = self.state();
            st.tick += 1;
            let tick = st.tick;
            let existing = st.map.get_mut(&key).map(|e| {
                let old = e.1;
                e.1 = tick;
                (e.0.clone(), old)
            });
            match existing {
                Some((slot, old)) => {
                    st.order.remove(&old);
                    st.order.insert(tick, key.clone());
                    self.hits.fetch_add(1, Ordering::Relaxed);
                    (slot, false)
                }
                None => {
                    let slot = Arc::new(Slot {
                        result: Mutex::new(None),
                        ready: Condvar::new(),
                    });
                    st.map.insert(key.clone(), (slot.clone(), tick));
                    st.order.insert(tick, key);
                    while st.map.len() > self.config.capacity.max(1) {
                        let Some((_, victim)) = st.order.pop_first() else {
                            break;
                        };
                        st.map.remove(&victim);
                        self.evictions.fetch_add(1, Ordering::Relaxed);
                    }
                    self.misses.fetch_add(1, Ordering::Relaxed);
                    (slot, true)
                }
            }
        };
        if owner {
            self.start_compile(spec, &slot);
        }
        self.wait(kind, &slot)
    }

    fn start_compile(&self, spec: &GrammarSpec, slot: &Arc<Slot>) {
        let backend = self.backend.clone();
        let errors = self.compile_errors.clone();
        let job_slot = slot.clone();
        let job_spec = spec.clone();
        let job = move || {
            let r = catch_panic(|| backend.compile(&job_spec))
                .map(|c| Arc::new(GuardedCompiled(c)) as Arc<dyn CompiledGrammar>);
            if r.is_err() {
                errors.fetch_add(1, Ordering::Relaxed);
            }
            job_slot.finish(r);
        };
        if self.config.compile_timeout.is_some() {
            let spawned = std::thread::Builder::new()
                .name("grammar-compile".into())
                .spawn(job);
            if let Err(e) = spawned {
                // Could not start a helper thread: report it, the next lookup retries.
                slot.finish(Err(GrammarError::Matcher(format!(
                    "could not start a grammar compile thread: {e}"
                ))));
                self.forget(spec);
            }
        } else {
            job();
        }
    }

    fn forget(&self, spec: &GrammarSpec) {
        let key = CacheKey {
            kind: spec.kind(),
            text: Arc::from(spec.text()),
        };
        let mut st = self.state();
        if let Some((_, tick)) = st.map.remove(&key) {
            st.order.remove(&tick);
        }
    }

    fn wait(&self, kind: GrammarKind, slot: &Slot) -> CompileResult {
        let deadline = self.config.compile_timeout.map(|t| (Instant::now() + t, t));
        let mut guard = slot.lock();
        loop {
            if let Some(r) = guard.as_ref() {
                return r.clone();
            }
            match deadline {
                None => {
                    guard = slot.ready.wait(guard).unwrap_or_else(|p| p.into_inner());
                }
                Some((deadline, limit)) => {
                    let now = Instant::now();
                    if now >= deadline {
                        self.timeouts.fetch_add(1, Ordering::Relaxed);
                        return Err(GrammarError::CompileTimeout {
                            kind,
                            limit_ms: limit.as_millis() as u64,
                        });
                    }
                    guard = slot
                        .ready
                        .wait_timeout(guard, deadline - now)
                        .map(|(g, _)| g)
                        .unwrap_or_else(|p| p.into_inner().0);
                }
            }
        }
    }

    /// A fresh matcher for `spec` (compiling it on a miss).
    pub fn matcher(&self, spec: &GrammarSpec) -> GrammarResult<Box<dyn GrammarMatcher>> {
        self.get(spec)?.matcher()
    }

    /// Drops every entry (compilations in flight finish into their waiters only).
    pub fn clear(&self) {
        let mut st = self.state();
        st.map.clear();
        st.order.clear();
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.state().map.len()
    }

    /// Whether the cache is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Counters.
    pub fn stats(&self) -> GrammarCacheStats {
        GrammarCacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            evictions: self.evictions.load(Ordering::Relaxed),
            compile_errors: self.compile_errors.load(Ordering::Relaxed),
            timeouts: self.timeouts.load(Ordering::Relaxed),
            entries: self.len() as u64,
        }
    }
}

#[cfg(test)]
mod tests;
