//! Incremental detokenization.
//!
//! Tokens do not map one-to-one onto characters: a byte-level BPE token may
//! hold half of a UTF-8 character, and SentencePiece decoders change a token's
//! text depending on its neighbours. [`IncrementalDetokenizer`] decodes a
//! window of recent tokens twice (without and with the newest ones) and emits
//! only the stable difference, holding text back while it ends in an
//! incomplete character. Concatenating every emitted delta and the final flush
//! gives exactly `decode(all tokens)`.

use crate::error::Result;

/// Turns token ids into text (implemented over a real tokenizer).
pub trait TokenDecoder: Send + Sync {
    /// Decodes `ids`; special tokens are left out when `skip_special_tokens`.
    fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String>;
}

/// Streams text for a growing sequence of token ids.
#[derive(Clone, Debug, Default)]
pub struct IncrementalDetokenizer {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    text: String,
    skip_special_tokens: bool,
}

impl IncrementalDetokenizer {
    /// A detokenizer whose text starts after `context` (e.g. the prompt's last tokens),
    /// which is decoded for spacing only and never emitted.
    pub fn new(context: &[u32], skip_special_tokens: bool) -> Self {
        Self {
            ids: context.to_vec(),
            prefix_offset: 0,
            read_offset: context.len(),
            text: String::new(),
            skip_special_tokens,
        }
    }

    /// Adds tokens and returns the newly stable text (possibly empty).
    pub fn push(&mut self, decoder: &dyn TokenDecoder, new_ids: &[u32]) -> Result<String> {
        self.push_str(decoder, new_ids).map(str::to_string)
    }

    /// [`Self::push`] without allocating the returned text: it is the end of [`Self::text`].
    pub fn push_str(&mut self, decoder: &dyn TokenDecoder, new_ids: &[u32]) -> Result<&str> {
        self.ids.extend_from_slice(new_ids);
        let skip = self.skip_special_tokens;
        let prefix = decoder.decode(&self.ids[self.prefix_offset..self.read_offset], skip)?;
        let full = decoder.decode(&self.ids[self.prefix_offset..], skip)?;
        let start = self.text.len();
        if full.len() > prefix.len()
            && !full.ends_with('\u{FFFD}')
            && full.starts_with(prefix.as_str())
            && let Some(delta) = full.get(prefix.len()..)
        {
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            self.text.push_str(delta);
        }
        Ok(&self.text[start..])
    }

    /// Emits whatever is still held back (even an incomplete character).
    pub fn flush(&mut self, decoder: &dyn TokenDecoder) -> Result<String> {
        let skip = self.skip_special_tokens;
        let prefix = decoder.decode(&self.ids[self.prefix_offset..self.read_offset], skip)?;
        let full = decoder.decode(&self.ids[self.prefix_offset..], skip)?;
        let delta = if full.starts_with(prefix.as_str()) {
            full[prefix.len()..].to_string()
        } else {
            String::new()
        };
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        self.text.push_str(&delta);
        Ok(delta)
    }

    /// All text emitted so far.
    pub fn text(&self) -> &str {
        &self.text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A byte-level decoder: each id is one byte; invalid UTF-8 becomes U+FFFD.
    struct Bytes;
    impl TokenDecoder for Bytes {
        fn decode(&self, ids: &[u32], _: bool) -> Result<String> {
            let b: Vec<u8> = ids.iter().map(|&i| i as u8).collect();
            Ok(String::from_utf8_lossy(&b).into_owned())
        }
    }

    #[test]
    fn never_emits_broken_utf8() {
        let text = "héllo → 世界!";
        let ids: Vec<u32> = text.bytes().map(u32::from).collect();
        let mut d = IncrementalDetokenizer::new(&[], true);
        let mut out = String::new();
        for &i in &ids {
            let delta = d.push(&Bytes, &[i]).unwrap();
            assert!(!delta.contains('\u{FFFD}'));
            out.push_str(&delta);
        }
        out.push_str(&d.flush(&Bytes).unwrap());
        assert_eq!(out, text);
        assert_eq!(d.text(), text);
    }
}
