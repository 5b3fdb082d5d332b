//! `bench serving` against a server that closes keep-alive connections
//! early, as llama.cpp's llama-server (cpp-httplib) does: a real HTTP/1.1
//! server written here on std's TCP sockets answers a few requests per
//! connection with keep-alive, then closes the connection when the next
//! request arrives, without reading it (the kernel resets the connection).
//! The client reused the pooled connection, so that request fails before any
//! byte of an answer; it must be sent again on a fresh connection and no
//! request may be lost. A server that resets every connection makes the
//! client give up after its retries, with the cause in the error.

use anyhow::{Context, Result};
use arbor_bench::client::{ApiBackend, ClientConfig, send_request};
use arbor_bench::dataset::Prompt;
use arbor_bench::run_serving;
use arbor_bench::serving::ServingArgs;
use clap::Parser;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

#[derive(Default)]
struct Counts {
    /// Completions answered.
    answered: AtomicUsize,
    /// Requests that arrived on a connection the server then closed unread.
    dropped: AtomicUsize,
    /// Connections accepted.
    connections: AtomicUsize,
}

/// Reads one request (head and body); `None` at end of stream.
fn read_request(r: &mut BufReader<TcpStream>) -> Result<Option<(String, Vec<u8>)>> {
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        return Ok(None);
    }
    let target = line.split(' ').nth(1).unwrap_or("/").to_string();
    let mut len = 0usize;
    loop {
        let mut h = String::new();
        r.read_line(&mut h)?;
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':')
            && k.eq_ignore_ascii_case("content-length")
        {
            len = v.trim().parse()?;
        }
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    Ok(Some((target, body)))
}

fn answer(s: &mut TcpStream, body: &str) -> Result<()> {
    write!(
        s,
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )?;
    s.flush()?;
    Ok(())
}

/// Serves one connection: `per_conn` requests, then a reset on the next.
fn serve_conn(stream: TcpStream, per_conn: usize, c: &Counts) -> Result<()> {
    let mut w = stream.try_clone()?;
    let mut r = BufReader::new(stream);
    let mut served = 0;
    loop {
        if served == per_conn {
            // Wait for the next request, then close without reading it.
            if r.buffer().is_empty() && w.peek(&mut [0u8; 1])? == 0 {
                return Ok(());
            }
            c.dropped.fetch_add(1, Ordering::SeqCst);
            return Ok(());
        }
        let Some((target, _)) = read_request(&mut r)? else {
            return Ok(());
        };
        let body = if target.starts_with("/v1/completions") {
            c.answered.fetch_add(1, Ordering::SeqCst);
            r#"{"choices":[{"text":"one two three","finish_reason":"length"}],"usage":{"prompt_tokens":8,"completion_tokens":3}}"#
        } else if target.starts_with("/v1/models") {
            r#"{"object":"list","data":[{"id":"m"}]}"#
        } else {
            "{}"
        };
        answer(&mut w, body)?;
        served += 1;
    }
}

/// A server on a free loopback port; its base URL and counters.
fn start(per_conn: usize) -> Result<(String, Arc<Counts>)> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    let url = format!("http://{}", l.local_addr()?);
    let counts = Arc::new(Counts::default());
    let c = counts.clone();
    std::thread::spawn(move || {
        for s in l.incoming().flatten() {
            c.connections.fetch_add(1, Ordering::SeqCst);
            let c = c.clone();
            std::thread::spawn(move || serve_conn(s, per_conn, &c));
        }
    });
    Ok((url, counts))
}

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: ServingArgs,
}

#[test]
fn requests_on_connections_the_server_closed_are_sent_again() -> Result<()> {
    let (url, counts) = start(2)?;
    let args = Cli::try_parse_from([
        "bench",
        "--backend",
        "openai",
        "--base-url",
        &url,
        "--model",
        "m",
        "--dataset-name",
        "random-ids",
        "--num-prompts",
        "24",
        "--random-input-len",
        "8",
        "--random-output-len",
        "3",
        "--random-range-ratio",
        "1",
        "--max-concurrency",
        "3",
        "--disable-stream",
        "--warmup-requests",
        "0",
        "--disable-tqdm",
    ])?
    .args;
    let r = run_serving(args)?;
    let failed: Vec<&str> = r
        .outputs
        .iter()
        .filter(|o| !o.success)
        .map(|o| o.error.as_str())
        .collect();
    assert!(failed.is_empty(), "lost requests: {failed:?}");
    assert_eq!((r.metrics.completed, r.metrics.failed), (24, 0));
    // Every request was answered exactly once, and the early closes happened.
    assert_eq!(counts.answered.load(Ordering::SeqCst), 24);
    let dropped = counts.dropped.load(Ordering::SeqCst);
    assert!(
        dropped >= 3,
        "the server closed only {dropped} reused connections"
    );
    Ok(())
}

#[tokio::test]
async fn a_server_that_resets_every_connection_fails_after_the_retries() -> Result<()> {
    let (url, counts) = start(0)?;
    let cfg = ClientConfig {
        backend: ApiBackend::Openai,
        api_url: format!("{url}/v1/completions"),
        model: "m".into(),
        stream: false,
        ignore_eos: true,
        extra_body: Default::default(),
        authorization: None,
    };
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = reqwest::Client::new();
    let out = send_request(
        &client,
        &cfg,
        &Prompt::Text("hello".into()),
        1,
        3,
        Instant::now(),
    )
    .await;
    assert!(!out.success);
    assert!(out.error.contains("request failed"), "{}", out.error);
    // The first send and two retries, each on its own connection.
    let conns = counts.connections.load(Ordering::SeqCst);
    assert_eq!(conns, 3, "connections: {conns}");
    assert_eq!(counts.answered.load(Ordering::SeqCst), 0);
    let _ = out.error.find("reset").context(out.error.clone())?;
    Ok(())
}
