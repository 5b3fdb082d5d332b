use super::*;

fn s(reasoning: &str, content: &str) -> Split {
    Split {
        reasoning: reasoning.into(),
        content: content.into(),
    }
}

/// Feeds `text` in pieces at every boundary in `cuts`.
fn streamed(
    kind: ReasoningParser,
    text: &str,
    cuts: &[usize],
    stream: bool,
    thinking: bool,
) -> Split {
    let mut p = ReasoningStream::with_thinking(kind, stream, thinking);
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

/// Every split in two and three pieces, with and without streamed reasoning,
/// and one char at a time, gives the whole text's split.
fn check_splits(kind: ReasoningParser, text: &str, thinking: bool) {
    let whole = split_with_thinking(kind, text, thinking);
    let bounds: Vec<usize> = (1..text.len())
        .filter(|&i| text.is_char_boundary(i))
        .collect();
    for &i in &bounds {
        for &j in bounds.iter().filter(|&&j| j > i) {
            for stream in [true, false] {
                assert_eq!(
                    streamed(kind, text, &[i, j], stream, thinking),
                    whole,
                    "{kind} {text:?} cut at {i},{j} stream {stream}"
                );
            }
        }
    }
    assert_eq!(streamed(kind, text, &bounds, true, thinking), whole);
}

#[test]
fn names_parse_and_unknown_is_refused() {
    for name in REASONING_PARSERS {
        let p: ReasoningParser = name.parse().unwrap();
        assert_eq!(p.name(), *name);
        assert_eq!(p.to_string(), *name);
    }
    assert_eq!(
        "qwen3".parse::<ReasoningParser>().ok(),
        Some(ReasoningParser::Qwen3)
    );
    let e = "gpt-5".parse::<ReasoningParser>().unwrap_err();
    assert!(e.to_string().contains("'gpt-5'") && e.to_string().contains("qwen3-thinking"));
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
    // enable_thinking: true starts in reasoning.
    assert_eq!(split_with_thinking(q, "a b</think>c", true), s("a b", "c"));
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
fn qwen3_thinking_and_glm45() {
    let t = ReasoningParser::Qwen3Thinking;
    assert_eq!(split(t, "plan</think>answer"), s("plan", "answer"));
    assert_eq!(split(t, "<think>plan</think>answer"), s("plan", "answer"));
    assert_eq!(split(t, "still thinking"), s("still thinking", ""));
    assert_eq!(
        split(t, "plan<tool_call>{}</tool_call>"),
        s("plan", "<tool_call>{}</tool_call>")
    );
    let g = ReasoningParser::Glm45;
    assert_eq!(split(g, "<think>why</think>because"), s("why", "because"));
    assert_eq!(split(g, "just text"), s("", "just text"));
    assert_eq!(split_with_thinking(g, "why</think>x", true), s("why", "x"));
}

#[test]
fn deepseek_v3_reasons_only_when_thinking_is_on() {
    let d = ReasoningParser::DeepSeekV3;
    // Thinking off: the template closed the block; the answer is content.
    assert_eq!(
        split(d, "The answer.</think>"),
        s("", "The answer.</think>")
    );
    assert_eq!(split(d, "<think>r</think>a"), s("r", "a"));
    // Thinking on (chat_template_kwargs.thinking): the template opened it.
    assert_eq!(split_with_thinking(d, "r</think>a", true), s("r", "a"));
    // A tool call does not end DeepSeek's reasoning.
    assert_eq!(
        split_with_thinking(d, "r<tool_call>x</think>a", true),
        s("r<tool_call>x", "a")
    );
    assert_eq!(d.thinking_switch(), Some("thinking"));
    assert_eq!(ReasoningParser::Kimi.thinking_switch(), None);
}

#[test]
fn kimi_uses_its_own_tags() {
    let k = ReasoningParser::Kimi;
    assert_eq!(split(k, "◁think▷why◁/think▷because"), s("why", "because"));
    assert_eq!(split(k, "<think>x</think>y"), s("", "<think>x</think>y"));
    assert_eq!(split(k, "plain"), s("", "plain"));
    assert_eq!(split(k, "◁think▷cut"), s("cut", ""));
}

#[test]
fn gpt_oss_reads_harmony_channels() {
    let g = ReasoningParser::GptOss;
    let text = "<|channel|>analysis<|message|>User asks weather.<|end|><|start|>assistant<|channel|>final<|message|>It is sunny.";
    assert_eq!(split(g, text), s("User asks weather.", "It is sunny."));
    assert_eq!(split(g, &format!("{text}<|return|>")), split(g, text));
    // A tool call passes through whole for the tool-call parser.
    let call = "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"location\":\"SF\"}<|call|>";
    let text = format!("<|channel|>analysis<|message|>Need weather.<|end|>{call}");
    assert_eq!(split(g, &text), s("Need weather.", call));
    // Commentary without a recipient is content (a preamble to the user).
    assert_eq!(
        split(g, "<|channel|>commentary<|message|>Checking.<|end|>"),
        s("", "Checking.")
    );
    // Cut off while thinking; plain text is content.
    assert_eq!(split(g, "<|channel|>analysis<|message|>hmm"), s("hmm", ""));
    assert_eq!(split(g, "plain answer"), s("", "plain answer"));
    // Reasoning held back comes out at the end of its message.
    let mut p = ReasoningStream::new(g, false);
    assert_eq!(p.push("<|channel|>analysis<|message|>a"), s("", ""));
    assert_eq!(p.push("b<|end|>"), s("ab", ""));
}

#[test]
fn tags_split_across_chunks_at_every_position() {
    let cases = [
        (ReasoningParser::Qwen3, "hi <think>é r</think> ok ü", false),
        (
            ReasoningParser::DeepSeekR1,
            "<think>why</think>because",
            false,
        ),
        (
            ReasoningParser::DeepSeekR1,
            "why? </think>because </thi",
            false,
        ),
        (
            ReasoningParser::Qwen3,
            "<thin<think>a</thin</think>b<",
            false,
        ),
        (
            ReasoningParser::Qwen3,
            "<think>p<tool_cal<tool_call>x",
            false,
        ),
        (
            ReasoningParser::Qwen3Thinking,
            "p<tool_cal<tool_call>x",
            false,
        ),
        (ReasoningParser::DeepSeekV3, "r</thi</think>a", true),
        (ReasoningParser::DeepSeekV3, "r</thi</think>a", false),
        (ReasoningParser::Kimi, "a◁thi◁think▷b◁/think▷c", false),
        (
            ReasoningParser::GptOss,
            "<|channel|>analysis<|message|>r é<|end|><|start|>assistant<|channel|>final<|message|>a<|",
            false,
        ),
        (
            ReasoningParser::GptOss,
            "x<|channel|>commentary to=functions.f<|message|>{}<|call|>y",
            false,
        ),
    ];
    for (kind, text, thinking) in cases {
        check_splits(kind, text, thinking);
        // One character at a time: no output piece holds a tag fragment.
        let whole = split_with_thinking(kind, text, thinking);
        let mut p = ReasoningStream::with_thinking(kind, true, thinking);
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
