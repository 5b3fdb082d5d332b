//! `/v1/score` and `/v1/rerank`. Score on the tiny Llama (f32 weights and
//! KV): query and item token ids joined into a fixture prompt give the
//! exponentiated log-softmax of transformers' logits there at the label
//! ids (or their softmax over the labels). Rerank on the default model: each
//! document's score equals `P(yes) / (P(yes) + P(no))` computed from
//! `/generate`'s `token_ids_logprob` on Qwen3-Reranker's prompt, and the
//! documents come best first. Bad input names its field.

mod common;

use anyhow::{Context, Result, ensure};
use common::{Server, client, f64s, fixture, log_softmax, post, post_ok, reference_json};
use serde_json::{Value, json};

#[tokio::test]
async fn score_matches_transformers() -> Result<()> {
    let reference = reference_json(&fixture("tiny-llama"))?;
    let s = Server::tiny(&["--dtype", "f32", "--kv-cache-dtype", "f32"])?;
    let c = client();
    let u = s.url("/v1/score");
    let labels = [7usize, 3, 499];
    for p in reference["prompts"].as_array().context("prompts")? {
        let ids: Vec<u64> = p["input_ids"]
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_u64).collect())
            .unwrap_or_default();
        let lp = log_softmax(&f64s(&p["last_logits"]));
        let (q, i) = ids.split_at(2);
        let plain = post_ok(
            &c,
            &u,
            &json!({"query": q, "items": [i], "label_token_ids": labels}),
        )
        .await?;
        ensure!(plain["object"] == "scoring", "{plain}");
        let got = f64s(&plain["scores"][0]);
        for (k, &l) in labels.iter().enumerate() {
            let want = lp[l].exp();
            ensure!(
                (got[k] - want).abs() <= 1e-4 * want.max(1e-6) + 1e-7,
                "{got:?} vs {want}"
            );
        }
        let soft = post_ok(
            &c,
            &u,
            &json!({"query": q, "items": [i], "label_token_ids": labels, "apply_softmax": true}),
        )
        .await?;
        let z: f64 = labels.iter().map(|&l| lp[l].exp()).sum();
        for (k, g) in f64s(&soft["scores"][0]).iter().enumerate() {
            let want = lp[labels[k]].exp() / z;
            ensure!((g - want).abs() <= 1e-4, "{g} vs {want}");
        }
        // Item first: the same prompt from the other split.
        let swapped = post_ok(
            &c,
            &u,
            &json!({"query": i, "items": [q], "label_token_ids": labels, "item_first": true}),
        )
        .await?;
        ensure!(swapped["scores"] == plain["scores"], "{swapped} vs {plain}");
    }
    for (body, param) in [
        (json!({"query": "a", "items": ["b"]}), "label_token_ids"),
        (
            json!({"query": "a", "items": ["b"], "label_token_ids": []}),
            "label_token_ids",
        ),
        (
            json!({"query": "a", "items": ["b"], "label_token_ids": [100000]}),
            "label_token_ids",
        ),
        (
            json!({"query": "a", "items": [[1]], "label_token_ids": [1]}),
            "items",
        ),
        (json!({"items": ["b"], "label_token_ids": [1]}), "query"),
    ] {
        let (code, e) = post(&c, &u, &body).await?;
        ensure!(
            code == 400 && e["error"]["param"] == param,
            "{body}: {code} {e}"
        );
    }
    common::assert_no_leak(&c, &s, "arbor", None).await?;
    Ok(())
}

#[tokio::test]
async fn rerank_orders_by_the_yes_probability() -> Result<()> {
    let Some(model) = arbor_models::default_model_path().filter(|p| p.exists()) else {
        eprintln!("skipping: the default model is absent (run `arbor fetch-default`)");
        return Ok(());
    };
    let m = model.display().to_string();
    let s = Server::small(&m, &[])?;
    let c = client();
    let id_of = |t: &'static str| {
        let c = c.clone();
        let u = s.url("/tokenize");
        async move {
            let v = post_ok(&c, &u, &json!({"prompt": t, "add_special_tokens": false})).await?;
            ensure!(v["count"] == 1, "{t}: {v}");
            v["tokens"][0].as_u64().context("id")
        }
    };
    let (yes, no) = (id_of("yes").await?, id_of("no").await?);
    let query = "What is the capital of France?";
    let docs = [
        "Paris is the capital and largest city of France.",
        "Bananas are rich in potassium.",
        "The Eiffel Tower stands in Paris.",
    ];
    let r = post_ok(
        &c,
        &s.url("/v1/rerank"),
        &json!({"query": query, "documents": docs}),
    )
    .await?;
    let list = r.as_array().context("a list")?;
    ensure!(list.len() == 3, "{r}");
    let mut last = f64::INFINITY;
    for e in list {
        let score = e["score"].as_f64().context("score")?;
        ensure!(score <= last, "not best first: {r}");
        last = score;
        let i = e["index"].as_u64().context("index")? as usize;
        ensure!(e["document"] == docs[i]);
        let prompt = format!(
            "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n<Instruct>: Given a web search query, retrieve relevant passages that answer the query\n<Query>: {query}\n<Document>: {}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
            docs[i]
        );
        let tok = post_ok(
            &c,
            &s.url("/tokenize"),
            &json!({"prompt": prompt, "add_special_tokens": false}),
        )
        .await?;
        let g = post_ok(
            &c,
            &s.url("/generate"),
            &json!({"input_ids": tok["tokens"], "return_logprob": true, "token_ids_logprob": [yes, no],
                    "sampling_params": {"max_new_tokens": 1, "temperature": 0}}),
        )
        .await?;
        let named = &g["meta_info"]["output_token_ids_logprobs"][0];
        let (ly, ln) = (
            named[0][0].as_f64().context("yes")?,
            named[1][0].as_f64().context("no")?,
        );
        let want = ly.exp() / (ly.exp() + ln.exp());
        ensure!((score - want).abs() <= 1e-5, "{score} vs {want}");
        ensure!(e["meta_info"]["prompt_tokens"] == tok["count"], "{e}");
    }
    let top = post_ok(
        &c,
        &s.url("/v1/rerank"),
        &json!({"query": query, "documents": docs, "top_n": 2, "return_documents": false}),
    )
    .await?;
    ensure!(
        top.as_array().map(Vec::len) == Some(2) && top[0]["document"].is_null(),
        "{top}"
    );
    ensure!(top[0]["index"] == list[0]["index"], "{top}");
    let (code, e) = post(
        &c,
        &s.url("/v1/rerank"),
        &json!({"query": "q", "documents": []}),
    )
    .await?;
    ensure!(
        code == 400 && e["error"]["param"] == "documents",
        "{code} {e}"
    );
    common::assert_no_leak(&c, &s, "arbor", None).await?;
    Ok(())
}
