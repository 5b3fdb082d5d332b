//! Sessions (`/open_session`, `/close_session`, `session_params` on
//! `/generate`) on the tiny Llama, f32 weights and KV: continuing a
//! request, rewinding it to an offset, and dropping its output each give
//! the tokens of the same prompt sent whole, with the parent's tokens
//! served from the prefix cache; `replace` drops the other branches; bad
//! session ids, request ids and offsets are 400s naming the field; after
//! the close the KV pool is empty. A session's turns are held against
//! eviction (other traffic does not evict them) until it is closed or
//! expires.

mod common;

use anyhow::{Context, Result, ensure};
use common::{Server, client, fixture, get, metric, post, post_ok};
use serde_json::{Value, json};

fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default()
}

#[tokio::test]
async fn sessions_branch_and_rewind_like_flat_requests() -> Result<()> {
    let s = Server::tiny(&["--dtype", "f32", "--kv-cache-dtype", "f32"])?;
    let c = client();
    let g = s.url("/generate");
    let gen_body = |input: &[u64], session: Value| {
        json!({"input_ids": input, "session_params": session,
               "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": true}})
    };
    let flat = |input: Vec<u64>| {
        let (c, g) = (c.clone(), g.clone());
        async move {
            let v = post_ok(
                &c,
                &g,
                &json!({"input_ids": input,
                "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": true}}),
            )
            .await?;
            anyhow::Ok(ids(&v["output_ids"]))
        }
    };
    let sid = post_ok(
        &c,
        &s.url("/open_session"),
        &json!({"capacity_of_str_len": 1000}),
    )
    .await?;
    let sid = sid.as_str().context("a session id")?.to_string();
    let p: Vec<u64> = (0..40).map(|i| 10 + (i * 13) % 400).collect();
    let a = post_ok(&c, &g, &gen_body(&p, json!({"id": sid}))).await?;
    let rid_a = a["meta_info"]["id"].as_str().context("rid")?.to_string();
    let out_a = ids(&a["output_ids"]);
    let whole_a: Vec<u64> = p.iter().chain(&out_a).copied().collect();
    // Continue: the parent's prompt and output, then the new input.
    let q = vec![77u64, 78, 79];
    let b = post_ok(&c, &g, &gen_body(&q, json!({"id": sid, "rid": rid_a}))).await?;
    let mut want = whole_a.clone();
    want.extend(&q);
    ensure!(
        ids(&b["output_ids"]) == flat(want.clone()).await?,
        "continue != flat"
    );
    ensure!(
        b["meta_info"]["prompt_tokens"] == want.len()
            && b["meta_info"]["cached_tokens"].as_u64() >= Some(32),
        "{}",
        b["meta_info"]
    );
    let rid_b = b["meta_info"]["id"].as_str().context("rid")?.to_string();
    // Rewind to an offset, and drop the output.
    let r = post_ok(
        &c,
        &g,
        &gen_body(&q, json!({"id": sid, "rid": rid_a, "offset": 20})),
    )
    .await?;
    let mut want: Vec<u64> = whole_a[..20].to_vec();
    want.extend(&q);
    ensure!(ids(&r["output_ids"]) == flat(want).await?, "rewind != flat");
    let d = post_ok(
        &c,
        &g,
        &gen_body(
            &q,
            json!({"id": sid, "rid": rid_a, "drop_previous_output": true}),
        ),
    )
    .await?;
    let mut want = p.clone();
    want.extend(&q);
    ensure!(
        ids(&d["output_ids"]) == flat(want).await?,
        "drop_previous_output != flat"
    );
    // Streamed, a request joins the session too.
    let resp = c
        .post(&g)
        .json(
            &json!({"input_ids": q, "stream": true, "session_params": {"id": sid, "rid": rid_b},
                      "sampling_params": {"max_new_tokens": 4, "temperature": 0}}),
        )
        .send()
        .await?;
    let (events, _) = common::sse_events(resp).await?;
    let rid_s = events
        .last()
        .and_then(|e| e["meta_info"]["id"].as_str())
        .context("streamed rid")?
        .to_string();
    post_ok(&c, &g, &gen_body(&[5], json!({"id": sid, "rid": rid_s}))).await?;
    // Replace: the parent's other branches go.
    post_ok(
        &c,
        &g,
        &gen_body(&q, json!({"id": sid, "rid": rid_a, "replace": true})),
    )
    .await?;
    for (body, param) in [
        (
            gen_body(&q, json!({"id": sid, "rid": rid_b})),
            "session_params.rid",
        ),
        (gen_body(&q, json!({"id": "nope"})), "session_params.id"),
        (
            gen_body(&q, json!({"id": sid, "rid": rid_a, "offset": 1000})),
            "session_params.offset",
        ),
        (gen_body(&q, json!({"rid": rid_a})), "session_params.id"),
        (
            gen_body(&q, json!({"id": sid, "colour": "red"})),
            "session_params.colour",
        ),
    ] {
        let (code, e) = post(&c, &g, &body).await?;
        ensure!(
            code == 400 && e["error"]["param"] == param,
            "{body}: {code} {e}"
        );
    }
    let (code, e) = post(
        &c,
        &s.url("/open_session"),
        &json!({"capacity_of_str_len": 10, "session_id": sid}),
    )
    .await?;
    ensure!(
        code == 400 && e["error"]["param"] == "session_id",
        "{code} {e}"
    );
    let (code, e) = post(&c, &s.url("/open_session"), &json!({})).await?;
    ensure!(
        code == 400 && e["error"]["param"] == "capacity_of_str_len",
        "{code} {e}"
    );
    post_ok(&c, &s.url("/close_session"), &json!({"session_id": sid})).await?;
    let (code, e) = post(&c, &g, &gen_body(&q, json!({"id": sid, "rid": rid_a}))).await?;
    ensure!(
        code == 400 && e["error"]["param"] == "session_params.id",
        "{code} {e}"
    );
    let (code, _) = post(&c, &s.url("/close_session"), &json!({"session_id": sid})).await?;
    ensure!(code == 400);
    common::assert_no_leak(&c, &s, "arbor", None).await?;
    Ok(())
}

/// The server's `arbor:NAME` gauge.
async fn gauge(c: &reqwest::Client, s: &Server, name: &str) -> Result<f64> {
    let (_, m) = get(c, &s.url("/metrics"), None).await?;
    metric(&m, &format!("arbor:{name}")).context(name.to_string())
}

/// Polls the gauge until it reads `want` (the scheduler publishes after the answer).
async fn wait_gauge(c: &reqwest::Client, s: &Server, name: &str, want: f64) -> Result<()> {
    for _ in 0..200 {
        if gauge(c, s, name).await? == want {
            return Ok(());
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    anyhow::bail!("{name} is {}, not {want}", gauge(c, s, name).await?)
}

#[tokio::test]
async fn sessions_hold_their_turns_until_closed_or_expired() -> Result<()> {
    let model = fixture("tiny-llama");
    // 256 tokens of KV in pages of 16: holds may keep 64.
    let s = Server::start(&[
        "--model-path",
        &model,
        "--port",
        "0",
        "--threads",
        "1",
        "--max-total-tokens",
        "256",
        "--page-size",
        "16",
        "--session-hold-ratio",
        "0.25",
        "--enable-metrics",
    ])?;
    let c = client();
    let g = s.url("/generate");
    let body = |input: &[u64], session: Option<Value>| {
        let mut b = json!({"input_ids": input,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": true}});
        if let Some(p) = session {
            b["session_params"] = p;
        }
        b
    };
    let open = |timeout: Option<f64>| {
        let (c, url) = (c.clone(), s.url("/open_session"));
        async move {
            let mut b = json!({"capacity_of_str_len": 1000});
            if let Some(t) = timeout {
                b["timeout"] = json!(t);
            }
            let v = post_ok(&c, &url, &b).await?;
            anyhow::Ok(v.as_str().context("a session id")?.to_string())
        }
    };
    // Other traffic: 12 prompts of 40 tokens (distinct per salt), twice the pool.
    let flood = |salt: u64| {
        let (c, g) = (c.clone(), g.clone());
        async move {
            for k in 0..12u64 {
                let p: Vec<u64> = (0..40).map(|i| 1 + (salt + k * 41 + i * 7) % 490).collect();
                post_ok(&c, &g, &body(&p, None)).await?;
            }
            anyhow::Ok(())
        }
    };
    let turn: Vec<u64> = (0..40).map(|i| 10 + (i * 13) % 400).collect();
    let sid = open(None).await?;
    let a = post_ok(&c, &g, &body(&turn, Some(json!({"id": sid})))).await?;
    let rid = a["meta_info"]["id"].as_str().context("rid")?.to_string();
    // 40 prompt and 7 computed output tokens: two whole pages held.
    wait_gauge(&c, &s, "held_tokens", 32.0).await?;
    flood(0).await?;
    let b = post_ok(
        &c,
        &g,
        &body(&[77, 78], Some(json!({"id": sid, "rid": rid}))),
    )
    .await?;
    ensure!(b["meta_info"]["cached_tokens"] == 32, "{}", b["meta_info"]);
    // Closing releases the hold: nothing is in use, without a flush.
    post_ok(&c, &s.url("/close_session"), &json!({"session_id": sid})).await?;
    wait_gauge(&c, &s, "held_tokens", 0.0).await?;
    wait_gauge(&c, &s, "num_used_tokens", 0.0).await?;
    // Without a session the same flood evicts the turn.
    let a = post_ok(&c, &g, &body(&turn, None)).await?;
    flood(200).await?;
    let mut again: Vec<u64> = turn.clone();
    again.extend(
        a["output_ids"]
            .as_array()
            .context("ids")?
            .iter()
            .filter_map(Value::as_u64),
    );
    again.extend([77, 78]);
    let b = post_ok(&c, &g, &body(&again, None)).await?;
    ensure!(b["meta_info"]["cached_tokens"] == 0, "{}", b["meta_info"]);

    // An idle session expires: closed by the server's sweep, its hold released.
    let sid = open(Some(0.5)).await?;
    post_ok(&c, &g, &body(&turn, Some(json!({"id": sid})))).await?;
    wait_gauge(&c, &s, "held_tokens", 32.0).await?;
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    wait_gauge(&c, &s, "held_tokens", 0.0).await?;
    let (code, e) = post(&c, &g, &body(&[5], Some(json!({"id": sid})))).await?;
    ensure!(
        code == 400 && e["error"]["param"] == "session_params.id",
        "{code} {e}"
    );
    for t in [json!(0), json!(-1), json!("soon")] {
        let (code, e) = post(
            &c,
            &s.url("/open_session"),
            &json!({"capacity_of_str_len": 10, "timeout": t}),
        )
        .await?;
        ensure!(
            code == 400 && e["error"]["param"] == "timeout",
            "{t}: {code} {e}"
        );
    }
    common::assert_no_leak(&c, &s, "arbor", None).await?;
    Ok(())
}
