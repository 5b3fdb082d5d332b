//! Each format's published examples, parsed whole and streamed in every
//! split: content and calls must come out the same whatever the chunking.

use super::*;
use serde_json::json;

fn tools() -> Vec<ToolSpec> {
    let t = |name: &str, parameters: Value| ToolSpec {
        name: name.into(),
        parameters,
    };
    vec![
        t(
            "get_weather",
            json!({"type": "object", "properties": {
                "location": {"type": "string"}, "city": {"type": "string"},
                "date": {"type": "string"}, "days": {"type": "integer"},
                "unit": {"type": "string", "enum": ["c", "f"]}}}),
        ),
        t(
            "get_current_weather",
            json!({"type": "object", "properties": {"location": {"type": "string"}}}),
        ),
        t(
            "execute_bash",
            json!({"type": "object", "properties": {"command": {"type": "string"}}}),
        ),
        t("get_time", json!({"type": "object"})),
        t(
            "search",
            json!({"type": "object", "properties": {
                "query": {"type": "string"}, "limit": {"type": "integer"},
                "filters": {"type": "object"}, "exact": {"type": "boolean"},
                "score": {"type": "number"}, "tags": {"type": "array"}}}),
        ),
    ]
}

/// Runs the stream over `text` cut at `cuts`; returns (content, calls).
fn stream(p: ToolCallParser, text: &str, cuts: &[usize]) -> (String, Vec<ToolCall>) {
    let mut s = ToolCallStream::new(p, &tools());
    let mut items = Vec::new();
    let mut last = 0;
    for &c in cuts.iter().chain(std::iter::once(&text.len())) {
        items.extend(s.push(&text[last..c]));
        last = c;
    }
    items.extend(s.finish());
    let mut content = String::new();
    let mut calls: Vec<ToolCall> = Vec::new();
    for item in items {
        match item {
            StreamItem::Content(c) => content.push_str(&c),
            StreamItem::Call {
                index,
                name,
                arguments_delta,
            } => {
                match name {
                    Some(name) => {
                        assert_eq!(index, calls.len(), "{p} {text:?} {cuts:?}: index order");
                        calls.push(ToolCall {
                            name,
                            arguments: String::new(),
                        });
                    }
                    None => assert!(index < calls.len(), "{p}: a delta before its name"),
                }
                calls[index].arguments.push_str(&arguments_delta);
            }
        }
    }
    (content, calls)
}

/// A small deterministic generator for random chunkings.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self, n: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 33) as usize) % n.max(1)
    }
}

/// Parses `text` whole and checks the expected content and calls, then
/// checks the stream gives the same in every split at one char boundary,
/// char by char, and in random chunkings.
fn check(p: ToolCallParser, text: &str, content: &str, calls: &[(&str, Value)]) {
    let parsed = p.parse(text, &tools());
    assert_eq!(parsed.content, content, "{p} {text:?}: content");
    assert_eq!(parsed.calls.len(), calls.len(), "{p} {text:?}: {parsed:?}");
    for (got, (name, args)) in parsed.calls.iter().zip(calls) {
        assert_eq!(got.name, *name, "{p} {text:?}");
        let v: Value = serde_json::from_str(&got.arguments)
            .unwrap_or_else(|e| panic!("{p} {text:?}: arguments {:?}: {e}", got.arguments));
        assert_eq!(&v, args, "{p} {text:?}");
    }
    let bounds: Vec<usize> = (1..text.len())
        .filter(|&i| text.is_char_boundary(i))
        .collect();
    let same = |cuts: &[usize]| {
        let (c, calls) = stream(p, text, cuts);
        assert_eq!(c.trim(), parsed.content, "{p} {text:?} cut at {cuts:?}");
        assert_eq!(calls, parsed.calls, "{p} {text:?} cut at {cuts:?}");
    };
    for &i in &bounds {
        same(&[i]);
    }
    same(&bounds);
    let mut rng = Lcg(text.len() as u64);
    for _ in 0..200 {
        let mut cuts: Vec<usize> = (0..rng.next(8) + 1)
            .map(|_| bounds.get(rng.next(bounds.len())).copied().unwrap_or(0))
            .filter(|&c| c > 0)
            .collect();
        cuts.sort_unstable();
        cuts.dedup();
        same(&cuts);
    }
}

/// Pushes `text` up to the end of `upto` and returns what came out.
fn first_items(p: ToolCallParser, text: &str, upto: &str) -> Vec<StreamItem> {
    let end = text
        .find(upto)
        .map(|i| i + upto.len())
        .unwrap_or(text.len());
    ToolCallStream::new(p, &tools()).push(&text[..end])
}

fn has_name(items: &[StreamItem], want: &str) -> bool {
    items
        .iter()
        .any(|i| matches!(i, StreamItem::Call { name: Some(n), .. } if n == want))
}

#[test]
fn names_parse_and_unknown_is_refused() {
    for name in TOOL_CALL_PARSERS {
        let p: ToolCallParser = name.parse().unwrap();
        assert_eq!(p.name(), *name);
        assert_eq!(p.to_string(), *name);
    }
    assert_eq!(
        "qwen".parse::<ToolCallParser>().ok(),
        Some(ToolCallParser::Qwen25)
    );
    assert_eq!(
        "glm".parse::<ToolCallParser>().ok(),
        Some(ToolCallParser::Glm45)
    );
    let e = "hermes2".parse::<ToolCallParser>().unwrap_err().to_string();
    assert!(
        e.contains("'hermes2'") && e.contains("qwen3_coder") && e.contains("gpt-oss"),
        "{e}"
    );
    assert_eq!(
        ToolCallParser::KimiK2.call_id("f", 2).as_deref(),
        Some("functions.f:2")
    );
    assert_eq!(ToolCallParser::Qwen25.call_id("f", 2), None);
}

#[test]
fn qwen25() {
    let p = ToolCallParser::Qwen25;
    check(
        p,
        "<tool_call>\n{\"name\": \"get_current_weather\", \"arguments\": {\"location\": \"Tokyo\"}}\n</tool_call>",
        "",
        &[("get_current_weather", json!({"location": "Tokyo"}))],
    );
    // A JSON list of calls in one block (SGLang reads each).
    check(
        p,
        "<tool_call>\n[{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}, {\"name\": \"get_time\", \"arguments\": {}}]\n</tool_call>",
        "",
        &[
            ("get_weather", json!({"city": "Paris"})),
            ("get_time", json!({})),
        ],
    );
    // A list that holds no call stays content; one broken after a call ends there.
    check(
        p,
        "<tool_call>[1, 2]</tool_call> ok",
        "<tool_call>[1, 2]</tool_call> ok",
        &[],
    );
    check(
        p,
        "<tool_call>[{\"name\": \"get_time\", \"arguments\": {}}, 7]</tool_call>",
        ", 7]</tool_call>",
        &[("get_time", json!({}))],
    );
    // Parallel calls, content before, between and after.
    check(
        p,
        "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>\nDone.",
        "Let me check.\n\n\nDone.",
        &[
            ("get_weather", json!({"city": "Paris"})),
            ("get_time", json!({})),
        ],
    );
    // Nested JSON, escapes, a closing tag inside a string, `parameters`.
    check(
        p,
        r#"<tool_call>{"name": "search", "parameters": {"query": "say \"hi\" </tool_call> é\n", "filters": {"tags": ["a", {"b": [1, 2]}]}}}</tool_call>"#,
        "",
        &[(
            "search",
            json!({"query": "say \"hi\" </tool_call> é\n", "filters": {"tags": ["a", {"b": [1, 2]}]}}),
        )],
    );
    // Not calls: plain text, broken JSON, an unknown function.
    check(p, "No tools needed: 2 < 3.", "No tools needed: 2 < 3.", &[]);
    check(
        p,
        "x <tool_call>{broken</tool_call> y",
        "x <tool_call>{broken</tool_call> y",
        &[],
    );
    check(
        p,
        "<tool_call>{\"name\": \"nope\", \"arguments\": {}}</tool_call>",
        "<tool_call>{\"name\": \"nope\", \"arguments\": {}}</tool_call>",
        &[],
    );
    // Each block stands alone: an unknown one stays content beside a call.
    check(
        p,
        "<tool_call>{\"name\": \"nope\", \"arguments\": {}}</tool_call><tool_call>{\"name\": \"get_time\"}</tool_call>",
        "<tool_call>{\"name\": \"nope\", \"arguments\": {}}</tool_call>",
        &[("get_time", json!({}))],
    );
    // Cut off inside a call: the name is certain, the call stays.
    let (content, calls) = stream(p, "<tool_call>{\"name\": \"get_time\", \"arg", &[]);
    assert_eq!((content.as_str(), calls[0].arguments.as_str()), ("", "{}"));
}

#[test]
fn streams_content_and_names_early() {
    let p = ToolCallParser::Qwen25;
    let mut s = ToolCallStream::new(p, &tools());
    assert_eq!(
        s.push("Hello <tool"),
        vec![StreamItem::Content("Hello ".into())]
    );
    assert_eq!(
        s.push("box> and"),
        vec![StreamItem::Content("<toolbox> and".into())]
    );
    let items = s.push(" <tool_call>{\"name\": \"get_weather\", ");
    assert_eq!(
        items,
        vec![
            StreamItem::Content(" ".into()),
            StreamItem::Call {
                index: 0,
                name: Some("get_weather".into()),
                arguments_delta: String::new()
            }
        ]
    );
    let items = s.push("\"arguments\": {\"city\": \"Par");
    assert_eq!(
        items,
        vec![StreamItem::Call {
            index: 0,
            name: None,
            arguments_delta: "{\"city\": \"Par".into()
        }]
    );
    assert_eq!(
        s.push("is\"}}</tool_call>"),
        vec![StreamItem::Call {
            index: 0,
            name: None,
            arguments_delta: "is\"}".into()
        }]
    );
    assert_eq!(s.finish(), vec![]);
}

#[test]
fn llama3() {
    let p = ToolCallParser::Llama3;
    check(
        p,
        "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"location\": \"Tokyo\"}}",
        "",
        &[("get_weather", json!({"location": "Tokyo"}))],
    );
    check(
        p,
        "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"a\\\"b\"}}; {\"name\": \"get_time\", \"parameters\": {}}",
        "",
        &[
            ("get_weather", json!({"city": "a\"b"})),
            ("get_time", json!({})),
        ],
    );
    check(
        p,
        "Sure.<|python_tag|>{\"name\": \"search\", \"arguments\": {\"filters\": {\"x\": [1, {\"y\": null}]}}} then text",
        "Sure. then text",
        &[("search", json!({"filters": {"x": [1, {"y": null}]}}))],
    );
    // A JSON answer that is no call stays content; `{` later is plain.
    check(p, "{\"answer\": 42}", "{\"answer\": 42}", &[]);
    check(
        p,
        "a {\"name\": \"get_time\"}",
        "a {\"name\": \"get_time\"}",
        &[],
    );
    check(p, "Just text.", "Just text.", &[]);
    assert!(has_name(
        &first_items(
            p,
            "{\"name\": \"get_time\", \"parameters\": {}}",
            "\"get_time\""
        ),
        "get_time"
    ));
}

#[test]
fn mistral() {
    let p = ToolCallParser::Mistral;
    check(
        p,
        "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"location\": \"Tokyo\"}}]",
        "",
        &[("get_weather", json!({"location": "Tokyo"}))],
    );
    check(
        p,
        "Checking. [TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"[Paris]\"}}, {\"name\": \"search\", \"arguments\": {\"tags\": [[1], []]}}] ok",
        "Checking.  ok",
        &[
            ("get_weather", json!({"city": "[Paris]"})),
            ("search", json!({"tags": [[1], []]})),
        ],
    );
    // Within one block an unknown call is dropped.
    check(
        p,
        "[TOOL_CALLS] [{\"name\": \"nope\", \"arguments\": {}}, {\"name\": \"get_time\", \"arguments\": {}}]",
        "",
        &[("get_time", json!({}))],
    );
    check(p, "[TOOL_CALLS] nothing", "[TOOL_CALLS] nothing", &[]);
    check(p, "A [list] of [TOOL_CALLS", "A [list] of [TOOL_CALLS", &[]);
}

#[test]
fn qwen3_coder() {
    let p = ToolCallParser::Qwen3Coder;
    check(
        p,
        "<tool_call>\n<function=execute_bash>\n<parameter=command>\npwd && ls\n</parameter>\n</function>\n</tool_call>",
        "",
        &[("execute_bash", json!({"command": "pwd && ls"}))],
    );
    // Types from the schema; a string that looks like a number stays one.
    let text = "I'll search.\n<tool_call>\n<function=search>\n<parameter=query>\n42 \"quoted\" <b>\n</parameter>\n<parameter=limit>\n5\n</parameter>\n<parameter=filters>\n{\"lang\": [\"en\"]}\n</parameter>\n<parameter=exact>\nfalse\n</parameter>\n<parameter=score>\n0.5\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>";
    check(
        p,
        text,
        "I'll search.",
        &[
            (
                "search",
                json!({"query": "42 \"quoted\" <b>", "limit": 5, "filters": {"lang": ["en"]}, "exact": false, "score": 0.5}),
            ),
            ("get_time", json!({})),
        ],
    );
    // The name comes as soon as its tag is complete.
    assert!(has_name(
        &first_items(p, text, "<function=search>"),
        "search"
    ));
    // A missing </parameter> ends at the next parameter.
    check(
        p,
        "<tool_call><function=get_weather><parameter=city>Oslo<parameter=days>3</parameter></function></tool_call>",
        "",
        &[("get_weather", json!({"city": "Oslo", "days": 3}))],
    );
    check(
        p,
        "<tool_call>not a function</tool_call> after",
        "<tool_call>not a function</tool_call> after",
        &[],
    );
}

#[test]
fn glm45() {
    let p = ToolCallParser::Glm45;
    check(
        p,
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>北京</arg_value>\n<arg_key>date</arg_key>\n<arg_value>2024-06-27</arg_value>\n</tool_call>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>上海</arg_value>\n<arg_key>date</arg_key>\n<arg_value>2024-06-27</arg_value>\n</tool_call>",
        "",
        &[
            ("get_weather", json!({"city": "北京", "date": "2024-06-27"})),
            ("get_weather", json!({"city": "上海", "date": "2024-06-27"})),
        ],
    );
    let text = "Let me look.<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>\"x\" & y</arg_value>\n<arg_key>limit</arg_key>\n<arg_value>10</arg_value>\n<arg_key>filters</arg_key>\n<arg_value>{\"a\": {\"b\": [1]}}</arg_value>\n</tool_call>";
    check(
        p,
        text,
        "Let me look.",
        &[(
            "search",
            json!({"query": "\"x\" & y", "limit": 10, "filters": {"a": {"b": [1]}}}),
        )],
    );
    assert!(has_name(&first_items(p, text, "search\n"), "search"));
    check(
        p,
        "<tool_call>get_time\n</tool_call>",
        "",
        &[("get_time", json!({}))],
    );
    check(
        p,
        "<tool_call>{\"name\": \"get_time\"}</tool_call>",
        "<tool_call>{\"name\": \"get_time\"}</tool_call>",
        &[],
    );
}

#[test]
fn deepseek_v3() {
    let p = ToolCallParser::DeepSeekV3;
    let text = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_current_weather\n```json\n{\"location\": \"Tokyo\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_current_weather\n```json\n{\"location\": \"Paris\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
    check(
        p,
        text,
        "",
        &[
            ("get_current_weather", json!({"location": "Tokyo"})),
            ("get_current_weather", json!({"location": "Paris"})),
        ],
    );
    assert!(has_name(
        &first_items(p, text, "```json\n"),
        "get_current_weather"
    ));
    check(
        p,
        &format!("Checking the weather.\n\n{text} Anything else?"),
        "Checking the weather.\n\n Anything else?",
        &[
            ("get_current_weather", json!({"location": "Tokyo"})),
            ("get_current_weather", json!({"location": "Paris"})),
        ],
    );
    check(
        p,
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n{\"query\": \"```\\n<｜tool▁call▁end｜>\", \"filters\": {\"n\": [1]}}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "",
        &[(
            "search",
            json!({"query": "```\n<｜tool▁call▁end｜>", "filters": {"n": [1]}}),
        )],
    );
    check(p, "No calls here.", "No calls here.", &[]);
}

#[test]
fn deepseek_v31() {
    let p = ToolCallParser::DeepSeekV31;
    let text = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_current_weather<｜tool▁sep｜>{\"location\": \"Tokyo\"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_current_weather<｜tool▁sep｜>{\"location\": \"Paris\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
    check(
        p,
        text,
        "",
        &[
            ("get_current_weather", json!({"location": "Tokyo"})),
            ("get_current_weather", json!({"location": "Paris"})),
        ],
    );
    assert!(has_name(
        &first_items(p, text, "<｜tool▁sep｜>"),
        "get_current_weather"
    ));
    check(
        p,
        "Sure<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>{\"query\": \"a\\\\b\", \"tags\": [{}]}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "Sure",
        &[("search", json!({"query": "a\\b", "tags": [{}]}))],
    );
    check(
        p,
        "<｜tool▁calls▁begin｜>oops",
        "<｜tool▁calls▁begin｜>oops",
        &[],
    );
}

#[test]
fn kimi_k2() {
    let p = ToolCallParser::KimiK2;
    let text = "<|tool_calls_section_begin|>\n<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Beijing\"}<|tool_call_end|>\n<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|>\n<|tool_calls_section_end|>";
    check(
        p,
        text,
        "",
        &[
            ("get_weather", json!({"city": "Beijing"})),
            ("get_time", json!({})),
        ],
    );
    assert!(has_name(
        &first_items(p, text, "<|tool_call_argument_begin|>"),
        "get_weather"
    ));
    check(
        p,
        &format!("Let me check.{text}"),
        "Let me check.",
        &[
            ("get_weather", json!({"city": "Beijing"})),
            ("get_time", json!({})),
        ],
    );
    check(
        p,
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>{\"query\": \"<|tool_call_end|>\", \"filters\": {\"a\": {}}}<|tool_call_end|><|tool_calls_section_end|>",
        "",
        &[(
            "search",
            json!({"query": "<|tool_call_end|>", "filters": {"a": {}}}),
        )],
    );
    check(
        p,
        "<|tool_calls_section_begin|><|tool_call_begin|>bad id<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>",
        "<|tool_calls_section_begin|><|tool_call_begin|>bad id<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>",
        &[],
    );
}

#[test]
fn gpt_oss() {
    let p = ToolCallParser::GptOss;
    let call = "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"location\": \"Tokyo\"}<|call|>";
    check(
        p,
        call,
        "",
        &[("get_weather", json!({"location": "Tokyo"}))],
    );
    assert!(has_name(
        &first_items(p, call, "<|message|>"),
        "get_weather"
    ));
    // Full harmony: analysis dropped, two calls, a final answer.
    let text = format!(
        "<|channel|>analysis<|message|>Need weather.<|end|>{call}<|start|>assistant to=functions.search<|channel|>commentary json<|message|>{{\"query\": \"a<b\", \"filters\": {{\"x\": [1]}}}}<|call|><|start|>assistant<|channel|>final<|message|>Here you go.<|return|>"
    );
    check(
        p,
        &text,
        "Here you go.",
        &[
            ("get_weather", json!({"location": "Tokyo"})),
            ("search", json!({"query": "a<b", "filters": {"x": [1]}})),
        ],
    );
    // An empty body is `{}`; an unknown function is dropped.
    check(
        p,
        "<|channel|>commentary to=functions.get_time<|message|><|call|>",
        "",
        &[("get_time", json!({}))],
    );
    check(
        p,
        "<|channel|>commentary to=browser.open<|message|>{}<|call|>ok",
        "ok",
        &[],
    );
    check(p, "Plain answer.", "Plain answer.", &[]);
}

#[test]
fn pythonic() {
    let p = ToolCallParser::Pythonic;
    check(
        p,
        "[get_weather(location=\"Tokyo\"), get_time()]",
        "",
        &[
            ("get_weather", json!({"location": "Tokyo"})),
            ("get_time", json!({})),
        ],
    );
    check(
        p,
        "Calling: [search(query='it\\'s \"x\"\\n', limit=3, exact=True, score=-1.5, filters={'a': [1, (2, 3)], 'b': None})] done",
        "Calling:  done",
        &[(
            "search",
            json!({"query": "it's \"x\"\n", "limit": 3, "exact": true, "score": -1.5, "filters": {"a": [1, [2, 3]], "b": null}}),
        )],
    );
    check(p, "See [1] and [a b].", "See [1] and [a b].", &[]);
    // Llama 4's markers around the list are removed, as SGLang does.
    check(
        p,
        "<|python_start|>[get_weather(location=\"Tokyo\"), get_time()]<|python_end|>",
        "",
        &[
            ("get_weather", json!({"location": "Tokyo"})),
            ("get_time", json!({})),
        ],
    );
    check(
        p,
        "Sure. <|python_start|>[get_time()]<|python_end|> Done <|python_",
        "Sure.  Done <|python_",
        &[("get_time", json!({}))],
    );
    check(p, "[unknown_fn(a=1)]", "[unknown_fn(a=1)]", &[]);
    check(
        p,
        "[get_time(), oops] x",
        ", oops] x",
        &[("get_time", json!({}))],
    );
}

#[test]
fn deeply_nested_input_does_not_overflow() {
    let deep = format!("[search(filters={}{})]", "[".repeat(500), "]".repeat(500));
    let parsed = ToolCallParser::Pythonic.parse(&deep, &tools());
    assert!(parsed.calls.is_empty());
    let deep = format!(
        "<tool_call>{{\"name\": \"search\", \"arguments\": {}{}}}</tool_call>",
        "[".repeat(5000),
        "]".repeat(5000)
    );
    let parsed = ToolCallParser::Qwen25.parse(&deep, &tools());
    assert_eq!(parsed.calls.len(), 1);
}
