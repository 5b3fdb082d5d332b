//! Reasoning parsers (SGLang's `--reasoning-parser`): the `<think>...</think>`
//! part of a chat answer goes to `reasoning_content`, the rest to `content`.
//!
//! - `deepseek-r1`: the answer starts in reasoning (the chat template may
//!   have opened `<think>` itself); an opening `<think>` the model writes
//!   anyway is dropped; everything up to `</think>` is reasoning, everything
//!   after it is content. Without `</think>` the whole answer is reasoning
//!   (cut off while thinking).
//! - `qwen3`: reasoning only inside an explicit `<think>` ... `</think>`;
//!   text before `<think>` is content. A `<tool_call>` inside the reasoning
//!   ends it (the tag stays in the content for the tool-call parser), as
//!   SGLang's Qwen3 detector does.
//!
//! Only the first reasoning block is parsed; later tags are plain content.
//! [`ReasoningStream`] parses incrementally: a tag split across chunks (or
//! tokens) is held back until it is complete or cannot be a tag any more, so
//! no fragment of a tag ever reaches either field. Invariant: for any split
//! of a text into chunks, the concatenated outputs of `push` and `finish`
//! equal those of [`split`] on the whole text.

use std::fmt;
use std::str::FromStr;

const THINK_START: &str = "<think>";
const THINK_END: &str = "</think>";
const TOOL_START: &str = "<tool_call>";

/// A reasoning format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReasoningParser {
    /// DeepSeek-R1: reasoning until `</think>`, the opening tag optional.
    DeepSeekR1,
    /// Qwen3: reasoning inside explicit `<think>` ... `</think>`.
    Qwen3,
}

/// The names `--reasoning-parser` accepts.
pub const REASONING_PARSERS: &[&str] = &["deepseek-r1", "qwen3"];

impl ReasoningParser {
    /// The flag value.
    pub fn name(self) -> &'static str {
        match self {
            Self::DeepSeekR1 => "deepseek-r1",
            Self::Qwen3 => "qwen3",
        }
    }
}

impl fmt::Display for ReasoningParser {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An unknown reasoning parser name.
#[derive(Debug, thiserror::Error)]
#[error("unknown reasoning parser '{0}' (known: deepseek-r1, qwen3)")]
pub struct UnknownReasoningParser(pub String);

impl FromStr for ReasoningParser {
    type Err = UnknownReasoningParser;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "deepseek-r1" => Ok(Self::DeepSeekR1),
            "qwen3" => Ok(Self::Qwen3),
            other => Err(UnknownReasoningParser(other.to_string())),
        }
    }
}

/// Reasoning and content separated from (a piece of) an answer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Split {
    /// Text inside the reasoning block.
    pub reasoning: String,
    /// Everything else.
    pub content: String,
}

impl Split {
    fn append(&mut self, other: Split) {
        self.reasoning.push_str(&other.reasoning);
        self.content.push_str(&other.content);
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Content; a `<think>` would open reasoning (qwen3, before the block).
    BeforeBlock,
    /// Inside the reasoning block; `start_seen` once an opening tag was consumed.
    Reasoning { start_seen: bool },
    /// After the block: everything is content.
    AfterBlock,
}

/// Incremental reasoning parser of one answer.
#[derive(Clone, Debug)]
pub struct ReasoningStream {
    kind: ReasoningParser,
    state: State,
    /// Text not yet classified (a possible tag prefix at the end).
    buf: String,
    /// Reasoning held back until the block ends (`stream_reasoning: false`).
    held: String,
    stream_reasoning: bool,
}

/// Length of the longest suffix of `text` that is a proper prefix of one of `tags`.
fn partial_tag_len(text: &str, tags: &[&str]) -> usize {
    let mut best = 0;
    for tag in tags {
        for k in (1..tag.len()).rev() {
            if k <= best {
                break;
            }
            if text.ends_with(&tag[..k]) {
                best = k;
                break;
            }
        }
    }
    best
}

/// The earliest occurrence of one of `tags` in `text`: (position, tag).
fn first_tag<'t>(text: &str, tags: &[&'t str]) -> Option<(usize, &'t str)> {
    tags.iter()
        .filter_map(|t| text.find(t).map(|i| (i, *t)))
        .min_by_key(|&(i, _)| i)
}

impl ReasoningStream {
    /// A parser at the start of an answer. With `stream_reasoning` false the
    /// reasoning comes out in one piece when its block ends.
    pub fn new(kind: ReasoningParser, stream_reasoning: bool) -> Self {
        let state = match kind {
            ReasoningParser::DeepSeekR1 => State::Reasoning { start_seen: false },
            ReasoningParser::Qwen3 => State::BeforeBlock,
        };
        Self {
            kind,
            state,
            buf: String::new(),
            held: String::new(),
            stream_reasoning,
        }
    }

    fn tags(&self) -> Vec<&'static str> {
        match self.state {
            State::BeforeBlock => vec![THINK_START],
            State::Reasoning { start_seen } => {
                let mut t = vec![THINK_END];
                if !start_seen {
                    t.push(THINK_START);
                }
                if self.kind == ReasoningParser::Qwen3 {
                    t.push(TOOL_START);
                }
                t
            }
            State::AfterBlock => Vec::new(),
        }
    }

    fn emit(&mut self, out: &mut Split, text: &str) {
        match self.state {
            State::Reasoning { .. } if self.stream_reasoning => out.reasoning.push_str(text),
            State::Reasoning { .. } => self.held.push_str(text),
            _ => out.content.push_str(text),
        }
    }

    fn end_block(&mut self, out: &mut Split) {
        out.reasoning.push_str(&std::mem::take(&mut self.held));
        self.state = State::AfterBlock;
    }

    /// Classifies a new piece of the answer; returns what is certain so far.
    pub fn push(&mut self, text: &str) -> Split {
        let mut out = Split::default();
        self.buf.push_str(text);
        loop {
            if self.state == State::AfterBlock {
                let rest = std::mem::take(&mut self.buf);
                out.content.push_str(&rest);
                return out;
            }
            let tags = self.tags();
            let buf = std::mem::take(&mut self.buf);
            let Some((at, tag)) = first_tag(&buf, &tags) else {
                let keep = partial_tag_len(&buf, &tags);
                let (sure, pending) = buf.split_at(buf.len() - keep);
                self.emit(&mut out, sure);
                self.buf = pending.to_string();
                return out;
            };
            self.emit(&mut out, &buf[..at]);
            let mut rest = &buf[at + tag.len()..];
            match (self.state, tag) {
                (State::BeforeBlock, _) => {
                    self.state = State::Reasoning { start_seen: true };
                }
                (State::Reasoning { .. }, THINK_START) => {
                    self.state = State::Reasoning { start_seen: true };
                }
                (State::Reasoning { .. }, THINK_END) => self.end_block(&mut out),
                (State::Reasoning { .. }, _) => {
                    // `<tool_call>` (qwen3): the block ends, the tag is content.
                    self.end_block(&mut out);
                    rest = &buf[at..];
                }
                (State::AfterBlock, _) => {}
            }
            self.buf = rest.to_string();
        }
    }

    /// Ends the answer: what was held back, classified by the current state
    /// (a partial tag at the very end is plain text).
    pub fn finish(&mut self) -> Split {
        let mut out = Split::default();
        let rest = std::mem::take(&mut self.buf);
        self.emit(&mut out, &rest);
        out.reasoning.push_str(&std::mem::take(&mut self.held));
        out
    }
}

/// Separates a whole answer.
pub fn split(kind: ReasoningParser, text: &str) -> Split {
    let mut p = ReasoningStream::new(kind, true);
    let mut out = p.push(text);
    out.append(p.finish());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(reasoning: &str, content: &str) -> Split {
        Split {
            reasoning: reasoning.into(),
            content: content.into(),
        }
    }

    /// Feeds `text` in pieces at every boundary in `cuts`, checking that no
    /// piece of output holds a tag fragment and the total matches `split`.
    fn streamed(kind: ReasoningParser, text: &str, cuts: &[usize], stream: bool) -> Split {
        let mut p = ReasoningStream::new(kind, stream);
        let mut out = Split::default();
        let mut last = 0;
        for &c in cuts.iter().chain(std::iter::once(&text.len())) {
            let piece = p.push(&text[last..c]);
            out.append(piece);
            last = c;
        }
        out.append(p.finish());
        out
    }

    #[test]
    fn names_parse_and_unknown_is_refused() {
        assert_eq!(
            "qwen3".parse::<ReasoningParser>().ok(),
            Some(ReasoningParser::Qwen3)
        );
        assert_eq!(
            "deepseek-r1".parse::<ReasoningParser>().ok(),
            Some(ReasoningParser::DeepSeekR1)
        );
        let e = "gpt-oss".parse::<ReasoningParser>().unwrap_err();
        assert!(e.to_string().contains("'gpt-oss'") && e.to_string().contains("qwen3"));
    }

    #[test]
    fn qwen3_needs_an_explicit_block() {
        let q = ReasoningParser::Qwen3;
        assert_eq!(
            split(q, "<think>a b</think>The answer."),
            s("a b", "The answer.")
        );
        assert_eq!(split(q, "No thinking here."), s("", "No thinking here."));
        // Without the opening tag nothing is reasoning (deepseek-r1 differs).
        assert_eq!(split(q, "a b</think>c"), s("", "a b</think>c"));
        assert_eq!(split(q, "pre <think>r</think>post"), s("r", "pre post"));
        // Cut off while thinking.
        assert_eq!(split(q, "<think>still going"), s("still going", ""));
        // Only the first block is parsed.
        assert_eq!(
            split(q, "<think>x</think>y<think>z</think>"),
            s("x", "y<think>z</think>")
        );
        // A tool call ends the reasoning; the tag stays for the tool parser.
        assert_eq!(
            split(q, "<think>plan<tool_call>{}</tool_call>"),
            s("plan", "<tool_call>{}</tool_call>")
        );
    }

    #[test]
    fn deepseek_r1_reasons_until_the_end_tag() {
        let d = ReasoningParser::DeepSeekR1;
        assert_eq!(split(d, "a b</think>The answer."), s("a b", "The answer."));
        assert_eq!(split(d, "<think>a b</think>c"), s("a b", "c"));
        assert_eq!(split(d, "no end tag"), s("no end tag", ""));
        assert_eq!(split(d, "</think>"), s("", ""));
        // A <tool_call> is reasoning text for deepseek-r1.
        assert_eq!(split(d, "x<tool_call>y</think>z"), s("x<tool_call>y", "z"));
    }

    #[test]
    fn tags_split_across_chunks_at_every_position() {
        let cases = [
            (ReasoningParser::Qwen3, "hi <think>é r</think> ok ü"),
            (ReasoningParser::DeepSeekR1, "<think>why</think>because"),
            (ReasoningParser::DeepSeekR1, "why? </think>because </thi"),
            (ReasoningParser::Qwen3, "<thin<think>a</thin</think>b<"),
            (ReasoningParser::Qwen3, "<think>p<tool_cal<tool_call>x"),
        ];
        for (kind, text) in cases {
            let whole = split(kind, text);
            let bounds: Vec<usize> = (1..text.len())
                .filter(|&i| text.is_char_boundary(i))
                .collect();
            for &i in &bounds {
                for &j in bounds.iter().filter(|&&j| j > i) {
                    for stream in [true, false] {
                        assert_eq!(
                            streamed(kind, text, &[i, j], stream),
                            whole,
                            "{kind} {text:?} cut at {i},{j} stream {stream}"
                        );
                    }
                }
            }
            // One character at a time: no output piece holds a tag fragment.
            let mut p = ReasoningStream::new(kind, true);
            for (k, ch) in text.char_indices() {
                let piece = p.push(&text[k..k + ch.len_utf8()]);
                for part in [&piece.reasoning, &piece.content] {
                    assert!(
                        !part.contains("think>") || whole.content.contains("think>"),
                        "{kind} {text:?}: tag fragment in {piece:?}"
                    );
                }
            }
        }
        assert_eq!(
            split(ReasoningParser::Qwen3, "<thin<think>a</thin</think>b<"),
            s("a</thin", "<thinb<")
        );
    }

    #[test]
    fn held_reasoning_comes_out_when_the_block_ends() {
        let mut p = ReasoningStream::new(ReasoningParser::DeepSeekR1, false);
        assert_eq!(p.push("thinking "), s("", ""));
        assert_eq!(p.push("hard</thi"), s("", ""));
        assert_eq!(p.push("nk>done"), s("thinking hard", "done"));
        let mut p = ReasoningStream::new(ReasoningParser::DeepSeekR1, false);
        assert_eq!(p.push("cut off <"), s("", ""));
        assert_eq!(p.finish(), s("cut off <", ""));
        let mut p = ReasoningStream::new(ReasoningParser::Qwen3, true);
        assert_eq!(p.push("<thi"), s("", ""));
        assert_eq!(p.push("nk>ab"), s("ab", ""));
        assert_eq!(p.push("</"), s("", ""));
        assert_eq!(p.push("think>c"), s("", "c"));
    }
}
