//! KV page transfer between engines over TCP (prefill/decode
//! disaggregation): [`TcpTransfer`] sends an exported prefix
//! ([`KvPages`]) to a [`TcpReceiver`], which hands it to the decode
//! engine's `import_kv` and answers with the tokens it now caches.
//!
//! [`TcpRooms`] is the other direction, for SGLang's router: a prefill
//! worker keeps each request's KV in a bootstrap room and the decode worker
//! pulls it ([`KvTransfer::pull`], [`rooms`]).
//!
//! One connection per transfer; the frame format is in [`wire`]. The
//! sender waits for the receiver's answer, so once `send` returned `Ok` the
//! pages are in the decode engine's prefix cache. Every failure is an error
//! value (the decode side then computes the prefix itself); nothing here
//! panics on what the network brings.

pub mod rooms;
pub mod wire;

pub use rooms::{RoomConfig, TcpRooms};

use arbor_engine_core::engine::transfer::{
    KvPages, KvTransfer, Prefilled, TransferError, TransferReport,
};
use std::io::{BufReader, BufWriter, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Sends pages over TCP.
#[derive(Debug, Clone)]
pub struct TcpTransfer {
    connect_timeout: Duration,
    io_timeout: Duration,
}

impl Default for TcpTransfer {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(5),
            io_timeout: Duration::from_secs(60),
        }
    }
}

fn io(e: std::io::Error) -> TransferError {
    TransferError::Io(e.to_string())
}

impl KvTransfer for TcpTransfer {
    fn name(&self) -> &str {
        "tcp"
    }

    fn send(&self, peer: &str, pages: &KvPages) -> Result<TransferReport, TransferError> {
        let start = Instant::now();
        let addr = peer
            .to_socket_addrs()
            .map_err(|e| TransferError::BadPeer(format!("{peer}: {e}")))?
            .next()
            .ok_or_else(|| TransferError::BadPeer(peer.to_string()))?;
        let stream = TcpStream::connect_timeout(&addr, self.connect_timeout).map_err(io)?;
        stream.set_read_timeout(Some(self.io_timeout)).map_err(io)?;
        stream
            .set_write_timeout(Some(self.io_timeout))
            .map_err(io)?;
        let _ = stream.set_nodelay(true);
        let mut w = BufWriter::with_capacity(1 << 20, stream.try_clone().map_err(io)?);
        wire::write_pages(&mut w, pages).map_err(io)?;
        w.flush().map_err(io)?;
        drop(w);
        let tokens = wire::read_answer(&mut BufReader::new(stream))?;
        Ok(TransferReport {
            tokens,
            bytes: pages.bytes(),
            seconds: start.elapsed().as_secs_f64(),
        })
    }

    fn pull(&self, peer: &str, room: u64) -> Result<Prefilled, TransferError> {
        let addr = peer
            .to_socket_addrs()
            .map_err(|e| TransferError::BadPeer(format!("{peer}: {e}")))?
            .next()
            .ok_or_else(|| TransferError::BadPeer(peer.to_string()))?;
        rooms::pull(addr, room, self.connect_timeout, self.io_timeout)
    }
}

/// Wakes an accept loop blocked on `addr` with a connection of our own (an
/// unspecified address is reached on loopback).
pub(crate) fn wake(addr: SocketAddr) {
    let mut wake = addr;
    if wake.ip().is_unspecified() {
        wake.set_ip(match wake.ip() {
            std::net::IpAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
            std::net::IpAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
        });
    }
    let _ = TcpStream::connect_timeout(&wake, Duration::from_secs(1));
}

/// What the receiver does with pages that arrived: import them and say how
/// many tokens are now cached, or why not.
pub type PageSink = Arc<dyn Fn(KvPages) -> Result<usize, String> + Send + Sync>;

/// Accepts transfers on a TCP port until dropped.
pub struct TcpReceiver {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
}

impl std::fmt::Debug for TcpReceiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TcpReceiver({})", self.addr)
    }
}

impl TcpReceiver {
    /// Listens on `addr` (port 0: any free port) and hands every transfer to `sink`.
    pub fn bind(addr: &str, sink: PageSink, limits: wire::Limits) -> std::io::Result<Self> {
        let listener = TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        std::thread::Builder::new()
            .name("arbor-kv-recv".into())
            .spawn(move || {
                accept_loop(listener, flag, "KV transfer", move |stream| {
                    serve_one(stream, &sink, limits)
                })
            })?;
        Ok(Self { addr, stop })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for TcpReceiver {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // The accept loop blocks in `accept`: a connection of our own wakes
        // it to see the flag.
        wake(self.addr);
    }
}

/// Blocks in `accept` (a transfer starts as soon as it connects) until
/// `stop` is set (the owner's drop sets it and [`wake`]s the loop), serving
/// each connection with `serve` on a thread of its own; `what` names the
/// service in warnings.
pub(crate) fn accept_loop<F>(
    listener: TcpListener,
    stop: Arc<AtomicBool>,
    what: &'static str,
    serve: F,
) where
    F: Fn(TcpStream) -> std::io::Result<()> + Clone + Send + 'static,
{
    loop {
        let accepted = listener.accept();
        if stop.load(Ordering::SeqCst) {
            return;
        }
        match accepted {
            Ok((stream, from)) => {
                let serve = serve.clone();
                let spawned = std::thread::Builder::new()
                    .name("arbor-kv-conn".into())
                    .spawn(move || {
                        if let Err(e) = serve(stream) {
                            tracing::warn!("{what} from {from}: {e}");
                        }
                    });
                if let Err(e) = spawned {
                    tracing::warn!("{what} from {from}: no thread: {e}");
                }
            }
            Err(e) => {
                tracing::warn!("{what} accept: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

fn serve_one(stream: TcpStream, sink: &PageSink, limits: wire::Limits) -> std::io::Result<()> {
    stream.set_read_timeout(Some(Duration::from_secs(60)))?;
    stream.set_write_timeout(Some(Duration::from_secs(60)))?;
    let _ = stream.set_nodelay(true);
    let mut r = BufReader::with_capacity(1 << 20, stream.try_clone()?);
    let answer = match wire::read_pages(&mut r, limits) {
        Ok(pages) => sink(pages),
        Err(e) => Err(e.to_string()),
    };
    let mut w = BufWriter::new(stream);
    wire::write_answer(&mut w, &answer)?;
    w.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The accept loop blocks in `accept`; dropping the receiver wakes it,
    /// and the listening socket closes with it.
    #[test]
    fn a_dropped_receiver_frees_its_port() {
        let sink: PageSink = Arc::new(|_| Err("not importing".into()));
        let rx = TcpReceiver::bind("127.0.0.1:0", sink, wire::Limits::default()).unwrap();
        let addr = rx.local_addr();
        assert!(TcpListener::bind(addr).is_err(), "the port is in use");
        drop(rx);
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpListener::bind(addr).is_err() {
            assert!(
                Instant::now() < deadline,
                "{addr} still bound after the drop"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}
