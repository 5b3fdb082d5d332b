//! A real `redis-server` for tests: started on a free loopback port in a
//! temporary folder, killed on drop; `require_server` finds the binary or
//! says why the test skips (and fails under `ARBOR_REQUIRE_REDIS=1`).
#![allow(dead_code)]

use anyhow::{Context, Result, bail, ensure};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub fn redis_server_bin() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("ARBOR_REDIS_SERVER").filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join("redis-server"))
        .find(|p| p.is_file())
}

/// The server binary, or `None` (after saying why) when the test should skip.
pub fn require_server() -> Option<PathBuf> {
    let bin = redis_server_bin();
    if bin.is_none() {
        assert!(
            std::env::var("ARBOR_REQUIRE_REDIS").map_or(true, |v| v != "1"),
            "ARBOR_REQUIRE_REDIS=1 but no redis-server on PATH (or ARBOR_REDIS_SERVER)"
        );
        eprintln!(
            "skipping: no redis-server on PATH (install redis-server, or set ARBOR_REDIS_SERVER)"
        );
    }
    bin
}

/// A redis-server this test started; killed when dropped.
pub struct Server {
    pub bin: PathBuf,
    pub dir: tempfile::TempDir,
    pub port: u16,
    pub child: Option<Child>,
}

pub fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn ping(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    let mut buf = [0u8; 7];
    s.write_all(b"PING\r\n").is_ok() && s.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n"
}

impl Server {
    pub fn start(bin: PathBuf) -> Result<Self> {
        let mut dir = tempfile::tempdir()?;
        let mut last = None;
        for _ in 0..5 {
            let mut s = Server {
                bin: bin.clone(),
                dir,
                port: free_port()?,
                child: None,
            };
            match s.spawn() {
                Ok(()) => return Ok(s),
                Err(e) => {
                    last = Some(e);
                    dir = std::mem::replace(&mut s.dir, tempfile::tempdir()?);
                }
            }
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("redis-server did not start")))
    }

    /// Starts the server (again) on its port and waits until it answers.
    pub fn spawn(&mut self) -> Result<()> {
        let mut child = Command::new(&self.bin)
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("start {}", self.bin.display()))?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Some(status) = child.try_wait()? {
                bail!("redis-server on port {} exited: {status}", self.port);
            }
            if ping(self.port) {
                self.child = Some(child);
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
        bail!("redis-server on port {} did not answer", self.port)
    }

    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn signal(&self, sig: &str) -> Result<()> {
        let pid = self.child.as_ref().context("not running")?.id();
        let st = Command::new("kill")
            .arg(sig)
            .arg(pid.to_string())
            .status()?;
        ensure!(st.success(), "kill {sig} {pid}: {st}");
        Ok(())
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn raw(&self) -> Result<redis::Connection> {
        Ok(redis::Client::open(self.url())?.get_connection()?)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}
