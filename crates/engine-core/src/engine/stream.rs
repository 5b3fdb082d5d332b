//! The channel from the engine to a request's [`RequestStream`](super::RequestStream)
//! (the output thread sends into it: [`super::output`]).
//!
//! Unbounded and coalescing: a chunk sent while the previous one of the same
//! sample still waits unread (and has not finished) is merged into it (token
//! ids, text and logprobs appended, the newer meta and finish kept), so a
//! consumer that falls behind reads fewer, larger chunks carrying the same
//! tokens and text, and the sender neither allocates nor wakes anyone for
//! them. A consumer that keeps up sees one chunk per emit, as before.
//!
//! The receiver sees the end (`None`) once every sender is dropped and the
//! queue is empty; sending after the receiver is gone does nothing.
//!
//! Text is made on one side only. A request with stop strings is
//! detokenized by the scheduler (it must see the text to stop), and its
//! chunks carry text. Any other request's chunks carry token ids only and
//! [`StreamText`] detokenizes them on the reader's thread, as SGLang's
//! detokenizer process does: the scheduler thread does no tokenizer work for
//! it. The reader feeds the detokenizer the same ids one at a time, in the
//! same order, as the scheduler would have, so the text is identical.

use super::{Finish, OutputChunk, OutputMeta, TokenLogprob};
use crate::detok::{IncrementalDetokenizer, TokenDecoder};
use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::task::{Poll, Waker};

#[derive(Default)]
struct State {
    queue: VecDeque<Received>,
    /// The async receiver waiting for a chunk.
    waker: Option<Waker>,
    /// Threads blocked in [`ChunkReceiver::blocking_recv`].
    blocked: usize,
    senders: usize,
    receiver: bool,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    ready: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Every operation leaves the state consistent: a poisoned lock is usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wakes whoever waits (after a chunk was queued or the last sender left).
    fn notify(&self, mut s: MutexGuard<'_, State>) {
        let waker = s.waker.take();
        let blocked = s.blocked > 0;
        drop(s);
        if let Some(w) = waker {
            w.wake();
        }
        if blocked {
            self.ready.notify_all();
        }
    }
}

/// A new channel.
pub(crate) fn channel() -> (ChunkSender, ChunkReceiver) {
    let shared = Arc::new(Shared::default());
    {
        let mut s = shared.lock();
        s.senders = 1;
        s.receiver = true;
    }
    (
        ChunkSender {
            shared: shared.clone(),
        },
        ChunkReceiver { shared },
    )
}

/// The sending end (one per sample; clones share the channel), held by the
/// request, then by the output thread.
pub(crate) struct ChunkSender {
    shared: Arc<Shared>,
}

impl Clone for ChunkSender {
    fn clone(&self) -> Self {
        self.shared.lock().senders += 1;
        Self {
            shared: self.shared.clone(),
        }
    }
}

impl Drop for ChunkSender {
    fn drop(&mut self) {
        let mut s = self.shared.lock();
        s.senders -= 1;
        if s.senders == 0 {
            self.shared.notify(s);
        }
    }
}

/// The parts of one chunk; `logprobs` is drained (its buffer keeps its
/// capacity when the chunk merges into a queued one).
pub(crate) struct ChunkParts<'a> {
    pub index: u32,
    pub token_ids: &'a [u32],
    pub text: &'a str,
    pub logprobs: &'a mut Vec<TokenLogprob>,
    /// Drained like `logprobs`.
    pub prompt_logprobs: &'a mut Vec<TokenLogprob>,
    /// Drained like `logprobs`.
    pub embedding: &'a mut Vec<f32>,
    pub finish: Option<Finish>,
    pub meta: OutputMeta,
    /// The last token id has no text (a stop token, trimmed); set only on
    /// a finishing chunk, and read only for a request whose text the reader
    /// makes.
    pub untexted_last: bool,
}

/// A chunk as it was queued.
pub(crate) struct Received {
    pub chunk: OutputChunk,
    /// See [`ChunkParts::untexted_last`].
    pub untexted_last: bool,
}

impl ChunkSender {
    /// Queues a chunk, or merges it into the unread one before it.
    pub fn send(&self, p: ChunkParts<'_>) {
        let mut s = self.shared.lock();
        if !s.receiver {
            p.logprobs.clear();
            p.prompt_logprobs.clear();
            p.embedding.clear();
            return;
        }
        if let Some(last) = s.queue.back_mut()
            && last.chunk.index == p.index
            && last.chunk.finish.is_none()
        {
            let c = &mut last.chunk;
            c.token_ids.extend_from_slice(p.token_ids);
            if !p.text.is_empty() {
                c.text.push_str(p.text);
            }
            if !p.logprobs.is_empty() {
                c.logprobs.append(p.logprobs);
            }
            if !p.prompt_logprobs.is_empty() {
                c.prompt_logprobs.append(p.prompt_logprobs);
            }
            if !p.embedding.is_empty() {
                c.embedding = std::mem::take(p.embedding);
            }
            c.finish = p.finish;
            c.meta = p.meta;
            last.untexted_last = p.untexted_last;
            // Whoever waits was woken when `last` was queued.
            return;
        }
        s.queue.push_back(Received {
            chunk: OutputChunk {
                index: p.index,
                token_ids: p.token_ids.to_vec(),
                text: p.text.to_string(),
                logprobs: std::mem::take(p.logprobs),
                prompt_logprobs: std::mem::take(p.prompt_logprobs),
                embedding: std::mem::take(p.embedding),
                finish: p.finish,
                meta: p.meta,
            },
            untexted_last: p.untexted_last,
        });
        self.shared.notify(s);
    }
}

/// The stream's end.
pub(crate) struct ChunkReceiver {
    shared: Arc<Shared>,
}

impl Drop for ChunkReceiver {
    fn drop(&mut self) {
        let mut s = self.shared.lock();
        s.receiver = false;
        s.queue.clear();
    }
}

impl ChunkReceiver {
    /// The next chunk, waiting for it; `None` once every sender is gone.
    pub fn blocking_recv(&mut self) -> Option<Received> {
        let mut s = self.shared.lock();
        loop {
            if let Some(c) = s.queue.pop_front() {
                return Some(c);
            }
            if s.senders == 0 {
                return None;
            }
            s.blocked += 1;
            s = self.shared.ready.wait(s).unwrap_or_else(|e| e.into_inner());
            s.blocked -= 1;
        }
    }

    /// The next chunk; `None` once every sender is gone.
    pub async fn recv(&mut self) -> Option<Received> {
        std::future::poll_fn(|cx| {
            let mut s = self.shared.lock();
            if let Some(c) = s.queue.pop_front() {
                return Poll::Ready(Some(c));
            }
            if s.senders == 0 {
                return Poll::Ready(None);
            }
            match &s.waker {
                Some(w) if w.will_wake(cx.waker()) => {}
                _ => s.waker = Some(cx.waker().clone()),
            }
            Poll::Pending
        })
        .await
    }
}

/// Whether the scheduler detokenizes a request (it must see the text of
/// one with stop strings); otherwise the reader does ([`StreamText`]).
pub(crate) fn scheduler_makes_text(params: &crate::sampling::SamplingParams) -> bool {
    !params.stop.is_empty() || !params.stop_regex.is_empty()
}

/// The reader's detokenizer, for the requests whose chunks carry ids only:
/// one [`IncrementalDetokenizer`] per sample, started, like the scheduler's,
/// after the prompt's last tokens.
pub(crate) struct StreamText {
    decoder: Arc<dyn TokenDecoder>,
    context: Vec<u32>,
    skip_special_tokens: bool,
    samples: Vec<SampleText>,
}

#[derive(Default)]
struct SampleText {
    detok: Option<IncrementalDetokenizer>,
    /// Detokenizing failed: the sample was ended with an abort chunk.
    failed: bool,
}

impl StreamText {
    /// Tokens of the prompt's end decoded for spacing (never emitted).
    const CONTEXT: usize = 5;

    pub fn new(decoder: Arc<dyn TokenDecoder>, prompt: &[u32], skip_special_tokens: bool) -> Self {
        Self {
            decoder,
            context: prompt[prompt.len().saturating_sub(Self::CONTEXT)..].to_vec(),
            skip_special_tokens,
            samples: Vec::new(),
        }
    }

    /// The chunk with its text.
    pub fn text_of(&mut self, r: Received) -> Decoded {
        let Received {
            mut chunk,
            untexted_last,
        } = r;
        let i = chunk.index as usize;
        if self.samples.len() <= i {
            self.samples.resize_with(i + 1, SampleText::default);
        }
        let sample = &mut self.samples[i];
        if sample.failed {
            return Decoded::Skip;
        }
        let (context, skip) = (&self.context, self.skip_special_tokens);
        let detok = sample
            .detok
            .get_or_insert_with(|| IncrementalDetokenizer::new(context, skip));
        let texted =
            chunk.token_ids.len() - usize::from(untexted_last && !chunk.token_ids.is_empty());
        let mut text = std::mem::take(&mut chunk.text);
        for &id in &chunk.token_ids[..texted] {
            match detok.push_str(&*self.decoder, &[id]) {
                Ok(delta) => text.push_str(delta),
                Err(e) => {
                    sample.failed = true;
                    chunk.text = text;
                    chunk.finish = Some(Finish::aborted(
                        super::AbortCause::Failed,
                        format!("detokenizing the output failed: {e}"),
                    ));
                    return Decoded::Failed(chunk);
                }
            }
        }
        if chunk.finish.is_some()
            && let Ok(rest) = detok.flush(&*self.decoder)
        {
            text.push_str(&rest);
        }
        chunk.text = text;
        Decoded::Chunk(chunk)
    }
}

/// What [`StreamText::text_of`] made of a chunk.
pub(crate) enum Decoded {
    Chunk(OutputChunk),
    /// The sample's tokens could not be decoded: this chunk ends it with an
    /// abort (the request should be aborted).
    Failed(OutputChunk),
    /// A chunk of a sample that already failed.
    Skip,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn send(tx: &ChunkSender, index: u32, ids: &[u32], text: &str, finish: bool) {
        tx.send(ChunkParts {
            index,
            token_ids: ids,
            text,
            logprobs: &mut Vec::new(),
            prompt_logprobs: &mut Vec::new(),
            embedding: &mut Vec::new(),
            finish: finish.then_some(Finish {
                kind: super::super::FinishKind::Length,
                matched: None,
                message: None,
                cause: None,
            }),
            meta: OutputMeta::default(),
            untexted_last: false,
        });
    }

    #[test]
    fn merges_unread_chunks_of_one_sample() {
        let (tx, mut rx) = channel();
        let tx2 = tx.clone();
        send(&tx, 0, &[1], "a", false);
        send(&tx, 0, &[2, 3], "bc", false);
        send(&tx2, 1, &[9], "z", false);
        send(&tx, 0, &[4], "d", true);
        send(&tx, 0, &[5], "e", false);
        let c = rx.blocking_recv().unwrap().chunk;
        assert_eq!(
            (c.index, c.token_ids, c.text.as_str()),
            (0, vec![1, 2, 3], "abc")
        );
        let c = rx.blocking_recv().unwrap().chunk;
        assert_eq!((c.index, c.token_ids, c.text.as_str()), (1, vec![9], "z"));
        let c = rx.blocking_recv().unwrap().chunk;
        assert_eq!((c.token_ids, c.finish.is_some()), (vec![4], true));
        // Nothing merges into a finished chunk.
        send(&tx, 0, &[6], "f", false);
        assert_eq!(rx.blocking_recv().unwrap().chunk.token_ids, vec![5, 6]);
        drop((tx, tx2));
        assert!(rx.blocking_recv().is_none());
    }

    #[test]
    fn blocked_receiver_wakes() {
        let (tx, mut rx) = channel();
        let t = std::thread::spawn(move || {
            let mut got = Vec::new();
            while let Some(c) = rx.blocking_recv() {
                got.extend(c.chunk.token_ids);
            }
            got
        });
        for i in 0..100 {
            send(&tx, 0, &[i], "x", false);
        }
        drop(tx);
        assert_eq!(t.join().unwrap(), (0..100).collect::<Vec<u32>>());
    }
}
