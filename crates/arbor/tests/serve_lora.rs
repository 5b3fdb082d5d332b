//! Multi-LoRA serving through `arbor serve` on the tiny Llama with the PEFT
//! adapters of tests/fixtures/lora (references from peft + transformers):
//! `lora_path` on `/generate` (one adapter, and one per prompt of a batch
//! mixing the base model and two adapters), OpenAI `model: "base:adapter"`,
//! `/v1/models` listing the adapters, `/load_lora_adapter` and
//! `/unload_lora_adapter` at run time, concurrent requests of three
//! adapters under `--max-loras-per-batch 2`; bad input (an unknown adapter,
//! a rank above the maximum, a missing folder, LoRA fields on a server
//! without LoRA) gets a 4xx naming the problem. Every test ends with the KV
//! pool free.

mod common;

use anyhow::{Context, Result, ensure};
use common::*;
use serde_json::{Value, json};

fn adapter_dir(name: &str) -> String {
    fixture(&format!("lora/{name}"))
}

/// Input ids, the adapter's greedy ids and the base model's, of one prompt.
type Case = (Vec<u64>, Vec<u64>, Vec<u64>);

/// The cases of an adapter's reference.json.
fn reference(name: &str) -> Result<Vec<Case>> {
    let text = std::fs::read_to_string(format!("{}/reference.json", adapter_dir(name)))?;
    let v: Value = serde_json::from_str(&text)?;
    let ids = |x: &Value| -> Vec<u64> {
        x.as_array()
            .map(|a| a.iter().filter_map(Value::as_u64).collect())
            .unwrap_or_default()
    };
    Ok(v["prompts"]
        .as_array()
        .context("prompts")?
        .iter()
        .map(|p| {
            (
                ids(&p["input_ids"]),
                ids(&p["greedy_ids"]),
                ids(&p["base_greedy_ids"]),
            )
        })
        .collect())
}

fn output_ids(v: &Value) -> Vec<u64> {
    v["output_ids"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default()
}

fn greedy_body(input: &Value, lora: Value) -> Value {
    json!({
        "input_ids": input,
        "lora_path": lora,
        "sampling_params": {"max_new_tokens": 32, "temperature": 0, "ignore_eos": true},
    })
}

fn lora_server(extra: &[&str]) -> Result<Server> {
    let attn = format!("attn={}", adapter_dir("tiny-llama-attn"));
    let all = format!("all={}", adapter_dir("tiny-llama-all"));
    let mut args = vec!["--lora-paths", &attn, &all];
    args.extend_from_slice(extra);
    Server::tiny(&args)
}

#[tokio::test]
async fn adapters_by_name_batch_openai_and_models() -> Result<()> {
    let s = lora_server(&[])?;
    let c = client();
    let attn = reference("tiny-llama-attn")?;
    let all = reference("tiny-llama-all")?;
    // One adapter per request.
    for (input, want, _) in &attn {
        let v = post_ok(
            &c,
            &s.url("/generate"),
            &greedy_body(&json!(input), json!("attn")),
        )
        .await?;
        ensure!(output_ids(&v) == *want, "attn: {v}");
    }
    // One batch: base, attn and all, prompt by prompt.
    let (p0, want_attn, want_base) = &attn[0];
    let (p1, want_all, _) = &all[1];
    let v = post_ok(
        &c,
        &s.url("/generate"),
        &greedy_body(&json!([p0, p0, p1]), json!([null, "attn", "all"])),
    )
    .await?;
    let outs = v.as_array().context("a list")?;
    ensure!(output_ids(&outs[0]) == *want_base, "base: {}", outs[0]);
    ensure!(output_ids(&outs[1]) == *want_attn, "attn: {}", outs[1]);
    ensure!(output_ids(&outs[2]) == *want_all, "all: {}", outs[2]);
    // OpenAI completions: "base:adapter" and the adapter alone give the
    // native text; another base name is a 404.
    let native = post_ok(
        &c,
        &s.url("/generate"),
        &greedy_body(&json!(p0), json!("attn")),
    )
    .await?;
    for model in ["tiny-llama:attn", "attn"] {
        let v = post_ok(
            &c,
            &s.url("/v1/completions"),
            &json!({"model": model, "prompt": p0, "max_tokens": 32, "temperature": 0, "ignore_eos": true}),
        )
        .await?;
        ensure!(
            v["choices"][0]["text"] == native["text"],
            "{model}: {v} vs {native}"
        );
        ensure!(v["model"] == "tiny-llama:attn", "{v}");
    }
    // Chat: the adapter by model name and by SGLang's extra `lora_path` agree.
    let chat = |extra: Value| {
        let mut body = json!({"messages": [{"role": "user", "content": "Hi there"}],
            "max_tokens": 12, "temperature": 0});
        if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
            b.extend(e.clone());
        }
        body
    };
    let url = s.url("/v1/chat/completions");
    let by_model = post_ok(&c, &url, &chat(json!({"model": "tiny-llama:all"}))).await?;
    let by_field = post_ok(
        &c,
        &url,
        &chat(json!({"model": "tiny-llama", "lora_path": "all"})),
    )
    .await?;
    let base = post_ok(&c, &url, &chat(json!({"model": "tiny-llama"}))).await?;
    let content = |v: &Value| v["choices"][0]["message"]["content"].clone();
    ensure!(
        content(&by_model) == content(&by_field),
        "{by_model} vs {by_field}"
    );
    ensure!(content(&by_model) != content(&base), "{by_model} vs {base}");
    let (code, v) = post(
        &c,
        &url,
        &chat(json!({"model": "attn", "lora_path": "all"})),
    )
    .await?;
    ensure!(
        code == 400 && v.to_string().contains("lora_path"),
        "{code} {v}"
    );
    let (code, v) = post(
        &c,
        &s.url("/v1/completions"),
        &json!({"model": "tiny-llama:nope", "prompt": "hi", "max_tokens": 2}),
    )
    .await?;
    ensure!(
        code == 404 && v.to_string().contains("tiny-llama:attn"),
        "{code} {v}"
    );
    // /v1/models lists the base model then the adapters.
    let (code, text) = get(&c, &s.url("/v1/models"), None).await?;
    let v: Value = serde_json::from_str(&text)?;
    let ids: Vec<&str> = v["data"]
        .as_array()
        .context("data")?
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    ensure!(
        code == 200 && ids == ["tiny-llama", "all", "attn"],
        "{text}"
    );
    ensure!(v["data"][2]["parent"] == "tiny-llama", "{text}");
    // An unknown adapter: a 400 naming the loaded ones.
    let (code, v) = post(
        &c,
        &s.url("/generate"),
        &greedy_body(&json!(p0), json!("nope")),
    )
    .await?;
    ensure!(
        code == 400 && v.to_string().contains("loaded: all, attn"),
        "{code} {v}"
    );
    assert_no_leak(&c, &s, "arbor", None).await
}

#[tokio::test]
async fn load_unload_and_concurrent_adapters() -> Result<()> {
    let s = lora_server(&["--max-loras-per-batch", "2"])?;
    let c = client();
    // The start-up adapters have ranks 8 and 4: rank 16 is refused.
    let (code, v) = post(
        &c,
        &s.url("/load_lora_adapter"),
        &json!({"lora_name": "mlp", "lora_path": adapter_dir("tiny-llama-mlp")}),
    )
    .await?;
    ensure!(
        code == 400 && v.to_string().contains("above max_lora_rank 8"),
        "{code} {v}"
    );
    let (code, v) = post(
        &c,
        &s.url("/load_lora_adapter"),
        &json!({"lora_name": "gone", "lora_path": "/nonexistent/adapter"}),
    )
    .await?;
    ensure!(
        code == 400 && v.to_string().contains("adapter_config.json"),
        "{code} {v}"
    );
    let v = post_ok(
        &c,
        &s.url("/load_lora_adapter"),
        &json!({"lora_name": "attn2", "lora_path": adapter_dir("tiny-llama-attn")}),
    )
    .await?;
    ensure!(
        v["success"] == true && v["loaded_adapters"]["attn2"].is_string(),
        "{v}"
    );
    // 3 adapters and the base model, 4 requests each, at once, two adapters per step.
    let attn = reference("tiny-llama-attn")?;
    let all = reference("tiny-llama-all")?;
    let mut cases: Vec<(Value, Vec<u64>)> = Vec::new();
    for i in 0..attn.len() {
        cases.push((
            greedy_body(&json!(attn[i].0), json!("attn")),
            attn[i].1.clone(),
        ));
        cases.push((
            greedy_body(&json!(attn[i].0), json!("attn2")),
            attn[i].1.clone(),
        ));
        cases.push((
            greedy_body(&json!(all[i].0), json!("all")),
            all[i].1.clone(),
        ));
        cases.push((
            greedy_body(&json!(attn[i].0), Value::Null),
            attn[i].2.clone(),
        ));
    }
    let url = s.url("/generate");
    let runs = cases.iter().map(|(b, _)| post_ok(&c, &url, b));
    let outs = futures_util::future::join_all(runs).await;
    for ((body, want), out) in cases.iter().zip(outs) {
        let out = out?;
        ensure!(output_ids(&out) == *want, "{body}: {out}");
    }
    // Unloading frees the name; the adapter is then unknown.
    let v = post_ok(
        &c,
        &s.url("/unload_lora_adapter"),
        &json!({"lora_name": "attn2"}),
    )
    .await?;
    ensure!(v["loaded_adapters"].get("attn2").is_none(), "{v}");
    let (code, v) = post(&c, &s.url("/generate"), &cases[1].0).await?;
    ensure!(
        code == 400 && v.to_string().contains("'attn2'"),
        "{code} {v}"
    );
    let (code, v) = post(
        &c,
        &s.url("/unload_lora_adapter"),
        &json!({"lora_name": "attn2"}),
    )
    .await?;
    ensure!(code == 400, "{code} {v}");
    assert_no_leak(&c, &s, "arbor", None).await
}

#[tokio::test]
async fn lora_fields_without_lora_and_bad_flags() -> Result<()> {
    let s = Server::tiny(&[])?;
    let c = client();
    let (code, v) = post(
        &c,
        &s.url("/generate"),
        &greedy_body(&json!([1, 2, 3]), json!("attn")),
    )
    .await?;
    ensure!(
        code == 400 && v.to_string().contains("--enable-lora"),
        "{code} {v}"
    );
    let (code, v) = post(
        &c,
        &s.url("/load_lora_adapter"),
        &json!({"lora_name": "a", "lora_path": adapter_dir("tiny-llama-attn")}),
    )
    .await?;
    ensure!(
        code == 400 && v.to_string().contains("--enable-lora"),
        "{code} {v}"
    );
    assert_no_leak(&c, &s, "arbor", None).await?;
    drop(s);
    let mlp = format!("mlp={}", adapter_dir("tiny-llama-mlp"));
    assert_serve_refuses(
        &["--lora-paths", &mlp, "--max-lora-rank", "8"],
        "[lora] max_lora_rank / --max-lora-rank: LoRA adapter 'mlp': rank 16",
    )?;
    assert_serve_refuses(
        &["--lora-paths", "x=/nonexistent/adapter"],
        "adapter_config.json",
    )?;
    assert_serve_refuses(
        &["--enable-lora", "--lora-target-modules", "lm_head"],
        "lm_head",
    )?;
    assert_serve_refuses(
        &["--enable-lora", "--max-loras-per-batch", "0"],
        "--max-loras-per-batch",
    )?;
    assert_serve_refuses(
        &[
            "--enable-lora",
            "--dp-size",
            "2",
            "--tp-size",
            "2",
            "--enable-dp-attention",
        ],
        "--lora-paths with --enable-dp-attention",
    )?;
    Ok(())
}

/// `--tp-size 2`: each rank applies its slices of an adapter's factors
/// (output rows of q/k/v/gate/up, input columns of o/down, before the
/// all-reduce). One batch mixing the base model and two start-up adapters,
/// and an adapter loaded at run time, give the peft references.
#[tokio::test]
async fn tensor_parallel_ranks_apply_their_slices_of_each_adapter() -> Result<()> {
    let s = lora_server(&["--tp-size", "2", "--max-lora-rank", "16"])?;
    ensure!(s.log_contains("tensor-parallel 2 ranks"), "{}", s.logs());
    mixed_batch_then_a_loaded_adapter(&s).await
}

/// `--dp-size 2`: each replica holds its own copy of every adapter (on its
/// devices; with `--tp-size 2` each copy is sliced over the replica's
/// ranks) and applies it to the requests it serves.
#[tokio::test]
async fn data_parallel_replicas_apply_the_adapters() -> Result<()> {
    let s = lora_server(&["--dp-size", "2", "--max-lora-rank", "16"])?;
    ensure!(s.log_contains("data-parallel: 2 replicas"), "{}", s.logs());
    mixed_batch_then_a_loaded_adapter(&s).await?;
    let s = lora_server(&["--dp-size", "2", "--tp-size", "2", "--max-lora-rank", "16"])?;
    mixed_batch_then_a_loaded_adapter(&s).await
}

/// One batch mixing the base model and the two start-up adapters, then the
/// `mlp` adapter loaded at run time: every answer is the peft reference.
async fn mixed_batch_then_a_loaded_adapter(s: &Server) -> Result<()> {
    let c = client();
    let attn = reference("tiny-llama-attn")?;
    let all = reference("tiny-llama-all")?;
    let mut cases: Vec<(Value, Vec<u64>)> = Vec::new();
    for ((p_attn, want_attn, want_base), (p_all, want_all, _)) in attn.iter().zip(&all) {
        cases.push((
            greedy_body(&json!(p_attn), json!("attn")),
            want_attn.clone(),
        ));
        cases.push((greedy_body(&json!(p_all), json!("all")), want_all.clone()));
        cases.push((greedy_body(&json!(p_attn), Value::Null), want_base.clone()));
    }
    let url = s.url("/generate");
    let answers =
        futures_util::future::join_all(cases.iter().map(|(b, _)| post_ok(&c, &url, b))).await;
    for (i, (a, (body, want))) in answers.into_iter().zip(&cases).enumerate() {
        let v = a?;
        ensure!(output_ids(&v) == *want, "case {i} {body}: {v}");
    }
    let v = post_ok(
        &c,
        &s.url("/load_lora_adapter"),
        &json!({"lora_name": "mlp", "lora_path": adapter_dir("tiny-llama-mlp")}),
    )
    .await?;
    ensure!(v["success"] == true, "{v}");
    for (input, want, _) in reference("tiny-llama-mlp")? {
        let v = post_ok(
            &c,
            &s.url("/generate"),
            &greedy_body(&json!(input), json!("mlp")),
        )
        .await?;
        ensure!(output_ids(&v) == want, "mlp: {v}");
    }
    assert_no_leak(&c, s, "arbor", None).await
}
