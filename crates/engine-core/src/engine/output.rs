//! The output thread: delivers the scheduler's chunks to the request streams.
//!
//! The scheduler does not lock each request's channel itself. During an
//! iteration it fills one [`OutputBatch`]: a compact record per request with
//! something new (ranges of one flat token buffer and one text buffer, the
//! figures that change every step; boxed, and only when present: logprobs,
//! the finish, and the figures of its meta that seldom change, sent when
//! they do). At the end it hands the batch over with one channel send, as SGLang's scheduler
//! hands a step's token ids to its detokenizer in one message. This thread
//! then merges each record into its request's channel (lock, coalesce, wake
//! the reader), so that cost leaves the scheduler's iteration and overlaps
//! the next forward. Emptied batches come back for reuse: neither side
//! allocates per request per step.
//!
//! Invariants:
//! - a request's records reach its channel in the order the scheduler made
//!   them (one FIFO, one delivering thread);
//! - a request's [`ChunkSender`] moves to this thread with its first record
//!   and is dropped here right after its final record is delivered, so the
//!   stream ends only after every chunk of it arrived;
//! - a request dropped without a final record (an internal path that never
//!   emits one) closes its route when its [`StreamHandle`] drops: the close
//!   travels with the next batch, after that request's last records, and
//!   its stream ends as it did when the scheduler held the sender.

use super::stream::{ChunkParts, ChunkSender};
use super::{Finish, OutputMeta, TokenLogprob};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::mpsc::{self, Receiver, Sender};
use std::thread::JoinHandle;

/// A request's end of its stream, as the scheduler holds it.
pub(crate) struct StreamHandle {
    state: HandleState,
}

enum HandleState {
    /// The scheduler still holds the sender (nothing emitted yet).
    Local(ChunkSender),
    /// The sender lives on the output thread under `id`, which knows the
    /// figures in `sent`; `close` tells the scheduler's route when this
    /// handle drops before a final record.
    Routed {
        id: u64,
        sent: StaticMeta,
        close: Sender<u64>,
    },
    /// The final record was made: nothing more is sent.
    Closed,
}

impl StreamHandle {
    pub fn new(sender: ChunkSender) -> Self {
        Self {
            state: HandleState::Local(sender),
        }
    }

    /// A handle on the same channel (another sample of one request); `None`
    /// once this handle has handed its sender to the output thread.
    pub fn try_clone(&self) -> Option<Self> {
        match &self.state {
            HandleState::Local(s) => Some(Self::new(s.clone())),
            _ => None,
        }
    }
}

impl Drop for StreamHandle {
    fn drop(&mut self) {
        if let HandleState::Routed { id, close, .. } = &self.state {
            let _ = close.send(*id);
        }
    }
}

/// The figures of an [`OutputMeta`] that seldom change (sent when they do).
#[derive(Clone, Copy, Debug, PartialEq)]
struct StaticMeta {
    prompt_tokens: usize,
    cached_tokens: usize,
    cached_tokens_host: usize,
    cached_tokens_storage: usize,
    retractions: u32,
    queue_time: f64,
    ttft: Option<f64>,
}

impl StaticMeta {
    fn of(m: &OutputMeta) -> Self {
        Self {
            prompt_tokens: m.prompt_tokens,
            cached_tokens: m.cached_tokens,
            cached_tokens_host: m.cached_tokens_host,
            cached_tokens_storage: m.cached_tokens_storage,
            retractions: m.retractions,
            queue_time: m.queue_time,
            ttft: m.ttft,
        }
    }

    fn apply(&self, m: &mut OutputMeta) {
        m.prompt_tokens = self.prompt_tokens;
        m.cached_tokens = self.cached_tokens;
        m.cached_tokens_host = self.cached_tokens_host;
        m.cached_tokens_storage = self.cached_tokens_storage;
        m.retractions = self.retractions;
        m.queue_time = self.queue_time;
        m.ttft = self.ttft;
    }
}

/// One request's new output: what changes every step inline (a cache line),
/// the rest boxed when there is any.
struct Record {
    id: u64,
    elapsed: f64,
    /// Ranges of [`OutputBatch::tokens`] and [`OutputBatch::text`].
    tokens: Range<u32>,
    text: Range<u32>,
    completion_tokens: u32,
    spec_verify_ct: u32,
    spec_accepted_tokens: u32,
    untexted_last: bool,
    more: Option<Box<More>>,
}

/// The parts of a [`Record`] that only some chunks have.
#[derive(Default)]
struct More {
    /// The request's first record: its sender and sample index.
    sender: Option<(ChunkSender, u32)>,
    /// The seldom-changing figures, when they changed (always on the first).
    meta: Option<StaticMeta>,
    logprobs: Vec<TokenLogprob>,
    prompt_logprobs: Vec<TokenLogprob>,
    embedding: Vec<f32>,
    finish: Option<Finish>,
}

/// What the output thread receives.
enum Delivery {
    Batch(OutputBatch),
    /// The scheduler is gone: deliver nothing more.
    Shutdown,
}

/// One turn's output, in the order it was made.
#[derive(Default)]
struct OutputBatch {
    records: Vec<Record>,
    tokens: Vec<u32>,
    text: String,
    /// Routed requests that went away without a final record, closed after
    /// the records.
    closed: Vec<u64>,
}

impl OutputBatch {
    /// An empty batch with room for what `self` holds.
    fn empty_like(&self) -> Self {
        Self {
            records: Vec::with_capacity(self.records.len()),
            tokens: Vec::with_capacity(self.tokens.len()),
            text: String::with_capacity(self.text.len()),
            closed: Vec::new(),
        }
    }
}

/// The parts of one chunk, as a request makes it (see [`ChunkParts`]).
pub(crate) struct ChunkOut<'a> {
    pub index: u32,
    /// Drained (keeps its capacity).
    pub token_ids: &'a mut Vec<u32>,
    pub text: &'a str,
    /// Taken when not empty.
    pub logprobs: &'a mut Vec<TokenLogprob>,
    /// Taken when not empty.
    pub prompt_logprobs: &'a mut Vec<TokenLogprob>,
    /// Taken on the last chunk.
    pub embedding: &'a mut Vec<f32>,
    pub finish: Option<Finish>,
    pub meta: OutputMeta,
    pub untexted_last: bool,
}

/// The scheduler's side: the batch being filled and the thread it goes to.
pub(crate) struct OutputRoute {
    batch: OutputBatch,
    tx: Sender<Delivery>,
    /// Emptied batches coming back.
    recycled: Receiver<OutputBatch>,
    /// Ids of routed handles dropped without a final record.
    closed_tx: Sender<u64>,
    closed: Receiver<u64>,
    next_id: u64,
    thread: Option<JoinHandle<()>>,
}

impl OutputRoute {
    /// Starts the output thread.
    pub fn start() -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel();
        let (back_tx, recycled) = mpsc::channel();
        let (closed_tx, closed) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("arbor-output".into())
            .spawn(move || deliver_loop(rx, back_tx))?;
        Ok(Self {
            batch: OutputBatch::default(),
            tx,
            recycled,
            closed_tx,
            closed,
            next_id: 0,
            thread: Some(thread),
        })
    }

    /// Adds a chunk of the request behind `handle` to this turn's batch
    /// (nothing once its final chunk was made).
    #[inline]
    pub fn push(&mut self, handle: &mut StreamHandle, c: ChunkOut<'_>) {
        let last = c.finish.is_some();
        let figures = StaticMeta::of(&c.meta);
        let mut more = None;
        if matches!(handle.state, HandleState::Local(_)) {
            let id = self.next_id;
            self.next_id += 1;
            let routed = HandleState::Routed {
                id,
                sent: figures,
                close: self.closed_tx.clone(),
            };
            if let HandleState::Local(sender) = std::mem::replace(&mut handle.state, routed) {
                more = Some(Box::new(More {
                    sender: Some((sender, c.index)),
                    meta: Some(figures),
                    ..More::default()
                }));
            }
        }
        let id = match &mut handle.state {
            HandleState::Routed { id, sent, .. } => {
                if *sent != figures {
                    *sent = figures;
                    more.get_or_insert_default().meta = Some(figures);
                }
                *id
            }
            _ => {
                c.token_ids.clear();
                c.logprobs.clear();
                c.prompt_logprobs.clear();
                c.embedding.clear();
                return;
            }
        };
        if last {
            // Dropped without a close: the final record ends the route.
            handle.state = HandleState::Closed;
        }
        if last || !c.logprobs.is_empty() || !c.prompt_logprobs.is_empty() {
            let m = more.get_or_insert_default();
            m.finish = c.finish;
            m.logprobs = std::mem::take(c.logprobs);
            m.prompt_logprobs = std::mem::take(c.prompt_logprobs);
            m.embedding = std::mem::take(c.embedding);
        }
        let b = &mut self.batch;
        let (t0, x0) = (b.tokens.len() as u32, b.text.len() as u32);
        // A decode step's one token is pushed (cheaper than an append).
        match c.token_ids.as_slice() {
            &[t] => {
                b.tokens.push(t);
                c.token_ids.clear();
            }
            _ => b.tokens.append(c.token_ids),
        }
        if !c.text.is_empty() {
            b.text.push_str(c.text);
        }
        b.records.push(Record {
            id,
            elapsed: c.meta.elapsed,
            tokens: t0..b.tokens.len() as u32,
            text: x0..b.text.len() as u32,
            completion_tokens: c.meta.completion_tokens as u32,
            spec_verify_ct: c.meta.spec_verify_ct,
            spec_accepted_tokens: c.meta.spec_accepted_tokens,
            untexted_last: c.untexted_last,
            more,
        });
    }

    /// Hands the batch to the output thread (one send; nothing when empty).
    pub fn flush(&mut self) {
        self.batch.closed.extend(self.closed.try_iter());
        if self.batch.records.is_empty() && self.batch.closed.is_empty() {
            return;
        }
        // A new batch (when none came back yet) starts as large as this one,
        // so it does not grow record by record.
        let next = self
            .recycled
            .try_recv()
            .unwrap_or_else(|_| self.batch.empty_like());
        let full = std::mem::replace(&mut self.batch, next);
        if let Err(mpsc::SendError(Delivery::Batch(b))) = self.tx.send(Delivery::Batch(full)) {
            // The thread is gone (it panicked): its senders went with it,
            // so those streams have ended; new ones are delivered here.
            deliver(b, &mut HashMap::new());
        }
    }
}

impl Drop for OutputRoute {
    fn drop(&mut self) {
        self.flush();
        let _ = self.tx.send(Delivery::Shutdown);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn deliver_loop(rx: Receiver<Delivery>, back: Sender<OutputBatch>) {
    let mut streams: HashMap<u64, Stream> = HashMap::new();
    while let Ok(Delivery::Batch(b)) = rx.recv() {
        let _ = back.send(deliver(b, &mut streams));
    }
}

/// A routed request's stream, as the output thread knows it.
struct Stream {
    sender: ChunkSender,
    index: u32,
    meta: OutputMeta,
}

/// Delivers a batch's records, then its closes; returns it emptied for reuse.
fn deliver(mut b: OutputBatch, streams: &mut HashMap<u64, Stream>) -> OutputBatch {
    for r in b.records.drain(..) {
        let mut more = r.more.map(|m| *m).unwrap_or_default();
        if let Some((sender, index)) = more.sender.take() {
            let meta = OutputMeta::default();
            streams.insert(
                r.id,
                Stream {
                    sender,
                    index,
                    meta,
                },
            );
        }
        let last = more.finish.is_some();
        if let Some(s) = streams.get_mut(&r.id) {
            if let Some(m) = &more.meta {
                m.apply(&mut s.meta);
            }
            s.meta.elapsed = r.elapsed;
            s.meta.completion_tokens = r.completion_tokens as usize;
            s.meta.spec_verify_ct = r.spec_verify_ct;
            s.meta.spec_accepted_tokens = r.spec_accepted_tokens;
            s.sender.send(ChunkParts {
                index: s.index,
                token_ids: &b.tokens[r.tokens.start as usize..r.tokens.end as usize],
                text: &b.text[r.text.start as usize..r.text.end as usize],
                logprobs: &mut more.logprobs,
                prompt_logprobs: &mut more.prompt_logprobs,
                embedding: &mut more.embedding,
                finish: more.finish,
                meta: s.meta.clone(),
                untexted_last: r.untexted_last,
            });
        }
        if last {
            streams.remove(&r.id);
        }
    }
    for id in b.closed.drain(..) {
        streams.remove(&id);
    }
    b.tokens.clear();
    b.text.clear();
    b
}

#[cfg(test)]
mod tests {
    use super::super::FinishKind;
    use super::super::stream::{ChunkReceiver, channel};
    use super::*;

    fn meta(completion_tokens: usize, retractions: u32) -> OutputMeta {
        OutputMeta {
            prompt_tokens: 7,
            completion_tokens,
            retractions,
            elapsed: completion_tokens as f64,
            ..OutputMeta::default()
        }
    }

    fn push(
        route: &mut OutputRoute,
        h: &mut StreamHandle,
        index: u32,
        ids: &[u32],
        m: OutputMeta,
        last: bool,
    ) {
        let mut ids = ids.to_vec();
        route.push(
            h,
            ChunkOut {
                index,
                token_ids: &mut ids,
                text: "",
                logprobs: &mut Vec::new(),
                prompt_logprobs: &mut Vec::new(),
                embedding: &mut Vec::new(),
                finish: last.then_some(Finish {
                    kind: FinishKind::Length,
                    matched: None,
                    message: None,
                    cause: None,
                }),
                meta: m,
                untexted_last: false,
            },
        );
        assert!(ids.is_empty(), "the ids are drained into the batch");
    }

    /// Every chunk of the stream until it ends, merged per sample index.
    fn drain(mut rx: ChunkReceiver) -> Vec<(u32, Vec<u32>, bool, OutputMeta)> {
        let mut got: Vec<(u32, Vec<u32>, bool, OutputMeta)> = Vec::new();
        while let Some(r) = rx.blocking_recv() {
            let c = r.chunk;
            match got.iter_mut().find(|g| g.0 == c.index && !g.2) {
                Some(g) => {
                    g.1.extend(c.token_ids);
                    g.2 = c.finish.is_some();
                    g.3 = c.meta;
                }
                None => got.push((c.index, c.token_ids, c.finish.is_some(), c.meta)),
            }
        }
        got
    }

    #[test]
    fn chunks_arrive_in_order_with_their_figures_and_the_stream_ends_after_the_last() {
        let mut route = OutputRoute::start().unwrap();
        let (tx, rx) = channel();
        let mut a = StreamHandle::new(tx);
        let mut b = a.try_clone().expect("not routed yet");
        for step in 1..=40u32 {
            push(
                &mut route,
                &mut a,
                0,
                &[step],
                meta(step as usize, 0),
                false,
            );
            // Sample 1 is retracted once: the changed figure travels.
            let r = u32::from(step > 20);
            push(
                &mut route,
                &mut b,
                1,
                &[100 + step],
                meta(step as usize, r),
                step == 30,
            );
            if step % 3 == 0 {
                route.flush();
            }
        }
        assert!(a.try_clone().is_none(), "a routed handle is not copied");
        // Nothing after the final chunk.
        push(&mut route, &mut b, 1, &[999], meta(31, 1), false);
        push(&mut route, &mut a, 0, &[41], meta(41, 0), true);
        route.flush();
        drop((a, b));
        let got = drain(rx);
        assert_eq!(got.len(), 2);
        let s0 = got.iter().find(|g| g.0 == 0).unwrap();
        let s1 = got.iter().find(|g| g.0 == 1).unwrap();
        assert_eq!(s0.1, (1..=41).collect::<Vec<u32>>());
        assert_eq!(s1.1, (101..=130).collect::<Vec<u32>>());
        assert!(s0.2 && s1.2);
        assert_eq!(s0.3, meta(41, 0));
        assert_eq!(s1.3, meta(30, 1));
    }

    #[test]
    fn a_handle_dropped_without_a_final_chunk_ends_the_stream_after_its_chunks() {
        let mut route = OutputRoute::start().unwrap();
        let (tx, rx) = channel();
        let mut h = StreamHandle::new(tx);
        push(&mut route, &mut h, 0, &[1, 2], meta(2, 0), false);
        route.flush();
        push(&mut route, &mut h, 0, &[3], meta(3, 0), false);
        // Dropped before the batch holding its last chunk is flushed.
        drop(h);
        route.flush();
        let got = drain(rx);
        assert_eq!(got.len(), 1);
        assert_eq!((got[0].1.clone(), got[0].2), (vec![1, 2, 3], false));
    }

    #[test]
    fn dropping_the_route_delivers_what_was_pushed() {
        let mut route = OutputRoute::start().unwrap();
        let (tx, rx) = channel();
        let mut h = StreamHandle::new(tx);
        push(&mut route, &mut h, 0, &[5], meta(1, 0), false);
        push(&mut route, &mut h, 0, &[6], meta(2, 0), true);
        drop(route);
        drop(h);
        let got = drain(rx);
        assert_eq!((got[0].1.clone(), got[0].2), (vec![5, 6], true));
    }
}
