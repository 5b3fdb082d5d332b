//! gpt-oss tool calls: harmony messages to a recipient
//! (`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{..}<|call|>`,
//! the `to=` may also stand before `<|channel|>`).
//!
//! The function's name is the recipient's last dotted part, certain once
//! the header is complete; the arguments are the body's text, trimmed, as
//! written (`{}` when empty). `<|constrain|>json` is optional (SGLang
//! requires it). `analysis` messages without a recipient are dropped (the
//! reasoning parser takes them first when one is on); `final` and
//! `commentary` bodies are content, their markers dropped; loose text is
//! content.

use super::{StreamItem, ToolSpec, push_content};
use crate::harmony::{Event, Reader};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Msg {
    #[default]
    Loose,
    /// A message whose body is dropped (analysis, an unknown function).
    Drop,
    /// A message whose body is content.
    Content,
    /// A call: its index.
    Call(usize),
}

/// The gpt-oss tool-call reader of one answer.
#[derive(Clone, Debug, Default)]
pub(super) struct Calls {
    reader: Reader,
    msg: Msg,
    /// The current call's body so far, and how much of it went out.
    body: String,
    sent: usize,
    next_index: usize,
}

impl Calls {
    pub(super) fn push(&mut self, chunk: &str, tools: &[ToolSpec]) -> Vec<StreamItem> {
        let events = self.reader.push(chunk);
        self.events(events, tools)
    }

    pub(super) fn finish(&mut self, tools: &[ToolSpec]) -> Vec<StreamItem> {
        let events = self.reader.finish();
        self.events(events, tools)
    }

    /// The new part of the current call's trimmed body (trailing
    /// whitespace waits: it may be the body's end).
    fn args_delta(&mut self, index: usize, out: &mut Vec<StreamItem>, done: bool) {
        let start = self.body.len() - self.body.trim_start().len();
        let mut sure = self.body[start..].trim_end().to_string();
        if done && sure.is_empty() {
            sure = "{}".to_string();
        }
        if sure.len() > self.sent && sure.is_char_boundary(self.sent) {
            out.push(StreamItem::Call {
                index,
                name: None,
                arguments_delta: sure[self.sent..].to_string(),
            });
            self.sent = sure.len();
        }
    }

    fn events(&mut self, events: Vec<Event>, tools: &[ToolSpec]) -> Vec<StreamItem> {
        let mut out = Vec::new();
        for e in events {
            match e {
                Event::Text(t) => push_content(&mut out, &t),
                Event::Header(h) => {
                    self.body.clear();
                    self.sent = 0;
                    self.msg = match &h.recipient {
                        Some(r) => {
                            let name = r.rsplit('.').next().unwrap_or(r);
                            if tools.iter().any(|t| t.name == name) {
                                out.push(StreamItem::Call {
                                    index: self.next_index,
                                    name: Some(name.to_string()),
                                    arguments_delta: String::new(),
                                });
                                self.next_index += 1;
                                Msg::Call(self.next_index - 1)
                            } else {
                                Msg::Drop
                            }
                        }
                        None if h.channel == "analysis" => Msg::Drop,
                        None => Msg::Content,
                    };
                }
                Event::Body(b) => match self.msg {
                    Msg::Content | Msg::Loose => push_content(&mut out, &b),
                    Msg::Drop => {}
                    Msg::Call(index) => {
                        self.body.push_str(&b);
                        self.args_delta(index, &mut out, false);
                    }
                },
                Event::End { .. } => {
                    if let Msg::Call(index) = self.msg {
                        self.args_delta(index, &mut out, true);
                    }
                    self.msg = Msg::Loose;
                }
            }
        }
        out
    }
}
