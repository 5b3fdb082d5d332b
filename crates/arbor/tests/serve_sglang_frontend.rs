//! SGLang's frontend language against `arbor serve`: the real `sglang`
//! package runs `scripts/sglang-frontend.py` (gen with a regex, a stop
//! string and a stop regex; select; fork/join) through
//! `sgl.RuntimeEndpoint`, and every value it produced is checked against
//! the native `/generate` API directly: each `gen` equals the same request
//! sent by hand, and `select` picked the choice with the highest normalized
//! prompt log-probability, computed here from `/generate`'s
//! `input_token_logprobs` as the frontend defines it (with its token healing).
//!
//! The Python interpreter with `sglang` installed is `ARBOR_SGLANG_PYTHON`
//! (`.ci/run` installs it); without it the test skips, or fails under
//! `ARBOR_REQUIRE_SGLANG=1`.

mod common;

use anyhow::{Context, Result, bail, ensure};
use common::{Server, client, post_ok};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

fn python() -> Result<Option<String>> {
    match std::env::var("ARBOR_SGLANG_PYTHON") {
        Ok(p) if !p.is_empty() => Ok(Some(p)),
        _ if std::env::var("ARBOR_REQUIRE_SGLANG").is_ok_and(|v| v == "1") => {
            bail!("ARBOR_REQUIRE_SGLANG=1 but ARBOR_SGLANG_PYTHON is not set")
        }
        _ => Ok(None),
    }
}

/// Runs the program to its end (at most three minutes): its JSON output.
fn run_program(python: &str, base: &str) -> Result<Value> {
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../scripts/sglang-frontend.py"
    );
    let mut child = std::process::Command::new(python)
        .arg(script)
        .arg(base)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {python}"))?;
    let deadline = Instant::now() + Duration::from_secs(180);
    while child.try_wait()?.is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output()?;
            bail!(
                "the program did not finish in 180 s: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = child.wait_with_output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(out.status.success(), "the program failed: {stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().last().context("no output")?;
    serde_json::from_str(line).with_context(|| format!("{line}\nstderr: {stderr}"))
}

/// The program's text up to and including `marker`.
fn prefix<'a>(text: &'a str, marker: &str) -> Result<&'a str> {
    let i = text
        .find(marker)
        .with_context(|| format!("no {marker:?} in {text:?}"))?;
    Ok(&text[..i + marker.len()])
}

/// The frontend's `compute_normalized_prompt_logprobs`: the mean of the
/// logprobs that are set and non-zero.
fn normalized(entries: &[Value]) -> f64 {
    let values: Vec<f64> = entries
        .iter()
        .filter_map(|e| e[0].as_f64())
        .filter(|v| *v != 0.0)
        .collect();
    values.iter().sum::<f64>() / values.len() as f64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frontend_program_runs_and_matches_the_native_api() -> Result<()> {
    let Some(python) = python()? else {
        eprintln!("skipping: ARBOR_SGLANG_PYTHON is not set (a Python with sglang installed)");
        return Ok(());
    };
    let Some(model) = arbor_models::default_model_path().filter(|p| p.exists()) else {
        eprintln!("skipping: the default model is absent (run `arbor fetch-default`)");
        return Ok(());
    };
    let m = model.display().to_string();
    let s = Server::small(&m, &[])?;
    let c = client();
    let base = s.base.clone();
    let out = tokio::task::spawn_blocking(move || run_program(&python, &base)).await??;
    let text = out["text"].as_str().context("text")?;
    let generate = s.url("/generate");

    // gen with a regex.
    let age = out["age"].as_str().context("age")?;
    ensure!(
        matches!(age.len(), 1 | 2)
            && age.chars().all(|ch| ch.is_ascii_digit())
            && !age.starts_with('0'),
        "age {age:?} does not match [1-9][0-9]?"
    );
    // gen with a stop string, and with a stop regex: the same requests by hand.
    for (var, marker, stop) in [
        (
            "city",
            "\nCity: ",
            json!({"stop": "\n", "max_new_tokens": 16}),
        ),
        (
            "motto",
            "\nMotto: ",
            json!({"stop_regex": "[.!?\n]", "max_new_tokens": 24}),
        ),
    ] {
        let mut params = stop;
        params["temperature"] = json!(0);
        let r = post_ok(
            &c,
            &generate,
            &json!({"text": prefix(text, marker)?, "sampling_params": params}),
        )
        .await?;
        ensure!(
            r["text"] == out[var],
            "{var}: {} by hand, {} by the frontend",
            r["text"],
            out[var]
        );
    }

    // select: recompute each choice's normalized prompt logprob as the frontend does.
    let before = prefix(text, "\nFavourite colour: ")?;
    let choices: Vec<String> = serde_json::from_value(out["choices"].clone())?;
    let head = post_ok(
        &c,
        &generate,
        &json!({"text": before, "sampling_params": {"max_new_tokens": 0}}),
    )
    .await?;
    let prompt_len = head["meta_info"]["prompt_tokens"]
        .as_u64()
        .context("prompt_tokens")?;
    let texts: Vec<String> = choices.iter().map(|ch| format!("{before}{ch}")).collect();
    let scored = post_ok(
        &c,
        &generate,
        &json!({"text": texts, "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                "return_logprob": true, "return_text_in_logprobs": true,
                "logprob_start_len": prompt_len.saturating_sub(2)}),
    )
    .await?;
    let frontend: Vec<f64> = serde_json::from_value(out["normalized_prompt_logprobs"].clone())?;
    let mut best = (f64::NEG_INFINITY, 0);
    for (i, r) in scored.as_array().context("a list")?.iter().enumerate() {
        let entries = r["meta_info"]["input_token_logprobs"]
            .as_array()
            .context("input_token_logprobs")?;
        let mut value = normalized(entries);
        // Token healing: a first token that the prefix already ends with is
        // taken out (over all the entries, as the frontend counts them).
        let first = &entries[0];
        let n = entries.len() as f64;
        if let (Some(tok), Some(lp)) = (first[2].as_str(), first[0].as_f64())
            && before.ends_with(tok)
        {
            value = (value * n - lp) / (n - 1.0);
        }
        ensure!(
            (value - frontend[i]).abs() < 1e-4,
            "choice {}: {value} here, {} in the frontend",
            choices[i],
            frontend[i]
        );
        if value > best.0 {
            best = (value, i);
        }
    }
    ensure!(
        out["colour"] == choices[best.1].as_str(),
        "select chose {} but {} scores highest",
        out["colour"],
        choices[best.1]
    );
    // fork/join: both branches' lines made it back into the main text.
    ensure!(text.contains("\n1. ") && text.contains("\n2. "), "{text}");
    ensure!(!out["summary"].as_str().unwrap_or(".").contains(['\n', '.']));
    common::assert_no_leak(&c, &s, "arbor", None).await?;
    Ok(())
}
