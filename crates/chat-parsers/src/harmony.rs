//! A streaming reader of OpenAI's harmony format (gpt-oss), shared by the
//! `gpt-oss` reasoning and tool-call parsers.
//!
//! An answer is a sequence of messages and loose text. A message is a header
//! (`<|start|>assistant`, `<|channel|>NAME`, optional ` to=RECIPIENT` and
//! `<|constrain|>TYPE`), then `<|message|>`, a body, and a terminator
//! (`<|end|>`, `<|call|>` or `<|return|>`). A body also ends where a new
//! header starts, or at the end of the text. Terminators outside a message
//! are dropped. A header the text ends in, or one broken by a terminator,
//! comes back as loose text.
//!
//! Events carry the raw text they were read from (`raw`), so a parser that
//! passes a message through can rebuild it byte for byte. Invariant: for any
//! split of a text into pieces, the events' concatenated texts are the same;
//! a marker split across pieces is held back until it is complete or cannot
//! be one.

use crate::text::{first_tag, partial_tag_len};

const START: &str = "<|start|>";
const CHANNEL: &str = "<|channel|>";
const MESSAGE: &str = "<|message|>";
const END: &str = "<|end|>";
const CALL: &str = "<|call|>";
const RETURN: &str = "<|return|>";

/// What a message header says.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Header {
    /// The raw header, from its first marker through `<|message|>`.
    pub raw: String,
    /// The channel's name (`analysis`, `commentary`, `final`), or empty.
    pub channel: String,
    /// The `to=` recipient (`functions.get_weather`), if any.
    pub recipient: Option<String>,
}

/// One piece of a harmony answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Event {
    /// Text outside any message.
    Text(String),
    /// A complete header: a message body follows.
    Header(Header),
    /// A piece of the current message's body.
    Body(String),
    /// The current message ended; `raw` is its terminator (empty when the
    /// body ended at a new header or at the end of the text).
    End { raw: String },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Outside,
    Header,
    Body,
}

/// The streaming reader.
#[derive(Clone, Debug)]
pub(crate) struct Reader {
    state: State,
    buf: String,
}

impl Default for Reader {
    fn default() -> Self {
        Self {
            state: State::Outside,
            buf: String::new(),
        }
    }
}

fn parse_header(raw: &str) -> Header {
    let mut h = Header {
        raw: raw.to_string(),
        ..Header::default()
    };
    let inner = raw.strip_suffix(MESSAGE).unwrap_or(raw);
    if let Some(i) = inner.find(CHANNEL) {
        let after = &inner[i + CHANNEL.len()..];
        h.channel = after
            .split(|c: char| c.is_whitespace() || c == '<')
            .next()
            .unwrap_or_default()
            .to_string();
    }
    if let Some(i) = inner.find("to=") {
        let r: String = inner[i + 3..]
            .chars()
            .take_while(|c| !c.is_whitespace() && *c != '<')
            .collect();
        if !r.is_empty() {
            h.recipient = Some(r);
        }
    }
    h
}

impl Reader {
    fn push_text(out: &mut Vec<Event>, text: &str, body: bool) {
        if text.is_empty() {
            return;
        }
        match (out.last_mut(), body) {
            (Some(Event::Text(t)), false) | (Some(Event::Body(t)), true) => t.push_str(text),
            _ => out.push(if body {
                Event::Body(text.to_string())
            } else {
                Event::Text(text.to_string())
            }),
        }
    }

    /// Reads a new piece; returns the events it completes.
    pub(crate) fn push(&mut self, text: &str) -> Vec<Event> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        while self.step(&mut out, false) {}
        out
    }

    /// Ends the text: what was held back comes out.
    pub(crate) fn finish(&mut self) -> Vec<Event> {
        let mut out = Vec::new();
        while self.step(&mut out, true) {}
        out
    }

    /// One transition; false when nothing more can be read now.
    fn step(&mut self, out: &mut Vec<Event>, eof: bool) -> bool {
        let buf = std::mem::take(&mut self.buf);
        match self.state {
            State::Outside => {
                let tags = [START, CHANNEL, END, CALL, RETURN];
                match first_tag(&buf, &tags) {
                    Some((at, tag)) => {
                        Self::push_text(out, &buf[..at], false);
                        if tag == START || tag == CHANNEL {
                            self.state = State::Header;
                            self.buf = buf[at..].to_string();
                        } else {
                            self.buf = buf[at + tag.len()..].to_string();
                        }
                        true
                    }
                    None => {
                        let keep = if eof { 0 } else { partial_tag_len(&buf, &tags) };
                        Self::push_text(out, &buf[..buf.len() - keep], false);
                        self.buf = buf[buf.len() - keep..].to_string();
                        false
                    }
                }
            }
            State::Header => {
                // Skip the opening marker itself when searching.
                let skip = [START, CHANNEL]
                    .iter()
                    .find(|t| buf.starts_with(**t))
                    .map_or(0, |t| t.len());
                let tags = [MESSAGE, START, END, CALL, RETURN];
                match first_tag(&buf[skip..], &tags) {
                    Some((at, MESSAGE)) => {
                        let end = skip + at + MESSAGE.len();
                        out.push(Event::Header(parse_header(&buf[..end])));
                        self.state = State::Body;
                        self.buf = buf[end..].to_string();
                        true
                    }
                    Some((at, _)) => {
                        // Broken header: loose text, read on from the marker.
                        Self::push_text(out, &buf[..skip + at], false);
                        self.state = State::Outside;
                        self.buf = buf[skip + at..].to_string();
                        true
                    }
                    None if eof => {
                        Self::push_text(out, &buf, false);
                        self.state = State::Outside;
                        false
                    }
                    None => {
                        self.buf = buf;
                        false
                    }
                }
            }
            State::Body => {
                let tags = [END, CALL, RETURN, START, CHANNEL];
                match first_tag(&buf, &tags) {
                    Some((at, tag)) => {
                        Self::push_text(out, &buf[..at], true);
                        let (raw, rest) = if tag == START || tag == CHANNEL {
                            ("", at)
                        } else {
                            (tag, at + tag.len())
                        };
                        out.push(Event::End {
                            raw: raw.to_string(),
                        });
                        self.state = if raw.is_empty() {
                            State::Header
                        } else {
                            State::Outside
                        };
                        self.buf = buf[rest..].to_string();
                        true
                    }
                    None if eof => {
                        Self::push_text(out, &buf, true);
                        out.push(Event::End { raw: String::new() });
                        self.state = State::Outside;
                        false
                    }
                    None => {
                        let keep = partial_tag_len(&buf, &tags);
                        Self::push_text(out, &buf[..buf.len() - keep], true);
                        self.buf = buf[buf.len() - keep..].to_string();
                        false
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_all(text: &str, cuts: &[usize]) -> Vec<Event> {
        let mut r = Reader::default();
        let mut ev = Vec::new();
        let mut last = 0;
        for &c in cuts.iter().chain(std::iter::once(&text.len())) {
            ev.extend(r.push(&text[last..c]));
            last = c;
        }
        ev.extend(r.finish());
        // Merge neighbouring texts and bodies so splits compare equal.
        let mut merged: Vec<Event> = Vec::new();
        for e in ev {
            match (merged.last_mut(), &e) {
                (Some(Event::Text(a)), Event::Text(b)) | (Some(Event::Body(a)), Event::Body(b)) => {
                    a.push_str(b)
                }
                _ => merged.push(e),
            }
        }
        merged
    }

    #[test]
    fn messages_and_splits() {
        let text = "<|channel|>analysis<|message|>think é<|end|><|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"a\":1}<|call|>tail";
        let whole = read_all(text, &[]);
        assert_eq!(whole.len(), 7, "{whole:?}");
        let Event::Header(h) = &whole[3] else {
            panic!("{whole:?}")
        };
        assert_eq!(h.channel, "commentary");
        assert_eq!(h.recipient.as_deref(), Some("functions.f"));
        assert_eq!(whole[6], Event::Text("tail".into()));
        for i in (1..text.len()).filter(|&i| text.is_char_boundary(i)) {
            assert_eq!(read_all(text, &[i]), whole, "cut at {i}");
        }
    }
}
