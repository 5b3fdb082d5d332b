//! Embeddings (`--is-embedding`, `/v1/embeddings`, `/encode`) on the tiny
//! Qwen3 fixture, f32 weights and KV. The reference is transformers: the
//! fixture's LM head is tied to its embeddings `W`, so the final normed
//! hidden state `h` at a prompt's last token gives transformers' last
//! logits as `W·h`; the served vector is `h/|h|`, so `W·e` must equal those
//! logits up to one positive scale. Mean pooling (a checkpoint whose
//! sentence-transformers config asks for it) is checked for losslessness:
//! chunked against unchunked prefill, a batch against single requests.

mod common;

use anyhow::{Context, Result, ensure};
use common::{Server, client, fixture, post, post_ok, reference_json};
use serde_json::{Value, json};

fn vector(v: &Value) -> Result<Vec<f32>> {
    v.as_array()
        .context("an embedding list")?
        .iter()
        .map(|x| x.as_f64().map(|x| x as f32).context("a number"))
        .collect()
}

/// The tied embedding table `[vocab, hidden]` of the fixture.
fn table(dir: &str) -> Result<(Vec<f32>, usize)> {
    let bytes = std::fs::read(format!("{dir}/model.safetensors"))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)?;
    let t = st.tensor("model.embed_tokens.weight")?;
    let hidden = t.shape()[1];
    let w = t
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    Ok((w, hidden))
}

fn args<'a>(model: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec![
        "--is-embedding",
        "--dtype",
        "f32",
        "--kv-cache-dtype",
        "f32",
    ];
    a.extend_from_slice(extra);
    let _ = model;
    a
}

fn close(a: &[f32], b: &[f32], tol: f32) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() <= tol)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn last_token_embeddings_match_transformers() -> Result<()> {
    let dir = fixture("tiny-qwen3");
    let reference = reference_json(&dir)?;
    let (w, hidden) = table(&dir)?;
    let s = Server::small(&dir, &args(&dir, &[]))?;
    let c = client();
    let prompts = reference["prompts"].as_array().context("prompts")?;
    let ids: Vec<Value> = prompts.iter().map(|p| p["input_ids"].clone()).collect();
    let r = post_ok(
        &c,
        &s.url("/v1/embeddings"),
        &json!({"input": ids, "model": "tiny-qwen3"}),
    )
    .await?;
    ensure!(r["object"] == "list", "{r}");
    let data = r["data"].as_array().context("data")?;
    ensure!(data.len() == prompts.len());
    let tokens: usize = prompts
        .iter()
        .map(|p| p["input_ids"].as_array().map_or(0, Vec::len))
        .sum();
    ensure!(r["usage"]["prompt_tokens"] == tokens, "{}", r["usage"]);
    for (p, d) in prompts.iter().zip(data) {
        let e = vector(&d["embedding"])?;
        ensure!(e.len() == hidden);
        let norm: f32 = e.iter().map(|x| x * x).sum::<f32>().sqrt();
        ensure!((norm - 1.0).abs() < 1e-5, "norm {norm}");
        let logits: Vec<f32> = vector(&p["last_logits"])?;
        let y: Vec<f32> = w
            .chunks_exact(hidden)
            .map(|row| row.iter().zip(&e).map(|(a, b)| a * b).sum())
            .collect();
        let scale = logits.iter().zip(&y).map(|(l, y)| l * y).sum::<f32>()
            / y.iter().map(|y| y * y).sum::<f32>();
        let max = logits.iter().fold(0f32, |m, l| m.max(l.abs()));
        let err = logits
            .iter()
            .zip(&y)
            .fold(0f32, |m, (l, y)| m.max((l - scale * y).abs()));
        ensure!(
            scale > 0.0 && err <= 1e-4 * max,
            "W·e is off transformers' logits by {err} (max {max})"
        );
    }
    // One at a time, by text through /encode, and as base64: the same vectors.
    let first = vector(&data[0]["embedding"])?;
    let one = post_ok(&c, &s.url("/encode"), &json!({"input_ids": ids[0]})).await?;
    ensure!(
        vector(&one["embedding"])? == first,
        "a batch changed the vector"
    );
    let text = prompts[0]["text"].as_str().context("text")?;
    let by_text = post_ok(&c, &s.url("/encode"), &json!({"text": [text]})).await?;
    ensure!(
        by_text.as_array().is_some_and(|a| a.len() == 1),
        "{by_text}"
    );
    let b64 = post_ok(
        &c,
        &s.url("/v1/embeddings"),
        &json!({"input": [ids[0]], "encoding_format": "base64"}),
    )
    .await?;
    let s64 = b64["data"][0]["embedding"].as_str().context("base64")?;
    ensure!(decode_b64(s64)? == first, "base64 differs");
    // A repeated long prompt reuses its cached prefix: the same vector.
    let long: Vec<u32> = (0..150).map(|i| 20 + (i * 7) % 400).collect();
    let a = post_ok(&c, &s.url("/encode"), &json!({"input_ids": long})).await?;
    let b = post_ok(&c, &s.url("/encode"), &json!({"input_ids": long})).await?;
    ensure!(
        vector(&a["embedding"])? == vector(&b["embedding"])?,
        "the cached prefix changed it"
    );

    // Bad input names its field.
    for (body, param) in [
        (json!({"input": []}), "input"),
        (json!({"input": [[]]}), "input"),
        (json!({"input": 3}), "input"),
        (
            json!({"input": "x", "encoding_format": "int8"}),
            "encoding_format",
        ),
        (json!({"input": "x", "dimensions": 3}), "dimensions"),
        (json!({"input": "x", "truncate": true}), "truncate"),
        (json!({}), "input"),
    ] {
        let (code, e) = post(&c, &s.url("/v1/embeddings"), &body).await?;
        ensure!(
            code == 400 && e["error"]["param"] == param,
            "{body}: {code} {e}"
        );
    }
    let (code, e) = post(
        &c,
        &s.url("/encode"),
        &json!({"text": "a", "input_ids": [1]}),
    )
    .await?;
    ensure!(code == 400, "{e}");
    common::assert_no_leak(&c, &s, "arbor", None).await?;
    Ok(())
}

fn decode_b64(s: &str) -> Result<Vec<f32>> {
    const ABC: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut bits = 0u32;
    let mut n = 0;
    let mut bytes = Vec::new();
    for ch in s.bytes().filter(|&b| b != b'=') {
        let v = ABC.iter().position(|&a| a == ch).context("base64 digit")? as u32;
        bits = (bits << 6) | v;
        n += 6;
        if n >= 8 {
            n -= 8;
            bytes.push((bits >> n) as u8);
            bits &= (1 << n) - 1;
        }
    }
    Ok(bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mean_pooling_is_lossless_across_chunks_and_batches() -> Result<()> {
    // The fixture with a sentence-transformers pooling config asking for the mean.
    let tmp = tempfile::tempdir()?;
    let src = fixture("tiny-qwen3");
    for e in std::fs::read_dir(&src)? {
        let p = e?.path();
        std::fs::copy(&p, tmp.path().join(p.file_name().context("name")?))?;
    }
    std::fs::create_dir(tmp.path().join("1_Pooling"))?;
    std::fs::write(
        tmp.path().join("1_Pooling/config.json"),
        r#"{"word_embedding_dimension": 64, "pooling_mode_mean_tokens": true, "pooling_mode_lasttoken": false}"#,
    )?;
    let dir = tmp.path().display().to_string();
    let long: Vec<u32> = (0..150).map(|i| 20 + (i * 7) % 400).collect();
    let short: Vec<u32> = vec![11, 12, 13, 14, 15];
    let c = client();
    let whole = Server::small(&dir, &args(&dir, &[]))?;
    let chunked = Server::small(&dir, &args(&dir, &["--chunked-prefill-size", "32"]))?;
    let last = Server::small(&src, &args(&src, &[]))?;
    let body = json!({"input": [long, short]});
    let a = post_ok(&c, &whole.url("/v1/embeddings"), &body).await?;
    let b = post_ok(&c, &chunked.url("/v1/embeddings"), &body).await?;
    let again = post_ok(&c, &whole.url("/v1/embeddings"), &body).await?;
    let single = post_ok(&c, &whole.url("/encode"), &json!({"input_ids": short})).await?;
    let by_last = post_ok(&c, &last.url("/encode"), &json!({"input_ids": long})).await?;
    let (a0, a1) = (
        vector(&a["data"][0]["embedding"])?,
        vector(&a["data"][1]["embedding"])?,
    );
    // Sums over chunks round differently from one sum: equal to 1e-6.
    ensure!(
        close(&a0, &vector(&b["data"][0]["embedding"])?, 1e-6),
        "chunking changed the mean"
    );
    ensure!(
        a0 == vector(&again["data"][0]["embedding"])?,
        "a repeat changed the mean"
    );
    ensure!(
        a1 == vector(&single["embedding"])?,
        "a batch changed the mean"
    );
    ensure!(
        !close(&a0, &vector(&by_last["embedding"])?, 1e-3),
        "mean equals last-token pooling"
    );
    // The generation server refuses embeddings, naming the flag.
    let g = Server::small(&src, &[])?;
    let (code, e) = post(&c, &g.url("/v1/embeddings"), &json!({"input": "x"})).await?;
    ensure!(
        code == 400 && e.to_string().contains("--is-embedding"),
        "{code} {e}"
    );
    for s in [&whole, &chunked] {
        common::assert_no_leak(&c, s, "arbor", None).await?;
    }
    Ok(())
}
