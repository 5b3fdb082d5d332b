//! Hub model ids end to end: `arbor serve --model-path ORG/NAME` against a
//! local server speaking the Hugging Face Hub's file routes (`HF_ENDPOINT`):
//! the repository listing (`/api/models/ORG/NAME/revision/REV`) and
//! `/ORG/NAME/resolve/REV/FILE` with ranges, the commit and etag headers.
//! It checks a download with a token and a revision, a download cut off
//! mid-file (the run fails naming the file, nothing half-written is used,
//! the next run resumes it to identical bytes), offline use of the cache
//! (`HF_HUB_OFFLINE=1`, and a cache laid out by hand as `huggingface_hub`
//! lays it out), `--tokenizer-path`, `--chat-template`, `--context-length`
//! and `--log-requests`. The served model's greedy output equals
//! transformers' (the fixture's reference).

mod common;

use anyhow::{Context, Result, ensure};
use axum::body::Body;
use axum::extract::{Path as UrlPath, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::Response;
use axum::routing::get;
use common::{Server, client, fixture, generate_greedy, get as http_get, post_ok, reference_json};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

const TOKEN: &str = "hf_test_token";
const REPO: &str = "arbor-test/tiny-llama";
const MAIN_COMMIT: &str = "1111111111111111111111111111111111111111";
const V1_COMMIT: &str = "2222222222222222222222222222222222222222";
/// The shard whose first downloads are cut off.
const CUT_FILE: &str = "model-00002-of-00002.safetensors";

/// The files of one commit.
type Files = BTreeMap<String, Vec<u8>>;

struct Hub {
    /// Revision name (or commit) to (commit, files).
    revisions: BTreeMap<String, (String, Files)>,
    /// Body downloads of `CUT_FILE` still to cut off.
    cuts_left: AtomicUsize,
    /// Requests without the token.
    unauthorized: AtomicUsize,
    /// Files whose bodies were served (not the one-byte probes).
    bodies: Mutex<Vec<String>>,
}

fn sha256_hex(b: &[u8]) -> String {
    Sha256::digest(b)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

fn read_dir_files(dir: &str) -> Result<Files> {
    let mut files = Files::new();
    for e in std::fs::read_dir(dir)? {
        let p = e?.path();
        let name = p.file_name().and_then(|n| n.to_str()).context("name")?;
        if name == "reference.json" {
            continue;
        }
        files.insert(name.to_string(), std::fs::read(&p)?);
    }
    Ok(files)
}

fn authorized(hub: &Hub, headers: &HeaderMap) -> bool {
    let ok = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        == Some(&format!("Bearer {TOKEN}"));
    if !ok {
        hub.unauthorized.fetch_add(1, Ordering::SeqCst);
    }
    ok
}

async fn info(
    State(hub): State<Arc<Hub>>,
    UrlPath((org, name, rev)): UrlPath<(String, String, String)>,
    headers: HeaderMap,
) -> Response {
    if !authorized(&hub, &headers) {
        return status(StatusCode::UNAUTHORIZED);
    }
    match hub.revisions.get(&rev) {
        Some((commit, files)) if format!("{org}/{name}") == REPO => {
            let siblings: Vec<Value> = files
                .keys()
                .chain(["README.md".to_string(), "original/params.json".to_string()].iter())
                .map(|f| json!({"rfilename": f}))
                .collect();
            let body = json!({"id": REPO, "sha": commit, "siblings": siblings});
            Response::builder()
                .header(header::CONTENT_TYPE, "application/json")
                .body(Body::from(body.to_string()))
                .unwrap_or_default()
        }
        _ => status(StatusCode::NOT_FOUND),
    }
}

fn status(s: StatusCode) -> Response {
    Response::builder()
        .status(s)
        .body(Body::empty())
        .unwrap_or_default()
}

/// `bytes=A-B` or `bytes=A-`.
fn range(headers: &HeaderMap, size: usize) -> (usize, usize) {
    let spec = headers
        .get(header::RANGE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("bytes="));
    let Some((a, b)) = spec.and_then(|s| s.split_once('-')) else {
        return (0, size.saturating_sub(1));
    };
    let start = a.parse().unwrap_or(0);
    let end = b.parse().unwrap_or(size.saturating_sub(1));
    (start, end.min(size.saturating_sub(1)))
}

async fn resolve(
    State(hub): State<Arc<Hub>>,
    UrlPath((org, name, rev, file)): UrlPath<(String, String, String, String)>,
    headers: HeaderMap,
) -> Response {
    if !authorized(&hub, &headers) {
        return status(StatusCode::UNAUTHORIZED);
    }
    let Some((commit, files)) = hub.revisions.get(&rev) else {
        return status(StatusCode::NOT_FOUND);
    };
    let Some(bytes) = files.get(&file).filter(|_| format!("{org}/{name}") == REPO) else {
        return status(StatusCode::NOT_FOUND);
    };
    let (start, end) = range(&headers, bytes.len());
    let part = bytes[start..=end].to_vec();
    let probe = start == 0 && end == 0;
    let builder = Response::builder()
        .status(StatusCode::PARTIAL_CONTENT)
        .header("x-repo-commit", commit.as_str())
        .header(header::ETAG, format!("\"{}\"", sha256_hex(bytes)))
        .header(
            header::CONTENT_RANGE,
            format!("bytes {start}-{end}/{}", bytes.len()),
        )
        .header(header::CONTENT_LENGTH, part.len());
    if !probe {
        if let Ok(mut b) = hub.bodies.lock() {
            b.push(format!("{file}@{start}"));
        }
        let cut = file == CUT_FILE
            && hub
                .cuts_left
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok();
        if cut {
            // Half the body reaches the client, then the connection breaks.
            use futures_util::StreamExt;
            let half = part[..part.len() / 2].to_vec();
            let chunks: Vec<std::io::Result<Vec<u8>>> = vec![
                Ok(half),
                Err(std::io::Error::other("connection cut by the test hub")),
            ];
            let paced = futures_util::stream::iter(chunks).then(|c| async move {
                if c.is_err() {
                    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
                }
                c
            });
            return builder.body(Body::from_stream(paced)).unwrap_or_default();
        }
    }
    builder.body(Body::from(part)).unwrap_or_default()
}

/// Starts the hub on a free loopback port; returns its address.
async fn start_hub(hub: Arc<Hub>) -> Result<String> {
    let app = axum::Router::new()
        .route("/api/models/{org}/{name}/revision/{rev}", get(info))
        .route("/{org}/{name}/resolve/{rev}/{*file}", get(resolve))
        .with_state(hub);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok(format!("http://{addr}"))
}

fn hub_of(cuts: usize) -> Result<Arc<Hub>> {
    let files = read_dir_files(&fixture("tiny-llama"))?;
    let mut revisions = BTreeMap::new();
    revisions.insert("main".to_string(), (MAIN_COMMIT.to_string(), files.clone()));
    revisions.insert("v1".to_string(), (V1_COMMIT.to_string(), files));
    Ok(Arc::new(Hub {
        revisions,
        cuts_left: AtomicUsize::new(cuts),
        unauthorized: AtomicUsize::new(0),
        bodies: Mutex::new(Vec::new()),
    }))
}

fn serve_args<'a>(model: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec![
        "--model-path",
        model,
        "--port",
        "0",
        "--threads",
        "1",
        "--max-total-tokens",
        "4096",
        "--dtype",
        "f32",
        "--kv-cache-dtype",
        "f32",
    ];
    a.extend_from_slice(extra);
    a
}

/// Runs `arbor serve` to its exit (a refusal at start-up): (success, stderr).
fn serve_exit(args: &[&str], env: &[(&str, &str)]) -> Result<(bool, String)> {
    let out = std::process::Command::new(common::BIN)
        .arg("serve")
        .args(args)
        .envs(env.iter().copied())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()?
        .wait_with_output()?;
    Ok((
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

/// The fixture's first reference prompt gives transformers' greedy ids.
async fn check_reference(s: &Server) -> Result<()> {
    let reference = reference_json(&fixture("tiny-llama"))?;
    let p = &reference["prompts"][0];
    let out = generate_greedy(&client(), s, &p["input_ids"], &reference["max_new_tokens"]).await?;
    ensure!(
        out["output_ids"] == p["greedy_ids"],
        "output {} != transformers {}",
        out["output_ids"],
        p["greedy_ids"]
    );
    Ok(())
}

fn snapshot(cache: &Path, commit: &str) -> PathBuf {
    cache
        .join(format!("models--{}", REPO.replace('/', "--")))
        .join("snapshots")
        .join(commit)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hub_ids_download_resume_and_work_offline() -> Result<()> {
    let home = tempfile::tempdir()?;
    let hf_home = home.path().display().to_string();
    let cache = home.path().join("hub");
    // Every body of the cut file is cut until the test says otherwise.
    let hub = hub_of(usize::MAX)?;
    let endpoint = start_hub(hub.clone()).await?;
    let env = [
        ("HF_HOME", hf_home.as_str()),
        ("HF_ENDPOINT", endpoint.as_str()),
        ("HF_TOKEN", TOKEN),
    ];

    // No token: the hub refuses, and the error says a token may be needed.
    let no_token = [
        ("HF_HOME", hf_home.as_str()),
        ("HF_ENDPOINT", endpoint.as_str()),
    ];
    let (ok, err) = serve_exit(&serve_args(REPO, &[]), &no_token)?;
    ensure!(
        !ok && err.contains("HF_TOKEN") && err.contains(REPO),
        "{err}"
    );

    // The cut download fails naming the file; the shard is not in the snapshot.
    let (ok, err) = serve_exit(&serve_args(REPO, &[]), &env)?;
    ensure!(
        !ok && err.contains(CUT_FILE),
        "a cut download was accepted: {err}"
    );
    ensure!(!snapshot(&cache, MAIN_COMMIT).join(CUT_FILE).exists());

    // The next run resumes it and serves the model under its hub id.
    hub.cuts_left.store(0, Ordering::SeqCst);
    let s = Server::start_with_env("serve", &serve_args(REPO, &[]), &env)?;
    let c = client();
    let (_, info) = http_get(&c, &s.url("/get_model_info"), None).await?;
    let info: Value = serde_json::from_str(&info)?;
    ensure!(
        info["model_path"] == REPO && info["served_model_name"] == REPO,
        "{info}"
    );
    check_reference(&s).await?;
    drop(s);
    let source = std::fs::read(format!("{}/{CUT_FILE}", fixture("tiny-llama")))?;
    let cached = std::fs::read(snapshot(&cache, MAIN_COMMIT).join(CUT_FILE))?;
    ensure!(
        sha256_hex(&source) == sha256_hex(&cached),
        "resumed file differs"
    );
    let bodies = hub.bodies.lock().map(|b| b.clone()).unwrap_or_default();
    ensure!(
        !bodies.iter().any(|f| f.contains(".md@") || f.contains('/')),
        "fetched files a server does not need: {bodies:?}"
    );
    ensure!(
        bodies
            .iter()
            .any(|f| f.starts_with(CUT_FILE) && !f.ends_with("@0")),
        "the cut file was not resumed: {bodies:?}"
    );

    // A cached complete snapshot needs no network: the hub stops answering.
    let fetched = bodies.len();
    let dead = [
        ("HF_HOME", hf_home.as_str()),
        ("HF_ENDPOINT", "http://127.0.0.1:9"),
    ];
    let s = Server::start_with_env("serve", &serve_args(REPO, &[]), &dead)?;
    check_reference(&s).await?;
    drop(s);

    // --revision v1 downloads the tag's commit.
    let s = Server::start_with_env("serve", &serve_args(REPO, &["--revision", "v1"]), &env)?;
    let (_, info) = http_get(&c, &s.url("/get_server_info"), None).await?;
    ensure!(info.contains(REPO), "{info}");
    ensure!(
        s.logs().contains(V1_COMMIT),
        "summary names the snapshot: {}",
        s.logs()
    );
    drop(s);
    ensure!(snapshot(&cache, V1_COMMIT).join("config.json").exists());
    let after = hub.bodies.lock().map(|b| b.len()).unwrap_or_default();
    ensure!(after > fetched, "v1 fetched nothing");

    // Offline: the cache serves; a revision it does not hold is refused clearly.
    let offline = [("HF_HOME", hf_home.as_str()), ("HF_HUB_OFFLINE", "1")];
    let s = Server::start_with_env("serve", &serve_args(REPO, &["--revision", "v1"]), &offline)?;
    drop(s);
    let (ok, err) = serve_exit(&serve_args(REPO, &["--revision", "v2"]), &offline)?;
    ensure!(
        !ok && err.contains("HF_HUB_OFFLINE") && err.contains("v2"),
        "{err}"
    );
    ensure!(hub.unauthorized.load(Ordering::SeqCst) > 0);
    Ok(())
}

/// A cache written as `huggingface_hub` writes it: content-addressed blobs,
/// a snapshot of relative symlinks, a ref naming the commit.
fn lay_out_cache(cache: &Path, repo: &str, refname: &str, commit: &str) -> Result<()> {
    let root = cache.join(format!("models--{}", repo.replace('/', "--")));
    let snap = root.join("snapshots").join(commit);
    std::fs::create_dir_all(root.join("blobs"))?;
    std::fs::create_dir_all(root.join("refs"))?;
    std::fs::create_dir_all(&snap)?;
    std::fs::write(root.join("refs").join(refname), commit)?;
    for (name, bytes) in read_dir_files(&fixture("tiny-llama"))? {
        let blob = sha256_hex(&bytes);
        std::fs::write(root.join("blobs").join(&blob), &bytes)?;
        std::os::unix::fs::symlink(format!("../../blobs/{blob}"), snap.join(&name))?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_laid_cache_and_the_model_flags() -> Result<()> {
    let home = tempfile::tempdir()?;
    let cache = home.path().join("cache");
    lay_out_cache(&cache, "org/llama", "release", &"a".repeat(40))?;
    let cache_s = cache.display().to_string();
    // HF_HUB_CACHE wins over HF_HOME.
    let env = [
        ("HF_HUB_CACHE", cache_s.as_str()),
        ("HF_HOME", "/nonexistent"),
        ("HF_HUB_OFFLINE", "1"),
        ("ARBOR_LOG", "warn,arbor::requests=info"),
    ];
    let template = home.path().join("t.jinja");
    std::fs::write(
        &template,
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]",
    )?;
    let template_s = template.display().to_string();
    let args = serve_args(
        "org/llama",
        &[
            "--revision",
            "release",
            "--tokenizer-path",
            "org/llama",
            "--chat-template",
            &template_s,
            "--context-length",
            "64",
            "--served-model-name",
            "llama",
            "--log-requests",
        ],
    );
    let s = Server::start_with_env("serve", &args, &env)?;
    let c = client();
    check_reference(&s).await?;
    ensure!(s.logs().contains("context 64 of"), "{}", s.logs());
    let (_, info) = http_get(&c, &s.url("/get_model_info"), None).await?;
    let info: Value = serde_json::from_str(&info)?;
    ensure!(info["context_length"] == 64, "{info}");
    // The template given renders the prompt.
    let r = post_ok(
        &c,
        &s.url("/v1/chat/completions"),
        &json!({"model": "llama", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 1, "temperature": 0}),
    )
    .await?;
    let tok = post_ok(
        &c,
        &s.url("/tokenize"),
        &json!({"prompt": "[user] hi\n[assistant]", "add_special_tokens": false}),
    )
    .await?;
    ensure!(
        r["usage"]["prompt_tokens"] == tok["count"],
        "prompt {} vs template text {}",
        r["usage"]["prompt_tokens"],
        tok["count"]
    );
    // --context-length bounds a request.
    let long: Vec<u32> = (0..80).map(|i| 10 + i % 100).collect();
    let (code, body) = common::post(
        &c,
        &s.url("/generate"),
        &json!({"input_ids": long, "sampling_params": {"max_new_tokens": 1}}),
    )
    .await?;
    ensure!(code == 400, "{code} {body}");
    // --log-requests: a line when enqueued and one when finished.
    let logs = s.logs();
    ensure!(
        logs.contains("Receive: rid=") && logs.contains("Finish: rid=") && logs.contains("text="),
        "{logs}"
    );
    drop(s);

    // Bad values name their flag.
    for (extra, needle) in [
        (
            vec!["--chat-template", "no-such-template"],
            "--chat-template",
        ),
        (vec!["--context-length", "100000"], "--context-length"),
        (
            vec!["--log-requests", "--log-requests-level", "7"],
            "--log-requests-level",
        ),
        (vec!["--tokenizer-path", "org/missing"], "org/missing"),
    ] {
        let mut a = serve_args("org/llama", &["--revision", "release"]);
        a.extend(extra.iter().copied());
        let (ok, err) = serve_exit(&a, &env)?;
        ensure!(!ok && err.contains(needle), "{extra:?}: {err}");
    }
    Ok(())
}
