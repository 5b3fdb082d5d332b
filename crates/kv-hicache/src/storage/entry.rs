//! The stored form of one page, shared by every backend.
//!
//! An entry is a fixed [`HEADER_BYTES`]-byte header then the payload:
//!
//! | bytes  | field                                                |
//! |--------|------------------------------------------------------|
//! | 0..4   | magic `AKVE`                                         |
//! | 4..6   | format version, u16 LE ([`FORMAT_VERSION`])          |
//! | 6..8   | reserved, zero                                       |
//! | 8..40  | [`TierIdentity::digest`] of the store that wrote it  |
//! | 40..72 | the [`PageKey`]                                      |
//! | 72..80 | payload length, u64 LE                               |
//! | 80..84 | CRC-32 (IEEE) of the payload, u32 LE                 |
//!
//! Invariant: [`EntryCodec::decode`] returns a payload only when every header
//! field matches (magic, version, zero reserved bytes, this identity, the key
//! asked for, the identity's page length, the bytes actually present) and the
//! checksum matches. The page key already depends on the identity; the
//! identity digest in the header is a second guard. An entry of another
//! identity is [`EntryError::Foreign`] (ignored, left in place); anything else
//! that fails is [`EntryError::Corrupt`] (the backend removes it).

use arbor_engine_core::tier::{PAGE_KEY_BYTES, PageKey, TierIdentity};

/// Magic bytes at the start of every entry.
pub const MAGIC: [u8; 4] = *b"AKVE";
/// Version of the entry layout.
pub const FORMAT_VERSION: u16 = 1;
/// Bytes of the header before the payload.
pub const HEADER_BYTES: usize = 84;

/// Hex characters of the identity digest naming an identity's folder.
pub const IDENTITY_PREFIX_CHARS: usize = 16;

/// The first [`IDENTITY_PREFIX_CHARS`] hex characters of `identity`'s digest.
pub fn identity_prefix(identity: &TierIdentity) -> String {
    let mut s = String::with_capacity(IDENTITY_PREFIX_CHARS);
    for b in &identity.digest()[..IDENTITY_PREFIX_CHARS / 2] {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

/// Why an entry was not decoded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EntryError {
    /// The entry was written for another identity: ignore it, never load it.
    #[error("entry of another identity")]
    Foreign,
    /// The entry is damaged (truncated, wrong key, bad checksum...): remove it.
    #[error("corrupt entry: {0}")]
    Corrupt(String),
}

/// A parsed and checked header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EntryHeader {
    /// Payload bytes that follow the header.
    pub payload_len: usize,
    /// CRC-32 of the payload.
    pub crc: u32,
}

/// Encodes and checks the entries of one identity.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EntryCodec {
    digest: [u8; PAGE_KEY_BYTES],
    page_bytes: usize,
}

impl EntryCodec {
    /// The codec of `identity`'s pages.
    pub fn new(identity: &TierIdentity) -> Self {
        Self {
            digest: identity.digest(),
            page_bytes: identity.page_bytes(),
        }
    }

    /// The identity digest written in every header.
    pub fn digest(&self) -> &[u8; PAGE_KEY_BYTES] {
        &self.digest
    }

    /// Bytes of a page (the only payload length accepted).
    pub fn page_bytes(&self) -> usize {
        self.page_bytes
    }

    /// Bytes of a whole entry (header and page).
    pub fn entry_bytes(&self) -> usize {
        HEADER_BYTES + self.page_bytes
    }

    /// The header of `payload` stored under `key`.
    pub fn header(&self, key: &PageKey, payload: &[u8]) -> [u8; HEADER_BYTES] {
        let mut h = [0u8; HEADER_BYTES];
        h[0..4].copy_from_slice(&MAGIC);
        h[4..6].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        h[8..40].copy_from_slice(&self.digest);
        h[40..72].copy_from_slice(&key.0);
        h[72..80].copy_from_slice(&(payload.len() as u64).to_le_bytes());
        h[80..84].copy_from_slice(&crc32fast::hash(payload).to_le_bytes());
        h
    }

    /// The whole entry (header then payload) of `payload` under `key`.
    pub fn encode(&self, key: &PageKey, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER_BYTES + payload.len());
        out.extend_from_slice(&self.header(key, payload));
        out.extend_from_slice(payload);
        out
    }

    /// Checks a header read for `key`; the payload is checked by [`check_payload`](Self::check_payload).
    pub fn parse_header(
        &self,
        header: &[u8; HEADER_BYTES],
        key: &PageKey,
    ) -> Result<EntryHeader, EntryError> {
        let corrupt = |why: &str| Err(EntryError::Corrupt(format!("{why} ({key:?})")));
        if header[0..4] != MAGIC {
            return corrupt("bad magic");
        }
        let version = u16::from_le_bytes([header[4], header[5]]);
        if version != FORMAT_VERSION {
            return corrupt(&format!(
                "format version {version}, expected {FORMAT_VERSION}"
            ));
        }
        if header[6..8] != [0, 0] {
            return corrupt("reserved bytes set");
        }
        if header[8..40] != self.digest {
            return Err(EntryError::Foreign);
        }
        if header[40..72] != key.0 {
            return corrupt("entry holds another key");
        }
        let mut len = [0u8; 8];
        len.copy_from_slice(&header[72..80]);
        let len = u64::from_le_bytes(len);
        if len != self.page_bytes as u64 {
            return corrupt(&format!(
                "payload of {len} bytes, pages are {} bytes",
                self.page_bytes
            ));
        }
        let crc = u32::from_le_bytes([header[80], header[81], header[82], header[83]]);
        Ok(EntryHeader {
            payload_len: self.page_bytes,
            crc,
        })
    }

    /// Checks the payload read after `header`.
    pub fn check_payload(
        &self,
        header: &EntryHeader,
        key: &PageKey,
        payload: &[u8],
    ) -> Result<(), EntryError> {
        if payload.len() != header.payload_len {
            return Err(EntryError::Corrupt(format!(
                "{} payload bytes present, header says {} ({key:?})",
                payload.len(),
                header.payload_len
            )));
        }
        if crc32fast::hash(payload) != header.crc {
            return Err(EntryError::Corrupt(format!("bad checksum ({key:?})")));
        }
        Ok(())
    }

    /// Checks a whole entry read for `key` and returns its payload.
    pub fn decode<'a>(&self, bytes: &'a [u8], key: &PageKey) -> Result<&'a [u8], EntryError> {
        let Some((head, payload)) = bytes.split_first_chunk::<HEADER_BYTES>() else {
            return Err(EntryError::Corrupt(format!(
                "{} bytes, shorter than the header ({key:?})",
                bytes.len()
            )));
        };
        let header = self.parse_header(head, key)?;
        self.check_payload(&header, key, payload)?;
        Ok(payload)
    }

    /// [`decode`](Self::decode) that takes the entry's buffer and returns the
    /// payload in it (shifted down in place, no second allocation).
    pub fn decode_owned(&self, mut bytes: Vec<u8>, key: &PageKey) -> Result<Vec<u8>, EntryError> {
        self.decode(&bytes, key)?;
        bytes.drain(..HEADER_BYTES);
        Ok(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arbor_engine_core::DType;

    fn identity(model: &str, page_size: usize) -> TierIdentity {
        TierIdentity {
            model: model.into(),
            kv_dtype: DType::F32,
            page_size,
            num_layers: 2,
            num_kv_heads: 1,
            head_dim: 4,
            values_in_keys: false,
        }
    }

    #[test]
    fn round_trip_and_every_field_checked() {
        let id = identity("m", 2);
        let codec = EntryCodec::new(&id);
        let key = PageKey([7; 32]);
        let payload: Vec<u8> = (0..id.page_bytes()).map(|i| i as u8).collect();
        let e = codec.encode(&key, &payload);
        assert_eq!(e.len(), codec.entry_bytes());
        assert_eq!(codec.decode(&e, &key), Ok(&payload[..]));
        assert_eq!(codec.decode_owned(e.clone(), &key), Ok(payload.clone()));

        // Every header byte and a payload byte, flipped: rejected.
        for i in 0..e.len() {
            let mut bad = e.clone();
            bad[i] ^= 0x10;
            let r = codec.decode(&bad, &key);
            assert!(r.is_err(), "byte {i} flipped was accepted");
            if (8..40).contains(&i) {
                assert_eq!(r, Err(EntryError::Foreign), "byte {i}");
            } else {
                assert!(matches!(r, Err(EntryError::Corrupt(_))), "byte {i}: {r:?}");
            }
        }
        // Truncated, extended, another key, another identity.
        assert!(matches!(
            codec.decode(&e[..e.len() - 1], &key),
            Err(EntryError::Corrupt(_))
        ));
        assert!(matches!(
            codec.decode(&e[..10], &key),
            Err(EntryError::Corrupt(_))
        ));
        let mut long = e.clone();
        long.push(0);
        assert!(matches!(
            codec.decode(&long, &key),
            Err(EntryError::Corrupt(_))
        ));
        assert!(matches!(
            codec.decode(&e, &PageKey([8; 32])),
            Err(EntryError::Corrupt(_))
        ));
        let other = EntryCodec::new(&identity("m2", 2));
        assert_eq!(other.decode(&e, &key), Err(EntryError::Foreign));
        // Another page size: another digest, so foreign (never loaded).
        let other = EntryCodec::new(&identity("m", 4));
        assert_eq!(other.decode(&e, &key), Err(EntryError::Foreign));
    }
}
