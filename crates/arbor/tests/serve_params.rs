//! Every refused request parameter is named in `error.param`, on every
//! generation route, as that route spells it: one table of bad values
//! (out of range, inconsistent, of the wrong type), sent to `/generate`
//! (inside `sampling_params` where SGLang puts it), `/v1/completions`,
//! `/v1/chat/completions` and `/v1/responses`. The names come from the typed engine error, so
//! no message text is read here to find a parameter.

mod common;

use anyhow::{Result, ensure};
use common::*;
use serde_json::{Value, json};

/// Where a route puts a field and what it calls it.
#[derive(Clone, Copy)]
enum Route {
    Native,
    Completions,
    Chat,
    Responses,
}

impl Route {
    fn path(self) -> &'static str {
        match self {
            Route::Native => "/generate",
            Route::Completions => "/v1/completions",
            Route::Chat => "/v1/chat/completions",
            Route::Responses => "/v1/responses",
        }
    }

    /// The route's name for an engine parameter (`None`: the route has no such field).
    fn name(self, engine: &str) -> Option<String> {
        let top_level = ["top_logprobs_num", "rid", "data_parallel_rank"];
        Some(match (self, engine) {
            (Route::Native, p) if top_level.contains(&p) => p.to_string(),
            (Route::Native, p) => format!("sampling_params.{p}"),
            (Route::Completions, "top_logprobs_num") => "logprobs".into(),
            (Route::Chat | Route::Responses, "top_logprobs_num") => "top_logprobs".into(),
            (Route::Responses, "max_new_tokens") => "max_output_tokens".into(),
            (_, "max_new_tokens") => "max_tokens".into(),
            (_, "min_new_tokens") => "min_tokens".into(),
            (_, p) => p.to_string(),
        })
    }

    /// A request body with `fields` (engine names, with values) placed
    /// where this route reads them.
    fn body(self, fields: &[(&str, Value)]) -> Value {
        let mut body = match self {
            Route::Native => json!({"text": "hello", "sampling_params": {"max_new_tokens": 2}}),
            Route::Completions => json!({"prompt": "hello", "max_tokens": 2}),
            Route::Chat => {
                json!({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2})
            }
            Route::Responses => json!({"input": "hello", "max_output_tokens": 2, "store": false}),
        };
        for (engine, v) in fields {
            let Some(name) = self.name(engine) else {
                continue;
            };
            match name.strip_prefix("sampling_params.") {
                Some(inner) => body["sampling_params"][inner] = v.clone(),
                None => body[name] = v.clone(),
            }
        }
        if matches!(self, Route::Chat) && fields.iter().any(|(k, _)| *k == "top_logprobs_num") {
            body["logprobs"] = json!(true);
        }
        if matches!(self, Route::Native) && fields.iter().any(|(k, _)| *k == "top_logprobs_num") {
            body["return_logprob"] = json!(true);
        }
        body
    }
}

#[tokio::test]
async fn every_refused_parameter_is_named_on_every_route() -> Result<()> {
    let s = Server::tiny(&[])?;
    let c = client();
    // (engine name, the request's fields); the first field is the one at fault.
    let cases: Vec<(&str, Vec<(&str, Value)>)> = vec![
        ("temperature", vec![("temperature", json!(-1))]),
        ("temperature", vec![("temperature", json!("hot"))]),
        ("top_p", vec![("top_p", json!(0))]),
        ("top_p", vec![("top_p", json!(1.5))]),
        ("top_k", vec![("top_k", json!(-5))]),
        ("top_k", vec![("top_k", json!(2.5))]),
        ("min_p", vec![("min_p", json!(2))]),
        ("repetition_penalty", vec![("repetition_penalty", json!(0))]),
        ("frequency_penalty", vec![("frequency_penalty", json!(3))]),
        ("presence_penalty", vec![("presence_penalty", json!(-3))]),
        ("logit_bias", vec![("logit_bias", json!({"999999": 1}))]),
        ("logit_bias", vec![("logit_bias", json!({"abc": 1}))]),
        ("stop", vec![("stop", json!([""]))]),
        ("stop", vec![("stop", json!(7))]),
        ("stop_regex", vec![("stop_regex", json!("(unclosed"))]),
        ("stop_regex", vec![("stop_regex", json!([1]))]),
        ("stop_token_ids", vec![("stop_token_ids", json!([999999]))]),
        ("stop_token_ids", vec![("stop_token_ids", json!("x"))]),
        ("n", vec![("n", json!(0))]),
        ("n", vec![("n", json!(500))]),
        ("max_new_tokens", vec![("max_new_tokens", json!(100000))]),
        ("max_new_tokens", vec![("max_new_tokens", json!("ten"))]),
        (
            "min_new_tokens",
            vec![("min_new_tokens", json!(5)), ("max_new_tokens", json!(2))],
        ),
        ("top_logprobs_num", vec![("top_logprobs_num", json!(50))]),
        ("data_parallel_rank", vec![("data_parallel_rank", json!(3))]),
        ("rid", vec![("rid", json!(""))]),
        ("seed", vec![("seed", json!(-1))]),
        ("ignore_eos", vec![("ignore_eos", json!("yes"))]),
        (
            "skip_special_tokens",
            vec![("skip_special_tokens", json!(1.5))],
        ),
        ("no_stop_trim", vec![("no_stop_trim", json!("no"))]),
    ];
    let mut checked = 0;
    for route in [
        Route::Native,
        Route::Completions,
        Route::Chat,
        Route::Responses,
    ] {
        for (engine, fields) in &cases {
            let Some(want) = route.name(engine) else {
                continue;
            };
            let body = route.body(fields);
            let (st, v) = post(&c, &s.url(route.path()), &body).await?;
            ensure!(
                st == 400 && v["error"]["param"] == want.as_str(),
                "{} {body}: got {st} {v}, want 400 naming {want}",
                route.path()
            );
            checked += 1;
        }
    }
    ensure!(checked >= 110, "only {checked} cases ran");
    // Still serving, and nothing leaked.
    post_ok(
        &c,
        &s.url("/generate"),
        &json!({"text": "ok", "sampling_params": {"max_new_tokens": 2}}),
    )
    .await?;
    assert_no_leak(&c, &s, "arbor", None).await
}

/// `/tokenize` and `/detokenize` (and their `/v1/` forms) in SGLang's
/// shapes: the ids equal transformers' (the fixture's reference), a list of
/// prompts gives lists, decoding gives transformers' text back, and bad
/// input is a 400 naming its field.
#[tokio::test]
async fn tokenize_and_detokenize_match_transformers() -> Result<()> {
    let s = Server::tiny(&["--served-model-name", "tiny"])?;
    let c = client();
    let reference = reference_json(&fixture("tiny-llama"))?;
    let prompts = reference["prompts"].as_array().cloned().unwrap_or_default();
    ensure!(prompts.len() >= 2, "the fixture has prompts");
    for path in ["/tokenize", "/v1/tokenize"] {
        let p = &prompts[0];
        let v = post_ok(
            &c,
            &s.url(path),
            &json!({"prompt": p["text"], "model": "tiny"}),
        )
        .await?;
        ensure!(
            v["tokens"] == p["input_ids"],
            "{path}: {v} vs {}",
            p["input_ids"]
        );
        ensure!(v["count"] == json!(p["input_ids"].as_array().map_or(0, Vec::len)));
        ensure!(v["max_model_len"].as_u64() > Some(0), "{v}");
        let texts: Vec<Value> = prompts.iter().map(|p| p["text"].clone()).collect();
        let v = post_ok(&c, &s.url(path), &json!({"prompt": texts})).await?;
        for (i, p) in prompts.iter().enumerate() {
            ensure!(
                v["tokens"][i] == p["input_ids"],
                "{path} list item {i}: {v}"
            );
        }
        // Without special tokens the BOS the reference adds is left out.
        let v = post_ok(
            &c,
            &s.url(path),
            &json!({"prompt": p["text"], "add_special_tokens": false}),
        )
        .await?;
        let ids = p["input_ids"].as_array().cloned().unwrap_or_default();
        ensure!(
            v["tokens"].as_array().map(Vec::len) == Some(ids.len() - 1),
            "{v}"
        );
    }
    for path in ["/detokenize", "/v1/detokenize"] {
        let p = &prompts[0];
        let v = post_ok(
            &c,
            &s.url(path),
            &json!({"tokens": p["greedy_ids"], "skip_special_tokens": false}),
        )
        .await?;
        ensure!(v["text"] == p["greedy_text"], "{path}: {v}");
        let lists: Vec<Value> = prompts.iter().map(|p| p["greedy_ids"].clone()).collect();
        let v = post_ok(
            &c,
            &s.url(path),
            &json!({"tokens": lists, "skip_special_tokens": false}),
        )
        .await?;
        for (i, p) in prompts.iter().enumerate() {
            ensure!(
                v["text"][i] == p["greedy_text"],
                "{path} list item {i}: {v}"
            );
        }
    }
    let bad: Vec<(&str, Value, u16, &str)> = vec![
        ("/tokenize", json!({}), 400, "prompt"),
        ("/tokenize", json!({"prompt": 5}), 400, "prompt"),
        ("/tokenize", json!({"prompt": ["a", 1]}), 400, "prompt"),
        (
            "/tokenize",
            json!({"prompt": "a", "add_special_tokens": "yes"}),
            400,
            "add_special_tokens",
        ),
        (
            "/tokenize",
            json!({"prompt": "a", "frobnicate": 1}),
            400,
            "frobnicate",
        ),
        (
            "/tokenize",
            json!({"prompt": "a", "model": "gpt-4"}),
            404,
            "model",
        ),
        ("/detokenize", json!({}), 400, "tokens"),
        ("/detokenize", json!({"tokens": [1, "x"]}), 400, "tokens"),
        ("/detokenize", json!({"tokens": [999999]}), 400, "tokens"),
        (
            "/detokenize",
            json!({"tokens": [[1], [999999]]}),
            400,
            "tokens",
        ),
    ];
    for (path, body, status, param) in bad {
        let (st, v) = post(&c, &s.url(path), &body).await?;
        ensure!(
            st == status && v["error"]["param"] == param,
            "{path} {body}: got {st} {v}, want {status} naming {param}"
        );
    }
    assert_no_leak(&c, &s, "arbor", None).await
}

/// `stop_regex` over HTTP: the output ends where its text first matches the
/// pattern, on the native and the OpenAI routes, and the finish names it.
#[tokio::test]
async fn stop_regex_ends_the_output_where_the_text_matches() -> Result<()> {
    let s = Server::tiny(&[])?;
    let c = client();
    let g = s.url("/generate");
    let free = post_ok(
        &c,
        &g,
        &json!({"text": "The radix cache is",
        "sampling_params": {"max_new_tokens": 24, "temperature": 0}}),
    )
    .await?;
    let text = free["text"].as_str().unwrap_or_default().to_string();
    let chars: Vec<char> = text.chars().collect();
    ensure!(chars.len() > 8, "{free}");
    // Two characters from the middle of the free text, as a regex.
    let probe: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let pattern = regex_escape(&probe);
    let v = post_ok(
        &c,
        &g,
        &json!({"text": "The radix cache is",
        "sampling_params": {"max_new_tokens": 24, "temperature": 0, "stop_regex": pattern}}),
    )
    .await?;
    let stopped = v["text"].as_str().unwrap_or_default();
    ensure!(
        stopped.contains(&probe) && text.starts_with(stopped),
        "{stopped:?} in {text:?}"
    );
    ensure!(stopped.len() < text.len(), "stopped early: {stopped:?}");
    ensure!(
        meta(&v)["finish_reason"] == json!({"type": "stop", "matched": pattern}),
        "{v}"
    );
    let v = post_ok(
        &c,
        &s.url("/v1/completions"),
        &json!({"prompt": "The radix cache is",
        "max_tokens": 24, "temperature": 0, "stop_regex": [pattern]}),
    )
    .await?;
    ensure!(v["choices"][0]["text"] == stopped, "{v}");
    ensure!(v["choices"][0]["finish_reason"] == "stop", "{v}");
    assert_no_leak(&c, &s, "arbor", None).await
}

/// The pattern that matches `s` literally.
fn regex_escape(s: &str) -> String {
    s.chars()
        .map(|ch| {
            if "\\.+*?()|[]{}^$#&-~".contains(ch) {
                format!("\\{ch}")
            } else if ch.is_control() || !ch.is_ascii() {
                format!("\\x{{{:x}}}", ch as u32)
            } else {
                ch.to_string()
            }
        })
        .collect()
}

/// `chat_template_kwargs` reaches the chat template, on chat completions
/// and on the Responses API: a Qwen3-style template (thinking switched off
/// with `enable_thinking: false`, as Qwen3's published template does)
/// prompts with the empty think block only when asked; bad arguments are a
/// 400 naming the field.
#[tokio::test]
async fn chat_template_kwargs_reach_the_template() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let src = std::path::PathBuf::from(fixture("tiny-qwen2"));
    for entry in std::fs::read_dir(&src)? {
        let entry = entry?;
        std::fs::copy(entry.path(), dir.path().join(entry.file_name()))?;
    }
    let cfg_path = dir.path().join("tokenizer_config.json");
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(&cfg_path)?)?;
    cfg["chat_template"] = json!(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}\
         {% if add_generation_prompt %}<|im_start|>assistant\n\
         {% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
    );
    std::fs::write(&cfg_path, serde_json::to_string(&cfg)?)?;
    let model = dir.path().display().to_string();
    let s = Server::small(&model, &[])?;
    let c = client();
    let url = s.url("/v1/chat/completions");
    let ask = |kwargs: Option<Value>| {
        let mut body = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0});
        if let Some(k) = kwargs {
            body["chat_template_kwargs"] = k;
        }
        body
    };
    let prompt_tokens = |v: &Value| v["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
    let plain = prompt_tokens(&post_ok(&c, &url, &ask(None)).await?);
    let thinking =
        prompt_tokens(&post_ok(&c, &url, &ask(Some(json!({"enable_thinking": true})))).await?);
    let off =
        prompt_tokens(&post_ok(&c, &url, &ask(Some(json!({"enable_thinking": false})))).await?);
    ensure!(plain > 0 && thinking == plain, "{plain} vs {thinking}");
    // The empty think block adds its tokens to the prompt.
    let block = post_ok(
        &c,
        &s.url("/tokenize"),
        &json!({"prompt": "<think>\n\n</think>\n\n", "add_special_tokens": false}),
    )
    .await?;
    let block_len = block["count"].as_u64().unwrap_or(0);
    ensure!(
        off > plain && off <= plain + block_len + 1,
        "{plain} -> {off} (block {block_len})"
    );
    // The Responses API renders the same prompt from the same switch.
    let responses = s.url("/v1/responses");
    let respond = |kwargs: Option<Value>| {
        let mut body =
            json!({"input": "Hi", "max_output_tokens": 1, "temperature": 0, "store": false});
        if let Some(k) = kwargs {
            body["chat_template_kwargs"] = k;
        }
        body
    };
    let input_tokens = |v: &Value| v["usage"]["input_tokens"].as_u64().unwrap_or(0);
    let r_plain = input_tokens(&post_ok(&c, &responses, &respond(None)).await?);
    let r_off = input_tokens(
        &post_ok(
            &c,
            &responses,
            &respond(Some(json!({"enable_thinking": false}))),
        )
        .await?,
    );
    ensure!(
        (r_plain, r_off) == (plain, off),
        "responses {r_plain}, {r_off} vs chat {plain}, {off}"
    );
    for bad in [
        json!(5),
        json!({"messages": []}),
        json!({"add_generation_prompt": false}),
    ] {
        let (st, v) = post(&c, &url, &ask(Some(bad.clone()))).await?;
        ensure!(
            st == 400 && v["error"]["param"] == "chat_template_kwargs",
            "{bad}: {st} {v}"
        );
        let (st, v) = post(&c, &responses, &respond(Some(bad.clone()))).await?;
        ensure!(
            st == 400 && v["error"]["param"] == "chat_template_kwargs",
            "responses {bad}: {st} {v}"
        );
    }
    assert_no_leak(&c, &s, "arbor", None).await
}

/// Prompt log-probabilities (`/generate` with `logprob_start_len`,
/// `/v1/completions` with `echo` and `logprobs`), f32 weights and KV:
/// the score of a token after each fixture prompt equals the log-softmax of
/// transformers' logits there (the fixture's reference), with its top
/// alternatives; a greedy continuation scored as prompt equals its own
/// output log-probabilities; chunked prefill and a cached prefix change
/// nothing; the first token has none.
#[tokio::test]
async fn prompt_logprobs_match_transformers() -> Result<()> {
    let reference = reference_json(&fixture("tiny-llama"))?;
    let prompts = reference["prompts"].as_array().cloned().unwrap_or_default();
    let c = client();
    let mut scored_runs: Vec<Vec<Value>> = Vec::new();
    for chunk in ["2048", "2"] {
        let s = Server::tiny(&[
            "--dtype",
            "f32",
            "--kv-cache-dtype",
            "f32",
            "--chunked-prefill-size",
            chunk,
        ])?;
        let g = s.url("/generate");
        let mut scored = Vec::new();
        for p in &prompts {
            let ids: Vec<u64> = p["input_ids"]
                .as_array()
                .map(|a| a.iter().filter_map(Value::as_u64).collect())
                .unwrap_or_default();
            let next = p["greedy_ids"][0].as_u64().unwrap_or(0);
            let reference_lp = log_softmax(&f64s(&p["last_logits"]));
            let scale = reference_lp.iter().fold(0f64, |m, x| m.max(x.abs()));
            let mut with_next = ids.clone();
            with_next.push(next);
            for round in 0..2 {
                // The second round finds the prompt cached: scores are equal.
                let v = post_ok(
                    &c,
                    &g,
                    &json!({"input_ids": with_next, "return_logprob": true,
                    "logprob_start_len": 0, "top_logprobs_num": 3,
                    "sampling_params": {"max_new_tokens": 1, "temperature": 0}}),
                )
                .await?;
                let m = meta(&v);
                let input = m["input_token_logprobs"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default();
                ensure!(input.len() == with_next.len(), "{m}");
                ensure!(input[0][0].is_null() && input[0][1] == json!(ids[0]), "{m}");
                let last = &input[input.len() - 1];
                let got = last[0].as_f64().unwrap_or(f64::NAN);
                let want = reference_lp[next as usize];
                ensure!(
                    (got - want).abs() <= 1e-4 * scale,
                    "round {round}: {got} vs transformers {want}"
                );
                let tops = m["input_top_logprobs"][input.len() - 1]
                    .as_array()
                    .cloned()
                    .unwrap_or_default();
                let mut order: Vec<usize> = (0..reference_lp.len()).collect();
                order.sort_by(|&a, &b| reference_lp[b].total_cmp(&reference_lp[a]));
                for (k, t) in tops.iter().enumerate() {
                    ensure!(t[1] == json!(order[k]), "top {k}: {t} vs {}", order[k]);
                    ensure!(
                        (t[0].as_f64().unwrap_or(f64::NAN) - reference_lp[order[k]]).abs()
                            <= 1e-4 * scale
                    );
                }
                ensure!(
                    tops.len() == 3 && m["input_top_logprobs"][0].is_null(),
                    "{m}"
                );
                if round == 1 {
                    ensure!(
                        m["cached_tokens"].as_u64() == Some(0),
                        "scored prompts are computed: {m}"
                    );
                }
                scored.push(json!(input));
            }
            // A greedy continuation scored as prompt: its output's logprobs.
            let v = post_ok(
                &c,
                &g,
                &json!({"input_ids": ids, "return_logprob": true,
                "sampling_params": {"max_new_tokens": 6, "temperature": 0}}),
            )
            .await?;
            let out: Vec<Value> = meta(&v)["output_token_logprobs"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            let generated: Vec<u64> = v["output_ids"]
                .as_array()
                .map(|a| a.iter().filter_map(Value::as_u64).collect())
                .unwrap_or_default();
            let mut forced = ids.clone();
            forced.extend(&generated);
            let w = post_ok(&c, &g, &json!({"input_ids": forced, "return_logprob": true,
                "logprob_start_len": ids.len(), "sampling_params": {"max_new_tokens": 1, "temperature": 0}})).await?;
            let input = meta(&w)["input_token_logprobs"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            ensure!(input.len() == generated.len(), "{}", meta(&w));
            for (a, b) in input.iter().zip(&out) {
                ensure!(a[1] == b[1], "{a} vs {b}");
                let (x, y) = (
                    a[0].as_f64().unwrap_or(f64::NAN),
                    b[0].as_f64().unwrap_or(f64::NAN),
                );
                ensure!((x - y).abs() <= 1e-4 * y.abs().max(1.0), "{a} vs {b}");
            }
            // /v1/completions with echo: the prompt, then the output.
            let v = post_ok(
                &c,
                &s.url("/v1/completions"),
                &json!({"prompt": with_next, "echo": true,
                "logprobs": 2, "max_tokens": 1, "temperature": 0}),
            )
            .await?;
            let lp = &v["choices"][0]["logprobs"];
            let tl = lp["token_logprobs"].as_array().cloned().unwrap_or_default();
            ensure!(tl.len() == with_next.len() + 1 && tl[0].is_null(), "{lp}");
            let native_last = scored
                .last()
                .and_then(|x| x.as_array().and_then(|a| a.last().cloned()))
                .unwrap_or_default();
            ensure!(
                (tl[with_next.len() - 1].as_f64().unwrap_or(f64::NAN)
                    - native_last[0].as_f64().unwrap_or(0.0))
                .abs()
                    < 1e-6,
                "{lp}"
            );
            ensure!(
                lp["top_logprobs"][0].is_null() && lp["text_offset"][0] == 0,
                "{lp}"
            );
        }
        // Bad input names its field.
        let (st, e) = post(
            &c,
            &g,
            &json!({"input_ids": [1, 2, 3], "return_logprob": true, "logprob_start_len": 3}),
        )
        .await?;
        ensure!(
            st == 400 && e["error"]["param"] == "logprob_start_len",
            "{e}"
        );
        let (st, e) = post(
            &c,
            &s.url("/v1/completions"),
            &json!({"prompt": "x", "echo": true, "stream": true}),
        )
        .await?;
        ensure!(st == 400 && e["error"]["param"] == "echo", "{e}");
        assert_no_leak(&c, &s, "arbor", None).await?;
        scored_runs.push(scored);
    }
    // Chunked prefill (2 tokens a step) scores the same.
    ensure!(
        scored_runs[0] == scored_runs[1],
        "chunking changed the scores"
    );
    Ok(())
}

/// `token_ids_logprob` on `/generate`, f32 weights and KV: at the first
/// output position (after each fixture prompt) the named ids' scores equal
/// the log-softmax of transformers' logits there; at prompt positions the
/// entry for the prompt's own next token equals `input_token_logprobs`;
/// the ids come back in the order named (an id repeated, repeated); a
/// chunked prefill changes nothing; ids outside the vocabulary are a 400
/// naming the field.
#[tokio::test]
async fn token_ids_logprob_match_transformers() -> Result<()> {
    let reference = reference_json(&fixture("tiny-llama"))?;
    let prompts = reference["prompts"].as_array().cloned().unwrap_or_default();
    let c = client();
    let mut runs: Vec<Vec<Value>> = Vec::new();
    for chunk in ["2048", "2"] {
        let s = Server::tiny(&[
            "--dtype",
            "f32",
            "--kv-cache-dtype",
            "f32",
            "--chunked-prefill-size",
            chunk,
        ])?;
        let g = s.url("/generate");
        let mut run = Vec::new();
        for p in &prompts {
            let reference_lp = log_softmax(&f64s(&p["last_logits"]));
            let scale = reference_lp.iter().fold(0f64, |m, x| m.max(x.abs()));
            // Some ids, one twice, and the prompt's second token.
            let second = p["input_ids"][1].as_u64().unwrap_or(0);
            let named = [7u64, 3, 499, 7, second];
            let v = post_ok(
                &c,
                &g,
                &json!({"input_ids": p["input_ids"], "return_logprob": true,
                "logprob_start_len": 0, "token_ids_logprob": named,
                "sampling_params": {"max_new_tokens": 2, "temperature": 0}}),
            )
            .await?;
            let m = meta(&v);
            let out = m["output_token_ids_logprobs"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            ensure!(out.len() == 2, "{m}");
            for (k, e) in out[0]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .iter()
                .enumerate()
            {
                ensure!(e[1] == json!(named[k]), "order: {e}");
                let got = e[0].as_f64().unwrap_or(f64::NAN);
                let want = reference_lp[named[k] as usize];
                ensure!(
                    (got - want).abs() <= 1e-4 * scale,
                    "{got} vs transformers {want}"
                );
            }
            let input = m["input_token_ids_logprobs"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            let chosen = m["input_token_logprobs"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            ensure!(input.len() == chosen.len() && input[0].is_null(), "{m}");
            // Position 1 predicts the second token: its named entry is the chosen score.
            let own = input[1][4][0].as_f64().unwrap_or(f64::NAN);
            let chosen1 = chosen[1][0].as_f64().unwrap_or(f64::NAN);
            ensure!(
                input[1][4][1] == json!(second)
                    && (own - chosen1).abs() <= 1e-6 * chosen1.abs().max(1.0),
                "{} vs {}",
                input[1],
                chosen[1]
            );
            run.push(json!(input));
            run.push(json!(out));
        }
        // Ids outside the vocabulary.
        let (code, e) = common::post(
            &c,
            &g,
            &json!({"input_ids": [1, 2], "return_logprob": true, "token_ids_logprob": [100000],
                    "sampling_params": {"max_new_tokens": 1}}),
        )
        .await?;
        ensure!(
            code == 400 && e["error"]["param"] == "token_ids_logprob",
            "{code} {e}"
        );
        runs.push(run);
    }
    // Chunked prefill (2 tokens a step) gives the same scores.
    for (a, b) in runs[0].iter().zip(&runs[1]) {
        let (fa, fb) = (flat_numbers(a), flat_numbers(b));
        ensure!(fa.len() == fb.len(), "{a} vs {b}");
        for (x, y) in fa.iter().zip(&fb) {
            ensure!((x - y).abs() <= 1e-4 * y.abs().max(1.0), "{a} vs {b}");
        }
    }
    Ok(())
}

fn flat_numbers(v: &Value) -> Vec<f64> {
    match v {
        Value::Number(n) => n.as_f64().into_iter().collect(),
        Value::Array(a) => a.iter().flat_map(flat_numbers).collect(),
        _ => Vec::new(),
    }
}

/// vLLM's `prompt_logprobs` on `/v1/completions` and `/v1/chat/completions`,
/// f32 weights and KV: after each fixture prompt, a probe token (the
/// reference's fifth most likely, where its neighbours are not near-ties)
/// gets transformers' log-softmax and its exact rank (5), beside the `k`
/// most likely alternatives ranked by place; the first token is `null`;
/// output logprobs stay off unless asked; bad values and streaming are 400s
/// naming the field.
#[tokio::test]
async fn vllm_prompt_logprobs_match_transformers() -> Result<()> {
    let reference = reference_json(&fixture("tiny-llama"))?;
    let prompts = reference["prompts"].as_array().cloned().unwrap_or_default();
    let c = client();
    let s = Server::tiny(&["--dtype", "f32", "--kv-cache-dtype", "f32"])?;
    let url = s.url("/v1/completions");
    let mut checked = 0;
    for p in &prompts {
        let reference_lp = log_softmax(&f64s(&p["last_logits"]));
        let scale = reference_lp.iter().fold(0f64, |m, x| m.max(x.abs()));
        let mut order: Vec<usize> = (0..reference_lp.len()).collect();
        order.sort_by(|&a, &b| reference_lp[b].total_cmp(&reference_lp[a]));
        let gap = |a: usize, b: usize| reference_lp[order[a]] - reference_lp[order[b]];
        if gap(3, 4) < 1e-3 * scale || gap(4, 5) < 1e-3 * scale {
            continue;
        }
        let probe = order[4] as u64;
        let mut ids: Vec<u64> = p["input_ids"]
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_u64).collect())
            .unwrap_or_default();
        ids.push(probe);
        let v = post_ok(
            &c,
            &url,
            &json!({"prompt": ids, "prompt_logprobs": 3, "max_tokens": 1, "temperature": 0}),
        )
        .await?;
        let choice = &v["choices"][0];
        ensure!(choice["logprobs"].is_null(), "{choice}");
        let pl = choice["prompt_logprobs"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        ensure!(pl.len() == ids.len() && pl[0].is_null(), "{choice}");
        let last = pl[ids.len() - 1].as_object().cloned().unwrap_or_default();
        let e = &last[&probe.to_string()];
        ensure!(e["rank"] == 5, "{e}");
        let got = e["logprob"].as_f64().unwrap_or(f64::NAN);
        ensure!(
            (got - reference_lp[probe as usize]).abs() <= 1e-4 * scale,
            "{got} vs transformers {}",
            reference_lp[probe as usize]
        );
        ensure!(
            last.len() == 4,
            "three alternatives and the token: {last:?}"
        );
        for (k, &t) in order[..3].iter().enumerate() {
            let alt = &last[&t.to_string()];
            ensure!(
                alt["rank"] == k + 1 && alt["decoded_token"].is_string(),
                "{alt}"
            );
        }
        // Every scored position ranks its token.
        ensure!(
            pl[1..].iter().all(|x| x
                .as_object()
                .is_some_and(|o| o.values().all(|e| e["rank"].as_u64() >= Some(1)))),
            "{choice}"
        );
        checked += 1;
    }
    ensure!(checked > 0, "no fixture prompt had a clear fifth token");
    // Chat: beside the choices, one entry per prompt token; output
    // logprobs cut to what was asked (1) while the prompt's carry 4.
    let v = post_ok(
        &c,
        &s.url("/v1/chat/completions"),
        &json!({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2,
                "temperature": 0, "prompt_logprobs": 4, "logprobs": true, "top_logprobs": 1}),
    )
    .await?;
    let pl = v["prompt_logprobs"].as_array().cloned().unwrap_or_default();
    ensure!(
        pl.len() as u64 == v["usage"]["prompt_tokens"].as_u64().unwrap_or(0) && pl[0].is_null(),
        "{v}"
    );
    ensure!(
        pl[1..]
            .iter()
            .all(|x| x.as_object().is_some_and(|o| (4..=5).contains(&o.len()))),
        "{v}"
    );
    let content = v["choices"][0]["logprobs"]["content"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    ensure!(
        !content.is_empty()
            && content
                .iter()
                .all(|e| e["top_logprobs"].as_array().map(Vec::len) == Some(1)),
        "{v}"
    );
    for (route, body) in [
        (
            "/v1/completions",
            json!({"prompt": "x", "prompt_logprobs": -1}),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "prompt_logprobs": 65}),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "prompt_logprobs": 2, "stream": true}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": "3"}),
        ),
    ] {
        let (st, e) = post(&c, &s.url(route), &body).await?;
        ensure!(
            st == 400 && e["error"]["param"] == "prompt_logprobs",
            "{body}: {st} {e}"
        );
    }
    assert_no_leak(&c, &s, "arbor", None).await
}
