//! The storage tier's threads: every storage I/O runs on them, never on the
//! scheduler thread. One thread reads (lookups and fetches, which requests
//! may wait on) and one writes (backups and clears, which wait on host
//! copies), so a read never queues behind a write.
//!
//! Jobs arrive on bounded channels (a full queue drops the job, counted as
//! an error: the scheduler never waits) and results go back on another:
//! - `Lookup`: the chained keys of a prompt's pages past what the tiers in
//!   memory hold, and how many of them the store has (in order, from the
//!   first);
//! - `Fetch`: reads those pages into host slots that the scheduler side
//!   allocated, stopping at the first one missing or failing its check;
//! - `Backup`: writes pages with a fresh host copy, once the step that
//!   copies them ran (it waits on the host slot; a slot freed meanwhile is
//!   skipped);
//! - `Clear`: empties the store.
//!
//! A failed operation is logged, counted, and answered as "nothing found":
//! the requests recompute.

use arbor_engine_core::{CacheNamespace, HostPages, KvTier, PageKey, page_keys};
use arbor_kv_radix::StorageBackup;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Jobs queued at most; beyond, new jobs are dropped.
const QUEUE: usize = 4096;
/// How long a backup waits for its host copy to be made.
const BACKUP_WAIT: Duration = Duration::from_secs(30);

pub(crate) enum Job {
    Lookup {
        key: u64,
        ns: CacheNamespace,
        root: PageKey,
        tokens: Arc<[u32]>,
        start: usize,
        page_size: usize,
    },
    Fetch {
        key: u64,
        ns: CacheNamespace,
        tokens: Arc<[u32]>,
        start: usize,
        keys: Vec<PageKey>,
        host: HostPages,
    },
    Backup(StorageBackup),
    Clear,
}

pub(crate) enum Done {
    /// The store holds `keys` (pages from `start` on, in order).
    Found {
        key: u64,
        ns: CacheNamespace,
        tokens: Arc<[u32]>,
        start: usize,
        keys: Vec<PageKey>,
    },
    /// The first `pages` of `host` hold the fetched pages.
    Fetched {
        key: u64,
        ns: CacheNamespace,
        tokens: Arc<[u32]>,
        start: usize,
        host: HostPages,
        pages: usize,
    },
}

/// Counters the thread keeps (read by the cache's stats).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub read_pages: AtomicU64,
    pub read_bytes: AtomicU64,
    pub read_micros: AtomicU64,
    pub write_pages: AtomicU64,
    pub write_bytes: AtomicU64,
    pub write_micros: AtomicU64,
    pub errors: AtomicU64,
}

impl Counters {
    fn error(&self, what: &str, e: &dyn std::fmt::Display) {
        let n = self.errors.fetch_add(1, Ordering::Relaxed);
        // The first failure and then one in a hundred: a store that is down stays quiet.
        if n.is_multiple_of(100) {
            tracing::warn!(
                "hicache storage {what} failed ({} so far): {e}; recomputing",
                n + 1
            );
        }
    }
}

/// The threads and their channels.
pub(crate) struct Worker {
    reads: Option<SyncSender<Job>>,
    writes: Option<SyncSender<Job>>,
    pub done: Receiver<Done>,
    pub counters: Arc<Counters>,
    threads: Vec<JoinHandle<()>>,
}

impl Worker {
    pub fn spawn(store: Arc<dyn KvTier>) -> std::io::Result<Self> {
        let (tx, done) = std::sync::mpsc::channel();
        let counters = Arc::new(Counters::default());
        let mut senders = Vec::new();
        let mut threads = Vec::new();
        for name in ["arbor-hicache-read", "arbor-hicache-write"] {
            let (jobs, rx) = std::sync::mpsc::sync_channel(QUEUE);
            let (store, tx, c) = (store.clone(), tx.clone(), counters.clone());
            threads.push(
                std::thread::Builder::new()
                    .name(name.into())
                    .spawn(move || run(&*store, &rx, &tx, &c))?,
            );
            senders.push(jobs);
        }
        let writes = senders.pop();
        let reads = senders.pop();
        Ok(Self {
            reads,
            writes,
            done,
            counters,
            threads,
        })
    }

    /// Queues a job; false (counted) when the queue is full or the thread is gone.
    pub fn send(&self, job: Job) -> bool {
        let queue = match job {
            Job::Backup(_) | Job::Clear => &self.writes,
            Job::Lookup { .. } | Job::Fetch { .. } => &self.reads,
        };
        let Some(jobs) = queue.as_ref() else {
            return false;
        };
        match jobs.try_send(job) {
            Ok(()) => true,
            Err(TrySendError::Full(_)) => {
                self.counters.error("queue", &"the storage queue is full");
                false
            }
            Err(TrySendError::Disconnected(_)) => {
                self.counters.error("thread", &"the storage thread stopped");
                false
            }
        }
    }
}

impl Drop for Worker {
    /// Lets queued writes finish (so a restart finds them), for a few seconds at most.
    fn drop(&mut self) {
        self.reads = None;
        self.writes = None;
        let deadline = Instant::now() + Duration::from_secs(10);
        for t in self.threads.drain(..) {
            while !t.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
            if t.is_finished() {
                let _ = t.join();
            }
        }
    }
}

fn micros(since: Instant) -> u64 {
    since.elapsed().as_micros() as u64
}

fn run(store: &dyn KvTier, rx: &Receiver<Job>, tx: &std::sync::mpsc::Sender<Done>, c: &Counters) {
    while let Ok(job) = rx.recv() {
        match job {
            Job::Lookup {
                key,
                ns,
                root,
                tokens,
                start,
                page_size,
            } => {
                let all = page_keys(root, &tokens, page_size);
                let wanted = all.get(start / page_size..).unwrap_or(&[]);
                let found = match store.exists(wanted) {
                    Ok(v) => v.iter().take_while(|&&b| b).count(),
                    Err(e) => {
                        c.error("lookup", &e);
                        0
                    }
                };
                let keys = wanted[..found].to_vec();
                let _ = tx.send(Done::Found {
                    key,
                    ns,
                    tokens,
                    start,
                    keys,
                });
            }
            Job::Fetch {
                key,
                ns,
                tokens,
                start,
                keys,
                host,
            } => {
                let t0 = Instant::now();
                let pages = match store.get(&keys) {
                    Ok(entries) => fill(&host, entries),
                    Err(e) => {
                        c.error("read", &e);
                        0
                    }
                };
                c.read_pages.fetch_add(pages as u64, Ordering::Relaxed);
                c.read_bytes
                    .fetch_add((pages * host.pool().page_bytes()) as u64, Ordering::Relaxed);
                c.read_micros.fetch_add(micros(t0), Ordering::Relaxed);
                let _ = tx.send(Done::Fetched {
                    key,
                    ns,
                    tokens,
                    start,
                    host,
                    pages,
                });
            }
            Job::Backup(b) => backup(store, &b, c),
            Job::Clear => {
                if let Err(e) = store.clear() {
                    c.error("clear", &e);
                }
            }
        }
    }
}

/// Copies fetched entries into the host slots, in order, up to the first
/// missing or wrongly sized one; returns how many.
fn fill(host: &HostPages, entries: Vec<Option<Vec<u8>>>) -> usize {
    let pool = host.pool();
    let mut n = 0;
    for (slot, entry) in host.slots().iter().zip(entries) {
        let Some(bytes) = entry.filter(|b| b.len() == pool.page_bytes()) else {
            break;
        };
        if !pool.write(*slot, |dst| dst.copy_from_slice(&bytes)) {
            break;
        }
        n += 1;
    }
    n
}

fn backup(store: &dyn KvTier, b: &StorageBackup, c: &Counters) {
    let t0 = Instant::now();
    let mut pages: Vec<(PageKey, Vec<u8>)> = Vec::with_capacity(b.keys.len());
    for (k, s) in b.keys.iter().zip(&b.slots) {
        match b.pool.read(*s, BACKUP_WAIT, <[u8]>::to_vec) {
            Some(bytes) => pages.push((*k, bytes)),
            None => break, // freed (evicted) before its copy ran: the rest would not chain
        }
    }
    if pages.is_empty() {
        return;
    }
    let entries: Vec<(PageKey, &[u8])> = pages.iter().map(|(k, v)| (*k, v.as_slice())).collect();
    match store.set(&entries) {
        Ok(()) => {
            c.write_pages
                .fetch_add(entries.len() as u64, Ordering::Relaxed);
            c.write_bytes.fetch_add(
                entries.iter().map(|(_, v)| v.len() as u64).sum(),
                Ordering::Relaxed,
            );
            c.write_micros.fetch_add(micros(t0), Ordering::Relaxed);
        }
        Err(e) => c.error("write", &e),
    }
}
