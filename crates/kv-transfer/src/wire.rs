//! The transfer frame (little-endian), version 1.
//!
//! Request: `b"ARKV"`, `u32` version, 32-byte layout digest, `u32` page
//! size, `u32` page bytes, the namespace (`u32` length, `u32::MAX` for
//! none, then UTF-8), `u32` token count and the tokens as `u32`, `u32` page
//! count and the pages' bytes, then the CRC-32 of everything after the
//! magic. Answer: `b"ARKV"`, `u8` 0 and `u64` tokens cached, or `u8` 1,
//! `u32` length and a UTF-8 message.
//!
//! A reader checks the magic, the version, the [`Limits`] before
//! allocating, the consistency of counts and the checksum; anything else
//! is a [`TransferError::Protocol`].

use arbor_engine_core::CacheNamespace;
use arbor_engine_core::engine::transfer::{KvPages, TransferError};
use std::io::{Read, Write};

const MAGIC: &[u8; 4] = b"ARKV";
const VERSION: u32 = 1;

/// Sizes a receiver accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Most pages in one transfer.
    pub max_pages: usize,
    /// Most bytes per page.
    pub max_page_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_pages: 1 << 20,
            max_page_bytes: 64 << 20,
        }
    }
}

struct Crc<W> {
    inner: W,
    crc: crc32fast::Hasher,
}

impl<W: Write> Crc<W> {
    fn put(&mut self, b: &[u8]) -> std::io::Result<()> {
        self.crc.update(b);
        self.inner.write_all(b)
    }
    fn u32(&mut self, v: u32) -> std::io::Result<()> {
        self.put(&v.to_le_bytes())
    }
}

fn len32(n: usize) -> std::io::Result<u32> {
    u32::try_from(n).map_err(|_| std::io::Error::other(format!("{n} does not fit the frame")))
}

/// Writes `p` as a request frame.
pub fn write_pages(w: &mut impl Write, p: &KvPages) -> std::io::Result<()> {
    w.write_all(MAGIC)?;
    let mut c = Crc {
        inner: w,
        crc: crc32fast::Hasher::new(),
    };
    c.u32(VERSION)?;
    c.put(&p.layout)?;
    c.u32(len32(p.page_size)?)?;
    c.u32(len32(p.page_bytes)?)?;
    match &p.namespace.0 {
        None => c.u32(u32::MAX)?,
        Some(s) => {
            c.u32(len32(s.len())?)?;
            c.put(s.as_bytes())?;
        }
    }
    c.u32(len32(p.tokens.len())?)?;
    let mut tok = Vec::with_capacity(4 * p.tokens.len());
    for t in &p.tokens {
        tok.extend_from_slice(&t.to_le_bytes());
    }
    c.put(&tok)?;
    c.u32(len32(p.pages.len())?)?;
    for page in &p.pages {
        c.put(page)?;
    }
    let sum = c.crc.finalize();
    c.inner.write_all(&sum.to_le_bytes())
}

struct CrcR<R> {
    inner: R,
    crc: crc32fast::Hasher,
}

fn proto(m: impl Into<String>) -> TransferError {
    TransferError::Protocol(m.into())
}

impl<R: Read> CrcR<R> {
    fn take(&mut self, n: usize) -> Result<Vec<u8>, TransferError> {
        let mut b = vec![0; n];
        self.inner
            .read_exact(&mut b)
            .map_err(|e| proto(format!("truncated frame: {e}")))?;
        self.crc.update(&b);
        Ok(b)
    }
    fn u32(&mut self) -> Result<u32, TransferError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
}

/// Reads a request frame.
pub fn read_pages(r: &mut impl Read, limits: Limits) -> Result<KvPages, TransferError> {
    let mut magic = [0u8; 4];
    r.read_exact(&mut magic)
        .map_err(|e| proto(format!("no frame: {e}")))?;
    if &magic != MAGIC {
        return Err(proto("not a KV transfer (bad magic)"));
    }
    let mut c = CrcR {
        inner: r,
        crc: crc32fast::Hasher::new(),
    };
    let version = c.u32()?;
    if version != VERSION {
        return Err(proto(format!(
            "frame version {version}, this build reads {VERSION}"
        )));
    }
    let layout: [u8; 32] = c.take(32)?.try_into().map_err(|_| proto("layout digest"))?;
    let page_size = c.u32()? as usize;
    let page_bytes = c.u32()? as usize;
    if page_bytes > limits.max_page_bytes {
        return Err(proto(format!(
            "pages of {page_bytes} bytes exceed {}",
            limits.max_page_bytes
        )));
    }
    let ns_len = c.u32()?;
    let namespace = if ns_len == u32::MAX {
        CacheNamespace(None)
    } else {
        if ns_len > 1 << 16 {
            return Err(proto("namespace too long"));
        }
        let b = c.take(ns_len as usize)?;
        CacheNamespace(Some(
            String::from_utf8(b).map_err(|_| proto("namespace is not UTF-8"))?,
        ))
    };
    let n_tokens = c.u32()? as usize;
    if page_size == 0 || n_tokens > limits.max_pages.saturating_mul(page_size) {
        return Err(proto(format!("{n_tokens} tokens in pages of {page_size}")));
    }
    let tb = c.take(4 * n_tokens)?;
    let tokens = tb
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let n_pages = c.u32()? as usize;
    if n_pages > limits.max_pages || n_pages * page_size != n_tokens {
        return Err(proto(format!("{n_pages} pages for {n_tokens} tokens")));
    }
    let mut pages = Vec::with_capacity(n_pages);
    for _ in 0..n_pages {
        pages.push(c.take(page_bytes)?);
    }
    let want = c.crc.finalize();
    let mut sum = [0u8; 4];
    c.inner
        .read_exact(&mut sum)
        .map_err(|e| proto(format!("truncated frame: {e}")))?;
    if u32::from_le_bytes(sum) != want {
        return Err(proto("checksum mismatch"));
    }
    Ok(KvPages {
        layout,
        page_size,
        page_bytes,
        namespace,
        tokens,
        pages,
    })
}

/// Writes the receiver's answer.
pub fn write_answer(w: &mut impl Write, a: &Result<usize, String>) -> std::io::Result<()> {
    w.write_all(MAGIC)?;
    match a {
        Ok(n) => {
            w.write_all(&[0])?;
            w.write_all(&(*n as u64).to_le_bytes())
        }
        Err(m) => {
            w.write_all(&[1])?;
            let m = &m.as_bytes()[..m.len().min(1 << 16)];
            w.write_all(&(m.len() as u32).to_le_bytes())?;
            w.write_all(m)
        }
    }
}

/// Reads the receiver's answer.
pub fn read_answer(r: &mut impl Read) -> Result<usize, TransferError> {
    let mut head = [0u8; 5];
    r.read_exact(&mut head)
        .map_err(|e| TransferError::Io(format!("no answer: {e}")))?;
    if &head[..4] != MAGIC {
        return Err(proto("not a KV transfer answer"));
    }
    if head[4] == 0 {
        let mut n = [0u8; 8];
        r.read_exact(&mut n)
            .map_err(|e| TransferError::Io(format!("truncated answer: {e}")))?;
        return Ok(u64::from_le_bytes(n) as usize);
    }
    let mut len = [0u8; 4];
    r.read_exact(&mut len)
        .map_err(|e| TransferError::Io(format!("truncated answer: {e}")))?;
    let len = (u32::from_le_bytes(len) as usize).min(1 << 16);
    let mut m = vec![0; len];
    r.read_exact(&mut m)
        .map_err(|e| TransferError::Io(format!("truncated answer: {e}")))?;
    Err(TransferError::Refused(
        String::from_utf8_lossy(&m).into_owned(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> KvPages {
        KvPages {
            layout: [7; 32],
            page_size: 2,
            page_bytes: 5,
            namespace: CacheNamespace(Some("lora:x\u{1f}".into())),
            tokens: vec![1, 2, 3, 4],
            pages: vec![vec![1, 2, 3, 4, 5], vec![9, 8, 7, 6, 5]],
        }
    }

    fn frame(p: &KvPages) -> Vec<u8> {
        let mut b = Vec::new();
        write_pages(&mut b, p).expect("in memory");
        b
    }

    #[test]
    fn frames_round_trip() {
        for p in [
            sample(),
            KvPages {
                namespace: CacheNamespace(None),
                tokens: vec![],
                pages: vec![],
                ..sample()
            },
        ] {
            let got = read_pages(&mut frame(&p).as_slice(), Limits::default()).expect("valid");
            assert_eq!(got, p);
        }
        let mut b = Vec::new();
        write_answer(&mut b, &Ok(42)).expect("in memory");
        assert_eq!(read_answer(&mut b.as_slice()), Ok(42));
        let mut b = Vec::new();
        write_answer(&mut b, &Err("no pages".into())).expect("in memory");
        assert_eq!(
            read_answer(&mut b.as_slice()),
            Err(TransferError::Refused("no pages".into()))
        );
    }

    #[test]
    fn damaged_frames_are_refused() {
        let good = frame(&sample());
        // Every truncation and every flipped byte is caught.
        for cut in 0..good.len() {
            assert!(
                read_pages(&mut &good[..cut], Limits::default()).is_err(),
                "cut {cut}"
            );
        }
        for i in 0..good.len() {
            let mut bad = good.clone();
            bad[i] ^= 0x40;
            assert!(
                read_pages(&mut bad.as_slice(), Limits::default()).is_err(),
                "byte {i}"
            );
        }
        let small = Limits {
            max_pages: 1,
            max_page_bytes: 64,
        };
        assert!(
            matches!(read_pages(&mut good.as_slice(), small), Err(TransferError::Protocol(m)) if m.contains("pages"))
        );
        let tiny = Limits {
            max_pages: 8,
            max_page_bytes: 4,
        };
        assert!(read_pages(&mut good.as_slice(), tiny).is_err());
    }
}
