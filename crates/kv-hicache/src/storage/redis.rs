//! The `redis` backend: pages as redis strings, over one synchronous connection.
//!
//! Keys are `arbor:<identity digest hex, 16 chars>:<page key hex>`, each value
//! one [`entry`](super::entry) (header then page). `exists` is one pipeline of
//! `EXISTS`, `get` one `MGET`, `set` one `MSET` (atomic for the whole batch),
//! `clear` a `SCAN` of this identity's keys with `UNLINK` in batches.
//!
//! Invariants:
//! - Every command runs under connect, read and write timeouts
//!   ([`RedisStore::DEFAULT_TIMEOUT`] unless configured), so no call blocks
//!   for longer than about one timeout per round trip. A failed call drops the
//!   connection and returns [`TierError::Unavailable`] (server gone, refused,
//!   timed out) or [`TierError::Io`] (an error reply); the next call connects
//!   again, so a restarted server is used again.
//! - A value is returned only after it decodes (see [`EntryCodec`]); a damaged
//!   one is deleted and counted ([`RedisStore::corrupt_removed`]); one of
//!   another identity is left alone. (The delete is unconditional: a page
//!   rewritten between the read and the delete is lost, which is only a
//!   miss.) Eviction (maxmemory policy, TTLs) is the server's business.
//! - One connection per store, behind a mutex: calls are serialized.

use super::entry::{EntryCodec, EntryError, identity_prefix};
use ::redis::{Client, Connection, RedisError};
use arbor_engine_core::{KvTier, PageKey, TierError, TierIdentity};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

/// Keys `clear` asks `SCAN` for per round trip (and unlinks per command).
const SCAN_BATCH: usize = 1000;

/// Pages in a redis server (see the module doc).
pub struct RedisStore {
    client: Client,
    prefix: String,
    codec: EntryCodec,
    timeout: Duration,
    conn: Mutex<Option<Connection>>,
    corrupt_removed: AtomicU64,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Not the URL: it may hold a password.
        f.debug_struct("RedisStore")
            .field("prefix", &self.prefix)
            .field("timeout", &self.timeout)
            .finish()
    }
}

fn unavailable_or_io(what: &str, e: &RedisError) -> TierError {
    if e.is_io_error() || e.is_timeout() || e.is_connection_dropped() || e.is_connection_refusal() {
        TierError::Unavailable(format!("redis {what}: {e}"))
    } else {
        TierError::Io(format!("redis {what}: {e}"))
    }
}

impl RedisStore {
    /// Connect, read and write timeout unless configured.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(2);

    /// Connects to `url` (`redis://[user:password@]host:port[/db]`) for
    /// `identity`'s pages, with [`DEFAULT_TIMEOUT`](Self::DEFAULT_TIMEOUT).
    pub fn connect(url: &str, identity: &TierIdentity) -> Result<Self, TierError> {
        Self::connect_with_timeout(url, identity, Self::DEFAULT_TIMEOUT)
    }

    /// [`connect`](Self::connect) with another timeout for connecting and for
    /// each read and write. A bad URL is a [`TierError::Config`]; a server
    /// that cannot be reached is [`TierError::Unavailable`].
    pub fn connect_with_timeout(
        url: &str,
        identity: &TierIdentity,
        timeout: Duration,
    ) -> Result<Self, TierError> {
        if timeout.is_zero() {
            return Err(TierError::Config("redis timeout must be above zero".into()));
        }
        let client =
            Client::open(url).map_err(|e| TierError::Config(format!("redis URL {url:?}: {e}")))?;
        let store = Self {
            client,
            prefix: format!("arbor:{}:", identity_prefix(identity)),
            codec: EntryCodec::new(identity),
            timeout,
            conn: Mutex::new(None),
            corrupt_removed: AtomicU64::new(0),
        };
        let con = store.open_connection()?;
        *store.lock() = Some(con);
        Ok(store)
    }

    /// The redis key of `key`'s entry.
    pub fn key_name(&self, key: &PageKey) -> String {
        format!("{}{}", self.prefix, key.hex())
    }

    /// The prefix of every key of this identity (`arbor:<identity prefix>:`).
    pub fn key_prefix(&self) -> &str {
        &self.prefix
    }

    /// The timeout of connecting and of each read and write.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Damaged values deleted so far.
    pub fn corrupt_removed(&self) -> u64 {
        self.corrupt_removed.load(Ordering::Relaxed)
    }

    fn lock(&self) -> MutexGuard<'_, Option<Connection>> {
        self.conn.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn open_connection(&self) -> Result<Connection, TierError> {
        let con = self
            .client
            .get_connection_with_timeout(self.timeout)
            .map_err(|e| TierError::Unavailable(format!("redis connect: {e}")))?;
        con.set_read_timeout(Some(self.timeout))
            .and_then(|()| con.set_write_timeout(Some(self.timeout)))
            .map_err(|e| TierError::Unavailable(format!("redis connect: {e}")))?;
        Ok(con)
    }

    /// Runs `f` on the connection (opening one when there is none); on
    /// failure the connection is dropped, so the next call starts afresh.
    fn with_conn<T>(
        &self,
        what: &str,
        f: impl FnOnce(&mut Connection) -> Result<T, RedisError>,
    ) -> Result<T, TierError> {
        let mut guard = self.lock();
        let mut con = match guard.take() {
            Some(c) => c,
            None => self.open_connection()?,
        };
        match f(&mut con) {
            Ok(v) => {
                *guard = Some(con);
                Ok(v)
            }
            Err(e) => {
                tracing::warn!("hicache redis storage: {what} failed: {e}");
                Err(unavailable_or_io(what, &e))
            }
        }
    }
}

impl KvTier for RedisStore {
    fn name(&self) -> &str {
        "redis"
    }

    fn exists(&self, keys: &[PageKey]) -> Result<Vec<bool>, TierError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let mut pipe = ::redis::pipe();
        for k in keys {
            pipe.cmd("EXISTS").arg(self.key_name(k));
        }
        self.with_conn("EXISTS", |con| pipe.query::<Vec<bool>>(con))
    }

    fn get(&self, keys: &[PageKey]) -> Result<Vec<Option<Vec<u8>>>, TierError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let names: Vec<String> = keys.iter().map(|k| self.key_name(k)).collect();
        let values = self.with_conn("MGET", |con| {
            ::redis::cmd("MGET")
                .arg(&names)
                .query::<Vec<Option<Vec<u8>>>>(con)
        })?;
        if values.len() != keys.len() {
            return Err(TierError::Io(format!(
                "redis MGET: {} values for {} keys",
                values.len(),
                keys.len()
            )));
        }
        let mut corrupt = Vec::new();
        let mut out = Vec::with_capacity(keys.len());
        for ((key, name), value) in keys.iter().zip(&names).zip(values) {
            let Some(bytes) = value else {
                out.push(None);
                continue;
            };
            match self.codec.decode_owned(bytes, key) {
                Ok(page) => out.push(Some(page)),
                Err(EntryError::Foreign) => out.push(None),
                Err(EntryError::Corrupt(why)) => {
                    tracing::warn!(key = %name, "hicache redis storage: removing corrupt entry: {why}");
                    corrupt.push(name.as_str());
                    out.push(None);
                }
            }
        }
        if !corrupt.is_empty() {
            // The pages already read stand even when the delete fails.
            let deleted = self.with_conn("DEL", |con| {
                ::redis::cmd("DEL").arg(&corrupt).query::<u64>(con)
            });
            if let Ok(n) = deleted {
                self.corrupt_removed.fetch_add(n, Ordering::Relaxed);
            }
        }
        Ok(out)
    }

    fn set(&self, entries: &[(PageKey, &[u8])]) -> Result<(), TierError> {
        if entries.is_empty() {
            return Ok(());
        }
        let want = self.codec.page_bytes();
        if let Some((key, p)) = entries.iter().find(|(_, p)| p.len() != want) {
            return Err(TierError::Config(format!(
                "page {key:?} of {} bytes, this store's pages are {want} bytes",
                p.len()
            )));
        }
        let mut cmd = ::redis::cmd("MSET");
        for (key, payload) in entries {
            cmd.arg(self.key_name(key))
                .arg(self.codec.encode(key, payload));
        }
        self.with_conn("MSET", |con| cmd.query::<()>(con))
    }

    fn clear(&self) -> Result<(), TierError> {
        let pattern = format!("{}*", self.prefix);
        let mut cursor: u64 = 0;
        loop {
            let (next, names) = self.with_conn("SCAN", |con| {
                ::redis::cmd("SCAN")
                    .arg(cursor)
                    .arg("MATCH")
                    .arg(&pattern)
                    .arg("COUNT")
                    .arg(SCAN_BATCH)
                    .query::<(u64, Vec<String>)>(con)
            })?;
            for batch in names.chunks(SCAN_BATCH) {
                self.with_conn("UNLINK", |con| {
                    ::redis::cmd("UNLINK").arg(batch).query::<u64>(con)
                })?;
            }
            if next == 0 {
                return Ok(());
            }
            cursor = next;
        }
    }
}
