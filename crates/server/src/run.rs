//! Running the prompts of one HTTP request through the engine.
//!
//! A [`Job`] is one prompt with its sampling parameters. [`submit`] validates
//! and enqueues every job of a request (all or none: if one is refused, the
//! streams already opened are dropped, which aborts them). The resulting
//! [`Run`] merges the jobs' output streams and keeps, per sample (prompt-major:
//! sample `i * n + j` is sample `j` of prompt `i`), the cumulative text, ids,
//! log-probabilities and finish, and feeds the latency histograms.
//!
//! Invariant: a `Run` owns its engine streams, so dropping it (a client that
//! disconnects drops the handler future or the response body) aborts every
//! unfinished sample and frees its KV pages.

use crate::constraint::{self, ConstraintSpec};
use crate::error::ApiError;
use crate::metrics::SampleTiming;
use crate::params::Dialect;
use crate::state::AppState;
use arbor_engine_core::SamplingParams;
use arbor_engine_core::engine::{
    AbortCause, Finish, FinishKind, GenerateRequest, Matched, OutputChunk, OutputMeta,
    RequestStream, TokenLogprob,
};
use futures_util::future::select_all;
use std::sync::Arc;

/// One prompt to generate from: the engine request as the route parsed
/// it, with what the server still has to resolve before submitting it.
#[derive(Clone, Debug)]
pub(crate) struct Job {
    /// The engine request; its grammar is compiled from `constraint` at [`submit`].
    pub req: GenerateRequest,
    /// The structured-output constraint and the field it came from.
    pub constraint: Option<ConstraintSpec>,
    /// SGLang's bootstrap room of a disaggregated request ([`crate::disagg`]).
    pub bootstrap: Option<crate::disagg::Bootstrap>,
}

impl Job {
    pub fn new(input_ids: Vec<u32>, params: SamplingParams) -> Self {
        Self {
            req: GenerateRequest::new(input_ids, params),
            constraint: None,
            bootstrap: None,
        }
    }
}

/// The output of one sample so far.
#[derive(Clone, Debug, Default)]
pub(crate) struct Sample {
    /// Index of its prompt.
    pub prompt: usize,
    /// The request id it runs under.
    pub rid: String,
    /// Text so far.
    pub text: String,
    /// Token ids so far.
    pub ids: Vec<u32>,
    /// Log-probabilities so far (when asked for).
    pub logprobs: Vec<TokenLogprob>,
    /// Log-probabilities of the prompt's tokens (with `logprob_start_len`).
    pub prompt_logprobs: Vec<TokenLogprob>,
    /// Set once it finished.
    pub finish: Option<Finish>,
    /// An embedding request's vector (with its finish).
    pub embedding: Vec<f32>,
    /// The latest counters.
    pub meta: OutputMeta,
    timing: SampleTiming,
}

/// A chunk that just arrived for sample `sample`.
#[derive(Debug)]
pub(crate) struct Event {
    pub sample: usize,
    pub chunk: OutputChunk,
}

struct Slot {
    stream: Option<RequestStream>,
    first_sample: usize,
    unfinished: usize,
}

/// The running prompts of one HTTP request.
pub(crate) struct Run {
    state: Arc<AppState>,
    slots: Vec<Slot>,
    /// Every sample, prompt-major.
    pub samples: Vec<Sample>,
    /// Prompt lengths in tokens.
    pub prompt_lens: Vec<usize>,
    /// Samples per prompt.
    pub n: usize,
    /// A disaggregated prefill: the KV to send once every sample finished.
    export: Option<crate::disagg::PrefillExport>,
}

/// Validates and enqueues every job; all share the same `n`. On a prefill
/// worker, `headers` may name a decode worker to send the prompts' KV to
/// ([`crate::disagg`]).
pub(crate) async fn submit(
    state: &Arc<AppState>,
    mut jobs: Vec<Job>,
    headers: &axum::http::HeaderMap,
    dialect: Dialect,
) -> Result<Run, ApiError> {
    let export = crate::disagg::prefill_jobs(state, headers, &mut jobs)?;
    let submitted = submit_jobs(state, jobs, export.as_ref(), dialect).await;
    if let (Err(e), Some(x)) = (&submitted, &export) {
        x.refuse(&e.message);
    }
    let (slots, samples, prompt_lens, n) = submitted?;
    Ok(Run {
        state: state.clone(),
        slots,
        samples,
        prompt_lens,
        n,
        export,
    })
}

type Submitted = (Vec<Slot>, Vec<Sample>, Vec<usize>, usize);

/// [`submit`]'s enqueueing: on a decode worker each job's bootstrap room
/// is pulled first.
async fn submit_jobs(
    state: &Arc<AppState>,
    jobs: Vec<Job>,
    export: Option<&crate::disagg::PrefillExport>,
    dialect: Dialect,
) -> Result<Submitted, ApiError> {
    state.check_accepting()?;
    if jobs.is_empty() {
        return Err(ApiError::bad_request("the request holds no prompt"));
    }
    let first_tokens = if export.is_none() {
        crate::disagg::pull_rooms(state, &jobs).await
    } else {
        Vec::new()
    };
    let n = jobs.first().map_or(1, |j| j.req.params.n.max(1));
    let mut slots = Vec::with_capacity(jobs.len());
    // Not sized by `n`: the engine has not checked it yet.
    let mut samples = Vec::with_capacity(jobs.len());
    let mut prompt_lens = Vec::with_capacity(jobs.len());
    for (i, job) in jobs.into_iter().enumerate() {
        let mut req = job.req;
        req.grammar = constraint::compile(state, job.constraint.as_ref()).await?;
        let jn = req.params.n.max(1);
        if jn != n {
            return Err(ApiError::bad_param(
                "n",
                "every prompt of a batch must use the same n",
            ));
        }
        prompt_lens.push(req.input_ids.len());
        req.first_token = first_tokens.get(i).copied().flatten();
        let logged = state
            .opts
            .log_requests
            .map(|level| crate::request_log::describe(&req, level, &state.tokenizer));
        let stream = state
            .engine
            .submit(req)
            .map_err(|e| ApiError::from_core(e, dialect))?;
        if let Some(line) = &logged {
            crate::request_log::received(stream.rid(), line);
        }
        for _ in 0..n {
            samples.push(Sample {
                prompt: i,
                rid: stream.rid().to_string(),
                ..Default::default()
            });
        }
        slots.push(Slot {
            stream: Some(stream),
            first_sample: i * n,
            unfinished: n,
        });
    }
    Ok((slots, samples, prompt_lens, n))
}

impl Run {
    /// The next chunk of any sample, already folded into [`Run::samples`];
    /// `None` once every sample finished.
    pub async fn next(&mut self) -> Option<Event> {
        loop {
            let futs: Vec<_> = self
                .slots
                .iter_mut()
                .enumerate()
                .filter_map(|(i, s)| s.stream.as_mut().map(|st| (i, st)))
                .map(|(i, st)| Box::pin(async move { (i, st.next().await) }))
                .collect();
            if futs.is_empty() {
                drop(futs);
                if let Some(x) = self.export.take() {
                    // One sample per prompt on a prefill worker.
                    let first_tokens = self
                        .samples
                        .iter()
                        .map(|s| match &s.finish {
                            Some(f) if f.kind != FinishKind::Abort => s.ids.first().copied(),
                            _ => None,
                        })
                        .collect();
                    x.send(self.state.clone(), first_tokens).await;
                }
                return None;
            }
            let ((slot, item), _, rest) = select_all(futs).await;
            drop(rest);
            let Some(mut chunk) = item else {
                // The engine dropped the stream: end whatever is unfinished.
                self.close_slot(slot, "the engine stopped the request");
                continue;
            };
            let s = &mut self.slots[slot];
            let sample = s.first_sample + chunk.index as usize;
            if chunk.finish.is_some() {
                s.unfinished = s.unfinished.saturating_sub(1);
                if s.unfinished == 0 {
                    s.stream = None;
                }
            }
            let Some(smp) = self.samples.get_mut(sample) else {
                continue;
            };
            smp.text.push_str(&chunk.text);
            smp.ids.extend_from_slice(&chunk.token_ids);
            smp.logprobs.extend(chunk.logprobs.iter().cloned());
            smp.prompt_logprobs
                .extend(chunk.prompt_logprobs.iter().cloned());
            smp.meta = chunk.meta.clone();
            if !chunk.embedding.is_empty() {
                smp.embedding = std::mem::take(&mut chunk.embedding);
            }
            if let Some(f) = &chunk.finish {
                smp.finish = Some(f.clone());
                if let Some(level) = self.state.opts.log_requests {
                    crate::request_log::finished(&smp.rid, level, f, &smp.meta, &smp.text);
                }
            }
            self.state.metrics.observe(&mut smp.timing, &chunk);
            return Some(Event { sample, chunk });
        }
    }

    fn close_slot(&mut self, slot: usize, msg: &str) {
        let s = &mut self.slots[slot];
        s.stream = None;
        let (a, b) = (s.first_sample, s.first_sample + self.n);
        for smp in self.samples.iter_mut().take(b).skip(a) {
            if smp.finish.is_none() {
                smp.finish = Some(Finish::aborted(AbortCause::Failed, msg));
            }
        }
    }

    /// Waits until every sample finished.
    pub async fn finish_all(&mut self) {
        while self.next().await.is_some() {}
    }

    /// For answers that are not streamed: the error to send instead of a
    /// result when the engine refused or failed a sample (an abort asked for
    /// by a client is a normal result with finish reason `abort`).
    pub fn failure(&self) -> Option<ApiError> {
        self.samples.iter().find_map(|s| {
            let f = s.finish.as_ref()?;
            if f.kind != FinishKind::Abort {
                return None;
            }
            let msg = f
                .message
                .clone()
                .unwrap_or_else(|| "the request was aborted".into());
            match f.cause {
                Some(AbortCause::Requested) => None,
                Some(AbortCause::RidInUse) => Some(ApiError::bad_param("rid", msg)),
                Some(AbortCause::QueueFull | AbortCause::ShuttingDown) => {
                    Some(ApiError::unavailable(msg))
                }
                Some(AbortCause::Failed) | None => Some(ApiError::internal(msg)),
            }
        })
    }

    /// Prompt tokens over all prompts (each counted once).
    pub fn prompt_tokens(&self) -> usize {
        self.prompt_lens.iter().sum()
    }

    /// Generated tokens over all samples.
    pub fn completion_tokens(&self) -> usize {
        self.samples.iter().map(|s| s.meta.completion_tokens).sum()
    }

    /// Cached prompt tokens over all prompts (from each prompt's first sample).
    pub fn cached_tokens(&self) -> usize {
        self.samples
            .iter()
            .step_by(self.n.max(1))
            .map(|s| s.meta.cached_tokens)
            .sum()
    }
}

/// OpenAI's `finish_reason` of a finish.
pub(crate) fn openai_finish_reason(f: &Finish) -> &'static str {
    match f.kind {
        FinishKind::Stop => "stop",
        FinishKind::Length => "length",
        FinishKind::Abort => "abort",
    }
}

/// SGLang's `matched_stop`: the stop token id or string.
pub(crate) fn matched_value(f: &Finish) -> serde_json::Value {
    match &f.matched {
        Some(Matched::Token(t)) => serde_json::json!(t),
        Some(Matched::Text(s) | Matched::Regex(s)) => serde_json::json!(s),
        None => serde_json::Value::Null,
    }
}
