//! The scheduler thread: continuous batching with chunked prefill, prefix
//! reuse, retraction and SGLang's admission budgets.
//!
//! Every iteration it drains incoming messages, then builds one batch:
//! prefill has priority (the chunked request first, then waiting requests in
//! policy order under `max_running_requests`, `max_prefill_tokens`,
//! `chunked_prefill_size` and the page budget), optionally mixed with the
//! running decodes; otherwise every running request decodes one token, after
//! retracting the least advanced ones if pages run out. It runs the batch,
//! samples, checks stop conditions, streams output, and on finish inserts the
//! sequence's KV into the prefix cache and unlocks its node. A turn's output
//! chunks go to the output thread in one batch at the end of the turn
//! ([`super::output`]), which delivers them to the request streams.
//!
//! Page budget (tokens): free pages plus evictable cache tokens, minus, for
//! every running request, its remaining new tokens (clipped) times
//! `new_token_ratio`. The ratio decays every decode step and jumps up after a
//! retraction, as in SGLang.
//!
//! Overlap scheduling (`EngineConfig::overlap_schedule`): the forward stays on
//! this thread while a scoped helper thread fills the batch's grammar masks
//! and admits the next batch's prefills into `lookahead`, counting every
//! request of the running batch that will still run after it (those whose
//! next token is not their last) as running. `lookahead` is empty whenever a
//! chunked prompt is mid-way, and it is part of every scan that must see all
//! live requests (idle, abort, rid uniqueness, stats).

use super::adaptive::Adaptive;
use super::output::OutputRoute;
use super::policy;
use super::request::Req;
use super::{
    AbortCause, EngineConfig, EngineParts, EngineStats, Finish, FinishKind, Matched, Msg,
    RequestKind, TokenLogprob,
};
use crate::detok::TokenDecoder;
use crate::error::{CoreError, Result};
use crate::executor::Executor;
use crate::grammar::TokenBitmask;
use crate::kv::prefix_cache::PrefixCache;
use crate::kv::state::StatePool;
use crate::kv::{PagePool, pages_for};
use crate::runner::is_stop;
use crate::sampling::SeqRng;
use crate::speculative::Speculator;

mod holds;
mod iteration;
mod refit;
mod snapshots;
mod speculation;
mod transfer;
use std::collections::VecDeque;
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// How often an idle scheduler republishes its counters.
const IDLE_PUBLISH: std::time::Duration = std::time::Duration::from_millis(200);
/// How long an iteration that ran nothing waits for a message.
const IDLE_WAIT: std::time::Duration = std::time::Duration::from_millis(1);
/// Remaining new tokens counted per request in the budget, at most.
const CLIP_MAX_NEW_TOKENS: usize = 4096;
/// Decode steps a retraction should buy the remaining requests.
const RETRACT_DECODE_STEPS: usize = 20;
const INIT_NEW_TOKEN_RATIO: f64 = 0.7;
const MIN_NEW_TOKEN_RATIO_FACTOR: f64 = 0.14;
const NEW_TOKEN_RATIO_DECAY_STEPS: f64 = 600.0;

/// What is left of one iteration's prefill budgets.
struct Budget {
    rem_chunk: usize,
    rem_input: usize,
    reserved: f64,
    /// Requests in the forward now that keep running after it (overlap).
    in_flight: usize,
}

struct PrefillEntry {
    req: Req,
    start: usize,
    len: usize,
    last: bool,
}

pub(crate) struct Scheduler {
    cfg: EngineConfig,
    /// Overlap scheduling is on (resolved from the config).
    overlap: bool,
    /// Prefill entries admitted during the previous forward (overlap), run
    /// by the next iteration before anything else is admitted.
    lookahead: Vec<PrefillEntry>,
    executor: Arc<dyn Executor>,
    pool: PagePool,
    /// Recurrent state slots (a model with recurrent layers).
    state_pool: Option<StatePool>,
    /// Snapshots of cached prefixes' recurrent state (prefix reuse on a
    /// model with recurrent layers).
    snapshots: Option<snapshots::SnapshotStore>,
    cache: Box<dyn PrefixCache>,
    /// Sequences kept cached for callers (open sessions).
    holds: holds::Holds,
    decoder: Arc<dyn TokenDecoder>,
    /// Proposes drafts when speculation is configured.
    speculator: Option<Box<dyn Speculator>>,
    adaptive: Adaptive,
    /// Next speculator key of an accepted request.
    next_key: u64,
    /// Verify steps and accepted drafts since the stats window began.
    window_verify: u64,
    window_accepted: u64,
    eos: Vec<u32>,
    waiting: VecDeque<Req>,
    running: Vec<Req>,
    chunked: Option<Req>,
    page_size: usize,
    new_token_ratio: f64,
    init_ratio: f64,
    min_ratio: f64,
    decay: f64,
    rng: SeqRng,
    stats: Arc<Mutex<EngineStats>>,
    counters: EngineStats,
    window_tokens: u64,
    window_start: Instant,
    hit_window: VecDeque<(usize, usize)>,
    /// Pause, drained weight update and weight version.
    refit: refit::RefitState,
    /// Sums of `hit_window`: cached and prompt tokens.
    hit_sums: (usize, usize),
    /// The last step's sequence plans, refilled by the next (their buffers reused).
    seq_bufs: Vec<crate::step::SeqPlan>,
    /// Per buffer of `seq_bufs`, the page-list stamp ([`Req::pages_stamp`])
    /// its `pages` were copied at (0: not a decoding request's copy).
    seq_stamps: Vec<u64>,
    /// When the last forward's results came back (the time its chunks
    /// report), in seconds from `request::clock_secs`'s epoch.
    step_time: f64,
    /// Some request ran with a LoRA adapter (admission then counts adapters).
    lora_used: bool,
    /// The chunks of this turn, handed to the output thread at its end.
    out: OutputRoute,
}

/// Which adapter a request runs with, for counting (`None`: the base model).
type AdapterKey = Option<usize>;

fn adapter_key(lora: &Option<Arc<crate::model::lora::LoraAdapter>>) -> AdapterKey {
    // The address of the shared adapter: requests of one adapter hold one Arc.
    lora.as_ref().map(|a| Arc::as_ptr(a) as usize)
}

/// Adds the keys of `keys` not in `set` yet (sets of a few adapters).
fn add_distinct(set: &mut Vec<AdapterKey>, keys: impl IntoIterator<Item = AdapterKey>) {
    for k in keys {
        if !set.contains(&k) {
            set.push(k);
        }
    }
}

impl Scheduler {
    pub fn new(
        cfg: EngineConfig,
        mut parts: EngineParts,
        stats: Arc<Mutex<EngineStats>>,
    ) -> Result<Self> {
        let kv = *parts.executor.kv_spec();
        let mut cfg = cfg;
        // A model with recurrent layers keeps a state slot per running
        // request; the slots past `max_running_requests` hold snapshots of
        // cached prefixes (without any, prefixes are not reused).
        let (state_pool, snapshots) = match parts.executor.model_spec().state {
            Some(_) => {
                let slots = parts.executor.state_slots();
                if slots == 0 {
                    return Err(CoreError::unsupported(
                        "a model with recurrent layers on an executor without state slots",
                    ));
                }
                let running = cfg.max_running_requests.clamp(1, slots);
                let policy = parts.prefix_cache.eviction_policy();
                let snapshots = (running < slots && !cfg.disable_radix_cache).then(|| {
                    snapshots::SnapshotStore::new(StatePool::over(running..slots), policy)
                });
                if snapshots.is_none() {
                    cfg.disable_radix_cache = true;
                }
                (Some(StatePool::over(0..running)), snapshots)
            }
            None => (None, None),
        };
        let pool = PagePool::new(kv.num_pages, kv.page_size);
        parts.prefix_cache.bind_pool(&pool)?;
        let page_size = pool.page_size();
        let init_ratio = (INIT_NEW_TOKEN_RATIO * cfg.schedule_conservativeness as f64).min(1.0);
        let min_ratio = init_ratio * MIN_NEW_TOKEN_RATIO_FACTOR;
        let counters = EngineStats {
            max_total_tokens: pool.total_pages() * page_size,
            new_token_ratio: init_ratio,
            ..Default::default()
        };
        let overlap = cfg
            .overlap_schedule
            .unwrap_or_else(|| parts.executor.capabilities().asynchronous);
        let holds = holds::Holds::new(cfg.hold_ratio, pool.total_pages() * page_size);
        Ok(Self {
            holds,
            overlap,
            lookahead: Vec::new(),
            lora_used: false,
            rng: SeqRng::new(cfg.seed),
            cfg,
            executor: Arc::from(parts.executor),
            pool,
            state_pool,
            snapshots,
            cache: parts.prefix_cache,
            decoder: parts.decoder,
            speculator: parts.speculator,
            adaptive: Adaptive::default(),
            next_key: 1,
            window_verify: 0,
            window_accepted: 0,
            eos: parts.eos_token_ids,
            waiting: VecDeque::new(),
            running: Vec::new(),
            chunked: None,
            page_size,
            new_token_ratio: init_ratio,
            init_ratio,
            min_ratio,
            decay: (init_ratio - min_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS,
            stats,
            counters,
            window_tokens: 0,
            window_start: Instant::now(),
            hit_window: VecDeque::new(),
            refit: Default::default(),
            hit_sums: (0, 0),
            seq_bufs: Vec::new(),
            seq_stamps: Vec::new(),
            step_time: 0.0,
            out: OutputRoute::start()
                .map_err(|e| CoreError::Internal(format!("starting the output thread: {e}")))?,
        })
    }

    fn idle(&self) -> bool {
        self.waiting.is_empty()
            && self.running.is_empty()
            && self.chunked.is_none()
            && self.lookahead.is_empty()
    }

    /// The thread's main loop.
    pub fn run(mut self, rx: Receiver<Msg>) {
        'outer: loop {
            self.poll_refit();
            if self.idle() || self.halted() {
                // Copies recorded by the last requests (backups) run before
                // sleeping (not while paused: the KV may be released).
                if !self.halted()
                    && let Err(e) = self.run_tier_copies()
                {
                    tracing::error!("KV tier copies: {e}");
                }
                self.publish();
                self.out.flush();
                // Idle: republish now and then (tier threads keep counting).
                match rx.recv_timeout(IDLE_PUBLISH) {
                    Ok(m) => {
                        if !self.handle(m) {
                            break 'outer;
                        }
                    }
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => continue 'outer,
                    Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break 'outer,
                }
                continue 'outer;
            }
            while let Ok(m) = rx.try_recv() {
                if !self.handle(m) {
                    break 'outer;
                }
            }
            match self.iterate() {
                Ok(true) => {}
                // Requests wait (a storage prefetch) but nothing ran: wait a
                // little for a message instead of spinning.
                Ok(false) => {
                    self.out.flush();
                    if let Ok(m) = rx.recv_timeout(IDLE_WAIT)
                        && !self.handle(m)
                    {
                        break 'outer;
                    }
                }
                Err(e) => {
                    tracing::error!("scheduler iteration failed: {e}");
                    self.abort(|_| true, AbortCause::Failed, &format!("engine error: {e}"));
                }
            }
            self.publish();
            self.out.flush();
        }
        self.abort(
            |_| true,
            AbortCause::ShuttingDown,
            "the engine is shutting down",
        );
        self.publish();
        self.out.flush();
    }

    fn handle(&mut self, m: Msg) -> bool {
        match m {
            Msg::Submit(r) => self.accept(*r),
            Msg::Abort(rid) => self.abort(
                |r| r.rid == rid,
                AbortCause::Requested,
                "aborted by request",
            ),
            Msg::AbortAll => self.abort(|_| true, AbortCause::Requested, "aborted by request"),
            Msg::Flush { reply, storage } => {
                let ok = self.idle();
                if ok {
                    self.flush_cache();
                    if storage && let Err(e) = self.cache.clear_storage() {
                        tracing::warn!("clearing the storage tier: {e}");
                    }
                    // Stats show the empty cache by the time the caller hears back.
                    self.publish();
                }
                let _ = reply.send(ok);
            }
            Msg::Control(c) => self.control(c),
            Msg::Transfer(op) => self.transfer(op),
            Msg::ReleaseHold(key) => self.release_hold(&key),
            Msg::Shutdown => return false,
        }
        true
    }

    fn live_rid(&self, rid: &str) -> bool {
        self.waiting
            .iter()
            .any(|r| r.rid == rid || r.followers.iter().any(|f| f.rid == rid))
            || self.running.iter().any(|r| r.rid == rid)
            || self.chunked.as_ref().is_some_and(|r| r.rid == rid)
            || self
                .lookahead
                .iter()
                .any(|e| e.req.rid == rid || e.req.followers.iter().any(|f| f.rid == rid))
    }

    fn reject(&mut self, mut r: Req, cause: AbortCause, msg: String) {
        let n = r.params.n.max(1);
        for i in 0..n {
            r.index = i as u32;
            r.emit(
                Some(Finish::aborted(cause, msg.as_str())),
                &*self.decoder,
                &mut self.out,
            );
        }
        self.counters.num_aborted_requests_total += 1;
    }

    fn accept(&mut self, mut r: Req) {
        self.lora_used |= r.lora.is_some();
        r.ns = self.current_namespace(&r.ns);
        r.key = self.next_key;
        self.next_key += 1;
        if self.live_rid(&r.rid) {
            let msg = format!("rid '{}' is already in use", r.rid);
            return self.reject(r, AbortCause::RidInUse, msg);
        }
        if self.waiting.len() >= self.cfg.max_queued_requests {
            return self.reject(r, AbortCause::QueueFull, "the request queue is full".into());
        }
        if let Some(tok) = r.given_first.take()
            && let Some(f) = self.start_from(&mut r, tok)
        {
            return self.finish(r, f);
        }
        if !self.cfg.disable_radix_cache {
            self.cache.prefetch(r.key, &r.ns, &r.prompt);
        }
        let n = r.params.n;
        if n <= 1 {
            self.waiting.push_back(r);
            return;
        }
        let mut copies = Vec::with_capacity(n);
        for i in 0..n {
            match r.sample_copy(i as u32) {
                Ok(mut c) => {
                    c.key = self.next_key;
                    self.next_key += 1;
                    copies.push(c);
                }
                Err(e) => return self.reject(r, AbortCause::Failed, e.to_string()),
            }
        }
        if self.cfg.disable_radix_cache {
            self.waiting.extend(copies);
        } else {
            // Fill the cache with the prompt once; the samples then share its pages.
            r.kind = RequestKind::PrefixOnly;
            Arc::make_mut(&mut r.params).n = 1;
            r.followers = copies;
            self.waiting.push_back(r);
        }
    }

    /// Starts `r` from `tok`, its first output token sampled elsewhere (a
    /// disaggregated prefill worker): the token is appended as if a step
    /// had sampled it and streamed at once, and the seeded sampler skips
    /// the draw it took. A grammar that does not allow it leaves `r` to
    /// sample its own. Returns the finish when the token ends `r`.
    fn start_from(&mut self, r: &mut Req, tok: u32) -> Option<Finish> {
        if let Some(m) = r.matcher.as_mut() {
            let mut mask = TokenBitmask::new(self.executor.model_spec().vocab_size);
            if m.fill_mask(&mut mask).is_err() || !mask.is_allowed(tok) {
                tracing::warn!(
                    "{}: the grammar does not allow the given first token {tok}; sampling one",
                    r.rid
                );
                return None;
            }
        }
        r.rng.next_u64();
        self.counters.given_first_tokens_total += 1;
        let finish = self.append(r, tok, None);
        if finish.is_none() {
            // Delivered now, not with the request's first step.
            r.emit(None, &*self.decoder, &mut self.out);
            self.out.flush();
        }
        finish
    }

    fn abort(&mut self, pred: impl Fn(&Req) -> bool, cause: AbortCause, msg: &str) {
        let mut victims = Vec::new();
        let mut i = 0;
        while i < self.waiting.len() {
            if pred(&self.waiting[i]) {
                if let Some(r) = self.waiting.remove(i) {
                    victims.push(r);
                }
            } else {
                self.waiting[i].followers.retain(|f| !pred(f));
                i += 1;
            }
        }
        let mut i = 0;
        while i < self.running.len() {
            if pred(&self.running[i]) {
                victims.push(self.running.swap_remove(i));
            } else {
                i += 1;
            }
        }
        if self.chunked.as_ref().is_some_and(&pred)
            && let Some(r) = self.chunked.take()
        {
            victims.push(r);
        }
        let mut i = 0;
        while i < self.lookahead.len() {
            if pred(&self.lookahead[i].req) {
                victims.push(self.lookahead.remove(i).req);
            } else {
                self.lookahead[i].req.followers.retain(|f| !pred(f));
                i += 1;
            }
        }
        for mut r in victims {
            self.cache.prefetch_cancel(r.key);
            // Followers of an aborted prefix-only request are aborted with it.
            for f in std::mem::take(&mut r.followers) {
                self.finish(f, Finish::aborted(cause, msg));
            }
            self.finish(r, Finish::aborted(cause, msg));
        }
    }

    // ---- KV bookkeeping -------------------------------------------------

    fn available_tokens(&self) -> usize {
        self.pool.free_pages() * self.page_size + self.cache.stats().evictable_tokens
    }

    /// Allocates `n` pages, evicting from the cache if needed.
    fn alloc_pages(&mut self, n: usize) -> Option<crate::kv::PageSet> {
        self.yield_holds(n);
        let free = self.pool.free_pages();
        if free < n {
            self.cache.evict((n - free) * self.page_size);
        }
        self.pool.alloc(n).ok()
    }

    /// Matches the request's cached prefix and locks it (first admission or after retraction).
    fn attach_prefix(&mut self, r: &mut Req) -> Result<()> {
        let mut toks = r.tokens();
        // While the prompt is scored, its scored rows must be computed.
        if let Some(cap) = r.cache_match_cap() {
            toks.truncate(cap + 1);
        }
        let m = if self.snapshots.is_some() {
            self.match_with_state(r, &toks)
        } else {
            self.cache.match_prefix(&r.ns, &toks[..toks.len() - 1])
        };
        self.cache.lock(m.node)?;
        r.node = Some(m.node);
        r.node_len = m.matched_tokens;
        r.set_pages(m.pages, Some(self.pool.empty_set()));
        r.computed = m.matched_tokens;
        if r.cached_tokens.is_none() {
            r.cached_tokens = Some(m.matched_tokens.min(r.prompt.len()));
            r.cached_tiers = (m.host_tokens, m.storage_tokens);
        }
        Ok(())
    }

    /// Gives the request's KV back: its computed part to the cache (when `keep`), the rest to the pool.
    fn release_kv(&mut self, r: &mut Req, keep: bool) {
        if keep {
            self.keep_snapshot(r);
        }
        r.state_slot = None;
        r.restore = None;
        r.snapshot_next = None;
        r.snapshot_done = None;
        r.draft_states.clear();
        let Some(node) = r.node.take() else {
            drop(r.take_own());
            return;
        };
        let mut own = r.take_own().unwrap_or_else(|| self.pool.empty_set());
        if keep && !self.cfg.disable_radix_cache && r.computed > r.node_len {
            let covered = (r.computed - r.node_len).div_ceil(self.page_size);
            drop(own.split_off(covered));
            let toks = r.tokens();
            if let Err(e) = self.cache.insert_with_prefix(
                &r.ns,
                &toks[..r.computed],
                r.node_len,
                own,
                r.priority,
            ) {
                tracing::warn!("caching request {}: {e}", r.rid);
            }
        } else {
            drop(own);
        }
        if let Err(e) = self.cache.unlock(node) {
            tracing::error!("unlocking the prefix of {}: {e}", r.rid);
        }
        r.clear_tree_pages();
        r.node_len = 0;
        r.computed = 0;
    }

    /// After a non-final chunk: cache the computed part and hold it through the cache's pages.
    fn cache_unfinished(&mut self, r: &mut Req) -> Result<()> {
        if self.cfg.disable_radix_cache {
            return Ok(());
        }
        self.keep_snapshot(r);
        let toks = r.tokens();
        let own = r.take_own().unwrap_or_else(|| self.pool.empty_set());
        let old = r.node.take();
        self.cache
            .insert_with_prefix(&r.ns, &toks[..r.computed], r.node_len, own, r.priority)?;
        let m = self.cache.match_prefix(&r.ns, &toks[..r.computed]);
        self.cache.lock(m.node)?;
        if let Some(old) = old {
            self.cache.unlock(old)?;
        }
        if m.matched_tokens != r.computed {
            return Err(CoreError::Internal(format!(
                "chunk of {} cached only {} tokens",
                r.computed, m.matched_tokens
            )));
        }
        r.node = Some(m.node);
        r.node_len = m.matched_tokens;
        r.set_pages(m.pages, Some(self.pool.empty_set()));
        Ok(())
    }

    // ---- Scheduling -----------------------------------------------------

    /// Tokens `r` is expected to still need: its remaining new tokens
    /// (clipped) times `new_token_ratio`.
    fn expected_new(&self, r: &Req) -> f64 {
        r.remaining_new().min(CLIP_MAX_NEW_TOKENS) as f64 * self.new_token_ratio
    }

    fn reserved_for_running(&self) -> f64 {
        self.running.iter().map(|r| self.expected_new(r)).sum()
    }

    /// Builds the prefill part of the next batch: the entries admitted
    /// during the last forward if any, else a fresh admission.
    fn schedule_prefill(&mut self) -> Result<Vec<PrefillEntry>> {
        if !self.lookahead.is_empty() {
            return Ok(std::mem::take(&mut self.lookahead));
        }
        self.admit(0, 0.0, &[])
    }

    /// Admits waiting requests (the chunked one first) under the budgets;
    /// `in_flight` requests needing `in_flight_reserve` tokens are counted as
    /// running on top of `self.running` (they are in the forward now).
    fn admit(
        &mut self,
        in_flight: usize,
        in_flight_reserve: f64,
        in_flight_adapters: &[AdapterKey],
    ) -> Result<Vec<PrefillEntry>> {
        let mut entries: Vec<PrefillEntry> = Vec::new();
        // Nothing to admit: the budget (a walk over the running requests)
        // is not needed.
        if self.chunked.is_none() && (self.waiting.is_empty() || self.admission_held()) {
            return Ok(entries);
        }
        let mut budget = Budget {
            rem_chunk: if self.cfg.chunked_prefill_size > 0 {
                self.cfg.chunked_prefill_size as usize
            } else {
                usize::MAX
            },
            rem_input: self.cfg.max_prefill_tokens,
            reserved: self.reserved_for_running() + in_flight_reserve,
            in_flight,
        };
        // The chunked request continues first.
        if let Some(r) = self.chunked.take() {
            match self.plan_chunk(r, &mut budget, true)? {
                Ok(e) => {
                    let last = e.last;
                    entries.push(e);
                    if !last {
                        return Ok(entries);
                    }
                }
                Err(r) => {
                    self.chunked = Some(r);
                    return Ok(entries);
                }
            }
        }
        if self.waiting.is_empty() || self.admission_held() {
            return Ok(entries);
        }
        let order = policy::order(
            self.cfg.schedule_policy,
            &self.waiting,
            &*self.cache,
            self.cfg.lpm_fallback_queue_len,
            &mut self.rng,
        );
        let mut queue: Vec<Option<Req>> = self.waiting.drain(..).map(Some).collect();
        // Adapters of the step, filled on the first request when LoRA is in use.
        let mut adapters: Option<Vec<AdapterKey>> = None;
        for i in order {
            let running = self.running.len() + in_flight + entries.len();
            if running >= self.cfg.max_running_requests || budget.rem_chunk == 0 {
                break;
            }
            let Some(r) = queue.get_mut(i).and_then(Option::take) else {
                continue;
            };
            if self.lora_used {
                let active = adapters.get_or_insert_with(|| {
                    let mut v = in_flight_adapters.to_vec();
                    let ours = self.running.iter().chain(&self.chunked);
                    let ours = ours.chain(entries.iter().map(|e| &e.req));
                    add_distinct(&mut v, ours.map(|q| adapter_key(&q.lora)));
                    v
                });
                let k = adapter_key(&r.lora);
                if !active.contains(&k) {
                    if active.len() >= self.cfg.max_loras_per_batch.max(1) {
                        queue[i] = Some(r);
                        continue;
                    }
                    active.push(k);
                }
            }
            // A fresh request waits while its prefix is fetched from storage
            // (as the prefetch policy says); the others may go first.
            if r.node.is_none() && !self.cache.prefetch_poll(r.key) {
                queue[i] = Some(r);
                continue;
            }
            let first = entries.is_empty();
            match self.plan_chunk(r, &mut budget, first) {
                Ok(Ok(e)) => {
                    let last = e.last;
                    entries.push(e);
                    if !last {
                        break;
                    }
                }
                Ok(Err(r)) => {
                    queue[i] = Some(r);
                    break;
                }
                Err(err) => {
                    self.waiting.extend(queue.into_iter().flatten());
                    return Err(err);
                }
            }
        }
        self.waiting.extend(queue.into_iter().flatten());
        Ok(entries)
    }

    /// Admits `r` for one chunk under the budgets, or gives it back untouched.
    fn plan_chunk(
        &mut self,
        mut r: Req,
        b: &mut Budget,
        first: bool,
    ) -> Result<std::result::Result<PrefillEntry, Req>> {
        let fresh = r.node.is_none();
        if fresh {
            self.attach_prefix(&mut r)?;
        }
        let ps = self.page_size;
        let total = r.len();
        let extend = total - r.computed;
        let mut len = extend.min(b.rem_chunk);
        if !first {
            len = len.min(b.rem_input);
        }
        if len < extend {
            // A partial chunk ends on a page boundary.
            let mut end = (r.computed + len) / ps * ps;
            if end <= r.computed && first {
                // A chunk budget under one page still makes progress (it
                // waited forever before): up to the next page boundary.
                end = (r.computed / ps + 1) * ps;
            }
            len = end.min(total).saturating_sub(r.computed);
        }
        let last = len == extend;
        let future = if last { self.expected_new(&r) } else { 0.0 };
        let mut room = self.available_tokens() as f64 - b.reserved;
        if len as f64 + future > room && !self.holds.is_empty() {
            let want = (len as f64 + future + b.reserved).ceil() as usize;
            self.yield_holds(want.div_ceil(ps));
            room = self.available_tokens() as f64 - b.reserved;
        }
        let alone = first && self.running.is_empty() && b.in_flight == 0;
        let fits = len > 0 && (alone || len as f64 + future <= room);
        let need_pages = (r.computed + len)
            .div_ceil(ps)
            .saturating_sub(r.page_capacity(ps) / ps);
        let pages = if fits && self.hold_state_slot(&mut r) {
            self.alloc_pages(need_pages)
        } else {
            None
        };
        let Some(pages) = pages else {
            if fresh {
                self.release_kv(&mut r, false);
            }
            return Ok(Err(r));
        };
        r.append_own(pages)?;
        if r.queue_time.is_none() {
            r.queue_time = Some(r.arrival.elapsed().as_secs_f64());
        }
        b.rem_chunk = b.rem_chunk.saturating_sub(len);
        b.rem_input = b.rem_input.saturating_sub(len);
        b.reserved += len as f64 + future;
        let start = r.computed;
        Ok(Ok(PrefillEntry {
            req: r,
            start,
            len,
            last,
        }))
    }

    /// Makes sure every running request has a slot for one more token, retracting if needed.
    fn prepare_decode(&mut self) -> Result<()> {
        let ps = self.page_size;
        // Pages each request still needs for its pending tokens (one, or more after jump-forward).
        let missing = |r: &Req| pages_for(r.len(), ps).saturating_sub(r.page_count());
        let need = loop {
            let need: usize = self.running.iter().map(missing).sum();
            self.yield_holds(need);
            let available = self.pool.free_pages() + self.cache.stats().evictable_tokens / ps;
            if need <= available || self.running.len() <= 1 {
                break need;
            }
            self.retract_one();
        };
        if need == 0 {
            return Ok(());
        }
        for i in 0..self.running.len() {
            let n = missing(&self.running[i]);
            if n > 0 {
                match self.alloc_pages(n) {
                    Some(p) => {
                        self.running[i].append_own(p)?;
                    }
                    None => {
                        return Err(CoreError::OutOfMemory(
                            "no KV page left for a decoding request".into(),
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// Retracts the running request with the least decoded progress.
    fn retract_one(&mut self) {
        let Some(victim) = (0..self.running.len()).min_by_key(|&i| {
            let r = &self.running[i];
            (r.output.len(), std::cmp::Reverse(r.prompt.len()))
        }) else {
            return;
        };
        let mut r = self.running.swap_remove(victim);
        self.release_kv(&mut r, true);
        r.retractions += 1;
        self.counters.num_retracted_reqs_total += 1;
        tracing::info!("retracted {} after {} tokens", r.rid, r.output.len());
        self.waiting.push_front(r);
        let decoded: usize = self.running.iter().map(|r| r.output.len()).sum();
        let max_new: usize = self
            .running
            .iter()
            .map(|r| r.token_limit())
            .sum::<usize>()
            .max(1);
        let ratio = (decoded + RETRACT_DECODE_STEPS * self.running.len()) as f64 / max_new as f64;
        self.new_token_ratio = ratio.clamp(self.new_token_ratio, 1.0);
    }

    /// Appends one token (sampled or forced) to `r`: grammar, text, stop checks.
    #[inline]
    fn append(&mut self, r: &mut Req, tok: u32, logprob: Option<TokenLogprob>) -> Option<Finish> {
        if let Some(m) = r.matcher.as_mut() {
            self.counters.constrained_tokens_total += 1;
            if let Err(e) = m.accept(tok) {
                return Some(abort_finish(&format!("grammar rejected token {tok}: {e}")));
            }
        }
        self.counters.generation_tokens_total += 1;
        self.window_tokens += 1;
        let stop_token = is_stop(tok, &r.params, &self.eos);
        let text_of_token = !stop_token || r.params.no_stop_trim;
        if let Some(f) = r.push_token(tok, logprob, &*self.decoder, text_of_token) {
            return Some(f);
        }
        if stop_token {
            return Some(Finish {
                kind: FinishKind::Stop,
                matched: Some(Matched::Token(tok)),
                message: None,
                cause: None,
            });
        }
        if r.output.len() >= r.token_limit() {
            return Some(Finish {
                kind: FinishKind::Length,
                matched: None,
                message: None,
                cause: None,
            });
        }
        None
    }

    fn finish(&mut self, mut r: Req, f: Finish) {
        self.finish_mut(&mut r, f);
    }

    /// Finishes `r` where it lies (the caller drops it).
    fn finish_mut(&mut self, r: &mut Req, f: Finish) {
        let computed = r.computed;
        self.release_kv(r, true);
        if f.kind != FinishKind::Abort && r.kind == RequestKind::Generate {
            self.hold_finished(r, computed);
        }
        if let Some(s) = self.speculator.as_mut() {
            s.release(r.key);
        }
        if f.kind == FinishKind::Abort {
            self.counters.num_aborted_requests_total +=
                u64::from(r.kind != RequestKind::PrefixOnly);
        }
        if r.kind == RequestKind::PrefixOnly {
            // The prompt is cached now: release the samples, in order, at the front.
            for s in std::mem::take(&mut r.followers).into_iter().rev() {
                self.waiting.push_front(s);
            }
            return;
        }
        self.counters.num_requests_total += 1;
        self.counters.cached_tokens_total += r.cached_tokens.unwrap_or(0) as u64;
        // Counters are current by the time the caller sees the final chunk.
        self.publish();
        r.emit(Some(f), &*self.decoder, &mut self.out);
    }

    fn record_hit(&mut self, r: &Req) {
        if r.retractions > 0 {
            return;
        }
        let hit = (r.cached_tokens.unwrap_or(0), r.prompt.len());
        self.hit_window.push_back(hit);
        self.hit_sums = (self.hit_sums.0 + hit.0, self.hit_sums.1 + hit.1);
        if self.hit_window.len() > 256
            && let Some((h, t)) = self.hit_window.pop_front()
        {
            self.hit_sums = (self.hit_sums.0 - h, self.hit_sums.1 - t);
        }
    }

    fn publish(&mut self) {
        if self.idle() {
            self.new_token_ratio = self.init_ratio;
        }
        let cache_stats = self.cache.stats();
        let c = &mut self.counters;
        let ps = self.page_size;
        c.num_running_reqs =
            self.running.len() + usize::from(self.chunked.is_some()) + self.lookahead.len();
        // Each queued sample counts (a prefix-only request's followers too).
        let (mut queued, mut queued_tokens) = (0, 0);
        for r in &self.waiting {
            let samples = 1 + r.followers.len();
            queued += samples;
            queued_tokens += samples * r.prompt.len();
        }
        c.num_queue_reqs = queued;
        c.num_queue_tokens = queued_tokens;
        // As SGLang: what requests hold, not what the cache keeps for reuse.
        c.num_used_tokens =
            (self.pool.used_pages() * ps).saturating_sub(cache_stats.evictable_tokens);
        c.evictable_tokens = cache_stats.evictable_tokens;
        c.held_tokens = self.holds.held();
        if let Some(sp) = &self.state_pool {
            c.used_state_slots = sp.used_slots();
            c.max_state_slots = sp.total_slots();
        }
        c.state_snapshots = self.snapshots.as_ref().map_or(0, |s| s.len());
        c.token_usage = c.num_used_tokens as f64 / c.max_total_tokens.max(1) as f64;
        let (hit, tot) = self.hit_sums;
        c.cache_hit_rate = if tot == 0 {
            0.0
        } else {
            hit as f64 / tot as f64
        };
        let dt = self.window_start.elapsed().as_secs_f64();
        if dt >= 1.0 || (self.window_tokens == 0 && dt > 0.1) {
            c.gen_throughput = self.window_tokens as f64 / dt;
            self.window_tokens = 0;
            if self.window_verify > 0 {
                c.spec_accept_length =
                    (self.window_verify + self.window_accepted) as f64 / self.window_verify as f64;
            }
            self.window_verify = 0;
            self.window_accepted = 0;
            self.window_start = Instant::now();
            c.expert_load = self.executor.expert_load();
        }
        c.cache_tokens = cache_stats.cached_tokens;
        c.tiers = cache_stats.tiers;
        c.new_token_ratio = self.new_token_ratio;
        *self.stats.lock().unwrap_or_else(|e| e.into_inner()) = c.clone();
    }
}

/// A request that failed with `msg`.
fn abort_finish(msg: &str) -> Finish {
    Finish::aborted(AbortCause::Failed, msg)
}
