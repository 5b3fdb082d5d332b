//! Reasoning parsers (SGLang's `--reasoning-parser`): the thinking part of a
//! chat answer goes to `reasoning_content`, the rest to `content`.
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
//! - `qwen3-thinking`: as `qwen3`, but the answer starts in reasoning (as
//!   `deepseek-r1`): the template of thinking-only models opens `<think>`.
//! - `glm45`: as `qwen3`.
//! - `deepseek-v3`: as `qwen3` without the `<tool_call>` rule; the answer
//!   starts in reasoning when the request turned thinking on (DeepSeek
//!   V3.1's template opens `<think>` then).
//! - `kimi`: reasoning inside explicit `◁think▷` ... `◁/think▷`.
//! - `gpt-oss`: harmony messages: the `analysis` channel is reasoning; the
//!   `final` channel and `commentary` without a recipient are content (their
//!   markers dropped); a message to a recipient (a tool call) passes through
//!   whole, markers included, for the tool-call parser; loose text is content.
//!
//! "Starts in reasoning" is forced for `deepseek-r1` and `qwen3-thinking`,
//! and for `qwen3`, `glm45` and `deepseek-v3` when the request's chat
//! template switch ([`ReasoningParser::thinking_switch`]) is true, as SGLang
//! does. Only the first reasoning block is parsed (`gpt-oss`: every analysis
//! message); later tags are plain content.
//! [`ReasoningStream`] parses incrementally: a tag split across chunks (or
//! tokens) is held back until it is complete or cannot be a tag any more, so
//! no fragment of a tag ever reaches either field. Invariant: for any split
//! of a text into chunks, the concatenated outputs of `push` and `finish`
//! equal those of [`split`] on the whole text.

use crate::harmony;
use crate::text::{first_tag, partial_tag_len};
use std::fmt;
use std::str::FromStr;

const THINK_START: &str = "<think>";
const THINK_END: &str = "</think>";
const KIMI_START: &str = "◁think▷";
const KIMI_END: &str = "◁/think▷";
const TOOL_START: &str = "<tool_call>";

/// A reasoning format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReasoningParser {
    /// DeepSeek-R1: reasoning until `</think>`, the opening tag optional.
    DeepSeekR1,
    /// Qwen3: reasoning inside explicit `<think>` ... `</think>`.
    Qwen3,
    /// DeepSeek V3.1: as Qwen3, forced on when thinking is on.
    DeepSeekV3,
    /// Qwen3 thinking models: reasoning until `</think>`.
    Qwen3Thinking,
    /// Kimi: `◁think▷` ... `◁/think▷`.
    Kimi,
    /// GLM-4.5: as Qwen3.
    Glm45,
    /// gpt-oss: harmony's analysis channel.
    GptOss,
}

/// The names `--reasoning-parser` accepts.
pub const REASONING_PARSERS: &[&str] = &[
    "deepseek-r1",
    "deepseek-v3",
    "glm45",
    "gpt-oss",
    "kimi",
    "qwen3",
    "qwen3-thinking",
];

const ALL: &[ReasoningParser] = &[
    ReasoningParser::DeepSeekR1,
    ReasoningParser::DeepSeekV3,
    ReasoningParser::Glm45,
    ReasoningParser::GptOss,
    ReasoningParser::Kimi,
    ReasoningParser::Qwen3,
    ReasoningParser::Qwen3Thinking,
];

impl ReasoningParser {
    /// The flag value.
    pub fn name(self) -> &'static str {
        match self {
            Self::DeepSeekR1 => "deepseek-r1",
            Self::Qwen3 => "qwen3",
            Self::DeepSeekV3 => "deepseek-v3",
            Self::Qwen3Thinking => "qwen3-thinking",
            Self::Kimi => "kimi",
            Self::Glm45 => "glm45",
            Self::GptOss => "gpt-oss",
        }
    }

    /// The `chat_template_kwargs` key whose `true` makes the answer start in
    /// reasoning (SGLang: `enable_thinking` for qwen3 and glm45, `thinking`
    /// for deepseek-v3).
    pub fn thinking_switch(self) -> Option<&'static str> {
        match self {
            Self::Qwen3 | Self::Glm45 => Some("enable_thinking"),
            Self::DeepSeekV3 => Some("thinking"),
            _ => None,
        }
    }

    /// Whether the answer starts in reasoning whatever the request says.
    fn forced(self) -> bool {
        matches!(self, Self::DeepSeekR1 | Self::Qwen3Thinking)
    }

    fn tags(self) -> (&'static str, &'static str) {
        match self {
            Self::Kimi => (KIMI_START, KIMI_END),
            _ => (THINK_START, THINK_END),
        }
    }

    /// A `<tool_call>` ends the reasoning (the Qwen family).
    fn tool_call_ends(self) -> bool {
        matches!(self, Self::Qwen3 | Self::Qwen3Thinking | Self::Glm45)
    }
}

impl fmt::Display for ReasoningParser {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An unknown reasoning parser name.
#[derive(Debug, thiserror::Error)]
#[error("unknown reasoning parser '{0}' (known: {known})", known = REASONING_PARSERS.join(", "))]
pub struct UnknownReasoningParser(pub String);

impl FromStr for ReasoningParser {
    type Err = UnknownReasoningParser;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ALL.iter()
            .copied()
            .find(|p| p.name() == s)
            .ok_or_else(|| UnknownReasoningParser(s.to_string()))
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
    /// Content; a start tag would open reasoning (before the block).
    BeforeBlock,
    /// Inside the reasoning block; `start_seen` once an opening tag was consumed.
    Reasoning { start_seen: bool },
    /// After the block: everything is content.
    AfterBlock,
}

/// What a gpt-oss message is, once its header is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Harmony {
    /// Outside messages.
    Loose,
    /// An analysis message: reasoning.
    Analysis,
    /// A final or commentary message: content.
    Answer,
    /// A message to a recipient: passed through whole as content.
    Call,
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
    /// gpt-oss: the harmony reader and the current message's kind.
    harmony: harmony::Reader,
    message: Harmony,
}

impl ReasoningStream {
    /// A parser at the start of an answer. With `stream_reasoning` false the
    /// reasoning comes out in one piece when its block ends.
    pub fn new(kind: ReasoningParser, stream_reasoning: bool) -> Self {
        Self::with_thinking(kind, stream_reasoning, false)
    }

    /// As [`ReasoningStream::new`]; `thinking` is the request's switch
    /// ([`ReasoningParser::thinking_switch`]): when true the answer starts
    /// in reasoning.
    pub fn with_thinking(kind: ReasoningParser, stream_reasoning: bool, thinking: bool) -> Self {
        let forced = kind.forced() || (thinking && kind.thinking_switch().is_some());
        let state = if forced {
            State::Reasoning { start_seen: false }
        } else {
            State::BeforeBlock
        };
        Self {
            kind,
            state,
            buf: String::new(),
            held: String::new(),
            stream_reasoning,
            harmony: harmony::Reader::default(),
            message: Harmony::Loose,
        }
    }

    fn tags(&self) -> Vec<&'static str> {
        let (start, end) = self.kind.tags();
        match self.state {
            State::BeforeBlock => vec![start],
            State::Reasoning { start_seen } => {
                let mut t = vec![end];
                if !start_seen {
                    t.push(start);
                }
                if self.kind.tool_call_ends() {
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
        if self.kind == ReasoningParser::GptOss {
            let events = self.harmony.push(text);
            return self.harmony_events(events);
        }
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
            let (start, end) = self.kind.tags();
            match self.state {
                State::BeforeBlock => {
                    self.state = State::Reasoning { start_seen: true };
                }
                State::Reasoning { .. } if tag == start => {
                    self.state = State::Reasoning { start_seen: true };
                }
                State::Reasoning { .. } if tag == end => self.end_block(&mut out),
                State::Reasoning { .. } => {
                    // `<tool_call>` (qwen3): the block ends, the tag is content.
                    self.end_block(&mut out);
                    rest = &buf[at..];
                }
                State::AfterBlock => {}
            }
            self.buf = rest.to_string();
        }
    }

    /// Ends the answer: what was held back, classified by the current state
    /// (a partial tag at the very end is plain text).
    pub fn finish(&mut self) -> Split {
        if self.kind == ReasoningParser::GptOss {
            let events = self.harmony.finish();
            let mut out = self.harmony_events(events);
            out.reasoning.push_str(&std::mem::take(&mut self.held));
            return out;
        }
        let mut out = Split::default();
        let rest = std::mem::take(&mut self.buf);
        self.emit(&mut out, &rest);
        out.reasoning.push_str(&std::mem::take(&mut self.held));
        out
    }

    /// gpt-oss: sorts harmony events into reasoning and content.
    fn harmony_events(&mut self, events: Vec<harmony::Event>) -> Split {
        let mut out = Split::default();
        for e in events {
            match e {
                harmony::Event::Text(t) => out.content.push_str(&t),
                harmony::Event::Header(h) => {
                    self.message = if h.recipient.is_some() {
                        out.content.push_str(&h.raw);
                        Harmony::Call
                    } else if h.channel == "analysis" {
                        Harmony::Analysis
                    } else {
                        Harmony::Answer
                    };
                }
                harmony::Event::Body(b) => match self.message {
                    Harmony::Analysis if self.stream_reasoning => out.reasoning.push_str(&b),
                    Harmony::Analysis => self.held.push_str(&b),
                    _ => out.content.push_str(&b),
                },
                harmony::Event::End { raw } => {
                    match self.message {
                        Harmony::Call => out.content.push_str(&raw),
                        Harmony::Analysis => {
                            out.reasoning.push_str(&std::mem::take(&mut self.held));
                        }
                        _ => {}
                    }
                    self.message = Harmony::Loose;
                }
            }
        }
        out
    }
}

/// Separates a whole answer.
pub fn split(kind: ReasoningParser, text: &str) -> Split {
    split_with_thinking(kind, text, false)
}

/// Separates a whole answer; `thinking` as in [`ReasoningStream::with_thinking`].
pub fn split_with_thinking(kind: ReasoningParser, text: &str, thinking: bool) -> Split {
    let mut p = ReasoningStream::with_thinking(kind, true, thinking);
    let mut out = p.push(text);
    out.append(p.finish());
    out
}

#[cfg(test)]
mod tests;
