//! A small fork-join thread pool tuned for many short parallel regions.
//!
//! A decode step runs a few hundred operations of tens of microseconds each,
//! so the cost of waking workers matters more than anything else: workers
//! spin (yielding) on an epoch counter for a short while after each job and
//! only then sleep on a condition variable.
//!
//! [`ThreadPool::run`] splits a job into `chunks` pieces handed out through an
//! atomic counter, so a worker that the OS has descheduled (shared, noisy
//! machines) never stalls the job: the caller and the awake workers take its
//! pieces. A worker that arrives after the caller closed the job backs off
//! without touching it.
//!
//! Invariants: one job at a time (callers are serialized by `submit`); the job
//! pointer is dereferenced only by workers registered in `active` before the
//! job is closed, and `run` returns only when `active` is back to zero, so the
//! borrowed closure outlives every use; a panicking piece is caught on its
//! thread and reported, never unwinding across threads.

use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

type Job = dyn Fn(usize, usize) + Sync;

/// How long an idle worker stays awake before it sleeps.
const SPIN: Duration = Duration::from_micros(300);
/// Pieces per thread: enough slack to rebalance around a late thread.
const CHUNKS_PER_THREAD: usize = 4;

struct JobSlot(std::cell::UnsafeCell<Option<(*const Job, usize)>>);
// SAFETY: written by the submitting thread only while no worker is active
// (`active == 0` and the job closed), read by workers only between
// registering in `active` and seeing the job open.
unsafe impl Sync for JobSlot {}
unsafe impl Send for JobSlot {}

struct Shared {
    epoch: AtomicUsize,
    next_chunk: AtomicUsize,
    done_chunks: AtomicUsize,
    active: AtomicUsize,
    closed: AtomicBool,
    panicked: AtomicBool,
    shutdown: AtomicBool,
    job: JobSlot,
    sleepers: Mutex<usize>,
    wake: Condvar,
    threads: usize,
}

/// A fork-join pool of `threads` threads (the caller counts as one).
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    submit: Mutex<()>,
}

thread_local! {
    static IN_POOL: Cell<bool> = const { Cell::new(false) };
}

/// Runs pieces of the current job until none is left.
fn drain(s: &Shared, f: &(dyn Fn(usize, usize) + Sync + '_), chunks: usize) {
    loop {
        let c = s.next_chunk.fetch_add(1, SeqCst);
        if c >= chunks {
            return;
        }
        if catch_unwind(AssertUnwindSafe(|| f(c, chunks))).is_err() {
            s.panicked.store(true, SeqCst);
        }
        s.done_chunks.fetch_add(1, SeqCst);
    }
}

fn backoff(spins: &mut u32) {
    *spins += 1;
    if *spins < 200 {
        std::hint::spin_loop();
    } else {
        std::thread::yield_now();
    }
}

impl ThreadPool {
    /// Starts `threads - 1` workers (at least one thread in all).
    pub fn new(threads: usize) -> std::io::Result<Self> {
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            epoch: AtomicUsize::new(0),
            next_chunk: AtomicUsize::new(0),
            done_chunks: AtomicUsize::new(0),
            active: AtomicUsize::new(0),
            closed: AtomicBool::new(true),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            job: JobSlot(std::cell::UnsafeCell::new(None)),
            sleepers: Mutex::new(0),
            wake: Condvar::new(),
            threads,
        });
        let mut workers = Vec::with_capacity(threads - 1);
        for tid in 1..threads {
            let s = shared.clone();
            workers.push(
                std::thread::Builder::new()
                    .name(format!("arbor-cpu-{tid}"))
                    .spawn(move || worker(s))?,
            );
        }
        Ok(Self {
            shared,
            workers,
            submit: Mutex::new(()),
        })
    }

    /// Threads that run each job.
    pub fn threads(&self) -> usize {
        self.shared.threads
    }

    /// Calls `f(i, n)` exactly once for every piece `i` in `0..n`, spread over the
    /// pool's threads, and returns when all are done. `n` is chosen by the pool.
    /// Returns false if any piece panicked.
    pub fn run<'a>(&self, f: &'a (dyn Fn(usize, usize) + Sync + 'a)) -> bool {
        let threads = self.shared.threads;
        if threads == 1 || IN_POOL.with(|c| c.get()) {
            // Single thread, or a nested call from inside a job: run inline.
            return catch_unwind(AssertUnwindSafe(|| f(0, 1))).is_ok();
        }
        let chunks = threads * CHUNKS_PER_THREAD;
        let _guard = self.submit.lock().unwrap_or_else(|e| e.into_inner());
        let s = &*self.shared;
        // SAFETY: erase the closure's lifetime; see the module invariants.
        let ptr: *const Job = unsafe {
            std::mem::transmute::<*const (dyn Fn(usize, usize) + Sync + 'a), *const Job>(f)
        };
        // SAFETY: the previous job is closed and no worker is active.
        unsafe { *s.job.0.get() = Some((ptr, chunks)) };
        s.panicked.store(false, SeqCst);
        s.next_chunk.store(0, SeqCst);
        s.done_chunks.store(0, SeqCst);
        s.closed.store(false, SeqCst);
        s.epoch.fetch_add(1, SeqCst);
        {
            let sleepers = s.sleepers.lock().unwrap_or_else(|e| e.into_inner());
            if *sleepers > 0 {
                s.wake.notify_all();
            }
        }
        IN_POOL.with(|c| c.set(true));
        drain(s, f, chunks);
        IN_POOL.with(|c| c.set(false));
        // Pieces taken by other threads may still run: wait for them.
        let mut spins = 0;
        while s.done_chunks.load(SeqCst) < chunks {
            backoff(&mut spins);
        }
        // Close the job; wait for workers that registered before it closed.
        s.closed.store(true, SeqCst);
        let mut spins = 0;
        while s.active.load(SeqCst) != 0 {
            backoff(&mut spins);
        }
        // SAFETY: closed and no worker active: nobody reads the slot now.
        unsafe { *s.job.0.get() = None };
        !s.panicked.load(SeqCst)
    }
}

fn worker(s: Arc<Shared>) {
    IN_POOL.with(|c| c.set(true));
    let mut seen = 0usize;
    loop {
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            if s.shutdown.load(SeqCst) {
                return;
            }
            let e = s.epoch.load(SeqCst);
            if e != seen {
                seen = e;
                break;
            }
            if spins % 64 == 63 && start.elapsed() > SPIN {
                let mut sleepers = s.sleepers.lock().unwrap_or_else(|e| e.into_inner());
                *sleepers += 1;
                while s.epoch.load(SeqCst) == seen && !s.shutdown.load(SeqCst) {
                    sleepers = s.wake.wait(sleepers).unwrap_or_else(|e| e.into_inner());
                }
                *sleepers -= 1;
            } else {
                backoff(&mut spins);
            }
        }
        s.active.fetch_add(1, SeqCst);
        if !s.closed.load(SeqCst) {
            // SAFETY: registered in `active` while the job is open: the slot
            // holds the current job and its closure is alive until we leave.
            if let Some((job, chunks)) = unsafe { *s.job.0.get() } {
                // SAFETY: as above.
                drain(&s, unsafe { &*job }, chunks);
            }
        }
        s.active.fetch_sub(1, SeqCst);
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, SeqCst);
        {
            let _g = self
                .shared
                .sleepers
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// The `[start, end)` share of `n` items for piece `t` of `pieces`, in units of `align`.
pub fn share(n: usize, t: usize, pieces: usize, align: usize) -> (usize, usize) {
    let align = align.max(1);
    let units = n.div_ceil(align);
    let per = units / pieces;
    let extra = units % pieces;
    let u0 = t * per + t.min(extra);
    let u1 = u0 + per + usize::from(t < extra);
    ((u0 * align).min(n), (u1 * align).min(n))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    #[test]
    fn every_piece_runs_once() {
        let pool = ThreadPool::new(3).unwrap();
        let total = AtomicU64::new(0);
        for _ in 0..2000 {
            assert!(pool.run(&|i, n| {
                assert_eq!(n, 12);
                total.fetch_add(i as u64 + 1, SeqCst);
            }));
        }
        assert_eq!(total.load(SeqCst), 2000 * 78);
        std::thread::sleep(Duration::from_millis(5));
        // After workers fall asleep, jobs still run.
        assert!(pool.run(&|_, _| {
            total.fetch_add(1, SeqCst);
        }));
        assert_eq!(total.load(SeqCst), 2000 * 78 + 12);
    }

    #[test]
    fn panics_are_reported() {
        let pool = ThreadPool::new(2).unwrap();
        assert!(!pool.run(&|i, _| {
            if i == 1 {
                panic!("boom")
            }
        }));
        assert!(pool.run(&|_, _| {}));
    }

    #[test]
    fn shares_cover_range() {
        for n in [0, 1, 7, 100, 1001] {
            for pieces in 1..9 {
                let mut covered = 0;
                for t in 0..pieces {
                    let (a, b) = share(n, t, pieces, 16);
                    assert_eq!(a, covered);
                    covered = b;
                }
                assert_eq!(covered, n);
            }
        }
    }
}
