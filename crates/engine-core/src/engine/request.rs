//! A request inside the scheduler: its tokens, KV pages, sampling state and
//! output text.
//!
//! KV ownership: the first `node_len` tokens live in pages owned by the prefix
//! cache (`tree_pages`, protected by the lock on `node`); the request's own
//! [`PageSet`] holds the pages after them. `computed` tokens have KV written.
//! While decoding, `computed == tokens - 1` (the newest sampled token is the
//! next input). Text is streamed only up to the longest suffix that could
//! still grow into a stop string.
//!
//! Only a request with stop strings is detokenized here ([`Req::text_here`]): the
//! others stream token ids, and the reader makes their text
//! ([`super::stream::StreamText`]).

use super::output::{ChunkOut, OutputRoute, StreamHandle};
use super::stream::ChunkSender;
use super::{Finish, FinishKind, GenerateRequest, Matched, OutputMeta, RequestKind, TokenLogprob};
use crate::detok::{IncrementalDetokenizer, TokenDecoder};
use crate::error::{CoreError, Result};
use crate::grammar::{CompiledGrammar, GrammarMatcher};
use crate::kv::PageSet;
use crate::kv::prefix_cache::{CacheNamespace, NodeId};
use crate::model::lora::LoraAdapter;
use crate::sampling::{SamplingParams, SeqRng};
use std::sync::Arc;
use std::time::Instant;

/// Seconds from a process-wide epoch to `t` (negative before it): the
/// scheduler's per-request times as f64, so that a step's figures are one
/// subtraction per request, not [`Instant`] arithmetic.
pub(crate) fn clock_secs(t: Instant) -> f64 {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    let epoch = *EPOCH.get_or_init(Instant::now);
    match t.checked_duration_since(epoch) {
        Some(d) => d.as_secs_f64(),
        None => -epoch.duration_since(t).as_secs_f64(),
    }
}

/// A page-list stamp never handed out before (see [`Req::pages_stamp`]; 0
/// is never one).
fn next_pages_stamp() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// The most output tokens reserved for at a request's first token (4 KiB).
const MAX_OUTPUT_RESERVE: usize = 1024;

/// A request as the scheduler tracks it.
pub(crate) struct Req {
    pub rid: String,
    pub index: u32,
    pub prompt: Arc<[u32]>,
    pub output: Vec<u32>,
    pub params: Arc<SamplingParams>,
    pub rng: SeqRng,
    /// Key of this sample for the speculator (unique among live requests).
    pub key: u64,
    /// Tokens of the sequence the speculator has been shown.
    pub spec_observed: usize,
    /// Decode steps run under speculation, and drafts accepted.
    pub spec_verify_ct: u32,
    pub spec_accepted: u32,
    /// Recent per-token acceptance of this request's drafts: (accepted, tried), decayed.
    pub spec_rate: (f64, f64),
    pub ns: CacheNamespace,
    /// The LoRA adapter (held until the request ends).
    pub lora: Option<Arc<LoraAdapter>>,
    pub priority: i64,
    pub return_logprob: bool,
    pub top_logprobs_num: usize,
    /// See [`super::GenerateRequest::token_ids_logprob`].
    pub token_ids_logprob: Option<Arc<[u32]>>,
    /// See [`super::GenerateRequest::prompt_logprob_ranks`].
    pub prompt_logprob_ranks: bool,
    /// The grammar the output follows, and this sample's matcher over it.
    pub grammar: Option<Arc<dyn CompiledGrammar>>,
    pub matcher: Option<Box<dyn GrammarMatcher>>,
    /// The matcher's error (or panic) while filling this step's masks.
    pub mask_error: Option<String>,
    /// A first token sampled elsewhere, taken when the scheduler accepts
    /// the request ([`crate::engine::GenerateRequest::first_token`]).
    pub given_first: Option<u32>,
    /// What the request is for; its token budget is [`Req::token_limit`].
    pub kind: RequestKind,
    /// Hold the finished sequence cached under this key
    /// ([`crate::engine::GenerateRequest::hold`]).
    pub hold: Option<Arc<str>>,
    /// `stop_regex`, compiled once (checked by `Engine::submit`).
    stop_regex: Vec<regex::Regex>,
    /// Samples that wait for this prefix-only request.
    pub followers: Vec<Req>,
    // KV state.
    pub node: Option<NodeId>,
    pub node_len: usize,
    /// The cache's pages and the request's own (private: every change
    /// goes through a method that renews `pages_stamp`).
    tree_pages: Vec<u32>,
    own: Option<PageSet>,
    /// Identifies the current page list process-wide (see [`Req::pages_stamp`]).
    pages_stamp: u64,
    pub computed: usize,
    /// The recurrent state slot of a model with recurrent layers, held
    /// from admission until the request finishes or is retracted (its
    /// state then restarts from its first token).
    pub state_slot: Option<crate::kv::state::StateSlot>,
    /// The snapshot the request's first chunk restores (the cached
    /// prefix's length and its slot), until that chunk has been planned.
    pub restore: Option<(usize, Arc<crate::kv::state::StateSlot>)>,
    /// The snapshot the step in flight writes (at this many tokens), and the
    /// latest one a finished step wrote (kept in the store when the
    /// request's KV is cached).
    pub snapshot_next: Option<(usize, crate::kv::state::StateSlot)>,
    pub snapshot_done: Option<(usize, crate::kv::state::StateSlot)>,
    /// While drafts are verified: the slots that receive the state after
    /// each draft token's predecessor (slot `j` the state after `j + 1` of
    /// the step's tokens); the accepted one is restored before the next step.
    pub draft_states: Vec<crate::kv::state::StateSlot>,
    /// Finished during this step (the scheduler drops it after the step).
    pub finished: bool,
    // Reporting.
    pub cached_tokens: Option<usize>,
    /// Of `cached_tokens`: from the host tier, and of those from storage.
    pub cached_tiers: (usize, usize),
    pub retractions: u32,
    pub arrival: Instant,
    /// `arrival` in [`clock_secs`] (per-step figures are plain f64 arithmetic).
    pub arrival_secs: f64,
    /// Seconds from arrival to the first admission (set once).
    pub queue_time: Option<f64>,
    /// When the first token came, in [`clock_secs`].
    pub first_token: Option<f64>,
    /// Seconds from arrival to the first token (set with `first_token`).
    ttft: Option<f64>,
    // Output text.
    /// The newest pending token has no text (a trimmed stop token).
    untexted_last: bool,
    detok: IncrementalDetokenizer,
    text: String,
    sent_text: usize,
    pending_ids: Vec<u32>,
    pending_logprobs: Vec<TokenLogprob>,
    /// With `logprob_start_len`: the prompt position scoring starts at (at
    /// least 1: the first token has no logprob), until the prompt was
    /// scored and the scores handed to the stream.
    pub prompt_scoring: Option<usize>,
    /// The prompt's scores so far, by position from `prompt_scoring`.
    prompt_scores: Vec<Option<TokenLogprob>>,
    /// An embedding request's pooled state: the running sum of its rows
    /// (mean pooling) or its last row, until the prompt is complete; then
    /// the normalized vector, sent with the finish.
    embedding: Vec<f32>,
    /// The prompt's scores, complete, to send with the next chunk.
    pending_prompt_logprobs: Vec<TokenLogprob>,
    sink: StreamHandle,
}

impl Req {
    pub fn new(
        rid: String,
        r: GenerateRequest,
        sink: ChunkSender,
        arrival: Instant,
    ) -> Result<Self> {
        let matcher = match &r.grammar {
            Some(g) => Some(g.matcher().map_err(CoreError::from)?),
            None => None,
        };
        let stop_regex = r
            .params
            .stop_regexes()
            .map_err(|e| CoreError::param(crate::error::Param::StopRegex, e))?;
        let ctx_start = r.input_ids.len().saturating_sub(5);
        let detok =
            IncrementalDetokenizer::new(&r.input_ids[ctx_start..], r.params.skip_special_tokens);
        let rng = r.params.seed.map_or_else(SeqRng::from_entropy, SeqRng::new);
        Ok(Self {
            rid,
            index: 0,
            prompt: Arc::from(r.input_ids),
            output: Vec::new(),
            params: Arc::new(r.params),
            rng,
            key: 0,
            spec_observed: 0,
            spec_verify_ct: 0,
            spec_accepted: 0,
            spec_rate: (0.0, 0.0),
            ns: super::transfer::request_namespace(&r.namespace, r.lora.as_ref()),
            lora: r.lora,
            priority: r.priority,
            return_logprob: r.return_logprob,
            top_logprobs_num: r.top_logprobs_num,
            token_ids_logprob: r.token_ids_logprob,
            prompt_logprob_ranks: r.prompt_logprob_ranks,
            grammar: r.grammar,
            matcher,
            mask_error: None,
            given_first: r.first_token,
            kind: r.kind,
            hold: r.hold,
            stop_regex,
            followers: Vec::new(),
            node: None,
            node_len: 0,
            tree_pages: Vec::new(),
            own: None,
            pages_stamp: next_pages_stamp(),
            computed: 0,
            state_slot: None,
            restore: None,
            snapshot_next: None,
            snapshot_done: None,
            draft_states: Vec::new(),
            finished: false,
            cached_tokens: None,
            cached_tiers: (0, 0),
            retractions: 0,
            arrival,
            arrival_secs: clock_secs(arrival),
            queue_time: None,
            first_token: None,
            ttft: None,
            untexted_last: false,
            detok,
            text: String::new(),
            sent_text: 0,
            pending_ids: Vec::new(),
            pending_logprobs: Vec::new(),
            prompt_scoring: r
                .logprob_start_len
                .filter(|_| r.return_logprob)
                .map(|s| s.max(1)),
            prompt_scores: Vec::new(),
            embedding: Vec::new(),
            pending_prompt_logprobs: Vec::new(),
            sink: StreamHandle::new(sink),
        })
    }

    /// A copy for sample `index` of an n > 1 request.
    pub fn sample_copy(&self, index: u32) -> Result<Self> {
        let sink = self.sink.try_clone().ok_or_else(|| {
            CoreError::Internal("a request's samples are copied after it streamed".into())
        })?;
        let matcher = match &self.grammar {
            Some(g) => Some(g.matcher().map_err(CoreError::from)?),
            None => None,
        };
        let mut params = (*self.params).clone();
        params.n = 1;
        let seed = self.params.seed.map(|s| s.wrapping_add(index as u64));
        params.seed = seed;
        let rng = seed.map_or_else(SeqRng::from_entropy, SeqRng::new);
        let ctx_start = self.prompt.len().saturating_sub(5);
        Ok(Self {
            rid: self.rid.clone(),
            index,
            prompt: self.prompt.clone(),
            output: Vec::new(),
            untexted_last: false,
            detok: IncrementalDetokenizer::new(
                &self.prompt[ctx_start..],
                params.skip_special_tokens,
            ),
            params: Arc::new(params),
            rng,
            key: 0,
            spec_observed: 0,
            spec_verify_ct: 0,
            spec_accepted: 0,
            spec_rate: (0.0, 0.0),
            ns: self.ns.clone(),
            lora: self.lora.clone(),
            priority: self.priority,
            return_logprob: self.return_logprob,
            top_logprobs_num: self.top_logprobs_num,
            token_ids_logprob: self.token_ids_logprob.clone(),
            prompt_logprob_ranks: self.prompt_logprob_ranks,
            grammar: self.grammar.clone(),
            matcher,
            mask_error: None,
            given_first: None,
            kind: self.kind,
            hold: self.hold.clone(),
            stop_regex: self.stop_regex.clone(),
            followers: Vec::new(),
            node: None,
            node_len: 0,
            tree_pages: Vec::new(),
            own: None,
            pages_stamp: next_pages_stamp(),
            computed: 0,
            state_slot: None,
            restore: None,
            snapshot_next: None,
            snapshot_done: None,
            draft_states: Vec::new(),
            finished: false,
            cached_tokens: None,
            cached_tiers: (0, 0),
            retractions: 0,
            arrival: self.arrival,
            arrival_secs: self.arrival_secs,
            queue_time: None,
            first_token: None,
            ttft: None,
            text: String::new(),
            sent_text: 0,
            pending_ids: Vec::new(),
            pending_logprobs: Vec::new(),
            prompt_scoring: self.prompt_scoring,
            prompt_scores: Vec::new(),
            embedding: Vec::new(),
            pending_prompt_logprobs: Vec::new(),
            sink,
        })
    }

    /// Stop strings are matched here, so this side detokenizes.
    fn text_here(&self) -> bool {
        super::stream::scheduler_makes_text(&self.params)
    }

    /// Prompt followed by the output.
    pub fn tokens(&self) -> Vec<u32> {
        let mut t = Vec::with_capacity(self.prompt.len() + self.output.len());
        t.extend_from_slice(&self.prompt);
        t.extend_from_slice(&self.output);
        t
    }

    /// Tokens `from..` of prompt followed by output, without building the whole sequence.
    pub fn tail(&self, from: usize) -> Vec<u32> {
        let mut t = Vec::with_capacity(self.len().saturating_sub(from));
        self.extend_tail(from, usize::MAX, &mut t);
        t
    }

    /// Appends at most `max` tokens `from..` of prompt followed by output to `out`.
    #[inline]
    pub fn extend_tail(&self, from: usize, max: usize, out: &mut Vec<u32>) {
        let p = self.prompt.len();
        let end = self.len().min(from.saturating_add(max));
        if from >= p && end == from + 1 {
            // One pending output token (a decode step): pushed, not copied.
            out.push(self.output[from - p]);
            return;
        }
        if from < p {
            out.extend_from_slice(&self.prompt[from..end.min(p)]);
        }
        if end > p {
            out.extend_from_slice(
                self.output
                    .get(from.max(p) - p..end - p)
                    .unwrap_or_default(),
            );
        }
    }

    /// Prompt plus output length.
    pub fn len(&self) -> usize {
        self.prompt.len() + self.output.len()
    }

    /// Writes the pages covering the sequence into `out`: the cache's, then the request's own.
    pub fn page_table_into(&self, out: &mut Vec<u32>) {
        out.clear();
        out.extend_from_slice(&self.tree_pages);
        if let Some(o) = &self.own {
            out.extend_from_slice(o.pages());
        }
    }

    /// A value that changes whenever the page list does and that no other
    /// request's page list ever had: a copy of the list tagged with it is
    /// current exactly while the stamps are equal.
    pub fn pages_stamp(&self) -> u64 {
        self.pages_stamp
    }

    /// The pages the prefix cache holds for this request.
    pub fn tree_pages(&self) -> &[u32] {
        &self.tree_pages
    }

    /// Sets the cache's pages and the request's own.
    pub fn set_pages(&mut self, tree: Vec<u32>, own: Option<PageSet>) {
        self.tree_pages = tree;
        self.own = own;
        self.pages_stamp = next_pages_stamp();
    }

    /// Takes the request's own pages (the cache's stay).
    pub fn take_own(&mut self) -> Option<PageSet> {
        self.pages_stamp = next_pages_stamp();
        self.own.take()
    }

    /// Forgets the cache's pages (after unlocking them).
    pub fn clear_tree_pages(&mut self) {
        self.tree_pages.clear();
        self.pages_stamp = next_pages_stamp();
    }

    /// Appends `pages` to the request's own (nothing when it has none).
    pub fn append_own(&mut self, pages: PageSet) -> crate::error::Result<()> {
        if let Some(own) = self.own.as_mut() {
            own.append(pages)?;
            self.pages_stamp = next_pages_stamp();
        }
        Ok(())
    }

    /// Returns the request's own pages past the first `keep` to the pool.
    #[inline]
    pub fn trim_own(&mut self, keep: usize) {
        if let Some(own) = self.own.as_mut()
            && own.len() > keep
        {
            drop(own.split_off(keep));
            self.pages_stamp = next_pages_stamp();
        }
    }

    /// Pages held: the cache's, then the request's own.
    pub fn page_count(&self) -> usize {
        self.tree_pages.len() + self.own.as_ref().map_or(0, |o| o.len())
    }

    /// Token capacity of the pages held.
    pub fn page_capacity(&self, page_size: usize) -> usize {
        self.page_count() * page_size
    }

    /// The most tokens this request generates (its kind's cap on `max_new_tokens`).
    pub fn token_limit(&self) -> usize {
        self.kind.token_limit(self.params.max_new_tokens)
    }

    /// The rows of a prompt chunk `start..start + len` that score prompt
    /// tokens (row `r` predicts position `start + r + 1`), and the tokens
    /// they predict; `None` when the request scores none there.
    pub fn prompt_rows(
        &self,
        start: usize,
        len: usize,
    ) -> Option<(std::ops::Range<usize>, Vec<u32>)> {
        let rows = self.prompt_row_range(start, len)?;
        let next = self.prompt[start + rows.start + 1..start + rows.end + 1].to_vec();
        Some((rows, next))
    }

    /// The rows of [`Req::prompt_rows`], without the tokens they predict.
    fn prompt_row_range(&self, start: usize, len: usize) -> Option<std::ops::Range<usize>> {
        let from = self.prompt_scoring?;
        if self.kind == RequestKind::PrefixOnly {
            return None;
        }
        // Rows predicting positions start + r + 1 within from..prompt_len.
        let first = from.saturating_sub(1).max(start);
        let end = (start + len).min(self.prompt.len() - 1);
        (first < end).then(|| first - start..end - start)
    }

    /// Records the scores of a chunk's prompt rows (from
    /// [`Req::prompt_rows`]); once the prompt is complete they wait for the
    /// next chunk (positions scored twice after a retraction keep one score).
    pub fn record_prompt_scores(&mut self, start: usize, len: usize, scores: Vec<TokenLogprob>) {
        let Some(from) = self.prompt_scoring else {
            return;
        };
        if let Some(rows) = self.prompt_row_range(start, len) {
            let first_pos = start + rows.start + 1;
            let need = self.prompt.len() - from;
            self.prompt_scores.resize(need, None);
            for (k, l) in scores.into_iter().enumerate() {
                if let Some(slot) = self.prompt_scores.get_mut(first_pos + k - from) {
                    *slot = Some(l);
                }
            }
        }
        if start + len >= self.prompt.len() {
            self.pending_prompt_logprobs = self.prompt_scores.drain(..).flatten().collect();
            self.prompt_scoring = None;
        }
    }

    /// Prefix-cache matches stop at this many tokens while the prompt is
    /// scored: the rows that score it must be computed (every row, for a
    /// mean-pooled embedding).
    pub fn cache_match_cap(&self) -> Option<usize> {
        if self.kind == RequestKind::Embed(super::Pooling::Mean) {
            return Some(0);
        }
        self.prompt_scoring.map(|from| from - 1)
    }

    /// Folds a prompt chunk's pooled rows (`start..start + len`; the sum of
    /// its rows for mean pooling, its last row otherwise) into the
    /// embedding; on the prompt's last chunk the embedding becomes the
    /// L2-normalized result. A chunk from position 0 starts over (a
    /// retracted request computes its prompt again). Returns whether the
    /// chunk brought a vector (an executor without pooling brings none).
    pub fn record_embedding(&mut self, start: usize, len: usize, pooled: Vec<f32>) -> bool {
        let RequestKind::Embed(pooling) = self.kind else {
            return true;
        };
        if pooled.is_empty() {
            return false;
        }
        match pooling {
            super::Pooling::Mean if start > 0 && self.embedding.len() == pooled.len() => {
                for (a, b) in self.embedding.iter_mut().zip(&pooled) {
                    *a += b;
                }
            }
            _ => self.embedding = pooled,
        }
        if start + len >= self.prompt.len() {
            if pooling == super::Pooling::Mean {
                let n = self.prompt.len().max(1) as f32;
                self.embedding.iter_mut().for_each(|x| *x /= n);
            }
            let norm = self.embedding.iter().map(|x| x * x).sum::<f32>().sqrt();
            if norm > 0.0 {
                self.embedding.iter_mut().for_each(|x| *x /= norm);
            }
        }
        true
    }

    /// Tokens still to generate at most.
    pub fn remaining_new(&self) -> usize {
        self.token_limit().saturating_sub(self.output.len())
    }

    #[inline]
    fn meta(&self, now: f64) -> OutputMeta {
        // `now` may be the step's time, read before this request's first token.
        let now = self.first_token.map_or(now, |f| now.max(f));
        OutputMeta {
            prompt_tokens: self.prompt.len(),
            completion_tokens: self.output.len(),
            cached_tokens: self.cached_tokens.unwrap_or(0),
            cached_tokens_host: self.cached_tiers.0,
            cached_tokens_storage: self.cached_tiers.1,
            retractions: self.retractions,
            queue_time: self.queue_time.unwrap_or(0.0),
            ttft: self.ttft,
            elapsed: now - self.arrival_secs,
            spec_verify_ct: self.spec_verify_ct,
            spec_accepted_tokens: self.spec_accepted,
        }
    }

    /// Records a sampled token and, when `with_text`, its text; returns a
    /// stop-string finish if one matched.
    #[inline]
    pub fn push_token(
        &mut self,
        token: u32,
        logprob: Option<TokenLogprob>,
        decoder: &dyn TokenDecoder,
        with_text: bool,
    ) -> Option<Finish> {
        if self.first_token.is_none() {
            let now = clock_secs(Instant::now());
            self.first_token = Some(now);
            self.ttft = Some(now - self.arrival_secs);
            // Room for the expected output (bounded), so decoding does not
            // grow the buffer step after step.
            let expected = self.token_limit().min(MAX_OUTPUT_RESERVE);
            self.output
                .reserve(expected.saturating_sub(self.output.len()));
        }
        self.output.push(token);
        self.pending_ids.push(token);
        if let Some(l) = logprob {
            self.pending_logprobs.push(l);
        }
        // Read only when the reader makes the text (see `ChunkParts`).
        self.untexted_last = !with_text;
        if !with_text || !self.text_here() {
            return None;
        }
        match self.detok.push_str(decoder, &[token]) {
            Ok(delta) => self.text.push_str(delta),
            Err(e) => {
                return Some(Finish::aborted(super::AbortCause::Failed, e.to_string()));
            }
        }
        self.match_stop_string().or_else(|| self.match_stop_regex())
    }

    /// The first `stop_regex` pattern the output text matches (SGLang's
    /// check): the text is kept whole and the finish names the pattern.
    fn match_stop_regex(&self) -> Option<Finish> {
        if self.stop_regex.is_empty() || self.output.len() < self.params.min_new_tokens {
            return None;
        }
        let hit = self
            .stop_regex
            .iter()
            .position(|r| r.is_match(&self.text))?;
        Some(Finish {
            kind: FinishKind::Stop,
            matched: Some(Matched::Regex(self.params.stop_regex[hit].clone())),
            message: None,
            cause: None,
        })
    }

    fn match_stop_string(&mut self) -> Option<Finish> {
        // Below min_new_tokens nothing stops a request but the length limit.
        if self.params.stop.is_empty() || self.output.len() < self.params.min_new_tokens {
            return None;
        }
        let longest = self.params.stop.iter().map(String::len).max().unwrap_or(0);
        let mut from = self.sent_text.saturating_sub(longest);
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        let hay = &self.text[from..];
        let hit = self
            .params
            .stop
            .iter()
            .filter_map(|s| hay.find(s.as_str()).map(|p| (p + from, s.clone())))
            .min_by_key(|(p, _)| *p)?;
        let (pos, s) = hit;
        let end = if self.params.no_stop_trim {
            pos + s.len()
        } else {
            pos
        };
        self.text.truncate(end);
        Some(Finish {
            kind: FinishKind::Stop,
            matched: Some(Matched::Text(s)),
            message: None,
            cause: None,
        })
    }

    /// Length of text safe to send: excludes a tail that may become a stop string.
    fn safe_text_len(&self) -> usize {
        let mut safe = self.text.len();
        for s in &self.params.stop {
            for k in (1..s.len()).rev() {
                if s.is_char_boundary(k) && self.text.ends_with(&s[..k]) {
                    safe = safe.min(self.text.len() - k);
                    break;
                }
            }
        }
        safe.max(self.sent_text)
    }

    /// Sends what is new since the last chunk (through `out`, the
    /// scheduler's output batch); with `finish`, flushes everything and ends.
    pub fn emit(
        &mut self,
        finish: Option<Finish>,
        decoder: &dyn TokenDecoder,
        out: &mut OutputRoute,
    ) {
        self.emit_at(finish, decoder, clock_secs(Instant::now()), out);
    }

    /// [`Self::emit`] with the time the chunk reports, in [`clock_secs`]
    /// (one clock read per step).
    #[inline]
    pub fn emit_at(
        &mut self,
        finish: Option<Finish>,
        decoder: &dyn TokenDecoder,
        now: f64,
        out: &mut OutputRoute,
    ) {
        let stopped_by_string = matches!(
            finish,
            Some(Finish {
                matched: Some(Matched::Text(_)),
                ..
            })
        );
        if finish.is_some()
            && self.text_here()
            && !stopped_by_string
            && let Ok(rest) = self.detok.flush(decoder)
        {
            self.text.push_str(&rest);
        }
        let upto = if finish.is_some() {
            self.text.len()
        } else {
            self.safe_text_len()
        };
        if finish.is_none()
            && self.pending_ids.is_empty()
            && upto == self.sent_text
            && self.pending_prompt_logprobs.is_empty()
        {
            return;
        }
        let meta = self.meta(now);
        out.push(
            &mut self.sink,
            ChunkOut {
                index: self.index,
                token_ids: &mut self.pending_ids,
                text: self.text.get(self.sent_text..upto).unwrap_or_default(),
                logprobs: &mut self.pending_logprobs,
                prompt_logprobs: &mut self.pending_prompt_logprobs,
                embedding: &mut self.embedding,
                finish,
                meta,
                untexted_last: std::mem::take(&mut self.untexted_last),
            },
        );
        self.sent_text = upto;
    }
}

#[cfg(test)]
mod tests {
    use super::{Req, clock_secs};
    use crate::engine::GenerateRequest;
    use crate::kv::PagePool;
    use crate::sampling::SamplingParams;
    use std::time::{Duration, Instant};

    #[test]
    fn every_page_change_renews_the_stamp() {
        let pool = PagePool::new(16, 4);
        let new_req = || {
            let (sink, _rx) = crate::engine::stream::channel();
            let r = GenerateRequest::new(vec![1, 2, 3], SamplingParams::greedy(4));
            Req::new("r".into(), r, sink, Instant::now()).unwrap()
        };
        let (mut a, b) = (new_req(), new_req());
        assert_ne!(a.pages_stamp(), b.pages_stamp());
        let mut seen = vec![a.pages_stamp(), b.pages_stamp()];
        let mut renewed = |r: &Req| {
            assert!(!seen.contains(&r.pages_stamp()), "a stamp came back");
            seen.push(r.pages_stamp());
        };
        a.set_pages(vec![7, 8], Some(pool.alloc(2).unwrap()));
        renewed(&a);
        a.append_own(pool.alloc(1).unwrap()).unwrap();
        renewed(&a);
        assert_eq!(a.page_count(), 5);
        // Trimming to what is held changes nothing.
        let before = a.pages_stamp();
        a.trim_own(3);
        assert_eq!(a.pages_stamp(), before);
        a.trim_own(1);
        renewed(&a);
        // Same count as before the trim and the append, other pages: a
        // count cannot tell them apart, the stamp does.
        a.append_own(pool.alloc(2).unwrap()).unwrap();
        renewed(&a);
        drop(a.take_own());
        renewed(&a);
        a.clear_tree_pages();
        renewed(&a);
        assert_eq!(a.page_count(), 0);
        assert_eq!(pool.free_pages(), 16);
    }

    #[test]
    fn clock_seconds_keep_the_instants_apart() {
        let now = Instant::now();
        let t = clock_secs(now);
        let later = clock_secs(now + Duration::from_millis(1500));
        assert!((later - t - 1.5).abs() < 1e-6, "{later} - {t}");
        // An instant before the epoch (a request that arrived before the
        // first reading) is negative, not clamped.
        if let Some(before) = now.checked_sub(Duration::from_secs(3)) {
            assert!((t - clock_secs(before) - 3.0).abs() < 1e-6);
        }
    }
}
