//! The `file` backend: one file per page in a local (or mounted) directory.
//!
//! Layout: `dir/<identity digest hex, 16 chars>/<key hex[0..2]>/<key hex>.kv`,
//! each file one [`entry`](super::entry) (header then page). The identity
//! folder keeps models, dtypes and page sizes apart: [`KvTier::clear`] removes
//! that folder only.
//!
//! Invariants:
//! - A file named `<key hex>.kv` is only ever created by a rename of a fully
//!   written temp file (`.<key hex>.<pid>.<seq>.tmp` in the same folder), so a
//!   crash leaves at most a temp file, which no read ever opens (they are
//!   removed by [`FileStore::remove_stale_temps`] and by `clear`).
//! - A read returns a page only after the entry decodes (header and checksum,
//!   see [`EntryCodec`]); a truncated or damaged file is removed and counted
//!   ([`FileStore::corrupt_removed`]); an entry of another identity is left alone.
//! - No call panics on I/O: failures are [`TierError::Io`].

use super::entry::{EntryCodec, EntryError, HEADER_BYTES, identity_prefix};
use arbor_engine_core::{KvTier, PageKey, TierError, TierIdentity};
use std::fs::{self, File, OpenOptions};
use std::io::{ErrorKind, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

/// Pages as files in a directory (see the module doc).
#[derive(Debug)]
pub struct FileStore {
    root: PathBuf,
    codec: EntryCodec,
    fsync: bool,
    corrupt_removed: AtomicU64,
    temp_seq: AtomicU64,
}

fn io_err(what: &str, path: &Path, e: std::io::Error) -> TierError {
    TierError::Io(format!("{what} {}: {e}", path.display()))
}

impl FileStore {
    /// Opens (creating it when missing) the store of `identity` under `dir`.
    /// A directory that cannot be created is a [`TierError::Config`].
    pub fn open(dir: impl AsRef<Path>, identity: &TierIdentity) -> Result<Self, TierError> {
        let root = dir.as_ref().join(identity_prefix(identity));
        fs::create_dir_all(&root).map_err(|e| {
            TierError::Config(format!(
                "hicache file storage directory {}: {e}",
                root.display()
            ))
        })?;
        Ok(Self {
            root,
            codec: EntryCodec::new(identity),
            fsync: false,
            corrupt_removed: AtomicU64::new(0),
            temp_seq: AtomicU64::new(0),
        })
    }

    /// Also `fsync`s each entry (and its folder) before it counts as written:
    /// entries then survive a power loss, not only a process crash. Off by default.
    pub fn with_fsync(mut self, fsync: bool) -> Self {
        self.fsync = fsync;
        self
    }

    /// The identity's folder (`dir/<identity prefix>`).
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The file of `key`'s entry.
    pub fn entry_path(&self, key: &PageKey) -> PathBuf {
        let hex = key.hex();
        self.root.join(&hex[..2]).join(format!("{hex}.kv"))
    }

    /// Truncated or damaged entries removed so far.
    pub fn corrupt_removed(&self) -> u64 {
        self.corrupt_removed.load(Ordering::Relaxed)
    }

    /// Removes temp files (left by a crash mid-write) last modified more than
    /// `older_than` ago; returns how many. A temp file younger than that may
    /// be another process's write in progress and is kept.
    pub fn remove_stale_temps(&self, older_than: Duration) -> Result<u64, TierError> {
        let now = SystemTime::now();
        let mut removed = 0;
        let dirs = match fs::read_dir(&self.root) {
            Ok(d) => d,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(0),
            Err(e) => return Err(io_err("list", &self.root, e)),
        };
        for sub in dirs.flatten() {
            let Ok(files) = fs::read_dir(sub.path()) else {
                continue;
            };
            for f in files.flatten() {
                let name = f.file_name();
                let Some(name) = name.to_str() else { continue };
                if !(name.starts_with('.') && name.ends_with(".tmp")) {
                    continue;
                }
                let age = f
                    .metadata()
                    .and_then(|m| m.modified())
                    .ok()
                    .and_then(|t| now.duration_since(t).ok());
                if age.is_some_and(|a| a >= older_than) && fs::remove_file(f.path()).is_ok() {
                    removed += 1;
                }
            }
        }
        Ok(removed)
    }

    fn remove_corrupt(&self, path: &Path, why: &str) {
        tracing::warn!(path = %path.display(), "hicache file storage: removing corrupt entry: {why}");
        match fs::remove_file(path) {
            Ok(()) => {
                self.corrupt_removed.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(path = %path.display(), "hicache file storage: cannot remove corrupt entry: {e}");
            }
        }
    }

    fn read_one(&self, key: &PageKey) -> Result<Option<Vec<u8>>, TierError> {
        let path = self.entry_path(key);
        let mut f = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_err("open", &path, e)),
        };
        let len = f.metadata().map_err(|e| io_err("stat", &path, e))?.len();
        if len != self.codec.entry_bytes() as u64 {
            self.remove_corrupt(
                &path,
                &format!("{len} bytes, entries are {}", self.codec.entry_bytes()),
            );
            return Ok(None);
        }
        let mut head = [0u8; HEADER_BYTES];
        match f.read_exact(&mut head) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::UnexpectedEof => {
                self.remove_corrupt(&path, "truncated header");
                return Ok(None);
            }
            Err(e) => return Err(io_err("read", &path, e)),
        }
        let header = match self.codec.parse_header(&head, key) {
            Ok(h) => h,
            Err(EntryError::Foreign) => return Ok(None),
            Err(EntryError::Corrupt(why)) => {
                self.remove_corrupt(&path, &why);
                return Ok(None);
            }
        };
        let mut payload = vec![0u8; header.payload_len];
        match f.read_exact(&mut payload) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::UnexpectedEof => {
                self.remove_corrupt(&path, "truncated payload");
                return Ok(None);
            }
            Err(e) => return Err(io_err("read", &path, e)),
        }
        match self.codec.check_payload(&header, key, &payload) {
            Ok(()) => Ok(Some(payload)),
            Err(EntryError::Foreign) => Ok(None),
            Err(EntryError::Corrupt(why)) => {
                self.remove_corrupt(&path, &why);
                Ok(None)
            }
        }
    }

    fn write_one(&self, key: &PageKey, payload: &[u8]) -> Result<(), TierError> {
        let path = self.entry_path(key);
        // Same key, same identity: same page. A whole-sized entry is kept
        // (a damaged one is caught and removed by the next read).
        if fs::metadata(&path).is_ok_and(|m| m.len() == self.codec.entry_bytes() as u64) {
            return Ok(());
        }
        let dir = path
            .parent()
            .ok_or_else(|| TierError::Io(format!("no folder for {}", path.display())))?;
        let tmp = dir.join(format!(
            ".{}.{}.{}.tmp",
            key.hex(),
            std::process::id(),
            self.temp_seq.fetch_add(1, Ordering::Relaxed)
        ));
        let create = || OpenOptions::new().write(true).create_new(true).open(&tmp);
        let mut f = match create() {
            Ok(f) => f,
            Err(e) if e.kind() == ErrorKind::NotFound => {
                fs::create_dir_all(dir).map_err(|e| io_err("create", dir, e))?;
                create().map_err(|e| io_err("create", &tmp, e))?
            }
            Err(e) => return Err(io_err("create", &tmp, e)),
        };
        let header = self.codec.header(key, payload);
        let written = f
            .write_all(&header)
            .and_then(|()| f.write_all(payload))
            .and_then(|()| f.flush())
            .and_then(|()| if self.fsync { f.sync_data() } else { Ok(()) });
        drop(f);
        let renamed = written.and_then(|()| fs::rename(&tmp, &path));
        if let Err(e) = renamed {
            let _ = fs::remove_file(&tmp);
            return Err(io_err("write", &path, e));
        }
        if self.fsync {
            File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(|e| io_err("sync", dir, e))?;
        }
        Ok(())
    }
}

impl KvTier for FileStore {
    fn name(&self) -> &str {
        "file"
    }

    fn exists(&self, keys: &[PageKey]) -> Result<Vec<bool>, TierError> {
        let want = self.codec.entry_bytes() as u64;
        keys.iter()
            .map(|key| {
                let path = self.entry_path(key);
                match fs::metadata(&path) {
                    Ok(m) if m.len() == want => Ok(true),
                    Ok(m) => {
                        self.remove_corrupt(
                            &path,
                            &format!("{} bytes, entries are {want}", m.len()),
                        );
                        Ok(false)
                    }
                    Err(e) if e.kind() == ErrorKind::NotFound => Ok(false),
                    Err(e) => Err(io_err("stat", &path, e)),
                }
            })
            .collect()
    }

    fn get(&self, keys: &[PageKey]) -> Result<Vec<Option<Vec<u8>>>, TierError> {
        keys.iter().map(|k| self.read_one(k)).collect()
    }

    fn set(&self, entries: &[(PageKey, &[u8])]) -> Result<(), TierError> {
        let want = self.codec.page_bytes();
        if let Some((key, p)) = entries.iter().find(|(_, p)| p.len() != want) {
            return Err(TierError::Config(format!(
                "page {key:?} of {} bytes, this store's pages are {want} bytes",
                p.len()
            )));
        }
        for (key, payload) in entries {
            self.write_one(key, payload)?;
        }
        Ok(())
    }

    fn clear(&self) -> Result<(), TierError> {
        match fs::remove_dir_all(&self.root) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) => return Err(io_err("remove", &self.root, e)),
        }
        fs::create_dir_all(&self.root).map_err(|e| io_err("create", &self.root, e))
    }
}
