//! The `redis` backend against a real `redis-server` started by each test on
//! a free loopback port: batches, identities apart, damaged values deleted,
//! clear, a server killed (calls fail promptly with `Unavailable`) and
//! restarted (calls work again), a stopped server (reads time out), and a
//! timing of MSET/MGET of 64 pages of 64 KiB.
//!
//! Without `redis-server` on PATH (or `ARBOR_REDIS_SERVER`) the tests print
//! why and pass, unless `ARBOR_REQUIRE_REDIS=1`, when they fail.

use anyhow::{Result, bail, ensure};
use arbor_engine_core::{DType, KvTier, PageKey, TierError, TierIdentity};
use arbor_kv_hicache::storage::{RedisStore, StorageConfig, Store, open_store};

#[path = "support/redis_server.rs"]
mod redis_server;
use redis_server::{Server, free_port, require_server};
use std::time::{Duration, Instant};

#[path = "support/pages.rs"]
mod pages;
use pages::{entries, key, page};

fn identity(model: &str, head_dim: usize) -> TierIdentity {
    TierIdentity {
        model: model.into(),
        kv_dtype: DType::F32,
        page_size: 16,
        num_layers: 4,
        num_kv_heads: 4,
        head_dim,
        values_in_keys: false,
    }
}

/// 64 KiB pages.
fn id64k(model: &str) -> TierIdentity {
    identity(model, 32)
}

#[test]
fn round_trip_batches_identities_and_clear() -> Result<()> {
    let Some(bin) = require_server() else {
        return Ok(());
    };
    let server = Server::start(bin)?;
    let id = id64k("m");
    let store = RedisStore::connect(&server.url(), &id)?;
    assert_eq!(store.name(), "redis");
    let keys: Vec<PageKey> = (0..64).map(key).collect();
    let pages: Vec<Vec<u8>> = (0..64).map(|i| page(&id, i)).collect();
    store.set(&entries(&keys[..48], &pages[..48]))?;
    let ex = store.exists(&keys)?;
    ensure!(
        ex[..48].iter().all(|&e| e) && ex[48..].iter().all(|&e| !e),
        "{ex:?}"
    );
    let got = store.get(&keys)?;
    for (i, g) in got.iter().enumerate() {
        ensure!(
            g.as_deref() == (i < 48).then(|| &pages[i][..]),
            "page {i} wrong"
        );
    }
    assert!(store.get(&[])?.is_empty() && store.exists(&[])?.is_empty());
    store.set(&[])?;
    let short = [0u8; 3];
    assert!(matches!(
        store.set(&[(keys[50], &short[..])]),
        Err(TierError::Config(_))
    ));
    let name = store.key_name(&keys[0]);
    assert!(
        name.starts_with("arbor:") && name.ends_with(&keys[0].hex()),
        "{name}"
    );

    // Another identity on the same server sees none of it; clear() leaves it alone.
    let other_id = id64k("other");
    let other = RedisStore::connect(&server.url(), &other_id)?;
    assert_eq!(other.exists(&keys[..4])?, [false; 4]);
    other.set(&entries(&keys[..1], &pages[..1]))?;
    // A value copied under another identity's prefix is ignored, not deleted.
    let mut raw = server.raw()?;
    let v: Vec<u8> = redis::cmd("GET")
        .arg(store.key_name(&keys[5]))
        .query(&mut raw)?;
    redis::cmd("SET")
        .arg(other.key_name(&keys[5]))
        .arg(v)
        .query::<()>(&mut raw)?;
    assert_eq!(other.get(&keys[5..6])?, [None]);
    assert_eq!(other.exists(&keys[5..6])?, [true]);
    assert_eq!(other.corrupt_removed(), 0);

    store.clear()?;
    assert_eq!(store.exists(&keys[..48])?, vec![false; 48]);
    assert_eq!(other.get(&keys[..1])?[0].as_deref(), Some(&pages[0][..]));

    // clear() over many keys (several SCAN rounds).
    let small = identity("small", 1);
    let s = RedisStore::connect(&server.url(), &small)?;
    let many: Vec<PageKey> = (0..2500).map(key).collect();
    let small_pages: Vec<Vec<u8>> = (0..2500).map(|i| page(&small, i)).collect();
    s.set(&entries(&many, &small_pages))?;
    assert!(s.exists(&many)?.iter().all(|&e| e));
    s.clear()?;
    assert!(s.exists(&many)?.iter().all(|&e| !e));
    let left: u64 = redis::cmd("DBSIZE").query(&mut raw)?;
    assert_eq!(left, 2, "the other identity's two keys remain");
    Ok(())
}

#[test]
fn damaged_values_are_deleted() -> Result<()> {
    let Some(bin) = require_server() else {
        return Ok(());
    };
    let server = Server::start(bin)?;
    let id = id64k("m");
    let store = RedisStore::connect(&server.url(), &id)?;
    let keys: Vec<PageKey> = (0..4).map(key).collect();
    let pages: Vec<Vec<u8>> = (0..4).map(|i| page(&id, i)).collect();
    store.set(&entries(&keys, &pages))?;
    let mut raw = server.raw()?;
    // 0: a payload byte flipped; 1: truncated; 2: not an entry at all.
    let k0 = store.key_name(&keys[0]);
    let mut v: Vec<u8> = redis::cmd("GET").arg(&k0).query(&mut raw)?;
    let n = v.len();
    v[n - 7] ^= 0x80;
    redis::cmd("SET").arg(&k0).arg(v).query::<()>(&mut raw)?;
    let k1 = store.key_name(&keys[1]);
    let v: Vec<u8> = redis::cmd("GETRANGE")
        .arg(&k1)
        .arg(0)
        .arg(999)
        .query(&mut raw)?;
    redis::cmd("SET").arg(&k1).arg(v).query::<()>(&mut raw)?;
    let k2 = store.key_name(&keys[2]);
    redis::cmd("SET")
        .arg(&k2)
        .arg("hello")
        .query::<()>(&mut raw)?;

    let got = store.get(&keys)?;
    assert_eq!(got[..3], [None, None, None]);
    assert_eq!(got[3].as_deref(), Some(&pages[3][..]));
    assert_eq!(store.corrupt_removed(), 3);
    let exists: u64 = redis::cmd("EXISTS").arg(&[&k0, &k1, &k2]).query(&mut raw)?;
    assert_eq!(exists, 0);
    // Written again, they read back.
    store.set(&entries(&keys[..3], &pages[..3]))?;
    assert!(store.get(&keys)?.iter().all(Option::is_some));
    Ok(())
}

fn expect_unavailable<T: std::fmt::Debug>(what: &str, r: Result<T, TierError>, t: Instant) {
    let took = t.elapsed();
    match r {
        Err(TierError::Unavailable(_)) => {}
        other => panic!("{what}: expected Unavailable, got {other:?}"),
    }
    assert!(took < Duration::from_secs(3), "{what} took {took:?}");
}

#[test]
fn server_killed_then_restarted() -> Result<()> {
    let Some(bin) = require_server() else {
        return Ok(());
    };
    let mut server = Server::start(bin)?;
    let id = id64k("m");
    let store = RedisStore::connect_with_timeout(&server.url(), &id, Duration::from_secs(1))?;
    let keys: Vec<PageKey> = (0..8).map(key).collect();
    let pages: Vec<Vec<u8>> = (0..8).map(|i| page(&id, i)).collect();
    store.set(&entries(&keys, &pages))?;

    server.kill();
    let t = Instant::now();
    expect_unavailable("get", store.get(&keys), t);
    let t = Instant::now();
    expect_unavailable("exists", store.exists(&keys), t);
    let t = Instant::now();
    expect_unavailable("set", store.set(&entries(&keys, &pages)), t);
    let t = Instant::now();
    expect_unavailable("clear", store.clear(), t);
    // Nothing listens: connecting afresh is Unavailable too, and prompt.
    let t = Instant::now();
    expect_unavailable(
        "connect",
        RedisStore::connect(&server.url(), &id).map(|_| ()),
        t,
    );

    // Restarted on the same port (empty: no persistence): the same store works again.
    server.spawn()?;
    assert_eq!(store.get(&keys[..1])?, [None]);
    store.set(&entries(&keys, &pages))?;
    assert_eq!(store.get(&keys[..1])?[0].as_deref(), Some(&pages[0][..]));
    Ok(())
}

#[test]
fn stopped_server_times_out() -> Result<()> {
    let Some(bin) = require_server() else {
        return Ok(());
    };
    let server = Server::start(bin)?;
    let id = id64k("m");
    let timeout = Duration::from_millis(300);
    let store = RedisStore::connect_with_timeout(&server.url(), &id, timeout)?;
    let keys: Vec<PageKey> = (0..4).map(key).collect();
    let pages: Vec<Vec<u8>> = (0..4).map(|i| page(&id, i)).collect();
    store.set(&entries(&keys, &pages))?;

    server.signal("-STOP")?;
    let t = Instant::now();
    let r = store.get(&keys);
    let took = t.elapsed();
    let cont = server.signal("-CONT");
    expect_unavailable("get of a stopped server", r, t);
    assert!(took >= timeout, "returned before the timeout: {took:?}");
    cont?;
    // Resumed: the next call reconnects.
    assert_eq!(store.get(&keys[..1])?[0].as_deref(), Some(&pages[0][..]));
    Ok(())
}

#[test]
fn config_and_bad_urls() -> Result<()> {
    let id = id64k("m");
    match RedisStore::connect("not a url", &id) {
        Err(TierError::Config(_)) => {}
        other => bail!("bad URL: {other:?}"),
    }
    let port = free_port()?;
    let t = Instant::now();
    expect_unavailable(
        "connect to a closed port",
        RedisStore::connect(&format!("redis://127.0.0.1:{port}"), &id).map(|_| ()),
        t,
    );
    let Some(bin) = require_server() else {
        return Ok(());
    };
    let server = Server::start(bin)?;
    let extra = serde_json::json!({"url": server.url(), "timeout": 0.5}).to_string();
    let cfg = StorageConfig::parse("redis", Some(&extra))?;
    let tier = open_store(&cfg, &id)?;
    assert_eq!(tier.name(), "redis");
    let p = page(&id, 3);
    tier.set(&[(key(3), &p[..])])?;
    let store = Store::open(&cfg, &id)?;
    assert_eq!(store.get(&[key(3)])?[0].as_deref(), Some(&p[..]));
    assert_eq!(store.corrupt_removed(), 0);
    Ok(())
}

/// Prints MSET/MGET throughput of 64 pages of 64 KiB over loopback.
#[test]
fn timing_64_pages_of_64k() -> Result<()> {
    let Some(bin) = require_server() else {
        return Ok(());
    };
    let server = Server::start(bin)?;
    let id = id64k("m");
    let store = RedisStore::connect(&server.url(), &id)?;
    let rounds = 16u32;
    let mut set_s = 0.0;
    let mut get_s = 0.0;
    for r in 0..rounds {
        let keys: Vec<PageKey> = (0..64).map(|i| key(r * 64 + i)).collect();
        let pages: Vec<Vec<u8>> = (0..64).map(|i| page(&id, r * 64 + i)).collect();
        let e = entries(&keys, &pages);
        let t = Instant::now();
        store.set(&e)?;
        set_s += t.elapsed().as_secs_f64();
        let t = Instant::now();
        let got = store.get(&keys)?;
        get_s += t.elapsed().as_secs_f64();
        ensure!(got.iter().all(Option::is_some), "missing pages");
    }
    let mb = 4.0 * rounds as f64;
    println!(
        "redis store, 64 pages of 64 KiB per call, {rounds} calls: MSET {:.1} ms/call ({:.0} MiB/s), MGET {:.1} ms/call ({:.0} MiB/s)",
        1e3 * set_s / rounds as f64,
        mb / set_s,
        1e3 * get_s / rounds as f64,
        mb / get_s
    );
    Ok(())
}
