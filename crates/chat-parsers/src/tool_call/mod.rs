//! Tool-call parsers (SGLang's `--tool-call-parser`): the calls a model
//! writes in its answer, and the content around them.
//!
//! Formats (the names `--tool-call-parser` takes, [`TOOL_CALL_PARSERS`]):
//! `qwen25` (alias `qwen`): `<tool_call>{"name":..,"arguments":{..}}</tool_call>`;
//! `llama3`: `<|python_tag|>{"name":..,"parameters":{..}}` (`;` between
//! calls; an answer that starts with `{` too); `mistral`:
//! `[TOOL_CALLS] [{"name":..,"arguments":{..}}, ..]`; `qwen3_coder`:
//! `<tool_call><function=NAME><parameter=P>value</parameter></function></tool_call>`;
//! `glm45` (alias `glm`): `<tool_call>NAME\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>\n</tool_call>`;
//! `deepseekv3`, `deepseekv31`: DeepSeek's `<｜tool▁calls▁begin｜>` sections;
//! `kimi_k2`: `<|tool_calls_section_begin|>` sections with `functions.NAME:IDX`
//! ids; `gpt-oss`: harmony messages to `functions.NAME`; `pythonic`:
//! `[f(a=1, b="x"), g()]`. Markers are SGLang 0.5.5's, byte for byte.
//!
//! Rules, the same for every format:
//! - Text outside calls is content, wherever it is (SGLang keeps only the
//!   text before the first call). [`ToolCallParser::parse`] trims the
//!   content at both ends; the stream does not.
//! - A call exists once its name is certain: in its block, complete, and one
//!   of the tools. From then on it stays a call, even if the rest of its
//!   block is broken (its arguments are then what was written, possibly not
//!   valid JSON, as OpenAI warns they may be).
//! - A call to a function that is not among the tools is dropped (SGLang's
//!   default). A block that yields no call at all (malformed before any
//!   name, or only unknown names) stays content.
//! - JSON formats keep the arguments' text as written; formats with
//!   parameters as text (`qwen3_coder`, `glm45`, `pythonic`) build compact
//!   JSON, converting values by the tool's parameter schema types.
//!
//! [`ToolCallStream`] parses incrementally: content comes out at once except
//! a possible partial start marker, held back; a call's name comes out as
//! soon as it is certain, its arguments as they are recognized (JSON formats
//! stream their text, the others add one parameter at a time; `pythonic`
//! gives each call whole). Invariant: for any split of a text into chunks,
//! the streamed content is the untrimmed content of `parse`, and each call's
//! argument pieces add up to its arguments.

mod deepseek;
mod harmony;
mod json_tags;
mod pythonic;
mod scan;
mod xml;

#[cfg(test)]
mod tests;

use serde_json::Value;
use std::fmt;
use std::str::FromStr;

/// A tool-call format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ToolCallParser {
    /// Qwen 2.5 / Qwen3 / Hermes-style `<tool_call>` JSON blocks.
    Qwen25,
    /// Llama 3.x JSON calls after `<|python_tag|>`.
    Llama3,
    /// Mistral's `[TOOL_CALLS] [...]` JSON array.
    Mistral,
    /// Qwen3-Coder's XML-like `<function=..>` blocks.
    Qwen3Coder,
    /// DeepSeek V3 / R1 sections with fenced JSON arguments.
    DeepSeekV3,
    /// DeepSeek V3.1 sections with bare JSON arguments.
    DeepSeekV31,
    /// Kimi K2 sections.
    KimiK2,
    /// GLM-4.5 / 4.6 `<arg_key>`/`<arg_value>` blocks.
    Glm45,
    /// gpt-oss harmony messages to `functions.NAME`.
    GptOss,
    /// Python call lists `[f(a=1), g()]` (Llama 4 and others).
    Pythonic,
}

/// The names `--tool-call-parser` accepts (besides the aliases `qwen` and `glm`).
pub const TOOL_CALL_PARSERS: &[&str] = &[
    "deepseekv3",
    "deepseekv31",
    "glm45",
    "gpt-oss",
    "kimi_k2",
    "llama3",
    "mistral",
    "pythonic",
    "qwen25",
    "qwen3_coder",
];

const ALL: &[ToolCallParser] = &[
    ToolCallParser::DeepSeekV3,
    ToolCallParser::DeepSeekV31,
    ToolCallParser::Glm45,
    ToolCallParser::GptOss,
    ToolCallParser::KimiK2,
    ToolCallParser::Llama3,
    ToolCallParser::Mistral,
    ToolCallParser::Pythonic,
    ToolCallParser::Qwen25,
    ToolCallParser::Qwen3Coder,
];

/// An unknown tool-call parser name.
#[derive(Debug, thiserror::Error)]
#[error("unknown tool-call parser '{0}' (known: {known})", known = TOOL_CALL_PARSERS.join(", "))]
pub struct UnknownToolCallParser(pub String);

impl FromStr for ToolCallParser {
    type Err = UnknownToolCallParser;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "qwen" => return Ok(Self::Qwen25),
            "glm" => return Ok(Self::Glm45),
            _ => {}
        }
        ALL.iter()
            .copied()
            .find(|p| p.name() == s)
            .ok_or_else(|| UnknownToolCallParser(s.to_string()))
    }
}

impl fmt::Display for ToolCallParser {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One function the model may call.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolSpec {
    /// The function's name.
    pub name: String,
    /// Its parameters' JSON schema (`qwen3_coder` and `glm45` read the
    /// `properties.*.type` of it to type values).
    pub parameters: Value,
}

/// A call found in an answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    /// The function's name.
    pub name: String,
    /// The arguments as JSON text.
    pub arguments: String,
}

/// An answer split into content and calls.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Parsed {
    /// The text outside calls, trimmed.
    pub content: String,
    /// The calls, in order.
    pub calls: Vec<ToolCall>,
}

/// A piece of a streamed answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StreamItem {
    /// Content text.
    Content(String),
    /// A piece of call `index` (0, 1, ... in the answer): the first piece
    /// of a call has its name, later ones `None`.
    Call {
        /// The call's position among the answer's calls.
        index: usize,
        /// The function's name, on the call's first piece only.
        name: Option<String>,
        /// The next piece of the arguments' JSON text (may be empty).
        arguments_delta: String,
    },
}

impl ToolCallParser {
    /// The flag value.
    pub fn name(self) -> &'static str {
        match self {
            Self::Qwen25 => "qwen25",
            Self::Llama3 => "llama3",
            Self::Mistral => "mistral",
            Self::Qwen3Coder => "qwen3_coder",
            Self::DeepSeekV3 => "deepseekv3",
            Self::DeepSeekV31 => "deepseekv31",
            Self::KimiK2 => "kimi_k2",
            Self::Glm45 => "glm45",
            Self::GptOss => "gpt-oss",
            Self::Pythonic => "pythonic",
        }
    }

    /// The OpenAI `id` of call `index` when the format fixes it: Kimi K2's
    /// `functions.NAME:IDX` (its template reads calls back by that id).
    pub fn call_id(self, name: &str, index: usize) -> Option<String> {
        (self == Self::KimiK2).then(|| format!("functions.{name}:{index}"))
    }

    /// Parses a whole answer.
    pub fn parse(self, text: &str, tools: &[ToolSpec]) -> Parsed {
        let mut s = ToolCallStream::new(self, tools);
        let mut items = s.push(text);
        items.extend(s.finish());
        let mut out = Parsed::default();
        for item in items {
            match item {
                StreamItem::Content(c) => out.content.push_str(&c),
                StreamItem::Call {
                    index,
                    name,
                    arguments_delta,
                } => {
                    if let Some(name) = name {
                        out.calls.push(ToolCall {
                            name,
                            arguments: String::new(),
                        });
                    }
                    if let Some(c) = out.calls.get_mut(index) {
                        c.arguments.push_str(&arguments_delta);
                    }
                }
            }
        }
        out.content = out.content.trim().to_string();
        out
    }

    /// Markers that open a call block: content holds back their prefixes.
    fn markers(self) -> &'static [&'static str] {
        match self {
            Self::Qwen25 | Self::Qwen3Coder | Self::Glm45 => &["<tool_call>"],
            Self::Llama3 => &["<|python_tag|>"],
            Self::Mistral => &["[TOOL_CALLS]"],
            Self::DeepSeekV3 | Self::DeepSeekV31 => &[deepseek::SECTION, deepseek::CALL],
            Self::KimiK2 => &[deepseek::KIMI_SECTION, deepseek::KIMI_CALL],
            Self::Pythonic => &["["],
            Self::GptOss => &[],
        }
    }

    /// Reads a call block: `region` starts with `marker` (empty for an
    /// answer that starts with `{` under llama3).
    fn scan(self, region: &str, marker: &str, eof: bool, tools: &[ToolSpec]) -> scan::Region {
        match self {
            Self::Qwen25 => json_tags::qwen25(region, eof),
            Self::Llama3 => json_tags::llama3(region, marker, eof),
            Self::Mistral => json_tags::mistral(region, eof),
            Self::Qwen3Coder => xml::qwen3_coder(region, eof, tools),
            Self::Glm45 => xml::glm45(region, eof, tools),
            Self::DeepSeekV3 => deepseek::scan(&deepseek::V3, region, marker, eof),
            Self::DeepSeekV31 => deepseek::scan(&deepseek::V31, region, marker, eof),
            Self::KimiK2 => deepseek::scan(&deepseek::KIMI, region, marker, eof),
            Self::Pythonic => pythonic::scan(region, eof),
            Self::GptOss => scan::Region::closed(Vec::new(), region.len()),
        }
    }
}

/// Appends content to `out`, merging with a content item before it.
pub(crate) fn push_content(out: &mut Vec<StreamItem>, text: &str) {
    if text.is_empty() {
        return;
    }
    if let Some(StreamItem::Content(c)) = out.last_mut() {
        c.push_str(text);
    } else {
        out.push(StreamItem::Content(text.to_string()));
    }
}

/// The calls of the open block: their global index (`None`: an unknown
/// function, dropped) and how much of their arguments went out.
#[derive(Clone, Debug, Default)]
struct OpenRegion {
    marker: &'static str,
    calls: Vec<(Option<usize>, usize)>,
}

/// Incremental tool-call parser of one answer.
#[derive(Clone, Debug)]
pub struct ToolCallStream {
    parser: ToolCallParser,
    tools: Vec<ToolSpec>,
    buf: String,
    region: Option<OpenRegion>,
    next_index: usize,
    /// Nothing but whitespace went out yet (llama3's leading `{`).
    at_start: bool,
    harmony: harmony::Calls,
    /// `pythonic`: a possible partial `<|python_start|>`/`<|python_end|>`
    /// at the end of the text so far, held back.
    held_marker: String,
}

impl ToolCallStream {
    /// A parser at the start of an answer, calling among `tools`.
    pub fn new(parser: ToolCallParser, tools: &[ToolSpec]) -> Self {
        Self {
            parser,
            tools: tools.to_vec(),
            buf: String::new(),
            region: None,
            next_index: 0,
            at_start: true,
            harmony: harmony::Calls::default(),
            held_marker: String::new(),
        }
    }

    /// Reads a new piece of the answer; returns what is certain so far.
    pub fn push(&mut self, chunk: &str) -> Vec<StreamItem> {
        if self.parser == ToolCallParser::GptOss {
            return self.harmony.push(chunk, &self.tools);
        }
        if self.parser == ToolCallParser::Pythonic {
            let text = pythonic::strip_markers(&mut self.held_marker, chunk, false);
            self.buf.push_str(&text);
        } else {
            self.buf.push_str(chunk);
        }
        self.run(false)
    }

    /// Ends the answer: what was held back comes out.
    pub fn finish(&mut self) -> Vec<StreamItem> {
        if self.parser == ToolCallParser::GptOss {
            return self.harmony.finish(&self.tools);
        }
        let held = pythonic::strip_markers(&mut self.held_marker, "", true);
        self.buf.push_str(&held);
        self.run(true)
    }

    fn known(&self, name: &str) -> bool {
        self.tools.iter().any(|t| t.name == name)
    }

    fn run(&mut self, eof: bool) -> Vec<StreamItem> {
        let mut out = Vec::new();
        loop {
            let progressed = if self.region.is_some() {
                self.step_region(&mut out, eof)
            } else {
                self.step_outside(&mut out, eof)
            };
            if !progressed {
                return out;
            }
        }
    }

    fn emit_content(&mut self, out: &mut Vec<StreamItem>, text: &str) {
        if !text.trim().is_empty() {
            self.at_start = false;
        }
        push_content(out, text);
    }

    /// Outside a block: content up to the next marker. False when waiting.
    fn step_outside(&mut self, out: &mut Vec<StreamItem>, eof: bool) -> bool {
        let buf = std::mem::take(&mut self.buf);
        if self.parser == ToolCallParser::Llama3 && self.at_start {
            let body = buf.trim_start();
            if body.is_empty() {
                if eof {
                    self.emit_content(out, &buf);
                } else {
                    self.buf = buf;
                }
                return false;
            }
            if body.starts_with('{') {
                let at = buf.len() - body.len();
                self.emit_content(out, &buf[..at]);
                self.at_start = false;
                self.region = Some(OpenRegion::default());
                self.buf = buf[at..].to_string();
                return true;
            }
            self.at_start = false;
        }
        let markers = self.parser.markers();
        if let Some((at, marker)) = crate::text::first_tag(&buf, markers) {
            self.emit_content(out, &buf[..at]);
            self.region = Some(OpenRegion {
                marker,
                calls: Vec::new(),
            });
            self.buf = buf[at..].to_string();
            return true;
        }
        let keep = if eof {
            0
        } else {
            crate::text::partial_tag_len(&buf, markers)
        };
        self.emit_content(out, &buf[..buf.len() - keep]);
        self.buf = buf[buf.len() - keep..].to_string();
        false
    }

    /// Inside a block: emits what its scan makes certain. False when waiting.
    fn step_region(&mut self, out: &mut Vec<StreamItem>, eof: bool) -> bool {
        let Some(mut region) = self.region.take() else {
            return false;
        };
        let mut scan = self.parser.scan(&self.buf, region.marker, eof, &self.tools);
        if eof && scan.end.is_none() {
            scan.end = Some(self.buf.len());
        }
        for (k, call) in scan.calls.iter().enumerate() {
            if k == region.calls.len() {
                let index = self.known(&call.name).then(|| {
                    self.next_index += 1;
                    self.next_index - 1
                });
                if let Some(index) = index {
                    out.push(StreamItem::Call {
                        index,
                        name: Some(call.name.clone()),
                        arguments_delta: call.args.clone(),
                    });
                }
                region.calls.push((index, call.args.len()));
                continue;
            }
            let Some((Some(index), sent)) = region.calls.get_mut(k) else {
                continue;
            };
            // Scanners only ever extend a call's arguments.
            if call.args.len() > *sent && call.args.is_char_boundary(*sent) {
                out.push(StreamItem::Call {
                    index: *index,
                    name: None,
                    arguments_delta: call.args[*sent..].to_string(),
                });
                *sent = call.args.len();
            }
        }
        let Some(end) = scan.end else {
            self.region = Some(region);
            return false;
        };
        let mut end = end.min(self.buf.len());
        while !self.buf.is_char_boundary(end) {
            end += 1;
        }
        let buf = std::mem::take(&mut self.buf);
        if region.calls.iter().all(|(i, _)| i.is_none()) {
            // No call: the block is content (at least one char, to move on).
            if end == 0 {
                end = buf.chars().next().map_or(0, char::len_utf8);
            }
            self.emit_content(out, &buf[..end]);
        } else {
            self.at_start = false;
        }
        self.buf = buf[end..].to_string();
        true
    }
}
