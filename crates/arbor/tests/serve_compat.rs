//! End-to-end tests of SGLang-compatibility details of `arbor serve`: the
//! default served model name, and the reasoning parsers (`--reasoning-parser
//! qwen3|deepseek-r1`) through the OpenAI chat API, whole and streamed.
//!
//! The tiny random model never writes think tags by itself, so the answers
//! are driven by a `regex` constraint (SGLang's extra chat field): greedy
//! output under the grammar is deterministic, and the tiny byte-level
//! vocabulary spells each tag in several tokens, so the tags arrive split
//! across stream chunks.

mod common;

use anyhow::{Context, Result};
use common::*;
use serde_json::{Value, json};

fn qwen2_server(extra: &[&str]) -> Result<Server> {
    let model = fixture("tiny-qwen2");
    let mut args = vec![
        "--model-path",
        &model,
        "--port",
        "0",
        "--threads",
        "1",
        "--max-total-tokens",
        "4096",
        "--enable-metrics",
    ];
    args.extend_from_slice(extra);
    Server::start(&args)
}

#[tokio::test]
async fn served_model_name_defaults_to_the_folder_name() -> Result<()> {
    let s = qwen2_server(&[])?;
    let c = client();
    let (st, models) = get(&c, &s.url("/v1/models"), None).await?;
    assert_eq!(st, 200);
    let models: Value = serde_json::from_str(&models)?;
    assert_eq!(models["data"][0]["id"], "tiny-qwen2", "{models}");
    let (_, info) = get(&c, &s.url("/get_model_info"), None).await?;
    let info: Value = serde_json::from_str(&info)?;
    assert_eq!(info["served_model_name"], "tiny-qwen2", "{info}");
    assert!(
        info["model_path"]
            .as_str()
            .is_some_and(|p| p.ends_with("tiny-qwen2") && p.len() > "tiny-qwen2".len()),
        "{info}"
    );
    assert_eq!(get(&c, &s.url("/v1/models/tiny-qwen2"), None).await?.0, 200);
    // The name and the path both address the model; anything else is a 404.
    let u = s.url("/v1/completions");
    let body = |m: &str| json!({"model": m, "prompt": "Hi", "max_tokens": 2, "ignore_eos": true});
    let v = post_ok(&c, &u, &body("tiny-qwen2")).await?;
    assert_eq!(v["model"], "tiny-qwen2");
    post_ok(&c, &u, &body(&fixture("tiny-qwen2"))).await?;
    let r = c.post(&u).json(&body("other")).send().await?;
    assert_eq!(r.status().as_u16(), 404);
    drop(s);

    // --served-model-name still wins.
    let s = qwen2_server(&["--served-model-name", "my-model"])?;
    let (_, models) = get(&c, &s.url("/v1/models"), None).await?;
    let models: Value = serde_json::from_str(&models)?;
    assert_eq!(models["data"][0]["id"], "my-model", "{models}");
    let (_, info) = get(&c, &s.url("/get_model_info"), None).await?;
    let info: Value = serde_json::from_str(&info)?;
    assert_eq!(info["served_model_name"], "my-model", "{info}");
    Ok(())
}

/// A chat request whose answer the regex fixes the shape of.
fn chat(regex: &str, extra: Value) -> Value {
    let mut b = json!({
        "messages": [{"role": "user", "content": "Think, then answer."}],
        "max_tokens": 96,
        "temperature": 0,
        "regex": regex,
    });
    if let (Some(o), Some(e)) = (b.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            o.insert(k.clone(), v.clone());
        }
    }
    b
}

/// The raw answer (reasoning not separated).
async fn raw_answer(c: &reqwest::Client, s: &Server, regex: &str) -> Result<String> {
    let v = post_ok(
        c,
        &s.url("/v1/chat/completions"),
        &chat(regex, json!({"separate_reasoning": false})),
    )
    .await?;
    let m = &v["choices"][0]["message"];
    assert!(m.get("reasoning_content").is_none(), "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    Ok(m["content"].as_str().context("content")?.to_string())
}

/// Streams the answer: (reasoning deltas, content deltas).
async fn streamed(
    c: &reqwest::Client,
    s: &Server,
    regex: &str,
    extra: Value,
) -> Result<(Vec<String>, Vec<String>)> {
    let mut body = chat(regex, extra);
    body["stream"] = json!(true);
    let events = sse(c, &s.url("/v1/chat/completions"), &body).await?;
    let field = |k: &str| -> Vec<String> {
        events
            .iter()
            .filter_map(|e| e["choices"][0]["delta"][k].as_str())
            .filter(|t| !t.is_empty())
            .map(str::to_string)
            .collect()
    };
    Ok((field("reasoning_content"), field("content")))
}

#[tokio::test]
async fn qwen3_reasoning_parser_whole_and_streamed() -> Result<()> {
    let s = qwen2_server(&["--reasoning-parser", "qwen3"])?;
    let c = client();
    let regex = "<think>[a-z]{6,14}</think>[a-z]{3,10}";
    let raw = raw_answer(&c, &s, regex).await?;
    let inner = raw
        .strip_prefix("<think>")
        .and_then(|r| r.split_once("</think>"))
        .with_context(|| format!("the answer follows the regex: {raw:?}"))?;
    let (reasoning, answer) = (inner.0.to_string(), inner.1.to_string());

    let v = post_ok(&c, &s.url("/v1/chat/completions"), &chat(regex, json!({}))).await?;
    let m = &v["choices"][0]["message"];
    assert_eq!(m["reasoning_content"], json!(reasoning), "{v}");
    assert_eq!(m["content"], json!(answer), "{v}");

    let (r, a) = streamed(&c, &s, regex, json!({})).await?;
    assert_eq!(r.concat(), reasoning, "{r:?}");
    assert_eq!(a.concat(), answer, "{a:?}");
    // How many pieces arrive depends on the reader's pace: the engine merges
    // chunks a slow reader has not taken yet; their text is the same.
    for piece in r.iter().chain(&a) {
        assert!(
            !piece.contains(['<', '>']),
            "a tag fragment leaked: {r:?} {a:?}"
        );
    }
    // stream_reasoning: false sends the reasoning in one piece.
    let (r, a) = streamed(&c, &s, regex, json!({"stream_reasoning": false})).await?;
    assert_eq!(r, vec![reasoning.clone()]);
    assert_eq!(a.concat(), answer);

    // qwen3 needs the opening tag: without it everything is content.
    let regex = "[a-z]{6,14}</think>[a-z]{3,10}";
    let raw = raw_answer(&c, &s, regex).await?;
    let v = post_ok(&c, &s.url("/v1/chat/completions"), &chat(regex, json!({}))).await?;
    let m = &v["choices"][0]["message"];
    assert_eq!(m["content"], json!(raw), "{v}");
    assert!(m["reasoning_content"].is_null(), "{v}");
    assert_no_leak(&c, &s, "arbor", None).await
}

#[tokio::test]
async fn deepseek_r1_reasoning_parser_without_an_opening_tag() -> Result<()> {
    let s = qwen2_server(&["--reasoning-parser", "deepseek-r1"])?;
    let c = client();
    // The template opened <think>: the model writes only the closing tag.
    let regex = "[a-z]{6,14}</think>[a-z]{3,10}";
    let raw = raw_answer(&c, &s, regex).await?;
    let (reasoning, answer) = raw
        .split_once("</think>")
        .with_context(|| format!("the answer follows the regex: {raw:?}"))?;
    let v = post_ok(&c, &s.url("/v1/chat/completions"), &chat(regex, json!({}))).await?;
    let m = &v["choices"][0]["message"];
    assert_eq!(m["reasoning_content"], json!(reasoning), "{v}");
    assert_eq!(m["content"], json!(answer), "{v}");
    let (r, a) = streamed(&c, &s, regex, json!({})).await?;
    assert_eq!((r.concat(), a.concat()), (reasoning.into(), answer.into()));
    for piece in r.iter().chain(&a) {
        assert!(
            !piece.contains(['<', '>']),
            "a tag fragment leaked: {r:?} {a:?}"
        );
    }
    // An answer with no end tag was cut off while thinking: all reasoning.
    let regex = "[a-z]{6,14}";
    let raw = raw_answer(&c, &s, regex).await?;
    let v = post_ok(&c, &s.url("/v1/chat/completions"), &chat(regex, json!({}))).await?;
    let m = &v["choices"][0]["message"];
    assert_eq!(m["reasoning_content"], json!(raw), "{v}");
    assert_eq!(m["content"], json!(""), "{v}");
    assert_no_leak(&c, &s, "arbor", None).await
}
