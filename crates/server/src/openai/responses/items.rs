//! The output items of a response and the stream events that build them.
//!
//! [`Items`] receives an answer piece by piece (reasoning, text, tool-call
//! pieces) and returns, for each piece, the Responses stream events it
//! makes (without `sequence_number`, which the stream adds): an item is
//! announced (`response.output_item.added`, then
//! `response.content_part.added` for reasoning and messages), grows
//! (`response.reasoning_text.delta`, `response.output_text.delta`,
//! `response.function_call_arguments.delta`) and is closed (`….done`,
//! `response.content_part.done`, `response.output_item.done`) when the
//! next kind of piece arrives or the answer ends. Answers that are not
//! streamed go through the same builder, so both give the same items.
//!
//! Invariants: only the last item may be open; every item added is done by
//! [`Items::finish`]; an answer without a message or a call still gets one
//! (empty) message, so `output` always holds the answer.

use serde_json::{Value, json};

#[derive(Clone, Debug, PartialEq)]
enum Kind {
    Reasoning,
    Message,
    Call { call_id: String, name: String },
}

#[derive(Clone, Debug)]
struct Item {
    id: String,
    kind: Kind,
    /// Reasoning text, message text, or call arguments.
    text: String,
    /// Log-probability entries of a message's text.
    logprobs: Vec<Value>,
    /// `None` while open.
    status: Option<&'static str>,
}

/// The items of one answer.
#[derive(Debug)]
pub(crate) struct Items {
    /// Item ids are `rs_`, `msg_` or `fc_` followed by this and a number.
    base: String,
    items: Vec<Item>,
    /// Log-probability entries not yet given to a message.
    pending_logprobs: Vec<Value>,
    finished: bool,
}

impl Item {
    fn json(&self) -> Value {
        let status = self.status.unwrap_or("in_progress");
        match &self.kind {
            Kind::Reasoning => json!({
                "type": "reasoning", "id": self.id, "summary": [],
                "content": [{"type": "reasoning_text", "text": self.text}],
                "status": status,
            }),
            Kind::Message => json!({
                "type": "message", "id": self.id, "status": status, "role": "assistant",
                "content": [self.part()],
            }),
            Kind::Call { call_id, name } => json!({
                "type": "function_call", "id": self.id, "call_id": call_id, "name": name,
                "arguments": self.text, "status": status,
            }),
        }
    }

    /// The content part of reasoning and messages.
    fn part(&self) -> Value {
        match self.kind {
            Kind::Reasoning => json!({"type": "reasoning_text", "text": self.text}),
            _ => json!({"type": "output_text", "text": self.text, "annotations": [],
                        "logprobs": self.logprobs}),
        }
    }

    /// The item as announced: empty.
    fn added_json(&self) -> Value {
        let mut v = self.json();
        match self.kind {
            Kind::Reasoning | Kind::Message => v["content"] = json!([]),
            Kind::Call { .. } => v["arguments"] = json!(""),
        }
        v
    }
}

impl Items {
    /// No items yet; ids are made from `base` (the response id's tail).
    pub fn new(base: &str) -> Self {
        Self {
            base: base.to_string(),
            items: Vec::new(),
            pending_logprobs: Vec::new(),
            finished: false,
        }
    }

    /// The open item, when it is of kind `k`.
    fn open_of(&mut self, k: fn(&Kind) -> bool) -> Option<(usize, &mut Item)> {
        let i = self.items.len().checked_sub(1)?;
        let item = self.items.get_mut(i)?;
        (item.status.is_none() && k(&item.kind)).then_some((i, item))
    }

    /// Opens an item of `kind` (closing the open one).
    fn open(&mut self, kind: Kind, events: &mut Vec<Value>) -> usize {
        events.extend(self.close("completed"));
        let prefix = match kind {
            Kind::Reasoning => "rs",
            Kind::Message => "msg",
            Kind::Call { .. } => "fc",
        };
        let item = Item {
            id: format!("{prefix}_{}_{}", self.base, self.items.len()),
            kind,
            text: String::new(),
            logprobs: Vec::new(),
            status: None,
        };
        let i = self.items.len();
        events.push(
            json!({"type": "response.output_item.added", "output_index": i,
                           "item": item.added_json()}),
        );
        if !matches!(item.kind, Kind::Call { .. }) {
            let mut part = item.part();
            if let Some(o) = part.as_object_mut() {
                o.remove("logprobs");
            }
            events.push(
                json!({"type": "response.content_part.added", "item_id": item.id,
                               "output_index": i, "content_index": 0, "part": part}),
            );
        }
        self.items.push(item);
        i
    }

    /// Closes the open item with `status`; its done events.
    fn close(&mut self, status: &'static str) -> Vec<Value> {
        let Some(i) = self.items.len().checked_sub(1) else {
            return Vec::new();
        };
        let Some(item) = self.items.get_mut(i).filter(|it| it.status.is_none()) else {
            return Vec::new();
        };
        item.status = Some(status);
        let id = item.id.clone();
        let mut ev = Vec::new();
        match &item.kind {
            Kind::Reasoning => {
                ev.push(
                    json!({"type": "response.reasoning_text.done", "item_id": id,
                               "output_index": i, "content_index": 0, "text": item.text}),
                );
            }
            Kind::Message => {
                item.logprobs.append(&mut self.pending_logprobs);
                ev.push(json!({"type": "response.output_text.done", "item_id": id,
                               "output_index": i, "content_index": 0, "text": item.text,
                               "logprobs": item.logprobs}));
            }
            Kind::Call { name, .. } => {
                ev.push(
                    json!({"type": "response.function_call_arguments.done", "item_id": id,
                               "output_index": i, "name": name, "arguments": item.text}),
                );
            }
        }
        if !matches!(item.kind, Kind::Call { .. }) {
            ev.push(json!({"type": "response.content_part.done", "item_id": id,
                           "output_index": i, "content_index": 0, "part": item.part()}));
        }
        ev.push(
            json!({"type": "response.output_item.done", "output_index": i,
                       "item": item.json()}),
        );
        ev
    }

    /// Log-probability entries of the tokens that arrived; they go with the
    /// next text.
    pub fn logprobs(&mut self, entries: Vec<Value>) {
        self.pending_logprobs.extend(entries);
    }

    /// A piece of reasoning.
    pub fn reasoning(&mut self, delta: &str) -> Vec<Value> {
        let mut ev = Vec::new();
        if delta.is_empty() {
            return ev;
        }
        let i = match self.open_of(|k| *k == Kind::Reasoning) {
            Some((i, _)) => i,
            None => self.open(Kind::Reasoning, &mut ev),
        };
        let item = &mut self.items[i];
        item.text.push_str(delta);
        ev.push(
            json!({"type": "response.reasoning_text.delta", "item_id": item.id,
                       "output_index": i, "content_index": 0, "delta": delta}),
        );
        ev
    }

    /// A piece of the answer's text.
    pub fn text(&mut self, delta: &str) -> Vec<Value> {
        let mut ev = Vec::new();
        if delta.is_empty() {
            return ev;
        }
        let i = match self.open_of(|k| *k == Kind::Message) {
            Some((i, _)) => i,
            None => self.open(Kind::Message, &mut ev),
        };
        let lps = std::mem::take(&mut self.pending_logprobs);
        let item = &mut self.items[i];
        item.text.push_str(delta);
        item.logprobs.extend(lps.iter().cloned());
        ev.push(
            json!({"type": "response.output_text.delta", "item_id": item.id,
                       "output_index": i, "content_index": 0, "delta": delta, "logprobs": lps}),
        );
        ev
    }

    /// The start of a call (`call_id`, `name`) with the first piece of its arguments.
    pub fn call(&mut self, call_id: String, name: String, arguments: &str) -> Vec<Value> {
        let mut ev = Vec::new();
        self.open(Kind::Call { call_id, name }, &mut ev);
        ev.extend(self.arguments(arguments));
        ev
    }

    /// A further piece of the open call's arguments (ignored without one).
    pub fn arguments(&mut self, delta: &str) -> Vec<Value> {
        let Some((i, item)) = self.open_of(|k| matches!(k, Kind::Call { .. })) else {
            return Vec::new();
        };
        if delta.is_empty() {
            return Vec::new();
        }
        item.text.push_str(delta);
        vec![
            json!({"type": "response.function_call_arguments.delta", "item_id": item.id,
                    "output_index": i, "delta": delta}),
        ]
    }

    /// Ends the answer: an empty message when there is no message or call,
    /// then the open item closed with `status` (`completed`, `incomplete`).
    /// Later calls return nothing.
    pub fn finish(&mut self, status: &'static str) -> Vec<Value> {
        if self.finished {
            return Vec::new();
        }
        self.finished = true;
        let mut ev = Vec::new();
        let answered = self
            .items
            .iter()
            .any(|it| !matches!(it.kind, Kind::Reasoning));
        if !answered {
            self.open(Kind::Message, &mut ev);
        }
        ev.extend(self.close(status));
        ev
    }

    /// The `output` list.
    pub fn output(&self) -> Vec<Value> {
        self.items.iter().map(Item::json).collect()
    }

    /// The reasoning text of the answer.
    pub fn reasoning_text(&self) -> String {
        self.items
            .iter()
            .filter(|it| it.kind == Kind::Reasoning)
            .map(|it| it.text.as_str())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn types(ev: &[Value]) -> Vec<&str> {
        ev.iter().map(|e| e["type"].as_str().unwrap()).collect()
    }

    #[test]
    fn pieces_make_items_and_events_in_order() {
        let mut it = Items::new("r1");
        let mut ev = it.reasoning("think");
        ev.extend(it.reasoning("ing"));
        it.logprobs(vec![json!({"token": "Hi", "logprob": -0.5})]);
        ev.extend(it.text("Hi"));
        ev.extend(it.text(" there"));
        ev.extend(it.call("call_1".into(), "f".into(), "{\"a\":"));
        ev.extend(it.arguments("1}"));
        ev.extend(it.finish("completed"));
        assert!(it.finish("completed").is_empty());
        assert_eq!(
            types(&ev),
            vec![
                "response.output_item.added",
                "response.content_part.added",
                "response.reasoning_text.delta",
                "response.reasoning_text.delta",
                "response.reasoning_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
            ]
        );
        let out = it.output();
        assert_eq!(out.len(), 3);
        assert_eq!(out[0]["content"][0]["text"], "thinking");
        assert_eq!(out[1]["id"], "msg_r1_1");
        assert_eq!(out[1]["content"][0]["text"], "Hi there");
        assert_eq!(out[1]["content"][0]["logprobs"][0]["token"], "Hi");
        assert_eq!(
            out[2],
            json!({"type": "function_call", "id": "fc_r1_2", "call_id": "call_1", "name": "f",
                   "arguments": "{\"a\":1}", "status": "completed"})
        );
        // Every done item equals its output entry.
        let done: Vec<&Value> = ev
            .iter()
            .filter(|e| e["type"] == "response.output_item.done")
            .map(|e| &e["item"])
            .collect();
        assert_eq!(done, out.iter().collect::<Vec<_>>());
        assert_eq!(it.reasoning_text(), "thinking");
    }

    #[test]
    fn an_answer_without_text_still_has_a_message() {
        let mut it = Items::new("r2");
        let ev = it.reasoning("only thoughts");
        assert_eq!(ev.len(), 3);
        let ev = it.finish("incomplete");
        assert_eq!(
            types(&ev),
            vec![
                "response.reasoning_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
            ]
        );
        let out = it.output();
        assert_eq!(out[1]["content"][0]["text"], "");
        assert_eq!(out[1]["status"], "incomplete");
        assert_eq!(out[0]["status"], "completed");
        assert!(it.arguments("x").is_empty());
    }
}
