//! The channel from the scheduler to a request's [`RequestStream`](super::RequestStream).
//!
//! Unbounded and coalescing: a chunk sent while the previous one of the same
//! sample still waits unread (and has not finished) is merged into it (token
//! ids, text and logprobs appended, the newer meta and finish kept), so a
//! consumer that falls behind reads fewer, larger chunks carrying the same
//! tokens and text, and the scheduler neither allocates nor wakes anyone for
//! them. A consumer that keeps up sees one chunk per emit, as before.
//!
//! The receiver sees the end (`None`) once every sender is dropped and the
//! queue is empty; sending after the receiver is gone does nothing.

use super::{Finish, OutputChunk, OutputMeta, TokenLogprob};
use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::task::{Poll, Waker};

#[derive(Default)]
struct State {
    queue: VecDeque<OutputChunk>,
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

/// The scheduler's end (one per sample; clones share the channel).
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

/// The parts of one chunk; `token_ids` and `logprobs` are drained (their
/// buffers keep their capacity when the chunk merges into a queued one).
pub(crate) struct ChunkParts<'a> {
    pub index: u32,
    pub token_ids: &'a mut Vec<u32>,
    pub text: &'a str,
    pub logprobs: &'a mut Vec<TokenLogprob>,
    pub finish: Option<Finish>,
    pub meta: OutputMeta,
}

impl ChunkSender {
    /// Queues a chunk, or merges it into the unread one before it.
    pub fn send(&self, p: ChunkParts<'_>) {
        let mut s = self.shared.lock();
        if !s.receiver {
            p.token_ids.clear();
            p.logprobs.clear();
            return;
        }
        if let Some(last) = s.queue.back_mut()
            && last.index == p.index
            && last.finish.is_none()
        {
            last.token_ids.append(p.token_ids);
            last.text.push_str(p.text);
            last.logprobs.append(p.logprobs);
            last.finish = p.finish;
            last.meta = p.meta;
            // Whoever waits was woken when `last` was queued.
            return;
        }
        s.queue.push_back(OutputChunk {
            index: p.index,
            token_ids: std::mem::take(p.token_ids),
            text: p.text.to_string(),
            logprobs: std::mem::take(p.logprobs),
            finish: p.finish,
            meta: p.meta,
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
    pub fn blocking_recv(&mut self) -> Option<OutputChunk> {
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
    pub async fn recv(&mut self) -> Option<OutputChunk> {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn send(tx: &ChunkSender, index: u32, ids: &[u32], text: &str, finish: bool) {
        let mut ids = ids.to_vec();
        tx.send(ChunkParts {
            index,
            token_ids: &mut ids,
            text,
            logprobs: &mut Vec::new(),
            finish: finish.then_some(Finish {
                kind: super::super::FinishKind::Length,
                matched: None,
                message: None,
            }),
            meta: OutputMeta::default(),
        });
        assert!(ids.is_empty());
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
        let c = rx.blocking_recv().unwrap();
        assert_eq!(
            (c.index, c.token_ids, c.text.as_str()),
            (0, vec![1, 2, 3], "abc")
        );
        let c = rx.blocking_recv().unwrap();
        assert_eq!((c.index, c.token_ids, c.text.as_str()), (1, vec![9], "z"));
        let c = rx.blocking_recv().unwrap();
        assert_eq!((c.token_ids, c.finish.is_some()), (vec![4], true));
        // Nothing merges into a finished chunk.
        send(&tx, 0, &[6], "f", false);
        assert_eq!(rx.blocking_recv().unwrap().token_ids, vec![5, 6]);
        drop((tx, tx2));
        assert!(rx.blocking_recv().is_none());
    }

    #[test]
    fn blocked_receiver_wakes() {
        let (tx, mut rx) = channel();
        let t = std::thread::spawn(move || {
            let mut got = Vec::new();
            while let Some(c) = rx.blocking_recv() {
                got.extend(c.token_ids);
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
