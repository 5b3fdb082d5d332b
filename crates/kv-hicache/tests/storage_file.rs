//! The `file` backend on real files: round trips, identity separation,
//! truncated and damaged entries removed, crash leftovers never read, clear,
//! config-driven opening, and a timing of 64 KiB pages.

use anyhow::{Result, ensure};
use arbor_engine_core::{DType, KvTier, PageKey, TierError, TierIdentity};
use arbor_kv_hicache::storage::{FileStore, StorageConfig, Store, open_store};
use std::fs;
use std::time::{Duration, Instant};

#[path = "support/pages.rs"]
mod pages;
use pages::{entries, key, page};

/// An identity whose pages are 64 KiB (F32: 2 × 4 layers × 16 tokens × 4 heads × 32 dims × 4 bytes).
fn identity(model: &str, dtype: DType, page_size: usize) -> TierIdentity {
    TierIdentity {
        model: model.into(),
        kv_dtype: dtype,
        page_size,
        num_layers: 4,
        num_kv_heads: 4,
        head_dim: 32,
        values_in_keys: false,
    }
}

#[test]
fn round_trip_exists_and_clear() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let id = identity("m", DType::F32, 16);
    assert_eq!(id.page_bytes(), 64 * 1024);
    let store = FileStore::open(dir.path().join("not/yet/made"), &id)?;
    assert_eq!(store.name(), "file");
    let pages: Vec<Vec<u8>> = (0..8).map(|i| page(&id, i)).collect();
    let keys: Vec<PageKey> = (0..8).map(key).collect();
    let entries = entries(&keys, &pages);
    store.set(&entries[..5])?;
    // Writing again is harmless.
    store.set(&entries[..2])?;
    assert_eq!(
        store.exists(&keys)?,
        [true, true, true, true, true, false, false, false]
    );
    let got = store.get(&keys)?;
    for (i, g) in got.iter().enumerate() {
        if i < 5 {
            ensure!(g.as_deref() == Some(&pages[i][..]), "page {i} differs");
        } else {
            ensure!(g.is_none(), "page {i} should be missing");
        }
    }
    assert!(store.get(&[])?.is_empty() && store.exists(&[])?.is_empty());
    store.set(&[])?;
    // A wrong-sized page is refused, and nothing of its batch is written.
    let short = [0u8; 10];
    match store.set(&[(keys[6], &pages[6][..]), (keys[7], &short[..])]) {
        Err(TierError::Config(m)) => assert!(m.contains("bytes"), "{m}"),
        other => anyhow::bail!("short page accepted: {other:?}"),
    }
    assert_eq!(store.exists(&keys[6..])?, [false, false]);

    // clear() removes this identity's entries only.
    let other_id = identity("other", DType::F32, 16);
    let other = FileStore::open(dir.path().join("not/yet/made"), &other_id)?;
    other.set(&[(keys[0], &pages[0][..])])?;
    store.clear()?;
    assert_eq!(store.exists(&keys[..5])?, [false; 5]);
    assert_eq!(other.get(&keys[..1])?[0].as_deref(), Some(&pages[0][..]));
    // The store still works after clear().
    store.set(&entries[..1])?;
    assert_eq!(store.get(&keys[..1])?[0].as_deref(), Some(&pages[0][..]));
    assert_eq!(store.corrupt_removed(), 0);
    Ok(())
}

#[test]
fn identities_do_not_see_each_other() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let id = identity("m", DType::F32, 16);
    let store = FileStore::open(dir.path(), &id)?;
    let keys: Vec<PageKey> = (0..4).map(key).collect();
    let pages: Vec<Vec<u8>> = (0..4).map(|i| page(&id, i)).collect();
    let entries = entries(&keys, &pages);
    store.set(&entries)?;
    for other in [
        identity("m2", DType::F32, 16),
        identity("m", DType::F16, 16),
        identity("m", DType::F32, 32),
    ] {
        let o = FileStore::open(dir.path(), &other)?;
        assert_ne!(o.root(), store.root());
        assert_eq!(o.exists(&keys)?, [false; 4], "{other:?}");
        assert!(o.get(&keys)?.iter().all(Option::is_none), "{other:?}");
    }
    // Even an entry copied into another identity's folder (a prefix collision)
    // is not loaded there, and it is not removed as corrupt either.
    let other_id = identity("m2", DType::F32, 16);
    let o = FileStore::open(dir.path(), &other_id)?;
    let to = o.entry_path(&keys[0]);
    fs::create_dir_all(to.parent().ok_or_else(|| anyhow::anyhow!("no parent"))?)?;
    fs::copy(store.entry_path(&keys[0]), &to)?;
    assert_eq!(o.get(&keys[..1])?, [None]);
    assert!(to.exists());
    assert_eq!(o.corrupt_removed(), 0);
    Ok(())
}

#[test]
fn truncated_and_damaged_entries_are_removed() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let id = identity("m", DType::F32, 16);
    let store = FileStore::open(dir.path(), &id)?;
    let keys: Vec<PageKey> = (0..4).map(key).collect();
    let pages: Vec<Vec<u8>> = (0..4).map(|i| page(&id, i)).collect();
    let entries = entries(&keys, &pages);
    store.set(&entries)?;

    // 0: truncated mid-payload; 1: payload bytes flipped; 2: header cut short.
    let p0 = store.entry_path(&keys[0]);
    let len = fs::metadata(&p0)?.len();
    fs::OpenOptions::new()
        .write(true)
        .open(&p0)?
        .set_len(len - 100)?;
    let p1 = store.entry_path(&keys[1]);
    let mut b = fs::read(&p1)?;
    let n = b.len();
    b[n - 1000] ^= 0xff;
    b[n - 999] ^= 0x01;
    fs::write(&p1, &b)?;
    let p2 = store.entry_path(&keys[2]);
    fs::OpenOptions::new().write(true).open(&p2)?.set_len(20)?;

    let got = store.get(&keys)?;
    assert_eq!(got[..3], [None, None, None]);
    assert_eq!(got[3].as_deref(), Some(&pages[3][..]));
    assert!(!p0.exists() && !p1.exists() && !p2.exists());
    assert_eq!(store.corrupt_removed(), 3);

    // A wrong-sized file is also caught by exists() (and removed).
    store.set(&entries[..1])?;
    fs::OpenOptions::new()
        .write(true)
        .open(&p0)?
        .set_len(len + 1)?;
    assert_eq!(store.exists(&keys[..1])?, [false]);
    assert!(!p0.exists());
    assert_eq!(store.corrupt_removed(), 4);
    // Written again, it reads back.
    store.set(&entries[..1])?;
    assert_eq!(store.get(&keys[..1])?[0].as_deref(), Some(&pages[0][..]));
    Ok(())
}

#[test]
fn crash_leftovers_are_never_read() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let id = identity("m", DType::F32, 16);
    let store = FileStore::open(dir.path(), &id)?;
    let k = key(9);
    let p = page(&id, 9);
    // A crash mid-write leaves a temp file beside where the entry would be;
    // here even a whole, valid entry in it.
    let path = store.entry_path(&k);
    let folder = path.parent().ok_or_else(|| anyhow::anyhow!("no parent"))?;
    fs::create_dir_all(folder)?;
    let tmp = folder.join(format!(".{}.4242.0.tmp", k.hex()));
    let mut whole = arbor_kv_hicache::storage::EntryCodec::new(&id).encode(&k, &p);
    fs::write(&tmp, &whole)?;
    whole.truncate(1000);
    let tmp2 = folder.join(format!(".{}.4242.1.tmp", k.hex()));
    fs::write(&tmp2, &whole)?;
    assert_eq!(store.exists(&[k])?, [false]);
    assert_eq!(store.get(&[k])?, [None]);
    // A write after the crash lands as usual; the leftovers stay unread.
    store.set(&[(k, &p[..])])?;
    assert_eq!(store.get(&[k])?[0].as_deref(), Some(&p[..]));
    // Young temps are kept (another writer's, maybe); old ones swept.
    assert_eq!(store.remove_stale_temps(Duration::from_secs(3600))?, 0);
    assert_eq!(store.remove_stale_temps(Duration::ZERO)?, 2);
    assert!(!tmp.exists() && !tmp2.exists() && path.exists());
    // No temp file is left by a normal write.
    let names: Vec<String> = fs::read_dir(folder)?
        .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect::<Result<_, _>>()?;
    assert_eq!(names, [format!("{}.kv", k.hex())]);
    Ok(())
}

#[test]
fn open_errors_and_config() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let id = identity("m", DType::F32, 16);
    // A directory that cannot be made (a file is in the way) is a Config error.
    let blocker = dir.path().join("file");
    fs::write(&blocker, b"x")?;
    match FileStore::open(&blocker, &id) {
        Err(TierError::Config(m)) => assert!(m.contains("directory"), "{m}"),
        other => anyhow::bail!("expected Config, got {other:?}"),
    }
    // Opened through the flags.
    let extra = serde_json::json!({"dir": dir.path().join("st"), "fsync": true}).to_string();
    let cfg = StorageConfig::parse("file", Some(&extra))?;
    let tier = open_store(&cfg, &id)?;
    assert_eq!(tier.name(), "file");
    let p = page(&id, 1);
    tier.set(&[(key(1), &p[..])])?;
    let store = Store::open(&cfg, &id)?;
    assert_eq!(store.get(&[key(1)])?[0].as_deref(), Some(&p[..]));
    assert_eq!(store.corrupt_removed(), 0);
    Ok(())
}

/// Prints set/get throughput of 64 KiB pages (no fsync, page cache warm).
#[test]
fn timing_64k_pages() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let id = identity("m", DType::F32, 16);
    let store = FileStore::open(dir.path(), &id)?;
    let n = 512u32;
    let keys: Vec<PageKey> = (0..n).map(key).collect();
    let pages: Vec<Vec<u8>> = (0..n).map(|i| page(&id, i)).collect();
    let entries = entries(&keys, &pages);
    let mb = (n as usize * id.page_bytes()) as f64 / (1 << 20) as f64;
    let t = Instant::now();
    for batch in entries.chunks(64) {
        store.set(batch)?;
    }
    let set_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let mut hits = 0;
    for batch in keys.chunks(64) {
        hits += store.get(batch)?.iter().filter(|p| p.is_some()).count();
    }
    let get_s = t.elapsed().as_secs_f64();
    assert_eq!(hits, n as usize);
    println!(
        "file store, {n} pages of 64 KiB in batches of 64: set {:.0} MiB/s ({:.0} pages/s), get {:.0} MiB/s ({:.0} pages/s)",
        mb / set_s,
        n as f64 / set_s,
        mb / get_s,
        n as f64 / get_s
    );
    Ok(())
}
