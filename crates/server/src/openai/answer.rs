//! An answer's text taken apart the way a request asked: reasoning (the
//! server's reasoning parser), then content and tool calls (the tool-call
//! parser under `tool_choice: auto`, the JSON of a forced call under
//! `required` or a named function). Shared by chat completions and the
//! Responses API, which only differ in how they shape the pieces.
//!
//! [`AnswerParser::parse`] takes a whole answer apart; [`SampleStream`]
//! does it incrementally for streaming (auto tools only: a forced call is
//! parsed whole when the answer ends). Invariant: both give the same
//! reasoning, content and calls for the same text.

use super::tools::{self, Tool, ToolCall, ToolCallParser, ToolChoice};
use crate::reasoning::{self, ReasoningParser, ReasoningStream};
use crate::tool_call::{StreamItem, ToolCallStream};

/// How a request's answers are taken apart.
#[derive(Clone, Debug)]
pub(crate) struct AnswerParser {
    /// Tool choice when tools are in play (their output is parsed into calls).
    pub tools: Option<ToolChoice>,
    /// The format of calls under `tool_choice: auto`.
    pub tool_parser: ToolCallParser,
    /// The request's tools.
    pub tool_list: Vec<Tool>,
    /// Reasoning parser, unless off (server or request).
    pub reasoning: Option<ReasoningParser>,
    /// The request turned thinking on (the answer starts in reasoning).
    pub thinking: bool,
    /// Stream reasoning as it comes (else in one piece when its block ends).
    pub stream_reasoning: bool,
}

/// A whole answer taken apart.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Parsed {
    /// The reasoning, when a parser is on and found some.
    pub reasoning: Option<String>,
    /// The content: the whole answer (less reasoning) when it holds no
    /// calls; what is outside the calls, when not empty, when it does.
    pub content: Option<String>,
    /// The calls, when the answer made some.
    pub calls: Option<Vec<ToolCall>>,
}

impl AnswerParser {
    /// Takes `text`, a whole answer, apart.
    pub fn parse(&self, text: &str) -> Parsed {
        let (reasoning, content) = match self.reasoning {
            Some(kind) => {
                let parts = reasoning::split_with_thinking(kind, text, self.thinking);
                let r = (!parts.reasoning.is_empty()).then_some(parts.reasoning);
                (r, parts.content)
            }
            None => (None, text.to_string()),
        };
        let calls = match &self.tools {
            None | Some(ToolChoice::None) => None,
            Some(ToolChoice::Auto) => {
                let p = self.tool_parser.parse(&content, &self.tool_list);
                (!p.calls.is_empty())
                    .then(|| ((!p.content.is_empty()).then_some(p.content), p.calls))
            }
            Some(_) => tools::parse_forced(&content).map(|c| (None, c)),
        };
        match calls {
            Some((content, calls)) => Parsed {
                reasoning,
                content,
                calls: Some(calls),
            },
            None => Parsed {
                reasoning,
                content: Some(content),
                calls: None,
            },
        }
    }

    /// True when a call is forced (required or named): the answer is parsed
    /// whole when it ends rather than streamed.
    pub fn forced(&self) -> bool {
        matches!(
            self.tools,
            Some(ToolChoice::Required | ToolChoice::Named(_))
        )
    }

    /// The incremental parsers of one streamed answer.
    pub fn stream(&self) -> SampleStream {
        let auto = self.tools == Some(ToolChoice::Auto);
        SampleStream::new(
            self.reasoning,
            self.stream_reasoning,
            self.thinking,
            auto.then_some((self.tool_parser, self.tool_list.as_slice())),
        )
    }
}

/// The incremental parsers of one streamed sample: reasoning first, its
/// content into the tool-call parser (`tool_choice: auto`).
pub(crate) struct SampleStream {
    reasoning: Option<ReasoningStream>,
    tools: Option<ToolCallStream>,
    /// Calls sent so far.
    pub calls: usize,
}

/// What one event of a sample gives: reasoning, then content and call
/// pieces in order.
#[derive(Default)]
pub(crate) struct Pieces {
    pub reasoning: String,
    pub items: Vec<StreamItem>,
}

impl SampleStream {
    pub fn new(
        reasoning: Option<ReasoningParser>,
        stream_reasoning: bool,
        thinking: bool,
        tools: Option<(ToolCallParser, &[Tool])>,
    ) -> Self {
        Self {
            reasoning: reasoning
                .map(|k| ReasoningStream::with_thinking(k, stream_reasoning, thinking)),
            tools: tools.map(|(p, list)| ToolCallStream::new(p, list)),
            calls: 0,
        }
    }

    /// Runs a piece of the sample's text through its parsers (`finish`:
    /// the sample ended, flush them).
    pub fn pieces(&mut self, text: &str, finish: bool) -> Pieces {
        let mut out = Pieces::default();
        let content = match &mut self.reasoning {
            Some(r) => {
                let mut parts = r.push(text);
                if finish {
                    let rest = r.finish();
                    parts.reasoning.push_str(&rest.reasoning);
                    parts.content.push_str(&rest.content);
                }
                out.reasoning = parts.reasoning;
                parts.content
            }
            None => text.to_string(),
        };
        match &mut self.tools {
            Some(t) => {
                out.items = t.push(&content);
                if finish {
                    out.items.extend(t.finish());
                }
                self.calls += out
                    .items
                    .iter()
                    .filter(|i| matches!(i, StreamItem::Call { name: Some(_), .. }))
                    .count();
            }
            None if !content.is_empty() => out.items.push(StreamItem::Content(content)),
            None => {}
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn whole_answers_split_into_reasoning_content_and_calls() {
        let list = vec![Tool {
            name: "now".into(),
            parameters: json!({"type": "object"}),
        }];
        let mut p = AnswerParser {
            tools: Some(ToolChoice::Auto),
            tool_parser: ToolCallParser::Qwen25,
            tool_list: list,
            reasoning: Some(ReasoningParser::Qwen3),
            thinking: false,
            stream_reasoning: true,
        };
        let a = p.parse(
            "<think>hm</think>Sure.\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>",
        );
        assert_eq!(a.reasoning.as_deref(), Some("hm"));
        assert_eq!(a.content.as_deref(), Some("Sure."));
        assert_eq!(a.calls.as_ref().map(Vec::len), Some(1));
        let a = p.parse("plain");
        assert_eq!(
            a,
            Parsed {
                reasoning: None,
                content: Some("plain".into()),
                calls: None
            }
        );
        p.tools = Some(ToolChoice::Named("now".into()));
        assert!(p.forced());
        let a = p.parse(r#"{"name": "now", "arguments": {}}"#);
        assert_eq!(a.content, None);
        assert_eq!(a.calls.unwrap()[0].arguments, "{}");
    }
}
