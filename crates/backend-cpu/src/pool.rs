//! A small fork-join thread pool tuned for many short parallel regions.
//!
//! A decode step runs a few hundred operations of tens of microseconds each,
//! so the cost of waking workers matters more than anything else: workers
//! spin on an epoch counter for a short while after each job and only then
//! sleep on a condition variable. [`ThreadPool::run`] executes one closure on
//! every thread (the caller is thread 0) and returns when all are done.
//!
//! Invariants: one job at a time (callers are serialized by `submit`); the job
//! pointer is only dereferenced between its publication and the completion
//! count reaching zero, while `run` still borrows the closure; a panicking job
//! is caught on its thread and reported as an error, never unwinding across
//! threads.

use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

type Job = dyn Fn(usize, usize) + Sync;

/// How long an idle worker spins before it sleeps.
const SPIN: Duration = Duration::from_micros(200);

struct JobSlot(std::cell::UnsafeCell<Option<*const Job>>);
// SAFETY: the slot is written only by the submitting thread while every worker
// waits for the next epoch, and read by workers only after they observe the
// new epoch (Acquire), before decrementing `pending` (Release).
unsafe impl Sync for JobSlot {}
unsafe impl Send for JobSlot {}

struct Shared {
    epoch: AtomicUsize,
    pending: AtomicUsize,
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

impl ThreadPool {
    /// Starts `threads - 1` workers (at least one thread in all).
    pub fn new(threads: usize) -> std::io::Result<Self> {
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            epoch: AtomicUsize::new(0),
            pending: AtomicUsize::new(0),
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
                    .spawn(move || worker(s, tid))?,
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

    /// Runs `f(thread_index, threads)` on every thread and waits for all.
    /// Returns false if any invocation panicked.
    pub fn run(&self, f: &(dyn Fn(usize, usize) + Sync)) -> bool {
        let n = self.shared.threads;
        if n == 1 || IN_POOL.with(|c| c.get()) {
            // Single thread, or a nested call from inside a job: run inline.
            return catch_unwind(AssertUnwindSafe(|| {
                for t in 0..n {
                    f(t, n)
                }
            }))
            .is_ok();
        }
        let _guard = self.submit.lock().unwrap_or_else(|e| e.into_inner());
        let s = &*self.shared;
        s.panicked.store(false, Ordering::Relaxed);
        // SAFETY: erase the closure's lifetime; it is only used until `pending`
        // reaches zero below, while `f` is still borrowed by this call.
        let ptr: *const Job = unsafe {
            std::mem::transmute::<*const (dyn Fn(usize, usize) + Sync + '_), *const Job>(
                f as *const _,
            )
        };
        // SAFETY: no worker reads the slot until it sees the new epoch.
        unsafe { *s.job.0.get() = Some(ptr) };
        s.pending.store(n - 1, Ordering::Relaxed);
        s.epoch.fetch_add(1, Ordering::Release);
        {
            let sleepers = s.sleepers.lock().unwrap_or_else(|e| e.into_inner());
            if *sleepers > 0 {
                s.wake.notify_all();
            }
        }
        IN_POOL.with(|c| c.set(true));
        let ok = catch_unwind(AssertUnwindSafe(|| f(0, n))).is_ok();
        IN_POOL.with(|c| c.set(false));
        while s.pending.load(Ordering::Acquire) != 0 {
            std::hint::spin_loop();
        }
        // SAFETY: every worker has finished with the job.
        unsafe { *s.job.0.get() = None };
        ok && !s.panicked.load(Ordering::Relaxed)
    }
}

fn worker(s: Arc<Shared>, tid: usize) {
    IN_POOL.with(|c| c.set(true));
    let mut seen = 0usize;
    loop {
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            let e = s.epoch.load(Ordering::Acquire);
            if e != seen {
                seen = e;
                break;
            }
            if s.shutdown.load(Ordering::Relaxed) {
                return;
            }
            spins += 1;
            if spins % 64 == 0 && start.elapsed() > SPIN {
                let mut sleepers = s.sleepers.lock().unwrap_or_else(|e| e.into_inner());
                *sleepers += 1;
                while s.epoch.load(Ordering::Acquire) == seen && !s.shutdown.load(Ordering::Relaxed)
                {
                    sleepers = s.wake.wait(sleepers).unwrap_or_else(|e| e.into_inner());
                }
                *sleepers -= 1;
            } else {
                std::hint::spin_loop();
            }
        }
        if s.shutdown.load(Ordering::Relaxed) {
            return;
        }
        // SAFETY: the epoch moved, so the slot holds the current job, which
        // stays alive until we decrement `pending`.
        let job = unsafe { *s.job.0.get() };
        if let Some(job) = job {
            // SAFETY: see above.
            let f = unsafe { &*job };
            if catch_unwind(AssertUnwindSafe(|| f(tid, s.threads))).is_err() {
                s.panicked.store(true, Ordering::Relaxed);
            }
        }
        s.pending.fetch_sub(1, Ordering::Release);
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Relaxed);
        {
            let _g = self.shared.sleepers.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// The `[start, end)` share of `n` items for thread `t` of `threads`, in units of `align`.
pub fn share(n: usize, t: usize, threads: usize, align: usize) -> (usize, usize) {
    let align = align.max(1);
    let units = n.div_ceil(align);
    let per = units / threads;
    let extra = units % threads;
    let u0 = t * per + t.min(extra);
    let u1 = u0 + per + usize::from(t < extra);
    ((u0 * align).min(n), (u1 * align).min(n))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    #[test]
    fn runs_every_thread_many_times() {
        let pool = ThreadPool::new(3).unwrap();
        let total = AtomicU64::new(0);
        for _ in 0..2000 {
            assert!(pool.run(&|t, n| {
                assert_eq!(n, 3);
                total.fetch_add(t as u64 + 1, Ordering::Relaxed);
            }));
        }
        assert_eq!(total.load(Ordering::Relaxed), 2000 * 6);
        std::thread::sleep(Duration::from_millis(5));
        // After workers fall asleep, jobs still run.
        assert!(pool.run(&|_, _| {
            total.fetch_add(1, Ordering::Relaxed);
        }));
        assert_eq!(total.load(Ordering::Relaxed), 2000 * 6 + 3);
    }

    #[test]
    fn panics_are_reported() {
        let pool = ThreadPool::new(2).unwrap();
        assert!(!pool.run(&|t, _| {
            if t == 1 {
                panic!("boom")
            }
        }));
        assert!(pool.run(&|_, _| {}));
    }

    #[test]
    fn shares_cover_range() {
        for n in [0, 1, 7, 100, 1001] {
            for threads in 1..5 {
                let mut covered = 0;
                for t in 0..threads {
                    let (a, b) = share(n, t, threads, 16);
                    assert_eq!(a, covered);
                    covered = b;
                }
                assert_eq!(covered, n);
            }
        }
    }
}
