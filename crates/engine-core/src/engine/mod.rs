//! The serving engine: an embedding API over one scheduler thread (or one
//! per data-parallel rank, [`Engine::data_parallel`]).
//!
//! [`Engine::new`] starts the scheduler thread, which owns the waiting queue,
//! the running batch, the page pool and the prefix cache (see
//! [`scheduler`](self::scheduler)). [`Engine::submit`] validates a request and
//! returns a [`RequestStream`] of [`OutputChunk`]s; dropping the stream before
//! the request finished aborts it (a client disconnect frees its pages within
//! one iteration). [`Engine::abort`], [`Engine::flush_cache`] and
//! [`Engine::stats`] complete the interface; [`refit`] adds weight updates,
//! pauses and memory release (RL training loops). With several ranks
//! ([`data_parallel`]) each request goes to one rank's scheduler, picked by
//! a [`LoadBalance`]; aborts, flushes and pauses go to every rank.
//!
//! Invariant: once every request has finished and the cache is flushed, every
//! KV page is back in the pool.

mod adaptive;
pub mod data_parallel;
mod output;
mod policy;
pub mod refit;
mod request;
mod scheduler;
mod stream;
pub mod transfer;

pub use data_parallel::LoadBalance;
pub use policy::SchedulePolicy;

use crate::detok::TokenDecoder;
use crate::error::{CoreError, Param, Result};
use crate::executor::{Executor, LocalExecutor};
use crate::kv::prefix_cache::{CacheNamespace, PrefixCache};
use crate::runner::ModelRunner;
use crate::sampling::{LogitsProcessor, Sampler, SamplingParams};
use crate::speculative::{SpeculativeConfig, Speculator};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Scheduler settings (SGLang's names).
#[derive(Clone, Debug, PartialEq)]
pub struct EngineConfig {
    /// Most requests decoding at once.
    pub max_running_requests: usize,
    /// Most new prompt tokens in one prefill batch.
    pub max_prefill_tokens: usize,
    /// Most prompt tokens of one request per iteration; -1 disables chunking.
    pub chunked_prefill_size: i64,
    /// Order of admission: fcfs, lpm, dfs-weight, lof, priority, random.
    pub schedule_policy: SchedulePolicy,
    /// Scales the expected-new-token ratio (higher admits fewer requests).
    pub schedule_conservativeness: f32,
    /// Let a prefill batch carry the running decodes too.
    pub enable_mixed_chunk: bool,
    /// The cache keeps nothing (no prefix reuse); chunked requests keep their own pages.
    pub disable_radix_cache: bool,
    /// Queue length above which `lpm` falls back to `fcfs`.
    pub lpm_fallback_queue_len: usize,
    /// Most requests waiting; more are refused.
    pub max_queued_requests: usize,
    /// Seed of the `random` policy.
    pub seed: u64,
    /// Append the tokens a grammar forces without a forward pass each (jump-forward).
    pub enable_jump_forward: bool,
    /// Overlap scheduling: while the forward of batch N runs (on a second
    /// thread), the scheduler fills the grammar masks of N's samples and
    /// admits the waiting requests of batch N+1 (prefix match, locks, pages),
    /// reserving room for every request of batch N as if it were running.
    /// Output is identical either way. `None`: on when the backend runs
    /// asynchronously to the host (its capabilities say so), off on the CPU,
    /// whose forward already uses every core.
    pub overlap_schedule: Option<bool>,
    /// Speculative decoding (`None`: off). The speculator itself comes in
    /// [`EngineParts::speculator`].
    pub speculative: Option<SpeculativeConfig>,
    /// Most distinct LoRA adapters in one step, the base model counting as
    /// one (SGLang's `--max-loras-per-batch`); requests of another adapter
    /// wait until a running one finishes.
    pub max_loras_per_batch: usize,
    /// Longest sequence (prompt plus output) a request may hold; `None`:
    /// the model's `max_position_embeddings`. Whoever sets it longer than
    /// the model's has decided to (SGLang's `--context-length`).
    pub context_length: Option<usize>,
    /// Share of the KV cache that holds may keep against eviction
    /// ([`GenerateRequest::hold`]: open sessions' latest sequences), in
    /// [0, 1]; 0 turns holds off.
    pub hold_ratio: f64,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_running_requests: 64,
            max_prefill_tokens: 8192,
            chunked_prefill_size: 2048,
            schedule_policy: SchedulePolicy::Lpm,
            schedule_conservativeness: 1.0,
            enable_mixed_chunk: false,
            disable_radix_cache: false,
            lpm_fallback_queue_len: 128,
            max_queued_requests: 4096,
            seed: 0,
            overlap_schedule: None,
            enable_jump_forward: true,
            speculative: None,
            max_loras_per_batch: 8,
            context_length: None,
            hold_ratio: 0.25,
        }
    }
}

/// What a request is for. Its token budget follows from it
/// ([`RequestKind::token_limit`]), so no caller overloads `max_new_tokens`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RequestKind {
    /// Generate up to `max_new_tokens` tokens (0: prefill only, SGLang's
    /// way to score a prompt).
    #[default]
    Generate,
    /// A disaggregated prefill worker's request: the prompt and the first
    /// output token only (the decode worker continues from it).
    PrefillForExport,
    /// Internal: fill the prefix cache with the prompt and sample nothing
    /// (the shared prompt of the `n` > 1 samples that follow it).
    PrefixOnly,
    /// An embedding: the prompt's final normed hidden states pooled into
    /// one L2-normalized vector (on the last chunk's finish), nothing sampled.
    Embed(Pooling),
}

impl RequestKind {
    /// The most tokens a request of this kind generates when it asks for `max_new_tokens`.
    pub fn token_limit(self, max_new_tokens: usize) -> usize {
        match self {
            RequestKind::Generate => max_new_tokens,
            RequestKind::PrefillForExport => max_new_tokens.min(1),
            RequestKind::PrefixOnly | RequestKind::Embed(_) => 0,
        }
    }
}

/// A request for generation.
#[derive(Clone)]
pub struct GenerateRequest {
    /// What the request is for (generation, a disaggregated prefill).
    pub kind: RequestKind,
    /// Caller's id; a fresh one is made when `None`. Must be unique among live requests.
    pub rid: Option<String>,
    /// Prompt token ids.
    pub input_ids: Vec<u32>,
    /// Sampling and stopping.
    pub params: SamplingParams,
    /// Scheduling priority (higher first under the `priority` policy and eviction).
    pub priority: i64,
    /// Cache namespace (LoRA adapter, tenant salt).
    pub namespace: CacheNamespace,
    /// Return the log-probability of each generated token.
    pub return_logprob: bool,
    /// Also return this many most likely alternatives per token.
    pub top_logprobs_num: usize,
    /// With `return_logprob`, also the log-probabilities of these token
    /// ids at every position scored (SGLang's `token_ids_logprob`; an id
    /// past the logits' width scores negative infinity).
    pub token_ids_logprob: Option<Arc<[u32]>>,
    /// With `return_logprob`, also return the log-probability of each
    /// prompt token from this position on (SGLang's `logprob_start_len`;
    /// the prompt's first token has none). The prefix cache serves the
    /// prompt only before it, so those tokens are computed.
    pub logprob_start_len: Option<usize>,
    /// With `logprob_start_len`, also the rank of each scored prompt token
    /// among its row's logits (1: the most likely; vLLM's
    /// `prompt_logprobs`). Computed where the logits are; the default
    /// backend method copies the scored rows to the host.
    pub prompt_logprob_ranks: bool,
    /// Constrain the output to a compiled grammar (JSON schema, regex, EBNF...).
    pub grammar: Option<Arc<dyn crate::grammar::CompiledGrammar>>,
    /// Run with this LoRA adapter (`None`: the base model).
    pub lora: Option<Arc<crate::model::lora::LoraAdapter>>,
    /// Run on this data-parallel rank (SGLang's `data_parallel_rank`),
    /// bypassing the load balance; `None`: the load balance picks.
    pub data_parallel_rank: Option<usize>,
    /// The first output token, already sampled elsewhere: a disaggregated
    /// prefill worker's (SGLang passes it the same way). The request starts
    /// with it as if its own first step had sampled it (grammar, stop
    /// checks, streamed at once), and a seeded request's sampler skips the
    /// draw that token took, so the rest equals a run that sampled it here.
    /// It needs `n` = 1, `max_new_tokens` > 0 and no log-probabilities; a
    /// grammar that does not allow it makes the request sample its own.
    pub first_token: Option<u32>,
    /// Keep the finished sequence (prompt and output) cached under this
    /// key, against eviction, until [`Engine::release_hold`] (an open
    /// session's key): a hold yields only to the hold budget
    /// ([`EngineConfig::hold_ratio`], oldest first) and to live requests
    /// that need its pages. `None`: cached as any request's.
    pub hold: Option<Arc<str>>,
}

impl std::fmt::Debug for GenerateRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GenerateRequest")
            .field("kind", &self.kind)
            .field("rid", &self.rid)
            .field("input_ids", &self.input_ids.len())
            .field("params", &self.params)
            .field("grammar", &self.grammar.is_some())
            .field("lora", &self.lora.as_ref().map(|a| a.name()))
            .field("data_parallel_rank", &self.data_parallel_rank)
            .field("first_token", &self.first_token)
            .field("hold", &self.hold)
            .finish()
    }
}

impl GenerateRequest {
    /// A request for `input_ids` with `params`, defaults otherwise.
    pub fn new(input_ids: Vec<u32>, params: SamplingParams) -> Self {
        Self {
            kind: RequestKind::Generate,
            rid: None,
            token_ids_logprob: None,
            input_ids,
            params,
            priority: 0,
            namespace: CacheNamespace::default(),
            return_logprob: false,
            top_logprobs_num: 0,
            logprob_start_len: None,
            prompt_logprob_ranks: false,
            grammar: None,
            lora: None,
            data_parallel_rank: None,
            first_token: None,
            hold: None,
        }
    }
}

/// Why a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishKind {
    /// EOS, a stop token id or a stop string.
    Stop,
    /// `max_new_tokens` reached.
    Length,
    /// Aborted by the caller, or failed.
    Abort,
}

/// What ended a request with [`FinishKind::Stop`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Matched {
    /// A stop or EOS token id.
    Token(u32),
    /// A stop string.
    Text(String),
    /// A `stop_regex` pattern the output text matched.
    Regex(String),
}

/// How a request ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finish {
    /// The kind.
    pub kind: FinishKind,
    /// What matched (stop only).
    pub matched: Option<Matched>,
    /// Why, for aborts and errors.
    pub message: Option<String>,
    /// The kind of abort (aborts only), for callers that answer each
    /// differently; `message` is for people.
    pub cause: Option<AbortCause>,
}

/// Why a request was aborted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AbortCause {
    /// The caller asked for it ([`Engine::abort`], [`Engine::abort_all`], a dropped stream).
    Requested,
    /// Another live request has the same `rid`.
    RidInUse,
    /// The waiting queue is at `max_queued_requests`.
    QueueFull,
    /// The engine is stopping.
    ShuttingDown,
    /// The request failed (a device or detokenizer error, a lost peer).
    Failed,
}

impl Finish {
    /// An abort for `cause`, with `message` for people.
    pub fn aborted(cause: AbortCause, message: impl Into<String>) -> Self {
        Finish {
            kind: FinishKind::Abort,
            matched: None,
            message: Some(message.into()),
            cause: Some(cause),
        }
    }
}

pub use crate::step::{Pooling, TokenLogprob};

/// Per-request figures, sent with every chunk.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OutputMeta {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Tokens generated so far.
    pub completion_tokens: usize,
    /// Prompt tokens served from the prefix cache at first admission.
    pub cached_tokens: usize,
    /// Times the request was retracted.
    pub retractions: u32,
    /// Seconds from arrival to first admission.
    pub queue_time: f64,
    /// Seconds from arrival to the first token.
    pub ttft: Option<f64>,
    /// Seconds from arrival to this chunk.
    pub elapsed: f64,
    /// Decode steps of this request that ran with speculation enabled
    /// (SGLang's `spec_verify_ct`; 0 without speculation).
    pub spec_verify_ct: u32,
    /// Draft tokens of this request the target accepted.
    pub spec_accepted_tokens: u32,
    /// Of `cached_tokens`, those loaded back from the host tier (HiCache).
    pub cached_tokens_host: usize,
    /// Of `cached_tokens_host`, those that had come from the storage tier.
    pub cached_tokens_storage: usize,
}

impl OutputMeta {
    /// Mean tokens per verify step (SGLang's `spec_accept_length`), when speculating.
    pub fn spec_accept_length(&self) -> Option<f64> {
        (self.spec_verify_ct > 0).then(|| {
            (self.spec_verify_ct + self.spec_accepted_tokens) as f64 / self.spec_verify_ct as f64
        })
    }
}

/// One piece of a request's output.
#[derive(Clone, Debug, PartialEq)]
pub struct OutputChunk {
    /// Sample index (0..n).
    pub index: u32,
    /// New token ids.
    pub token_ids: Vec<u32>,
    /// New text (held back while it could be the start of a stop string).
    pub text: String,
    /// Log-probabilities of the new tokens, when asked for.
    pub logprobs: Vec<TokenLogprob>,
    /// Log-probabilities of the prompt's tokens from `logprob_start_len`
    /// (the first position has none), once, with the first chunk after the
    /// prompt was computed.
    pub prompt_logprobs: Vec<TokenLogprob>,
    /// Set on the sample's last chunk.
    pub finish: Option<Finish>,
    /// An embedding request's vector, on its last chunk (else empty).
    pub embedding: Vec<f32>,
    /// Counters and timings.
    pub meta: OutputMeta,
}

/// Counters for metrics, refreshed every iteration.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EngineStats {
    pub num_running_reqs: usize,
    pub num_queue_reqs: usize,
    /// Prompt tokens of the queued requests (what SGLang's `/get_load`
    /// adds to the used tokens).
    pub num_queue_tokens: usize,
    /// Tokens of KV that requests hold (SGLang's `num_used_tokens`): every
    /// allocated token but the cache's evictable ones. A cached prefix that a
    /// running request has locked counts as used.
    pub num_used_tokens: usize,
    /// KV capacity in tokens.
    pub max_total_tokens: usize,
    /// Recurrent state slots requests hold, and the slots there are (a
    /// hybrid model's; both 0 for a model without recurrent layers).
    pub used_state_slots: usize,
    pub max_state_slots: usize,
    /// Recurrent state snapshots of cached prefixes kept.
    pub state_snapshots: usize,
    /// `num_used_tokens / max_total_tokens`.
    pub token_usage: f64,
    /// Cached share of prompt tokens over recent prefills.
    pub cache_hit_rate: f64,
    /// Generated tokens per second over the last interval.
    pub gen_throughput: f64,
    pub prompt_tokens_total: u64,
    pub generation_tokens_total: u64,
    pub cached_tokens_total: u64,
    pub num_requests_total: u64,
    pub num_aborted_requests_total: u64,
    pub num_retracted_reqs_total: u64,
    /// Tokens the prefix cache holds.
    pub cache_tokens: usize,
    /// Cached tokens no request holds (reusable, freed on demand); allocated
    /// pages are `num_used_tokens + evictable_tokens`.
    /// Tokens held against eviction for callers ([`GenerateRequest::hold`]).
    pub held_tokens: usize,
    pub evictable_tokens: usize,
    /// Current expected-new-token ratio.
    pub new_token_ratio: f64,
    /// Forward passes run.
    pub iterations: u64,
    /// Tokens appended by jump-forward (forced by a grammar, no forward pass of their own).
    pub jump_forward_tokens_total: u64,
    /// Requests that started from a first token sampled elsewhere (a
    /// disaggregated prefill worker's, [`GenerateRequest::first_token`]).
    pub given_first_tokens_total: u64,
    /// Requests admitted while the previous batch's forward ran (overlap scheduling).
    pub overlap_admitted_total: u64,
    /// Tokens generated by requests with a grammar (sampled and forced).
    pub constrained_tokens_total: u64,
    /// Decode steps of requests under speculation (one per request and step).
    pub spec_verify_ct_total: u64,
    /// Draft tokens proposed and verified.
    pub spec_draft_tokens_total: u64,
    /// Draft tokens accepted.
    pub spec_accepted_tokens_total: u64,
    /// Draft tokens the adaptive controller cut because they would not pay.
    pub spec_draft_tokens_skipped_total: u64,
    /// Mean tokens per verify step over the last interval (accepted drafts + 1).
    pub spec_accept_length: f64,
    /// Draft tokens per request and step the adaptive controller allows now
    /// (mean over the last step's decoding requests).
    pub spec_draft_budget: f64,
    /// The prefix cache's tiers below the device (HiCache).
    pub tiers: crate::kv::prefix_cache::TierStats,
    /// Copies between device and host the steps ran (HiCache).
    pub kv_copy: crate::kv::tier::KvCopyStats,
    /// Most distinct LoRA adapters one step has run with, the base model
    /// counting as one (0 until a request with an adapter arrives); never
    /// above [`EngineConfig::max_loras_per_batch`].
    pub lora_max_step_adapters: usize,
    /// Tokens routed to each expert of each MoE layer since start-up
    /// (refreshed about once a second; empty for a dense model).
    pub expert_load: Vec<crate::model::moe::ExpertLoad>,
}

/// Everything the engine runs with besides its settings.
pub struct EngineParts {
    /// Runs step plans: the model, device, KV cache and sampling.
    pub executor: Box<dyn Executor>,
    /// The prefix cache (its page size must match the KV cache's).
    pub prefix_cache: Box<dyn PrefixCache>,
    /// Detokenizer for text output and stop strings.
    pub decoder: Arc<dyn TokenDecoder>,
    /// Ids that end generation unless `ignore_eos`.
    pub eos_token_ids: Vec<u32>,
    /// Proposes draft tokens; required when [`EngineConfig::speculative`] is set.
    pub speculator: Option<Box<dyn Speculator>>,
}

impl EngineParts {
    /// Parts for one device: a [`LocalExecutor`] over `runner` with `sampler`
    /// and `processors`, and no speculator.
    pub fn local(
        runner: impl Into<Arc<ModelRunner>>,
        prefix_cache: Box<dyn PrefixCache>,
        sampler: Arc<dyn Sampler>,
        processors: Vec<Arc<dyn LogitsProcessor>>,
        decoder: Arc<dyn TokenDecoder>,
        eos_token_ids: Vec<u32>,
    ) -> Self {
        Self {
            executor: Box::new(LocalExecutor::new(
                runner,
                sampler,
                processors,
                eos_token_ids.clone(),
            )),
            prefix_cache,
            decoder,
            eos_token_ids,
            speculator: None,
        }
    }
}

enum Msg {
    Submit(Box<request::Req>),
    Abort(String),
    AbortAll,
    /// Flush the cache when idle (and the storage tier too when `storage`).
    Flush {
        reply: mpsc::Sender<bool>,
        storage: bool,
    },
    Control(refit::Control),
    Transfer(transfer::TransferOp),
    /// Release every hold of this key.
    ReleaseHold(Arc<str>),
    Shutdown,
}

/// The stream of a request's output. Chunks the reader has not yet taken
/// merge into one (same tokens and text, fewer chunks); see `stream`.
pub struct RequestStream {
    rid: String,
    rx: stream::ChunkReceiver,
    tx: mpsc::Sender<Msg>,
    remaining: usize,
    /// Makes the text of chunks that carry ids only (no stop strings).
    text: Option<stream::StreamText>,
    /// The request's share of its rank's in-flight load.
    _load: data_parallel::LoadGuard,
}

impl RequestStream {
    /// The request's id.
    pub fn rid(&self) -> &str {
        &self.rid
    }
    /// Next chunk, waiting for it; `None` once every sample finished.
    pub fn blocking_next(&mut self) -> Option<OutputChunk> {
        loop {
            let r = self.rx.blocking_recv();
            if let Some(c) = self.take(r) {
                return c;
            }
        }
    }
    /// Next chunk; `None` once every sample finished.
    pub async fn next(&mut self) -> Option<OutputChunk> {
        loop {
            let r = self.rx.recv().await;
            if let Some(c) = self.take(r) {
                return c;
            }
        }
    }
    /// The chunk to hand out for what the channel gave (`None`: skip it).
    fn take(&mut self, r: Option<stream::Received>) -> Option<Option<OutputChunk>> {
        let c = match (r, self.text.as_mut()) {
            (None, _) => None,
            (Some(r), None) => Some(r.chunk),
            (Some(r), Some(t)) => match t.text_of(r) {
                stream::Decoded::Chunk(c) => Some(c),
                stream::Decoded::Failed(c) => {
                    // The text is lost: stop generating it.
                    let _ = self.tx.send(Msg::Abort(self.rid.clone()));
                    Some(c)
                }
                stream::Decoded::Skip => return None,
            },
        };
        self.track(&c);
        Some(c)
    }
    fn track(&mut self, c: &Option<OutputChunk>) {
        match c {
            Some(c) if c.finish.is_some() => self.remaining = self.remaining.saturating_sub(1),
            None => self.remaining = 0,
            _ => {}
        }
    }
    /// Collects every chunk until the request finishes.
    pub fn collect_blocking(mut self) -> Vec<OutputChunk> {
        let mut v = Vec::new();
        while let Some(c) = self.blocking_next() {
            v.push(c);
        }
        v
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if self.remaining > 0 {
            let _ = self.tx.send(Msg::Abort(self.rid.clone()));
        }
    }
}

/// One scheduler thread and what the engine keeps of it.
struct SchedulerRank {
    tx: mpsc::Sender<Msg>,
    stats: Arc<Mutex<EngineStats>>,
    thread: Option<JoinHandle<()>>,
    load: Arc<data_parallel::RankLoad>,
}

/// A running engine.
pub struct Engine {
    /// One per data-parallel rank (one without data parallelism).
    ranks: Vec<SchedulerRank>,
    dispatcher: data_parallel::Dispatcher,
    /// For the text of streams whose chunks carry ids only.
    decoder: Arc<dyn TokenDecoder>,
    next_id: AtomicU64,
    limits: Limits,
}

#[derive(Clone, Copy, Debug)]
struct Limits {
    vocab_size: usize,
    context: usize,
    capacity_tokens: usize,
    num_layers: usize,
}

impl Engine {
    /// Starts the scheduler thread.
    pub fn new(config: EngineConfig, parts: EngineParts) -> Result<Self> {
        Self::data_parallel(config, vec![parts], LoadBalance::RoundRobin)
    }

    /// Starts one scheduler thread per data-parallel rank, each with its
    /// own parts (executor, prefix cache, speculator); new requests are
    /// spread over them by `balance`. The ranks must serve the same model
    /// (vocabulary, context length and layers); a request must fit the
    /// smallest rank's KV cache.
    pub fn data_parallel(
        config: EngineConfig,
        parts: Vec<EngineParts>,
        balance: LoadBalance,
    ) -> Result<Self> {
        Self::check_config(&config, &parts)?;
        let first = parts
            .first()
            .ok_or_else(|| CoreError::Config("an engine of no data-parallel ranks".into()))?;
        let spec = first.executor.model_spec().clone();
        let decoder = first.decoder.clone();
        let mut limits = Limits {
            vocab_size: spec.vocab_size,
            context: config
                .context_length
                .unwrap_or(spec.max_position_embeddings),
            capacity_tokens: usize::MAX,
            num_layers: spec.num_layers,
        };
        for (rank, p) in parts.iter().enumerate() {
            let s = p.executor.model_spec();
            if (s.vocab_size, s.max_position_embeddings, s.num_layers)
                != (
                    limits.vocab_size,
                    spec.max_position_embeddings,
                    limits.num_layers,
                )
            {
                return Err(CoreError::Config(format!(
                    "data-parallel rank {rank} serves a different model than rank 0"
                )));
            }
            limits.capacity_tokens = limits
                .capacity_tokens
                .min(p.executor.kv_spec().capacity_tokens());
        }
        let world = parts.len();
        let mut ranks = Vec::with_capacity(world);
        for (rank, parts) in parts.into_iter().enumerate() {
            let stats = Arc::new(Mutex::new(EngineStats {
                max_total_tokens: parts.executor.kv_spec().capacity_tokens(),
                ..Default::default()
            }));
            let (tx, rx) = mpsc::channel();
            let sched = scheduler::Scheduler::new(config.clone(), parts, stats.clone())?;
            let name = if world == 1 {
                "arbor-scheduler".to_string()
            } else {
                format!("arbor-scheduler-dp{rank}")
            };
            let thread = std::thread::Builder::new()
                .name(name)
                .spawn(move || sched.run(rx))
                .map_err(|e| CoreError::Internal(format!("starting the scheduler: {e}")))?;
            ranks.push(SchedulerRank {
                tx,
                stats,
                thread: Some(thread),
                load: Arc::default(),
            });
        }
        Ok(Self {
            ranks,
            dispatcher: data_parallel::Dispatcher::new(balance),
            decoder,
            next_id: AtomicU64::new(1),
            limits,
        })
    }

    /// Checks the settings (and that speculation has its speculators).
    fn check_config(config: &EngineConfig, parts: &[EngineParts]) -> Result<()> {
        if let Some(sc) = &config.speculative {
            sc.validate()?;
            if parts.iter().any(|p| p.speculator.is_none()) {
                return Err(CoreError::Config(format!(
                    "speculative decoding ({}) is configured but no speculator was given",
                    sc.algorithm
                )));
            }
        }
        if config.max_running_requests == 0 {
            return Err(CoreError::Config(
                "max_running_requests must be at least 1".into(),
            ));
        }
        if config.max_prefill_tokens == 0 {
            return Err(CoreError::Config(
                "max_prefill_tokens must be at least 1".into(),
            ));
        }
        if config.chunked_prefill_size == 0 || config.chunked_prefill_size < -1 {
            return Err(CoreError::Config(
                "chunked_prefill_size must be -1 (off) or positive".into(),
            ));
        }
        if !(0.0..=1.0).contains(&config.hold_ratio) {
            return Err(CoreError::Config(format!(
                "hold_ratio must be in [0, 1], got {}",
                config.hold_ratio
            )));
        }
        if config.schedule_conservativeness.is_nan() || config.schedule_conservativeness <= 0.0 {
            return Err(CoreError::Config(
                "schedule_conservativeness must be positive".into(),
            ));
        }
        Ok(())
    }

    /// `Ok` when `r` names one of the engine's data-parallel ranks (a
    /// request's `data_parallel_rank`).
    pub(crate) fn check_dp_rank(&self, r: usize) -> Result<()> {
        let n = self.ranks.len();
        if r >= n {
            return Err(CoreError::param(
                Param::DataParallelRank,
                format!(
                    "{r} is out of range: this engine has {n} data-parallel rank{}",
                    if n == 1 { "" } else { "s" }
                ),
            ));
        }
        Ok(())
    }

    /// Data-parallel ranks (scheduler threads).
    pub fn dp_size(&self) -> usize {
        self.ranks.len()
    }

    /// Sends `msg()` to every rank's scheduler; errors if one had stopped
    /// (after sending to the others).
    fn broadcast(&self, msg: impl Fn() -> Msg) -> Result<()> {
        self.send_each(|_| msg())
    }

    /// Sends `msg(rank)` to every rank's scheduler.
    fn send_each(&self, msg: impl Fn(usize) -> Msg) -> Result<()> {
        let mut stopped = false;
        for (rank, r) in self.ranks.iter().enumerate() {
            stopped |= r.tx.send(msg(rank)).is_err();
        }
        if stopped {
            return Err(CoreError::Internal("the scheduler has stopped".into()));
        }
        Ok(())
    }

    /// Validates and enqueues a request.
    pub fn submit(&self, req: GenerateRequest) -> Result<RequestStream> {
        let l = self.limits;
        if req.input_ids.is_empty() {
            return Err(CoreError::param(Param::InputIds, "must not be empty"));
        }
        req.params.validate(l.vocab_size)?;
        if let Some(bad) = req.input_ids.iter().find(|&&t| t as usize >= l.vocab_size) {
            return Err(CoreError::param(
                Param::InputIds,
                format!(
                    "has token id {bad}, outside the vocabulary of {}",
                    l.vocab_size
                ),
            ));
        }
        let max_new_tokens = req.kind.token_limit(req.params.max_new_tokens);
        let total = req.input_ids.len() + max_new_tokens;
        if req.input_ids.len() >= l.context {
            return Err(CoreError::param(
                Param::InputIds,
                format!(
                    "has {} tokens; the context length is {}",
                    req.input_ids.len(),
                    l.context
                ),
            ));
        }
        if total > l.context {
            return Err(CoreError::param(
                Param::MaxNewTokens,
                format!(
                    "({}) plus the prompt ({} tokens) exceeds the context length of {}",
                    max_new_tokens,
                    req.input_ids.len(),
                    l.context
                ),
            ));
        }
        if total > l.capacity_tokens {
            return Err(CoreError::param(
                Param::MaxNewTokens,
                format!(
                    "({}) plus the prompt ({} tokens) exceeds the KV cache capacity of {} tokens",
                    max_new_tokens,
                    req.input_ids.len(),
                    l.capacity_tokens
                ),
            ));
        }
        if req.top_logprobs_num > 20 {
            return Err(CoreError::param(
                Param::TopLogprobsNum,
                format!("must be in [0, 20], got {}", req.top_logprobs_num),
            ));
        }
        if let Some(s) = req.logprob_start_len {
            if !req.return_logprob {
                return Err(CoreError::param(
                    Param::LogprobStartLen,
                    "needs return_logprob",
                ));
            }
            if s >= req.input_ids.len() {
                return Err(CoreError::param(
                    Param::LogprobStartLen,
                    format!(
                        "({s}) must be below the prompt's length ({} tokens)",
                        req.input_ids.len()
                    ),
                ));
            }
        }
        if let Some(r) = req.data_parallel_rank {
            self.check_dp_rank(r)?;
        }
        if let Some(t) = req.first_token {
            if t as usize >= l.vocab_size {
                return Err(CoreError::param(
                    Param::FirstToken,
                    format!("{t} is outside the vocabulary of {}", l.vocab_size),
                ));
            }
            if req.params.n > 1 || req.return_logprob || max_new_tokens == 0 {
                return Err(CoreError::param(
                    Param::FirstToken,
                    "needs n = 1, max_new_tokens > 0 and no log-probabilities",
                ));
            }
        }
        if let Some(a) = &req.lora
            && a.num_layers() != l.num_layers
        {
            return Err(CoreError::param(
                Param::Lora,
                format!(
                    "'{}' has {} layers, the model {}",
                    a.name(),
                    a.num_layers(),
                    l.num_layers
                ),
            ));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let rid = req.rid.clone().unwrap_or_else(|| format!("req-{id}"));
        if rid.is_empty() {
            return Err(CoreError::param(Param::Rid, "must not be empty"));
        }
        let (otx, orx) = stream::channel();
        let n = req.params.n;
        // Only stop strings need the text on the scheduler thread.
        let text = (!stream::scheduler_makes_text(&req.params)).then(|| {
            stream::StreamText::new(
                self.decoder.clone(),
                &req.input_ids,
                req.params.skip_special_tokens,
            )
        });
        let tokens = total * n.max(1);
        let rank = if let Some(r) = req.data_parallel_rank {
            &self.ranks[r]
        } else if self.ranks.len() > 1 {
            let loads: Vec<&data_parallel::RankLoad> =
                self.ranks.iter().map(|r| &*r.load).collect();
            let ns = || transfer::request_namespace(&req.namespace, req.lora.as_ref());
            &self.ranks[self.dispatcher.pick_for(&loads, ns, &req.input_ids)]
        } else {
            &self.ranks[0]
        };
        let load = rank.load.take(tokens);
        let r = request::Req::new(rid.clone(), req, otx, Instant::now())?;
        rank.tx
            .send(Msg::Submit(Box::new(r)))
            .map_err(|_| CoreError::Internal("the scheduler has stopped".into()))?;
        Ok(RequestStream {
            rid,
            rx: orx,
            tx: rank.tx.clone(),
            remaining: n,
            text,
            _load: load,
        })
    }

    /// Aborts every sample of the request `rid` (no-op if unknown).
    pub fn abort(&self, rid: &str) {
        // A rank that does not know the id ignores it.
        let _ = self.broadcast(|| Msg::Abort(rid.to_string()));
    }

    /// Releases every hold of `key` ([`GenerateRequest::hold`]): its
    /// sequences stay cached as any others, evictable. No-op if unknown.
    pub fn release_hold(&self, key: &str) {
        let key: Arc<str> = Arc::from(key);
        let _ = self.broadcast(|| Msg::ReleaseHold(key.clone()));
    }

    /// Aborts every request.
    pub fn abort_all(&self) {
        let _ = self.broadcast(|| Msg::AbortAll);
    }

    /// Empties the prefix cache (device and host tiers) if no request is
    /// queued or running; returns whether it did.
    pub fn flush_cache(&self) -> Result<bool> {
        self.flush_cache_tiers(false)
    }

    /// [`flush_cache`](Self::flush_cache), and when `storage` also clears
    /// the storage tier (in the background).
    pub fn flush_cache_tiers(&self, storage: bool) -> Result<bool> {
        let (tx, rx) = mpsc::channel();
        self.broadcast(|| Msg::Flush {
            reply: tx.clone(),
            storage,
        })?;
        drop(tx);
        let mut flushed = true;
        for _ in &self.ranks {
            flushed &= rx
                .recv_timeout(Duration::from_secs(60))
                .map_err(|_| CoreError::Internal("the scheduler did not answer".into()))?;
        }
        Ok(flushed)
    }

    /// A snapshot of the counters (every rank's together).
    pub fn stats(&self) -> EngineStats {
        data_parallel::merged_stats(&self.rank_stats())
    }

    /// A snapshot of each data-parallel rank's counters.
    pub fn rank_stats(&self) -> Vec<EngineStats> {
        self.ranks
            .iter()
            .map(|r| r.stats.lock().unwrap_or_else(|e| e.into_inner()).clone())
            .collect()
    }

    /// KV capacity in tokens (of every rank together).
    pub fn capacity_tokens(&self) -> usize {
        self.limits.capacity_tokens * self.ranks.len()
    }

    /// The most tokens (prompt plus new) one request can hold: the KV
    /// capacity of the smallest rank.
    pub fn request_capacity_tokens(&self) -> usize {
        self.limits.capacity_tokens
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.broadcast(|| Msg::Shutdown);
        for r in &mut self.ranks {
            if let Some(t) = r.thread.take() {
                let _ = t.join();
            }
        }
    }
}
