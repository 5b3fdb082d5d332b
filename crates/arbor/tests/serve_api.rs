//! End-to-end tests of `arbor serve`'s APIs: SGLang's native `/generate`
//! (single, batch, n, streaming, SGLang's own client payloads), the OpenAI
//! completions and chat routes (usage, n, seed, logprobs, streaming), and a
//! table of bad requests that must get 4xx answers and leak nothing.
//! Speed is never asserted.

mod common;

use anyhow::{Context, Result, ensure};
use common::*;
use serde_json::{Value, json};

#[tokio::test]
async fn native_generate_single_batch_n_stream_and_bench_payloads() -> Result<()> {
    let s = Server::tiny(&[])?;
    let c = client();
    let g = s.url("/generate");
    // Longer than a KV page (16 tokens), so a repeat can hit the prefix cache.
    let prompt =
        "The quick brown fox jumps over the lazy dog, again and again, until the end of the story.";
    let greedy = json!({"text": prompt, "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": true}});
    let a = post_ok(&c, &g, &greedy).await?;
    let b = post_ok(&c, &g, &greedy).await?;
    assert_eq!(a["output_ids"], b["output_ids"], "greedy is deterministic");
    assert_eq!(a["text"], b["text"]);
    let ids: Vec<u64> = a["output_ids"]
        .as_array()
        .context("ids")?
        .iter()
        .filter_map(Value::as_u64)
        .collect();
    assert_eq!(ids.len(), 12);
    let m = meta(&a);
    assert_eq!(m["completion_tokens"], 12);
    assert!(m["prompt_tokens"].as_u64() > Some(0));
    assert_eq!(m["finish_reason"], json!({"type": "length", "length": 12}));
    assert!(m["id"].is_string() && m["e2e_latency"].is_number() && m["cached_tokens"].is_number());
    // The second identical prompt hits the prefix cache.
    assert!(meta(&b)["cached_tokens"].as_u64() > Some(0), "{b}");

    // input_ids, null sampling values (SGLang's clients send them), rid.
    let v = post_ok(&c, &g, &json!({"input_ids": [5, 6, 7, 8], "rid": "my-rid",
        "sampling_params": {"max_new_tokens": 3, "temperature": 0, "top_p": null, "stop": null, "n": null}})).await?;
    assert_eq!(meta(&v)["id"], "my-rid");
    assert_eq!(meta(&v)["prompt_tokens"], 4);
    // A rid still in use is refused.
    let slow = json!({"input_ids": [5, 6, 7], "rid": "dup", "stream": true, "sampling_params": {"max_new_tokens": 240, "ignore_eos": true, "n": 8}});
    let mut first = SseReader::new(c.post(&g).json(&slow).send().await?)?;
    ensure!(first.next().await?.is_some(), "no first event");
    let (st, e) = post(&c, &g, &json!({"input_ids": [1, 2], "rid": "dup"})).await?;
    assert_eq!(
        (st, e["error"]["param"].as_str()),
        (400, Some("rid")),
        "{e}"
    );
    drop(first);

    // A stop token id ends generation at its first occurrence.
    let stop_id = ids[5];
    let first = ids.iter().position(|&t| t == stop_id).context("pos")?;
    let v = post_ok(&c, &g, &json!({"text": prompt, "sampling_params": {"max_new_tokens": 12, "temperature": 0, "stop_token_ids": [stop_id]}})).await?;
    assert_eq!(
        meta(&v)["finish_reason"],
        json!({"type": "stop", "matched": stop_id})
    );
    assert_eq!(v["output_ids"].as_array().map(Vec::len), Some(first + 1));

    // A stop string is matched and trimmed.
    let text = a["text"].as_str().context("text")?.to_string();
    let chars: Vec<char> = text.chars().collect();
    if let Some(i) = (1..chars.len().saturating_sub(1))
        .find(|&i| chars[i].is_ascii_alphanumeric() && chars[i + 1].is_ascii_alphanumeric())
    {
        let stop: String = chars[i..i + 2].iter().collect();
        let v = post_ok(&c, &g, &json!({"text": prompt, "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": true, "stop": stop}})).await?;
        let pos = text.find(&stop).context("stop in text")?;
        assert_eq!(
            v["text"].as_str(),
            Some(&text[..pos]),
            "stop {stop:?} in {text:?}"
        );
        assert_eq!(meta(&v)["finish_reason"]["matched"], json!(stop));
    }

    // Batch with n: a list, prompt-major, with index.
    let v = post_ok(&c, &g, &json!({"text": [prompt, "abc"], "sampling_params": {"max_new_tokens": 4, "temperature": 0, "n": 2, "ignore_eos": true}})).await?;
    let list = v.as_array().context("a list")?;
    assert_eq!(list.len(), 4);
    for (i, o) in list.iter().enumerate() {
        assert_eq!(o["index"], i);
        assert_eq!(meta(o)["completion_tokens"], 4);
    }
    assert_eq!(
        list[0]["output_ids"],
        json!(ids[..4]),
        "greedy samples agree with the single request"
    );
    assert_eq!(list[0]["output_ids"], list[1]["output_ids"]);

    // Log-probabilities.
    let v = post_ok(&c, &g, &json!({"text": "Hello", "return_logprob": true, "top_logprobs_num": 2, "return_text_in_logprobs": true,
        "sampling_params": {"max_new_tokens": 3, "temperature": 0}})).await?;
    let lp = meta(&v)["output_token_logprobs"]
        .as_array()
        .context("logprobs")?;
    assert_eq!(
        lp.len(),
        meta(&v)["completion_tokens"].as_u64().unwrap_or(0) as usize
    );
    assert!(lp[0][0].as_f64() <= Some(0.0) && lp[0][2].is_string());
    assert_eq!(
        meta(&v)["output_top_logprobs"][0].as_array().map(Vec::len),
        Some(2)
    );

    // Streaming: cumulative text and ids, meta_info in every chunk, then [DONE].
    let mut body = greedy.clone();
    body["stream"] = json!(true);
    let events = sse(&c, &g, &body).await?;
    ensure!(!events.is_empty());
    let mut prev_text = String::new();
    let mut prev_n = 0;
    for e in &events {
        let t = e["text"].as_str().context("text")?;
        assert!(t.starts_with(&prev_text), "cumulative text");
        let n = meta(e)["completion_tokens"]
            .as_u64()
            .context("completion_tokens")?;
        assert!(n >= prev_n);
        assert_eq!(e["output_ids"].as_array().map(Vec::len), Some(n as usize));
        prev_text = t.to_string();
        prev_n = n;
    }
    let last = events.last().context("last")?;
    assert_eq!(last["text"], a["text"]);
    assert_eq!(meta(last)["finish_reason"]["type"], "length");

    // SGLang bench_serving --backend sglang, verbatim payload and parsing.
    let bench = json!({"text": "Hello world", "sampling_params": {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": true},
        "stream": true, "lora_path": null, "return_logprob": false, "return_routed_experts": false, "logprob_start_len": -1,
        "a_future_sglang_flag": null});
    let events = sse(&c, &g, &bench).await?;
    let mut out_len = 0;
    for e in events
        .iter()
        .filter(|e| e["text"].as_str().is_some_and(|t| !t.is_empty()))
    {
        out_len = meta(e)["completion_tokens"]
            .as_u64()
            .context("completion_tokens")?;
    }
    assert_eq!(out_len, 8);
    // Fields not implemented yet are refused once they ask for something.
    let (st, v) = post(&c, &g, &json!({"text": "x", "lora_path": "adapter"})).await?;
    assert_eq!(st, 400);
    assert_eq!(v["error"]["param"], "lora_path", "{v}");
    assert_no_leak(&c, &s, "arbor", None).await
}

#[tokio::test]
async fn openai_completions_models_usage_n_and_stream() -> Result<()> {
    let s = Server::tiny(&["--served-model-name", "tiny", "--enable-cache-report"])?;
    let c = client();
    let (st, models) = get(&c, &s.url("/v1/models"), None).await?;
    assert_eq!(st, 200);
    let models: Value = serde_json::from_str(&models)?;
    assert_eq!(models["data"][0]["id"], "tiny");
    let u = s.url("/v1/completions");
    let prompt =
        "The capital of France is a city with a long history, many museums and a famous tower.";
    let body = json!({"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": true});
    let a = post_ok(&c, &u, &body).await?;
    assert_eq!(a["object"], "text_completion");
    assert_eq!(a["choices"][0]["finish_reason"], "length");
    let usage = &a["usage"];
    assert_eq!(usage["completion_tokens"], 6);
    assert_eq!(
        usage["total_tokens"].as_u64(),
        Some(usage["prompt_tokens"].as_u64().unwrap_or(0) + 6)
    );
    let b = post_ok(&c, &u, &body).await?;
    assert!(
        b["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() > Some(0),
        "cache report: {b}"
    );
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);

    // n, seed: the same seed gives the same samples.
    let seeded = json!({"model": "tiny", "prompt": "Once", "max_tokens": 8, "temperature": 0.9, "n": 3, "seed": 11});
    let x = post_ok(&c, &u, &seeded).await?;
    let y = post_ok(&c, &u, &seeded).await?;
    assert_eq!(x["choices"].as_array().map(Vec::len), Some(3));
    assert_eq!(x["choices"], y["choices"]);

    // Token-id prompts and a batch of prompts.
    let v = post_ok(
        &c,
        &u,
        &json!({"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 2, "n": 2}),
    )
    .await?;
    assert_eq!(v["choices"].as_array().map(Vec::len), Some(4));
    assert_eq!(v["usage"]["prompt_tokens"], 5);

    // Logprobs.
    let v = post_ok(
        &c,
        &u,
        &json!({"prompt": "Hi", "max_tokens": 3, "logprobs": 2, "temperature": 0}),
    )
    .await?;
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().map(Vec::len), Some(3));
    assert_eq!(lp["top_logprobs"][0].as_object().map(|o| o.len()), Some(2));

    // Streaming with usage; concatenated text equals the non-streamed text.
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    sb["stream_options"] = json!({"include_usage": true});
    let events = sse(&c, &u, &sb).await?;
    let mut text = String::new();
    let mut finish = None;
    for e in &events[..events.len() - 1] {
        assert!(e["usage"].is_null());
        text.push_str(e["choices"][0]["text"].as_str().unwrap_or(""));
        if let Some(f) = e["choices"][0]["finish_reason"].as_str() {
            finish = Some(f.to_string());
        }
    }
    assert_eq!(json!(text), a["choices"][0]["text"]);
    assert_eq!(finish.as_deref(), Some("length"));
    let last = events.last().context("usage chunk")?;
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["completion_tokens"], 6);

    // SGLang bench_serving --backend sglang-oai, verbatim payload and parsing.
    let bench = json!({"model": "tiny", "prompt": "Hello", "temperature": 0.0, "best_of": 1, "max_tokens": 5, "stream": true, "ignore_eos": true});
    let events = sse(&c, &u, &bench).await?;
    let generated: String = events
        .iter()
        .filter_map(|e| e["choices"][0]["text"].as_str())
        .collect();
    assert!(!events.is_empty() && !generated.is_empty());
    assert_no_leak(&c, &s, "arbor", None).await
}

#[tokio::test]
async fn openai_chat_with_qwen2_template() -> Result<()> {
    let model = fixture("tiny-qwen2");
    let s = Server::start(&[
        "--model-path",
        &model,
        "--port",
        "0",
        "--threads",
        "1",
        "--max-total-tokens",
        "4096",
        "--enable-metrics",
    ])?;
    let c = client();
    let u = s.url("/v1/chat/completions");
    let msgs = json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]);
    let body =
        json!({"messages": msgs, "max_completion_tokens": 5, "temperature": 0, "ignore_eos": true});
    let a = post_ok(&c, &u, &body).await?;
    assert_eq!(a["object"], "chat.completion");
    assert_eq!(a["choices"][0]["message"]["role"], "assistant");
    assert!(a["choices"][0]["message"]["content"].is_string());
    assert_eq!(a["usage"]["completion_tokens"], 5);
    // The template adds its own text around the messages.
    assert!(a["usage"]["prompt_tokens"].as_u64() > Some(10));
    // Content parts are joined like a string.
    let parts = json!({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hello there"}]}],
        "max_tokens": 5, "temperature": 0, "ignore_eos": true});
    let p = post_ok(&c, &u, &parts).await?;
    assert_eq!(
        p["choices"][0]["message"]["content"],
        a["choices"][0]["message"]["content"]
    );

    // Streaming: role first, content deltas, finish, usage, [DONE].
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    sb["stream_options"] = json!({"include_usage": true});
    let events = sse(&c, &u, &sb).await?;
    assert_eq!(events[0]["object"], "chat.completion.chunk");
    assert_eq!(events[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = events
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(json!(text), a["choices"][0]["message"]["content"]);
    let fin = events
        .iter()
        .find_map(|e| e["choices"][0]["finish_reason"].as_str());
    assert_eq!(fin, Some("length"));
    assert_eq!(
        events.last().context("last")?["usage"]["total_tokens"],
        a["usage"]["total_tokens"]
    );

    // n and logprobs.
    let v = post_ok(
        &c,
        &u,
        &json!({"messages": msgs, "max_tokens": 3, "n": 2, "logprobs": true, "top_logprobs": 2}),
    )
    .await?;
    assert_eq!(v["choices"].as_array().map(Vec::len), Some(2));
    let content = v["choices"][1]["logprobs"]["content"]
        .as_array()
        .context("logprobs")?;
    assert!(!content.is_empty() && content[0]["top_logprobs"].as_array().map(Vec::len) == Some(2));

    // Structured output: response_format json_schema gives JSON that follows the schema.
    let schema = json!({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": false});
    let v = post_ok(&c, &u, &json!({"messages": msgs, "max_tokens": 64, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})).await?;
    let text = v["choices"][0]["message"]["content"]
        .as_str()
        .context("content")?;
    let parsed: serde_json::Value = serde_json::from_str(text).with_context(|| text.to_string())?;
    assert!(parsed["ok"].is_boolean(), "{parsed}");

    // Forced tool calls: tool_choice required gives parsed tool_calls.
    let tools = json!([{"type": "function", "function": {"name": "set_flag",
        "parameters": {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]}}}]);
    let v = post_ok(
        &c,
        &u,
        &json!({"messages": msgs, "max_tokens": 96, "temperature": 0,
        "tools": tools, "tool_choice": "required"}),
    )
    .await?;
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    let call = &choice["message"]["tool_calls"][0];
    assert_eq!(call["function"]["name"], "set_flag");
    let args: serde_json::Value =
        serde_json::from_str(call["function"]["arguments"].as_str().context("args")?)?;
    assert!(args["on"].is_boolean(), "{args}");
    // Streamed, the call arrives as one delta with the finish.
    let events = sse(
        &c,
        &u,
        &json!({"messages": msgs, "max_tokens": 96, "temperature": 0, "stream": true,
        "tools": tools, "tool_choice": {"type": "function", "function": {"name": "set_flag"}}}),
    )
    .await?;
    let last = events
        .iter()
        .rev()
        .find(|e| !e["choices"][0]["finish_reason"].is_null())
        .context("finish")?;
    assert_eq!(last["choices"][0]["finish_reason"], "tool_calls");
    assert_eq!(
        last["choices"][0]["delta"]["tool_calls"][0]["function"]["name"],
        "set_flag"
    );
    // A tool_choice naming no tool is refused.
    let (st, e) = post(
        &c,
        &u,
        &json!({"messages": msgs, "tools": tools,
        "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
    )
    .await?;
    assert_eq!(st, 400, "{e}");
    assert_eq!(e["error"]["param"], "tool_choice");
    let ok = post_ok(&c, &u, &json!({"messages": msgs, "max_tokens": 2, "response_format": {"type": "text"}, "tools": [], "tool_choice": "none"})).await?;
    assert_eq!(ok["choices"][0]["message"]["role"], "assistant");
    assert_no_leak(&c, &s, "arbor", None).await
}

/// Grammar warm-up and the grammar cache over HTTP: a `max_new_tokens: 0`
/// request with a schema compiles it (a cache miss) and generates nothing;
/// the next request with the same schema is a cache hit and compiles
/// nothing. `response_format: json_object` output starts a JSON object, and
/// `tool_choice: auto` leaves generation free (no tool call is forced).
#[tokio::test]
async fn grammar_warm_up_cache_json_object_and_auto_tools() -> Result<()> {
    let s = Server::tiny(&[])?;
    let c = client();
    let counters = |m: &str| {
        (
            metric(m, "arbor:grammar_cache_hits_total"),
            metric(m, "arbor:grammar_cache_misses_total"),
        )
    };
    let (_, m) = get(&c, &s.url("/metrics"), None).await?;
    assert_eq!(counters(&m), (Some(0.0), Some(0.0)), "{m}");
    let schema =
        json!({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
            .to_string();
    let warm = post_ok(
        &c,
        &s.url("/generate"),
        &json!({"text": "x", "sampling_params": {"max_new_tokens": 0, "json_schema": schema}}),
    )
    .await?;
    assert_eq!(meta(&warm)["completion_tokens"], 0, "{warm}");
    let (_, m) = get(&c, &s.url("/metrics"), None).await?;
    assert_eq!(counters(&m), (Some(0.0), Some(1.0)), "warm-up compiles");
    let v = post_ok(
        &c,
        &s.url("/generate"),
        &json!({"text": "y", "sampling_params": {"max_new_tokens": 24, "temperature": 0, "json_schema": schema}}),
    )
    .await?;
    let text = v["text"].as_str().context("text")?;
    assert!(text.starts_with("{\"n\":"), "{text:?}");
    let (_, m) = get(&c, &s.url("/metrics"), None).await?;
    assert_eq!(
        counters(&m),
        (Some(1.0), Some(1.0)),
        "served from the cache"
    );

    let msgs = json!([{"role": "user", "content": "Give me JSON."}]);
    let u = s.url("/v1/chat/completions");
    let v = post_ok(
        &c,
        &u,
        &json!({"messages": msgs, "max_tokens": 16, "temperature": 0, "response_format": {"type": "json_object"}}),
    )
    .await?;
    let text = v["choices"][0]["message"]["content"]
        .as_str()
        .context("content")?;
    assert!(text.starts_with('{'), "{text:?}");

    let tools = json!([{"type": "function", "function": {"name": "set_flag",
        "parameters": {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]}}}]);
    let v = post_ok(
        &c,
        &u,
        &json!({"messages": msgs, "max_tokens": 8, "temperature": 0, "tools": tools, "tool_choice": "auto"}),
    )
    .await?;
    let choice = &v["choices"][0];
    // The tiny random model writes no <tool_call> tag, so the answer is text.
    assert_eq!(choice["finish_reason"], "length", "{v}");
    assert!(
        choice["message"]["tool_calls"].is_null() || choice["message"]["tool_calls"] == json!([]),
        "{v}"
    );
    assert_eq!(v["usage"]["completion_tokens"], 8, "{v}");
    assert_no_leak(&c, &s, "arbor", None).await
}

/// `oneOf` with branches that may overlap compiles by default (as `anyOf`)
/// and constrains the output; `[grammar] json_strict_one_of = true` refuses
/// the schema with a 400 naming `oneOf`.
#[tokio::test]
async fn one_of_schemas_by_default_and_strictly() -> Result<()> {
    let schema = json!({"type": "object", "properties": {"id": {"oneOf": [
        {"type": "string", "maxLength": 3}, {"type": "string", "pattern": "^a"}]}},
        "required": ["id"]})
    .to_string();
    let body = json!({"text": "y", "sampling_params": {"max_new_tokens": 24, "temperature": 0, "json_schema": schema}});
    let s = Server::tiny(&[])?;
    let c = client();
    let v = post_ok(&c, &s.url("/generate"), &body).await?;
    let text = v["text"].as_str().context("text")?;
    assert!(text.starts_with("{\"id\":\""), "{text:?}");
    assert_no_leak(&c, &s, "arbor", None).await?;
    drop(s);
    let dir = tempfile::tempdir()?;
    let cfg = dir.path().join("arbor.toml");
    std::fs::write(&cfg, "[grammar]\njson_strict_one_of = true\n")?;
    let cfg = cfg.display().to_string();
    let s = Server::tiny(&["--config", &cfg])?;
    let (code, v) = post(&c, &s.url("/generate"), &body).await?;
    assert!(code == 400 && v.to_string().contains("oneOf"), "{code} {v}");
    assert_no_leak(&c, &s, "arbor", None).await
}

/// Prefix-cache namespaces: `extra_key` (native) and `cache_salt` (native
/// and OpenAI) keep tenants apart: the same prompt is a cache hit only for a
/// later request with the same keys.
#[tokio::test]
async fn extra_key_and_cache_salt_separate_cached_prefixes() -> Result<()> {
    let s = Server::tiny(&["--enable-cache-report"])?;
    let c = client();
    let ids: Vec<u32> = (1..=70).collect();
    let cached = |v: &Value| meta(v)["cached_tokens"].as_u64().unwrap_or(u64::MAX);
    let gen_ = |extra: Value| {
        let mut body =
            json!({"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0}});
        if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
            b.extend(e.clone());
        }
        body
    };
    let u = s.url("/generate");
    assert_eq!(
        cached(&post_ok(&c, &u, &gen_(json!({"extra_key": "t1"}))).await?),
        0
    );
    assert_eq!(
        cached(&post_ok(&c, &u, &gen_(json!({"extra_key": "t1"}))).await?),
        64,
        "same key: 4 pages hit"
    );
    assert_eq!(
        cached(&post_ok(&c, &u, &gen_(json!({"extra_key": "t2"}))).await?),
        0,
        "other key"
    );
    assert_eq!(
        cached(&post_ok(&c, &u, &gen_(json!({}))).await?),
        0,
        "no key"
    );
    assert_eq!(
        cached(&post_ok(&c, &u, &gen_(json!({"cache_salt": "s"}))).await?),
        0
    );
    assert_eq!(
        cached(&post_ok(&c, &u, &gen_(json!({"cache_salt": "s"}))).await?),
        64
    );
    // The OpenAI route: cache_salt with usage.prompt_tokens_details.
    let cmpl =
        |salt: &str| json!({"prompt": ids, "max_tokens": 2, "temperature": 0, "cache_salt": salt});
    let v = post_ok(&c, &s.url("/v1/completions"), &cmpl("s")).await?;
    assert_eq!(
        v["usage"]["prompt_tokens_details"]["cached_tokens"], 64,
        "{v}"
    );
    let v = post_ok(&c, &s.url("/v1/completions"), &cmpl("other")).await?;
    assert_eq!(
        v["usage"]["prompt_tokens_details"]["cached_tokens"], 0,
        "{v}"
    );
    let (st, v) = post(&c, &u, &json!({"text": "x", "extra_key": 5})).await?;
    assert_eq!(st, 400, "{v}");
    assert_no_leak(&c, &s, "arbor", None).await
}

#[tokio::test]
async fn bad_requests_get_4xx_with_a_message_and_leak_nothing() -> Result<()> {
    let s = Server::tiny(&[
        "--served-model-name",
        "tiny",
        "--max-request-bytes",
        "65536",
    ])?;
    let c = client();
    let long: Vec<u32> = (0..300).map(|i| i % 400).collect();
    let big = format!("{{\"prompt\": \"{}\"}}", "a".repeat(70_000));
    // (route, body, status, part of the message)
    let cases: Vec<(&str, String, u16, &str)> = vec![
        ("/v1/completions", "{".into(), 400, "invalid JSON"),
        ("/v1/completions", "[1, 2]".into(), 400, "must be a JSON object"),
        ("/v1/completions", "".into(), 400, "body is empty"),
        ("/v1/completions", json!({"prompt": "x", "temperature": "hot"}).to_string(), 400, "'temperature' must be a number"),
        ("/v1/completions", json!({"prompt": "x", "max_tokens": "ten"}).to_string(), 400, "'max_tokens' must be an integer"),
        ("/v1/completions", json!({"prompt": 5}).to_string(), 400, "'prompt' must be"),
        ("/v1/completions", json!({"model": "gpt-4", "prompt": "x"}).to_string(), 404, "'gpt-4' does not exist"),
        ("/v1/completions", json!({"prompt": ""}).to_string(), 400, "prompt is empty"),
        ("/v1/completions", json!({"prompt": []}).to_string(), 400, "prompt is empty"),
        ("/v1/completions", json!({"prompt": long}).to_string(), 400, "context length"),
        ("/v1/completions", json!({"prompt": "x", "max_tokens": 0}).to_string(), 400, "'max_tokens' must be in [1, "),
        ("/v1/completions", json!({"prompt": "x", "max_tokens": -3}).to_string(), 400, "'max_tokens' must be in [1, "),
        ("/v1/completions", json!({"prompt": "x", "max_tokens": 100000}).to_string(), 400, "'max_tokens' (100000) plus the prompt"),
        ("/v1/completions", json!({"prompt": "x", "n": 0}).to_string(), 400, "'n' must be in [1, 128]"),
        ("/v1/completions", json!({"prompt": "x", "n": 500}).to_string(), 400, "'n' must be in [1, 128]"),
        ("/v1/completions", json!({"prompt": "x", "temperature": -1}).to_string(), 400, "temperature"),
        ("/v1/completions", json!({"prompt": "x", "top_p": 0}).to_string(), 400, "'top_p' must be in (0, 1]"),
        ("/v1/completions", json!({"prompt": "x", "top_p": 1.5}).to_string(), 400, "'top_p' must be in (0, 1]"),
        ("/v1/completions", json!({"prompt": "x", "stop": 7}).to_string(), 400, "'stop' must be a string or a list of strings"),
        ("/v1/completions", json!({"prompt": "x", "stop": [""]}).to_string(), 400, "'stop' must not hold empty strings"),
        ("/v1/completions", json!({"prompt": "x", "stop": ["a", 1]}).to_string(), 400, "'stop' must be a string or a list"),
        ("/v1/completions", json!({"prompt": "x", "logit_bias": {"abc": 1}}).to_string(), 400, "not a token id"),
        ("/v1/completions", json!({"prompt": "x", "frobnicate": true}).to_string(), 400, "unknown field 'frobnicate'"),
        ("/v1/completions", json!({"prompt": "x", "echo": true, "stream": true}).to_string(), 400, "'echo'"),
        ("/v1/completions", json!({"prompt": "x", "suffix": "y"}).to_string(), 400, "'suffix'"),
        ("/v1/completions", json!({"prompt": "x", "regex": "([a-z]+"}).to_string(), 400, "'regex' cannot be used"),
        ("/v1/completions", json!({"prompt": "x", "json_schema": "{\"type\": 5}"}).to_string(), 400, "'json_schema' cannot be used"),
        ("/v1/completions", json!({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}}}).to_string(), 400, "'response_format'"),
        ("/v1/completions", big, 413, "exceeds the limit of 65536 bytes"),
        ("/v1/chat/completions", json!({"messages": []}).to_string(), 400, "'messages' must not be empty"),
        ("/v1/chat/completions", json!({"messages": [{"content": "x"}]}).to_string(), 400, "'messages[0].role' is required"),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}).to_string(), 400, "not supported yet"),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}).to_string(), 400, "'max_completion_tokens' must be in [1, "),
        ("/generate", json!({}).to_string(), 400, "one of 'text' or 'input_ids' is required"),
        ("/generate", json!({"text": ""}).to_string(), 400, "prompt is empty"),
        ("/generate", json!({"input_ids": []}).to_string(), 400, "prompt is empty"),
        ("/generate", json!({"input_ids": [100000]}).to_string(), 400, "outside the vocabulary"),
        ("/generate", json!({"input_ids": long}).to_string(), 400, "context length"),
        ("/generate", json!({"text": "x", "sampling_params": {"max_new_tokens": "x"}}).to_string(), 400, "'sampling_params.max_new_tokens' must be an integer"),
        ("/generate", json!({"text": "x", "sampling_params": {"temprature": 0}}).to_string(), 400, "unknown field 'sampling_params.temprature'"),
        ("/generate", json!({"text": "x", "sampling_params": {"n": 0}}).to_string(), 400, "'sampling_params.n' must be in [1, 128]"),
        ("/generate", json!({"text": "x", "sampling_params": {"regex": "(a"}}).to_string(), 400, "'sampling_params.regex'"),
        ("/generate", json!({"text": "x", "sampling_params": {"ebnf": "root ::= missing_rule"}}).to_string(), 400, "'sampling_params.ebnf'"),
        ("/generate", json!({"text": "x", "sampling_params": {"json_schema": "not json"}}).to_string(), 400, "'sampling_params.json_schema'"),
        ("/generate", json!({"text": ["a", "b"], "sampling_params": [{}]}).to_string(), 400, "'sampling_params' has 1 entries"),
        ("/generate", json!({"text": "x", "image_data": "data:..."}).to_string(), 400, "'image_data'"),
        ("/generate", json!({"text": "hello world, how are you", "return_logprob": true, "logprob_start_len": 1000}).to_string(), 400, "'logprob_start_len'"),
        ("/abort_request", json!({}).to_string(), 400, "give 'rid' or 'abort_all'"),
    ];
    for (route, body, status, needle) in &cases {
        let (st, v) = post_raw(&c, &s.url(route), body.clone(), None).await?;
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        ensure!(
            st == *status && msg.contains(needle),
            "{route} {}: got {st} {v}, want {status} with {needle:?}",
            body.chars().take(120).collect::<String>()
        );
        assert_eq!(v["error"]["code"], *status);
        assert!(v["error"]["type"].is_string());
    }
    let (st, v) = get(&c, &s.url("/no/such/route"), None).await?;
    assert_eq!(st, 404, "{v}");
    let (st, _) = get(&c, &s.url("/generate"), None).await?;
    assert_eq!(st, 405);
    // Still serving, and nothing leaked.
    post_ok(
        &c,
        &s.url("/generate"),
        &json!({"text": "ok", "sampling_params": {"max_new_tokens": 2}}),
    )
    .await?;
    let (st, _) = get(&c, &s.url("/health"), None).await?;
    assert_eq!(st, 200);
    assert_no_leak(&c, &s, "arbor", None).await
}
