//! An incremental parser of Server-Sent Events (the `text/event-stream`
//! format that SGLang's, vLLM's, llama.cpp's and Arbor's streaming answers use).
//!
//! Bytes arrive in arbitrary network chunks; [`SseParser::push`] keeps the
//! unfinished line between calls and returns the events completed by the
//! chunk, so the caller can time each event by the chunk that completed it.
//!
//! Rules (the WHATWG event-stream rules, minus what benchmarks never need):
//! lines end with `\n` (a `\r` before it is dropped); a line starting with `:`
//! is a comment; `data:` lines (one optional space after the colon removed)
//! accumulate, joined with `\n`; an empty line dispatches the accumulated
//! data as one event; `event:`, `id:` and `retry:` are ignored. A payload of
//! exactly `[DONE]` is reported as [`SseEvent::Done`]. Data left when the
//! stream ends is dispatched by [`SseParser::finish`]. Invariant: no byte is
//! lost or reported twice, whatever the chunk boundaries (UTF-8 sequences
//! split across chunks included, since lines are decoded only when complete).

/// One dispatched event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SseEvent {
    /// The data of an event (its `data:` lines joined with `\n`).
    Data(String),
    /// The OpenAI/SGLang end marker `data: [DONE]`.
    Done,
}

/// Incremental event-stream parser.
#[derive(Debug, Default)]
pub struct SseParser {
    /// Bytes of the current, unfinished line.
    line: Vec<u8>,
    /// `data:` lines of the current event.
    data: Vec<String>,
}

impl SseParser {
    /// A parser at the start of a stream.
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds a chunk; returns the events it completed, in order.
    pub fn push(&mut self, chunk: &[u8]) -> Vec<SseEvent> {
        let mut out = Vec::new();
        let mut rest = chunk;
        while let Some(pos) = rest.iter().position(|&b| b == b'\n') {
            self.line.extend_from_slice(&rest[..pos]);
            rest = &rest[pos + 1..];
            let mut line = std::mem::take(&mut self.line);
            if line.last() == Some(&b'\r') {
                line.pop();
            }
            self.take_line(&line, &mut out);
        }
        self.line.extend_from_slice(rest);
        out
    }

    /// Ends the stream: dispatches an event whose terminating blank line never came.
    pub fn finish(&mut self) -> Option<SseEvent> {
        let mut out = Vec::new();
        if !self.line.is_empty() {
            let mut line = std::mem::take(&mut self.line);
            if line.last() == Some(&b'\r') {
                line.pop();
            }
            self.take_line(&line, &mut out);
        }
        self.dispatch(&mut out);
        out.pop()
    }

    fn take_line(&mut self, line: &[u8], out: &mut Vec<SseEvent>) {
        if line.is_empty() {
            self.dispatch(out);
            return;
        }
        if line[0] == b':' {
            return;
        }
        let text = String::from_utf8_lossy(line);
        let (field, value) = match text.find(':') {
            Some(i) => {
                let v = &text[i + 1..];
                (&text[..i], v.strip_prefix(' ').unwrap_or(v))
            }
            None => (&text[..], ""),
        };
        if field == "data" {
            self.data.push(value.to_string());
        }
    }

    fn dispatch(&mut self, out: &mut Vec<SseEvent>) {
        if self.data.is_empty() {
            return;
        }
        let data = std::mem::take(&mut self.data).join("\n");
        out.push(if data.trim() == "[DONE]" {
            SseEvent::Done
        } else {
            SseEvent::Data(data)
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(chunks: &[&[u8]]) -> Vec<SseEvent> {
        let mut p = SseParser::new();
        let mut out: Vec<SseEvent> = chunks.iter().flat_map(|c| p.push(c)).collect();
        out.extend(p.finish());
        out
    }

    fn data(s: &str) -> SseEvent {
        SseEvent::Data(s.to_string())
    }

    #[test]
    fn whole_events_and_done() {
        let ev = all(&[b"data: {\"a\":1}\n\ndata: {\"a\":2}\n\ndata: [DONE]\n\n"]);
        assert_eq!(
            ev,
            vec![data("{\"a\":1}"), data("{\"a\":2}"), SseEvent::Done]
        );
    }

    #[test]
    fn events_split_anywhere_give_the_same_result() {
        let stream = "data: {\"text\":\"h\u{e9}llo\"}\r\n\r\n: keep-alive\n\ndata: {\"x\":2}\n\ndata: [DONE]\n\n";
        let whole = all(&[stream.as_bytes()]);
        assert_eq!(whole.len(), 3);
        let bytes = stream.as_bytes();
        for cut in 0..bytes.len() {
            assert_eq!(all(&[&bytes[..cut], &bytes[cut..]]), whole, "cut at {cut}");
        }
        // One byte at a time.
        let singles: Vec<&[u8]> = bytes.chunks(1).collect();
        assert_eq!(all(&singles), whole);
    }

    #[test]
    fn events_complete_only_at_the_blank_line() {
        let mut p = SseParser::new();
        assert!(p.push(b"data: {\"a\":").is_empty());
        assert!(p.push(b"1}\n").is_empty());
        assert_eq!(p.push(b"\n"), vec![data("{\"a\":1}")]);
    }

    #[test]
    fn multi_line_events_join_with_newlines() {
        let ev = all(&[b"event: message\nid: 7\ndata: {\"a\":\ndata:1}\n\n"]);
        assert_eq!(ev, vec![data("{\"a\":\n1}")]);
        let v: serde_json::Value = match &ev[0] {
            SseEvent::Data(d) => serde_json::from_str(d).unwrap(),
            SseEvent::Done => panic!(),
        };
        assert_eq!(v["a"], 1);
    }

    #[test]
    fn comments_other_fields_and_trailing_data() {
        let ev = all(&[b": comment\nretry: 10\ndata\n\ndata:no-space\n\ndata: tail"]);
        assert_eq!(ev, vec![data(""), data("no-space"), data("tail")]);
        // [DONE] without a final blank line.
        assert_eq!(all(&[b"data: [DONE]"]), vec![SseEvent::Done]);
        assert!(all(&[b"\n\n\n"]).is_empty());
    }
}
