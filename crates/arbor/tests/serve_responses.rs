//! OpenAI's Responses API (`/v1/responses`) over HTTP against `arbor serve`.
//!
//! On the default model (SmolLM2-135M-Instruct; skipped with a message when
//! absent): a greedy answer equals `/v1/chat/completions`' on the same
//! messages (text and token counts), streamed or not, and the stream's named
//! events come in order with increasing `sequence_number`s, ending with the
//! full response; stored responses are read back, continued with
//! `previous_response_id` (the prompt holds the earlier input and output)
//! and deleted; `text.format` json_schema answers validate; a named
//! `tool_choice` comes back as a `function_call` item, and an answer that
//! writes a call under `tool_choice: auto` streams a message then the call;
//! a client that hangs up mid-stream frees its KV pages; a background
//! response still running is cancelled.
//!
//! On the tiny Llama: bad requests are 4xx naming the field; a stored
//! response lists its input items a page at a time; a background response
//! answers at once and stores the foreground answer. With
//! `ARBOR_SGLANG_PYTHON` (a Python with the `openai` package) the official
//! client's `responses.create` runs against the server, streamed and not.

#![allow(clippy::unwrap_used)]

mod common;

use anyhow::{Context, Result, ensure};
use common::*;
use serde_json::{Value, json};

/// The named events of a Responses stream: `(event name, data)`.
async fn events(c: &reqwest::Client, url: &str, body: &Value) -> Result<Vec<(String, Value)>> {
    let r = c.post(url).json(body).send().await?;
    ensure!(r.status().as_u16() == 200, "status {}", r.status());
    let ct = r
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    ensure!(ct.starts_with("text/event-stream"), "content-type {ct}");
    let text = r.text().await?;
    let mut out = Vec::new();
    for block in text.split("\n\n").filter(|b| !b.trim().is_empty()) {
        let mut name = None;
        let mut data = None;
        for line in block.lines() {
            if let Some(n) = line.strip_prefix("event: ") {
                name = Some(n.to_string());
            } else if let Some(d) = line.strip_prefix("data: ") {
                data = Some(serde_json::from_str::<Value>(d).with_context(|| d.to_string())?);
            }
        }
        let (name, data) = (name.context(block.to_string())?, data.context("no data")?);
        ensure!(data["type"] == name.as_str(), "event {name} holds {data}");
        out.push((name, data));
    }
    Ok(out)
}

/// Checks the order of a stream's events; returns its final response.
fn check_sequence(ev: &[(String, Value)]) -> Result<Value> {
    for (i, (_, d)) in ev.iter().enumerate() {
        ensure!(d["sequence_number"] == i, "event {i}: {d}");
    }
    ensure!(ev.len() >= 3, "{ev:?}");
    ensure!(ev[0].0 == "response.created" && ev[1].0 == "response.in_progress");
    ensure!(ev[0].1["response"]["status"] == "in_progress");
    let (last, data) = ev.last().context("empty stream")?;
    let response = data["response"].clone();
    let want = match response["status"].as_str() {
        Some("completed") => "response.completed",
        Some("incomplete") => "response.incomplete",
        _ => "response.failed",
    };
    ensure!(last == want, "last event {last} for {response}");
    // Every item added is done, in output order, as the final output has it.
    let done: Vec<&Value> = ev
        .iter()
        .filter(|(n, _)| n == "response.output_item.done")
        .map(|(_, d)| &d["item"])
        .collect();
    let output: Vec<&Value> = response["output"]
        .as_array()
        .context("output")?
        .iter()
        .collect();
    ensure!(done == output, "done items {done:?} != output {output:?}");
    let added = ev
        .iter()
        .filter(|(n, _)| n == "response.output_item.added")
        .count();
    ensure!(added == output.len(), "{added} items added");
    Ok(response)
}

/// The text of a response's message items.
fn output_text(r: &Value) -> String {
    r["output"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|i| i["type"] == "message")
        .flat_map(|i| i["content"].as_array().cloned().unwrap_or_default())
        .filter_map(|p| p["text"].as_str().map(str::to_string))
        .collect()
}

fn default_model() -> Option<String> {
    match arbor_models::default_model_path().filter(|p| p.exists()) {
        Some(p) => Some(p.display().to_string()),
        None => {
            eprintln!("skipping: the default model is absent (run `arbor fetch-default`)");
            None
        }
    }
}

/// Greedy answers equal chat's, whole and streamed; the stream is in order.
async fn same_as_chat(c: &reqwest::Client, s: &Server) -> Result<()> {
    let body = json!({
        "model": "x",
        "instructions": "You are a helpful assistant.",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Name three colors."}]}],
        "temperature": 0,
        "max_output_tokens": 40,
        "store": false,
    });
    let r = post_ok(c, &s.url("/v1/responses"), &body).await?;
    let chat = post_ok(
        c,
        &s.url("/v1/chat/completions"),
        &json!({"model": "x", "temperature": 0, "max_tokens": 40, "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Name three colors."}]}),
    )
    .await?;
    let text = chat["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(r["id"].as_str().unwrap().starts_with("resp_"), "{r}");
    assert_eq!(r["object"], "response");
    assert_eq!(output_text(&r), text, "{r}");
    assert_eq!(r["usage"]["input_tokens"], chat["usage"]["prompt_tokens"]);
    assert_eq!(
        r["usage"]["output_tokens"],
        chat["usage"]["completion_tokens"]
    );
    assert_eq!(r["usage"]["total_tokens"], chat["usage"]["total_tokens"]);
    let status = match chat["choices"][0]["finish_reason"].as_str() {
        Some("length") => "incomplete",
        _ => "completed",
    };
    assert_eq!(r["status"], status, "{r}");
    if status == "incomplete" {
        assert_eq!(r["incomplete_details"]["reason"], "max_output_tokens");
    }
    let msg = &r["output"][0];
    assert_eq!(msg["type"], "message");
    assert_eq!(msg["role"], "assistant");
    assert!(msg["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(msg["content"][0]["type"], "output_text");
    assert_eq!(msg["content"][0]["annotations"], json!([]));
    // The request's settings come back.
    assert_eq!(r["instructions"], "You are a helpful assistant.");
    assert_eq!(r["max_output_tokens"], 40);
    assert_eq!(r["temperature"], 0.0);
    assert_eq!(r["store"], false);
    assert_eq!(r["text"], json!({"format": {"type": "text"}}));
    assert_eq!(r["tool_choice"], "auto");
    assert_eq!(r["tools"], json!([]));
    assert_eq!(r["metadata"], json!({}));

    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let ev = events(c, &s.url("/v1/responses"), &sbody).await?;
    let fin = check_sequence(&ev)?;
    let deltas: String = ev
        .iter()
        .filter(|(n, _)| n == "response.output_text.delta")
        .map(|(_, d)| d["delta"].as_str().unwrap())
        .collect();
    assert_eq!(deltas, text);
    assert!(
        ev.iter()
            .filter(|(n, _)| n == "response.output_text.delta")
            .count()
            > 1,
        "the text came in one piece"
    );
    let names: Vec<&str> = ev.iter().map(|(n, _)| n.as_str()).collect();
    let pos = |n: &str| names.iter().position(|x| *x == n).unwrap();
    assert!(pos("response.output_item.added") < pos("response.content_part.added"));
    assert!(pos("response.content_part.added") < pos("response.output_text.delta"));
    assert!(pos("response.output_text.delta") < pos("response.output_text.done"));
    assert!(pos("response.output_text.done") < pos("response.content_part.done"));
    assert!(pos("response.content_part.done") < pos("response.output_item.done"));
    let done = &ev[pos("response.output_text.done")].1;
    assert_eq!(done["text"], text);
    assert_eq!(output_text(&fin), text);
    assert_eq!(fin["usage"], r["usage"]);
    assert_eq!(fin["status"], r["status"]);
    Ok(())
}

/// Stored responses: read back, continued, deleted.
async fn store_and_continue(c: &reqwest::Client, s: &Server) -> Result<()> {
    let url = s.url("/v1/responses");
    let first = post_ok(
        c,
        &url,
        &json!({"input": "What is the capital of France?", "temperature": 0,
                "max_output_tokens": 16, "metadata": {"k": "v"}}),
    )
    .await?;
    let id = first["id"].as_str().unwrap();
    assert_eq!(first["store"], true, "store defaults to true");
    let (st, got) = get(c, &s.url(&format!("/v1/responses/{id}")), None).await?;
    assert_eq!(st, 200);
    assert_eq!(serde_json::from_str::<Value>(&got)?, first);
    let answer = output_text(&first);

    let second = post_ok(
        c,
        &url,
        &json!({"input": [{"role": "user", "content": "And of Italy?"}],
                "previous_response_id": id, "temperature": 0, "max_output_tokens": 16}),
    )
    .await?;
    assert_eq!(second["previous_response_id"], id);
    let chat = post_ok(
        c,
        &s.url("/v1/chat/completions"),
        &json!({"temperature": 0, "max_tokens": 16, "messages": [
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "And of Italy?"}]}),
    )
    .await?;
    assert_eq!(
        second["usage"]["input_tokens"],
        chat["usage"]["prompt_tokens"]
    );
    assert_eq!(
        output_text(&second),
        chat["choices"][0]["message"]["content"].as_str().unwrap()
    );
    // A third turn goes through both earlier ones.
    let third = post_ok(
        c,
        &url,
        &json!({"input": "Thanks.", "previous_response_id": second["id"],
                "temperature": 0, "max_output_tokens": 4, "store": false}),
    )
    .await?;
    assert!(
        third["usage"]["input_tokens"].as_u64() > second["usage"]["input_tokens"].as_u64(),
        "{third}"
    );
    let (st, _) = get(
        c,
        &s.url(&format!("/v1/responses/{}", third["id"].as_str().unwrap())),
        None,
    )
    .await?;
    assert_eq!(st, 404, "store: false keeps nothing");

    let del = c
        .delete(s.url(&format!("/v1/responses/{id}")))
        .send()
        .await?;
    assert_eq!(del.status().as_u16(), 200);
    let del: Value = del.json().await?;
    assert_eq!(
        del,
        json!({"id": id, "object": "response.deleted", "deleted": true})
    );
    let (st, body) = get(c, &s.url(&format!("/v1/responses/{id}")), None).await?;
    assert_eq!(st, 404, "{body}");
    let (st, e) = post(c, &url, &json!({"input": "x", "previous_response_id": id})).await?;
    assert_eq!(st, 404, "{e}");
    assert_eq!(e["error"]["param"], "previous_response_id");
    Ok(())
}

/// `text.format` json_schema: the answer parses and validates.
async fn json_schema_answers(c: &reqwest::Client, s: &Server) -> Result<()> {
    let schema = json!({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
        "required": ["name", "age"], "additionalProperties": false});
    let r = post_ok(
        c,
        &s.url("/v1/responses"),
        &json!({"input": "Describe a person as JSON.", "temperature": 0, "max_output_tokens": 64,
                "text": {"format": {"type": "json_schema", "name": "person", "schema": schema,
                                    "strict": true}}}),
    )
    .await?;
    assert_eq!(r["status"], "completed", "{r}");
    let v: Value = serde_json::from_str(&output_text(&r))?;
    let validator = jsonschema::validator_for(&schema)?;
    assert!(validator.is_valid(&v), "{v}");
    assert_eq!(r["text"]["format"]["type"], "json_schema");
    Ok(())
}

fn weather_tool() -> Value {
    json!({"type": "function", "name": "get_weather", "description": "The weather of a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}})
}

/// A named tool choice gives a function_call item; its output goes back in.
async fn forced_and_streamed_calls(c: &reqwest::Client, s: &Server) -> Result<()> {
    let url = s.url("/v1/responses");
    let body = json!({"input": "What is the weather in Paris?", "tools": [weather_tool()],
                      "tool_choice": {"type": "function", "name": "get_weather"},
                      "temperature": 0, "max_output_tokens": 64});
    let r = post_ok(c, &url, &body).await?;
    let calls: Vec<&Value> = r["output"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i["type"] == "function_call")
        .collect();
    assert_eq!(calls.len(), 1, "{r}");
    let call = calls[0];
    assert_eq!(call["name"], "get_weather");
    assert_eq!(call["status"], "completed");
    assert!(call["id"].as_str().unwrap().starts_with("fc_"));
    let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap())?;
    assert!(args["city"].is_string(), "{args}");
    assert_eq!(r["tool_choice"]["name"], "get_weather");
    assert_eq!(r["tools"][0]["name"], "get_weather");

    // Streamed: the same call, its arguments in delta events.
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let ev = events(c, &url, &sbody).await?;
    let fin = check_sequence(&ev)?;
    let args_streamed: String = ev
        .iter()
        .filter(|(n, _)| n == "response.function_call_arguments.delta")
        .map(|(_, d)| d["delta"].as_str().unwrap())
        .collect();
    assert_eq!(args_streamed, call["arguments"].as_str().unwrap());
    let done = ev
        .iter()
        .find(|(n, _)| n == "response.function_call_arguments.done")
        .context("no arguments.done")?;
    assert_eq!(done.1["arguments"], call["arguments"]);
    assert_eq!(
        fin["output"].as_array().unwrap().len(),
        r["output"].as_array().unwrap().len()
    );

    // The call and its output as the next turn's input.
    let next = post_ok(
        c,
        &url,
        &json!({"previous_response_id": r["id"], "tools": [weather_tool()],
                "input": [{"type": "function_call_output", "call_id": call["call_id"],
                           "output": "{\"temperature\": 21}"}],
                "temperature": 0, "max_output_tokens": 8}),
    )
    .await?;
    assert!(next["usage"]["input_tokens"].as_u64() > r["usage"]["input_tokens"].as_u64());

    // Under auto, an answer that writes a call (forced here by a regex in
    // the qwen25 format) streams a message, then the call.
    let auto = json!({"input": "Weather in Paris?", "tools": [weather_tool()],
        "regex": r#"Let me check\. <tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}\n</tool_call>"#,
        "temperature": 0, "max_output_tokens": 64, "stream": true});
    let ev = events(c, &url, &auto).await?;
    let fin = check_sequence(&ev)?;
    let out = fin["output"].as_array().unwrap();
    assert_eq!(out.len(), 2, "{fin}");
    assert_eq!(out[0]["type"], "message");
    assert_eq!(output_text(&fin).trim(), "Let me check.");
    assert_eq!(out[1]["type"], "function_call");
    assert_eq!(out[1]["name"], "get_weather");
    let args: Value = serde_json::from_str(out[1]["arguments"].as_str().unwrap())?;
    assert_eq!(args, json!({"city": "Paris"}));
    Ok(())
}

/// A client that hangs up mid-stream: the request is aborted.
async fn hang_up(c: &reqwest::Client, s: &Server) -> Result<()> {
    let body = json!({"input": "Tell me a very long story.", "max_output_tokens": 2000,
                      "min_tokens": 2000, "stream": true});
    let mut r = c.post(s.url("/v1/responses")).json(&body).send().await?;
    ensure!(r.status().as_u16() == 200);
    // Wait for some text, then go away.
    let mut seen = String::new();
    while !seen.contains("response.output_text.delta") {
        match r.chunk().await? {
            Some(b) => seen.push_str(&String::from_utf8_lossy(&b)),
            None => anyhow::bail!("the stream ended early: {seen}"),
        }
    }
    drop(r);
    Ok(())
}

#[tokio::test]
async fn responses_on_the_default_model() -> Result<()> {
    let Some(model) = default_model() else {
        return Ok(());
    };
    let s = Server::small(&model, &["--served-model-name", "x"])?;
    let c = client();
    same_as_chat(&c, &s).await?;
    store_and_continue(&c, &s).await?;
    json_schema_answers(&c, &s).await?;
    forced_and_streamed_calls(&c, &s).await?;
    hang_up(&c, &s).await?;
    background_cancel(&c, &s).await?;
    assert_no_leak(&c, &s, "arbor", None).await?;
    Ok(())
}

#[tokio::test]
async fn bad_requests_name_the_field() -> Result<()> {
    let s = Server::tiny(&[])?;
    let c = client();
    let url = s.url("/v1/responses");
    let cases = [
        (json!({"input": "hi", "colour": "blue"}), 400, "colour"),
        (json!({}), 400, "input"),
        (json!({"input": 3}), 400, "input"),
        (json!({"input": []}), 400, "input"),
        (
            json!({"input": [{"type": "item_reference", "id": "x"}]}),
            400,
            "input[0].type",
        ),
        (
            json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
            400,
            "input[0].content[0].type",
        ),
        (
            json!({"input": "hi", "tools": [{"type": "web_search"}]}),
            400,
            "tools[0].type",
        ),
        (
            json!({"input": "hi", "tools": [{"type": "function"}]}),
            400,
            "tools[0].name",
        ),
        (
            json!({"input": "hi", "tools": [{"type": "function", "name": "f"}],
                "tool_choice": {"type": "function", "name": "g"}}),
            400,
            "tool_choice",
        ),
        (
            json!({"input": "hi", "previous_response_id": "resp_nope"}),
            404,
            "previous_response_id",
        ),
        (
            json!({"input": "hi", "max_output_tokens": 0}),
            400,
            "max_output_tokens",
        ),
        (
            json!({"input": "hi", "max_output_tokens": 1_000_000}),
            400,
            "max_output_tokens",
        ),
        (
            json!({"input": "hi", "text": {"format": {"type": "xml"}}}),
            400,
            "text.format.type",
        ),
        (
            json!({"input": "hi", "include": ["file_search_call.results"]}),
            400,
            "include[0]",
        ),
        (
            json!({"input": "hi", "background": true, "store": false}),
            400,
            "background",
        ),
        (json!({"input": "hi", "n": 2}), 400, "n"),
        (
            json!({"input": "hi", "temperature": "hot"}),
            400,
            "temperature",
        ),
        (json!({"input": "hi", "model": "other"}), 404, "model"),
    ];
    for (body, status, param) in cases {
        let (st, e) = post(&c, &url, &body).await?;
        assert_eq!(st, status, "{body} -> {e}");
        assert_eq!(e["error"]["param"], param, "{body} -> {e}");
    }
    let (st, e) = get(&c, &s.url("/v1/responses/resp_unknown"), None).await?;
    assert_eq!(st, 404, "{e}");
    let e = c.delete(s.url("/v1/responses/resp_unknown")).send().await?;
    assert_eq!(e.status().as_u16(), 404);
    // Settings that ask for nothing are accepted.
    let ok = post_ok(
        &c,
        &url,
        &json!({"input": "hi", "max_output_tokens": 2, "reasoning": {"effort": "low"},
                "truncation": "disabled", "service_tier": "auto", "parallel_tool_calls": true,
                "user": "u", "text": {"format": {"type": "text"}, "verbosity": "low"},
                "include": ["reasoning.encrypted_content"], "stream_options": {"include_obfuscation": false},
                "top_logprobs": 2}),
    )
    .await?;
    assert_eq!(ok["reasoning"]["effort"], "low");
    assert_eq!(ok["user"], "u");
    let lps = &ok["output"][0]["content"][0]["logprobs"];
    assert_eq!(lps.as_array().map(Vec::len), Some(2), "{ok}");
    assert_eq!(lps[0]["top_logprobs"].as_array().map(Vec::len), Some(2));
    assert_no_leak(&c, &s, "arbor", None).await?;
    Ok(())
}

/// `GET /v1/responses/{id}/input_items`: the request's items in OpenAI's
/// shape (a string content becomes one `input_text`, ids given where the
/// client gave none, the client's kept), newest first by default, paged by
/// `limit` and `after`; bad query values are 400s naming them; an unknown or
/// unstored response is a 404.
#[tokio::test]
async fn input_items_list_a_stored_request() -> Result<()> {
    let s = Server::tiny(&[])?;
    let c = client();
    let r = post_ok(
        &c,
        &s.url("/v1/responses"),
        &json!({"max_output_tokens": 2, "input": [
            {"role": "user", "content": "first"},
            {"type": "message", "role": "assistant", "content": "second", "id": "msg_mine"},
            {"role": "user", "content": [{"type": "input_text", "text": "third"}]}]}),
    )
    .await?;
    let id = r["id"].as_str().context("id")?.to_string();
    let items_url = |q: &str| s.url(&format!("/v1/responses/{id}/input_items{q}"));
    let (st, body) = get(&c, &items_url(""), None).await?;
    ensure!(st == 200, "{st} {body}");
    let list: Value = serde_json::from_str(&body)?;
    let data = list["data"].as_array().cloned().unwrap_or_default();
    ensure!(
        list["object"] == "list" && data.len() == 3 && list["has_more"] == false,
        "{list}"
    );
    let texts: Vec<&str> = data
        .iter()
        .filter_map(|i| i["content"][0]["text"].as_str())
        .collect();
    ensure!(
        texts == ["third", "second", "first"],
        "newest first: {list}"
    );
    ensure!(
        data[1]["id"] == "msg_mine"
            && data[1]["content"][0]["type"] == "output_text"
            && data[2]["content"][0]["type"] == "input_text"
            && data
                .iter()
                .all(|i| i["type"] == "message" && i["id"].is_string()),
        "{list}"
    );
    ensure!(
        list["first_id"] == data[0]["id"] && list["last_id"] == data[2]["id"],
        "{list}"
    );
    let first_id = data[2]["id"].as_str().context("first item id")?.to_string();
    let (_, body) = get(
        &c,
        &items_url(&format!("?order=asc&limit=1&after={first_id}")),
        None,
    )
    .await?;
    let page: Value = serde_json::from_str(&body)?;
    ensure!(
        page["data"].as_array().map(Vec::len) == Some(1)
            && page["data"][0]["id"] == "msg_mine"
            && page["has_more"] == true,
        "{page}"
    );
    for (q, param) in [
        ("?limit=0", "limit"),
        ("?limit=101", "limit"),
        ("?order=up", "order"),
        ("?after=msg_nope", "after"),
        ("?colour=red", "colour"),
    ] {
        let (st, body) = get(&c, &items_url(q), None).await?;
        let e: Value = serde_json::from_str(&body)?;
        ensure!(st == 400 && e["error"]["param"] == param, "{q}: {st} {e}");
    }
    let (st, _) = get(&c, &s.url("/v1/responses/resp_unknown/input_items"), None).await?;
    ensure!(st == 404);
    let unstored = post_ok(
        &c,
        &s.url("/v1/responses"),
        &json!({"input": "hi", "max_output_tokens": 1, "store": false}),
    )
    .await?;
    let (st, _) = get(
        &c,
        &s.url(&format!(
            "/v1/responses/{}/input_items",
            unstored["id"].as_str().unwrap_or("")
        )),
        None,
    )
    .await?;
    ensure!(st == 404, "store: false keeps no items");
    assert_no_leak(&c, &s, "arbor", None).await?;
    Ok(())
}

/// Polls a stored response until it leaves `in_progress`.
async fn settled(c: &reqwest::Client, s: &Server, id: &str) -> Result<Value> {
    for _ in 0..400 {
        let (st, body) = get(c, &s.url(&format!("/v1/responses/{id}")), None).await?;
        ensure!(st == 200, "{st} {body}");
        let v: Value = serde_json::from_str(&body)?;
        if v["status"] != "in_progress" {
            return Ok(v);
        }
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
    }
    anyhow::bail!("response {id} still in progress after 10 s")
}

/// A long background answer is cancelled while it runs.
async fn background_cancel(c: &reqwest::Client, s: &Server) -> Result<()> {
    let r = post_ok(
        c,
        &s.url("/v1/responses"),
        &json!({"input": "Count to a thousand.", "background": true, "temperature": 0,
                "max_output_tokens": 1500, "ignore_eos": true}),
    )
    .await?;
    let id = r["id"].as_str().context("id")?.to_string();
    ensure!(
        r["status"] == "in_progress" && r["background"] == true,
        "{r}"
    );
    let cancelled = post_ok(c, &s.url(&format!("/v1/responses/{id}/cancel")), &json!({})).await?;
    ensure!(cancelled["status"] == "cancelled", "{cancelled}");
    ensure!(settled(c, s, &id).await?["status"] == "cancelled");
    Ok(())
}

/// `background: true`: the POST answers at once (`in_progress`); the stored
/// result equals the same request's foreground answer; cancelling a
/// finished one answers it as it is; a foreground response cannot be
/// cancelled; background needs store and refuses stream.
#[tokio::test]
async fn background_responses_store_the_foreground_answer() -> Result<()> {
    let s = Server::tiny(&[])?;
    let c = client();
    let url = s.url("/v1/responses");
    let body = json!({"input": "hi", "max_output_tokens": 8, "temperature": 0});
    let fore = post_ok(&c, &url, &body).await?;
    let mut bg_body = body.clone();
    bg_body["background"] = json!(true);
    let r = post_ok(&c, &url, &bg_body).await?;
    let id = r["id"].as_str().context("id")?.to_string();
    ensure!(
        r["status"] == "in_progress" && r["output"] == json!([]),
        "{r}"
    );
    let done = settled(&c, &s, &id).await?;
    ensure!(
        done["status"] == fore["status"] && done["background"] == true,
        "{done}"
    );
    ensure!(output_text(&done) == output_text(&fore), "{done} vs {fore}");
    let again = post_ok(
        &c,
        &s.url(&format!("/v1/responses/{id}/cancel")),
        &json!({}),
    )
    .await?;
    ensure!(again["status"] == done["status"], "{again}");
    let (_, items) = get(&c, &s.url(&format!("/v1/responses/{id}/input_items")), None).await?;
    ensure!(
        serde_json::from_str::<Value>(&items)?["data"][0]["content"][0]["text"] == "hi",
        "{items}"
    );
    let fid = fore["id"].as_str().context("id")?;
    let (st, e) = post(
        &c,
        &s.url(&format!("/v1/responses/{fid}/cancel")),
        &json!({}),
    )
    .await?;
    ensure!(
        st == 400 && e["error"]["param"] == "response_id",
        "{st} {e}"
    );
    for (extra, param) in [
        (json!({"store": false}), "background"),
        (json!({"stream": true}), "background"),
    ] {
        let mut b = bg_body.clone();
        for (k, v) in extra.as_object().context("object")? {
            b[k] = v.clone();
        }
        let (st, e) = post(&c, &url, &b).await?;
        ensure!(st == 400 && e["error"]["param"] == param, "{b}: {st} {e}");
    }
    assert_no_leak(&c, &s, "arbor", None).await?;
    Ok(())
}

/// The official `openai` client, with `ARBOR_SGLANG_PYTHON` (a Python with
/// the package); skipped without it.
#[tokio::test]
async fn the_openai_client_reads_responses() -> Result<()> {
    let python = match std::env::var("ARBOR_SGLANG_PYTHON") {
        Ok(p) if !p.is_empty() => p,
        _ => {
            eprintln!("skipping: ARBOR_SGLANG_PYTHON is not set (a Python with openai installed)");
            return Ok(());
        }
    };
    let s = Server::tiny(&["--served-model-name", "tiny"])?;
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../scripts/openai_responses.py"
    );
    let base = s.base.clone();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(python)
            .arg(script)
            .arg(base)
            .output()
    })
    .await??;
    let stdout = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(stdout.contains("ok"), "{stdout}");
    Ok(())
}
