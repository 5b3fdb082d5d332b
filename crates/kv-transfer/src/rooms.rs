//! Bootstrap rooms over TCP: a prefill worker's side of SGLang's
//! room-based PD flow. The router sends a request to the prefill and the
//! decode worker at once, both carrying `bootstrap_room`; the prefill
//! worker computes the prompt and deposits its KV in that room
//! ([`TcpRooms::put`]); the decode worker connects to the prefill worker's
//! bootstrap address and pulls the room ([`pull`]), waiting until the
//! pages are there.
//!
//! Pull frame (little-endian): `b"ARKR"`, `u32` version (2; 1 is still
//! served), `u64` room. Answer: `u8` 0, a page frame
//! ([`crate::wire::write_pages`]) and, for version 2, the first token:
//! `u8` 0 (none), or `u8` 1, `u32` token, `u32` count and the prompt's
//! tail as `u32`, then the CRC-32 of those fields; or `u8` 1, `u32` length
//! and a UTF-8 message. A version-1 puller gets the pages alone and
//! computes the prompt's last position itself.
//!
//! Invariants: a room is taken by exactly one pull (a second pull of the
//! same room waits and then times out); a room nobody pulls is dropped
//! after [`RoomConfig::ttl`], so deposited pages never accumulate; a pull
//! waits at most [`RoomConfig::wait`] for its room.

use crate::wire::{self, Limits};
use arbor_engine_core::engine::transfer::{FirstToken, KvRooms, Prefilled, TransferError};
use std::collections::HashMap;
use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

const MAGIC: &[u8; 4] = b"ARKR";
const VERSION: u32 = 2;
/// The first version, answered without the first token.
const VERSION_PAGES_ONLY: u32 = 1;
/// Most prompt-tail tokens a first-token section may carry.
const MAX_TAIL: usize = 1 << 24;

/// How long rooms wait.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RoomConfig {
    /// Longest a pull waits for its room to be deposited.
    pub wait: Duration,
    /// Longest a deposited room waits for its pull.
    pub ttl: Duration,
}

impl Default for RoomConfig {
    fn default() -> Self {
        Self {
            wait: Duration::from_secs(50),
            ttl: Duration::from_secs(120),
        }
    }
}

type RoomPages = Result<Prefilled, String>;

struct Store {
    rooms: Mutex<HashMap<u64, (RoomPages, Instant)>>,
    deposited: Condvar,
    cfg: RoomConfig,
}

impl Store {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, (RoomPages, Instant)>> {
        self.rooms.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn put(&self, room: u64, pages: RoomPages) {
        let mut rooms = self.lock();
        let now = Instant::now();
        rooms.retain(|r, (_, at)| {
            let keep = now.duration_since(*at) < self.cfg.ttl;
            if !keep {
                tracing::warn!("bootstrap room {r}: nobody pulled its KV; dropped");
            }
            keep
        });
        rooms.insert(room, (pages, now));
        self.deposited.notify_all();
    }

    fn take(&self, room: u64) -> RoomPages {
        let deadline = Instant::now() + self.cfg.wait;
        let mut rooms = self.lock();
        loop {
            if let Some((pages, _)) = rooms.remove(&room) {
                return pages;
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(format!(
                    "bootstrap room {room}: no KV after {:.0} s",
                    self.cfg.wait.as_secs_f64()
                ));
            }
            rooms = self
                .deposited
                .wait_timeout(rooms, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn len(&self) -> usize {
        self.lock().len()
    }
}

/// A prefill worker's bootstrap server: rooms of exported KV, served to
/// decode workers that pull them. Stops listening when dropped.
pub struct TcpRooms {
    addr: SocketAddr,
    store: Arc<Store>,
    stop: Arc<AtomicBool>,
}

impl std::fmt::Debug for TcpRooms {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TcpRooms({})", self.addr)
    }
}

impl TcpRooms {
    /// Listens on `addr` (port 0: any free port).
    pub fn bind(addr: &str, cfg: RoomConfig) -> std::io::Result<Self> {
        let listener = TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        let store = Arc::new(Store {
            rooms: Mutex::new(HashMap::new()),
            deposited: Condvar::new(),
            cfg,
        });
        let stop = Arc::new(AtomicBool::new(false));
        let (s, flag) = (store.clone(), stop.clone());
        std::thread::Builder::new()
            .name("arbor-kv-rooms".into())
            .spawn(move || {
                crate::accept_loop(listener, flag, "KV room pull", move |stream| {
                    serve_pull(stream, &s)
                })
            })?;
        Ok(Self { addr, store, stop })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Rooms deposited and not pulled yet.
    pub fn pending(&self) -> usize {
        self.store.len()
    }
}

impl KvRooms for TcpRooms {
    fn address(&self) -> String {
        self.addr.to_string()
    }

    fn put(&self, room: u64, prefilled: Result<Prefilled, String>) {
        self.store.put(room, prefilled);
    }
}

impl Drop for TcpRooms {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        crate::wake(self.addr);
    }
}

fn serve_pull(stream: TcpStream, store: &Store) -> std::io::Result<()> {
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let _ = stream.set_nodelay(true);
    let mut r = BufReader::new(stream.try_clone()?);
    let mut head = [0u8; 16];
    r.read_exact(&mut head)?;
    let mut w = BufWriter::with_capacity(1 << 20, stream);
    let version = u32::from_le_bytes([head[4], head[5], head[6], head[7]]);
    let answer = if &head[..4] != MAGIC || !(VERSION_PAGES_ONLY..=VERSION).contains(&version) {
        Err(format!("not a KV room pull (version {version})"))
    } else {
        let mut room = [0u8; 8];
        room.copy_from_slice(&head[8..]);
        store.take(u64::from_le_bytes(room))
    };
    w.get_ref()
        .set_write_timeout(Some(Duration::from_secs(60)))?;
    match answer {
        Ok(prefilled) => {
            w.write_all(&[0])?;
            wire::write_pages(&mut w, &prefilled.pages)?;
            if version >= VERSION {
                write_first(&mut w, prefilled.first.as_ref())?;
            }
        }
        Err(msg) => {
            w.write_all(&[1])?;
            w.write_all(&(msg.len() as u32).to_le_bytes())?;
            w.write_all(msg.as_bytes())?;
        }
    }
    w.flush()
}

/// Writes the first-token section of a version-2 answer.
fn write_first(w: &mut impl Write, first: Option<&FirstToken>) -> std::io::Result<()> {
    let Some(f) = first else {
        return w.write_all(&[0]);
    };
    let count = u32::try_from(f.prompt_tail.len())
        .ok()
        .filter(|&n| n as usize <= MAX_TAIL)
        .ok_or_else(|| std::io::Error::other("a prompt tail too long for the frame"))?;
    let mut b = Vec::with_capacity(9 + 4 * f.prompt_tail.len());
    b.push(1);
    b.extend_from_slice(&f.token.to_le_bytes());
    b.extend_from_slice(&count.to_le_bytes());
    for t in &f.prompt_tail {
        b.extend_from_slice(&t.to_le_bytes());
    }
    let crc = crc32fast::hash(&b);
    w.write_all(&b)?;
    w.write_all(&crc.to_le_bytes())
}

/// Reads the first-token section [`write_first`] wrote.
fn read_first(r: &mut impl Read) -> Result<Option<FirstToken>, TransferError> {
    let proto = |e: std::io::Error| TransferError::Protocol(format!("truncated first token: {e}"));
    let mut head = [0u8; 9];
    r.read_exact(&mut head[..1]).map_err(proto)?;
    match head[0] {
        0 => return Ok(None),
        1 => {}
        x => return Err(TransferError::Protocol(format!("first-token marker {x}"))),
    }
    r.read_exact(&mut head[1..]).map_err(proto)?;
    let token = u32::from_le_bytes([head[1], head[2], head[3], head[4]]);
    let count = u32::from_le_bytes([head[5], head[6], head[7], head[8]]) as usize;
    if count > MAX_TAIL {
        return Err(TransferError::Protocol(format!(
            "a prompt tail of {count} tokens"
        )));
    }
    let mut tail = vec![0u8; 4 * count];
    r.read_exact(&mut tail).map_err(proto)?;
    let mut sum = [0u8; 4];
    r.read_exact(&mut sum).map_err(proto)?;
    let mut crc = crc32fast::Hasher::new();
    crc.update(&head);
    crc.update(&tail);
    if crc.finalize() != u32::from_le_bytes(sum) {
        return Err(TransferError::Protocol(
            "first token: checksum mismatch".into(),
        ));
    }
    let prompt_tail = tail
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    Ok(Some(FirstToken { prompt_tail, token }))
}

/// Pulls room `room` from the bootstrap server at `addr`; waits as long as
/// the server holds the pull open (its [`RoomConfig::wait`]) plus `io`.
pub(crate) fn pull(
    addr: SocketAddr,
    room: u64,
    connect: Duration,
    io: Duration,
) -> Result<Prefilled, TransferError> {
    let ioe = |e: std::io::Error| TransferError::Io(e.to_string());
    let stream = TcpStream::connect_timeout(&addr, connect).map_err(ioe)?;
    stream.set_read_timeout(Some(io)).map_err(ioe)?;
    stream.set_write_timeout(Some(io)).map_err(ioe)?;
    let _ = stream.set_nodelay(true);
    let mut frame = Vec::with_capacity(16);
    frame.extend_from_slice(MAGIC);
    frame.extend_from_slice(&VERSION.to_le_bytes());
    frame.extend_from_slice(&room.to_le_bytes());
    (&stream).write_all(&frame).map_err(ioe)?;
    let mut r = BufReader::with_capacity(1 << 20, stream);
    let mut status = [0u8; 1];
    r.read_exact(&mut status).map_err(ioe)?;
    match status[0] {
        0 => {
            let pages = wire::read_pages(&mut r, Limits::default())?;
            let first = read_first(&mut r)?;
            Ok(Prefilled { pages, first })
        }
        1 => {
            let mut len = [0u8; 4];
            r.read_exact(&mut len).map_err(ioe)?;
            let len = u32::from_le_bytes(len) as usize;
            if len > 1 << 16 {
                return Err(TransferError::Protocol(format!("a {len}-byte message")));
            }
            let mut msg = vec![0u8; len];
            r.read_exact(&mut msg).map_err(ioe)?;
            Err(TransferError::Refused(
                String::from_utf8_lossy(&msg).into_owned(),
            ))
        }
        s => Err(TransferError::Protocol(format!("room answer status {s}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arbor_engine_core::CacheNamespace;
    use arbor_engine_core::engine::transfer::{KvPages, KvTransfer};

    fn pages(seed: u8) -> KvPages {
        KvPages {
            layout: [seed; 32],
            page_size: 2,
            page_bytes: 4,
            namespace: CacheNamespace::default(),
            tokens: vec![1, 2, 3, 4],
            pages: vec![vec![seed; 4], vec![seed + 1; 4]],
        }
    }

    fn prefilled(seed: u8) -> Prefilled {
        Prefilled::pages(pages(seed))
    }

    fn rooms(wait_ms: u64, ttl_ms: u64) -> TcpRooms {
        let cfg = RoomConfig {
            wait: Duration::from_millis(wait_ms),
            ttl: Duration::from_millis(ttl_ms),
        };
        TcpRooms::bind("127.0.0.1:0", cfg).unwrap()
    }

    #[test]
    fn a_room_is_pulled_once_whether_it_comes_before_or_after_the_pull() {
        let r = rooms(5_000, 60_000);
        let tcp = crate::TcpTransfer::default();
        let addr = r.address();
        // Deposited first.
        r.put(7, Ok(prefilled(3)));
        let got = tcp.pull(&addr, 7).unwrap();
        assert_eq!(got, prefilled(3));
        assert_eq!(r.pending(), 0);
        // Pulled first: the pull waits for the deposit.
        let r = Arc::new(r);
        let r2 = r.clone();
        let late = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(150));
            r2.put(1 << 62, Ok(prefilled(9)));
        });
        let got = tcp.pull(&addr, 1 << 62).unwrap();
        assert_eq!(got, prefilled(9));
        late.join().unwrap();
        // A failed prefill's room says why.
        r.put(8, Err("the prompt is empty".into()));
        let e = tcp.pull(&addr, 8).unwrap_err();
        assert!(e.to_string().contains("the prompt is empty"), "{e}");
    }

    #[test]
    fn a_missing_room_times_out_and_an_unpulled_room_expires() {
        let r = rooms(200, 100);
        let tcp = crate::TcpTransfer::default();
        let start = Instant::now();
        let e = tcp.pull(&r.address(), 5).unwrap_err();
        assert!(e.to_string().contains("no KV after"), "{e}");
        assert!(start.elapsed() >= Duration::from_millis(200));
        r.put(1, Ok(prefilled(1)));
        std::thread::sleep(Duration::from_millis(150));
        // The next deposit drops the expired room.
        r.put(2, Ok(prefilled(2)));
        assert_eq!(r.pending(), 1);
        assert!(tcp.pull(&r.address(), 2).is_ok());
        // A dropped server frees its port.
        let addr = r.local_addr();
        drop(r);
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpListener::bind(addr).is_err() {
            assert!(Instant::now() < deadline, "{addr} still bound");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The prefill's first token travels with the pages to a version-2
    /// puller, intact (its section is checksummed); a version-1 puller
    /// (an older decode worker) gets the pages alone.
    #[test]
    fn the_first_token_reaches_a_current_puller_and_an_old_one_gets_pages() {
        let r = rooms(5_000, 60_000);
        let tcp = crate::TcpTransfer::default();
        let with_first = Prefilled {
            pages: pages(5),
            first: Some(FirstToken {
                prompt_tail: vec![9, 8, 7],
                token: 42,
            }),
        };
        r.put(3, Ok(with_first.clone()));
        let got = tcp.pull(&r.address(), 3).unwrap();
        assert_eq!(got, with_first);
        assert_eq!(got.first_token_for(&[1, 2, 3, 4, 9, 8, 7]), Some(42));
        // Another prompt (longer, shorter, or another tail) gets no token.
        for other in [
            &[1, 2, 3, 4, 9, 8, 7, 6][..],
            &[1, 2, 3, 4, 9, 8],
            &[1, 2, 3, 5, 9, 8, 7],
        ] {
            assert_eq!(got.first_token_for(other), None, "{other:?}");
        }
        r.put(4, Ok(with_first));
        let mut s = TcpStream::connect(r.local_addr()).unwrap();
        let mut frame = MAGIC.to_vec();
        frame.extend_from_slice(&VERSION_PAGES_ONLY.to_le_bytes());
        frame.extend_from_slice(&4u64.to_le_bytes());
        s.write_all(&frame).unwrap();
        let mut status = [0u8; 1];
        s.read_exact(&mut status).unwrap();
        assert_eq!(status[0], 0);
        assert_eq!(
            wire::read_pages(&mut s, Limits::default()).unwrap(),
            pages(5)
        );
        let mut rest = Vec::new();
        s.read_to_end(&mut rest).unwrap();
        assert!(rest.is_empty(), "{} bytes after the pages", rest.len());
    }

    #[test]
    fn a_corrupt_first_token_section_is_refused() {
        let first = FirstToken {
            prompt_tail: vec![3, 4],
            token: 11,
        };
        let mut b = Vec::new();
        write_first(&mut b, Some(&first)).unwrap();
        assert_eq!(read_first(&mut &b[..]).unwrap(), Some(first));
        let mut none = Vec::new();
        write_first(&mut none, None).unwrap();
        assert_eq!(read_first(&mut &none[..]).unwrap(), None);
        for at in 0..b.len() {
            let mut bad = b.clone();
            bad[at] ^= 0x10;
            assert!(read_first(&mut &bad[..]).is_err(), "flipped byte {at}");
        }
        assert!(read_first(&mut &b[..b.len() - 1]).is_err());
        assert!(read_first(&mut &[2u8][..]).is_err());
    }

    #[test]
    fn a_bad_pull_frame_is_refused() {
        let r = rooms(200, 1000);
        let mut s = TcpStream::connect(r.local_addr()).unwrap();
        s.write_all(b"XXXX\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00")
            .unwrap();
        let mut status = [0u8; 1];
        s.read_exact(&mut status).unwrap();
        assert_eq!(status[0], 1);
    }
}
