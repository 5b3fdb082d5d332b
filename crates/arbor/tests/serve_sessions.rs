//! Sessions (`/open_session`, `/close_session`, `session_params` on
//! `/generate`) on the tiny Llama, f32 weights and KV: continuing a
//! request, rewinding it to an offset, and dropping its output each give
//! the tokens of the same prompt sent whole, with the parent's tokens
//! served from the prefix cache; `replace` drops the other branches; bad
//! session ids, request ids and offsets are 400s naming the field; after
//! the close the KV pool is empty.

mod common;

use anyhow::{Context, Result, ensure};
use common::{Server, client, post, post_ok};
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
